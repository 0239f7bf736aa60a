"""Checkpoint reading: sharded, fused-expert and per-expert spellings; clear errors on bad input."""

import json
import shutil

import pytest
import torch

import moeserve
from moeserve.checkpoint import save_safetensors_atomic, to_per_expert
from moeserve.errors import MoeserveError
from moeserve.spec import ModelSpec


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


def test_sharded_checkpoint_matches_single_file(hf_checkpoints, tmp_path):
    hf, path = hf_checkpoints["mixtral"]
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    tokens = torch.randint(3, 97, (1, 9))
    a = logits(moeserve.load_model(tmp_path), tokens)
    b = logits(moeserve.load_model(path), tokens)
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_expert_tensors_load(family, hf_checkpoints, tmp_path):
    """transformers 5.x in-memory names (experts.gate_up_proj / down_proj) are read as they are."""
    hf, path = hf_checkpoints[family]
    ours = moeserve.load_model(path)
    state = {k: v for k, v in ours.state_dict().items() if k != "lm_head.weight" or not ours.spec.tie_word_embeddings}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    save_safetensors_atomic(state, tmp_path / "model.safetensors")
    tokens = torch.randint(3, 97, (2, 7))
    a, b = logits(moeserve.load_model(tmp_path), tokens), logits(ours, tokens)
    assert (a - b).abs().max() < 1e-5  # same weights; only CPU kernel choice (alignment) may differ


def test_per_expert_round_trip_names(hf_checkpoints):
    _, path = hf_checkpoints["mixtral"]
    state = to_per_expert(moeserve.load_model(path).state_dict(), "mixtral")
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in state
    assert "model.layers.0.block_sparse_moe.gate.weight" in state
    assert not any("gate_up_proj" in k for k in state)


def test_missing_path_and_missing_config(tmp_path):
    with pytest.raises(MoeserveError, match="does not exist"):
        moeserve.load_model(tmp_path / "nope")
    with pytest.raises(MoeserveError, match="no config.json"):
        moeserve.load_model(tmp_path)


def test_unknown_architecture_lists_supported(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["olmoe"]
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(MoeserveError, match="unsupported architecture.*MixtralForCausalLM.*OlmoeForCausalLM"):
        ModelSpec.from_hf_config(cfg)


def test_truncated_safetensors(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["qwen2_moe"]
    shutil.copy(path / "config.json", tmp_path / "config.json")
    data = (path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(MoeserveError, match="truncated"):
        moeserve.load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(MoeserveError, match="truncated"):
        moeserve.load_model(tmp_path)


def test_no_weights_and_wrong_shapes(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["olmoe"]
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MoeserveError, match="no \\*.safetensors"):
        moeserve.load_model(tmp_path)
    cfg["hidden_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(MoeserveError, match="shape"):
        moeserve.load_model(tmp_path)


def test_parameter_counts_match_the_model(hf_checkpoints):
    for fam, (hf, path) in hf_checkpoints.items():
        spec = ModelSpec.from_dir(path)
        counts = spec.parameter_counts()
        stored = [p for p in hf.parameters()] + [b for n, b in hf.named_buffers() if n.endswith("correction_bias")]
        assert counts["total"] == sum(t.numel() for t in stored), fam
        assert counts["experts"] > 0 and counts["dense"] > 0


def test_rope_scaling_variants_match_hf():
    """Our inverse frequencies equal transformers' for each rope type we accept."""
    from transformers import MixtralConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moeserve.spec import rope_inv_freq

    variants = [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 512},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    ]
    for rp in variants:
        rp = {"rope_theta": 50000.0, **rp}
        cfg = MixtralConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=2048,
                            rope_parameters=rp)
        ref, ref_scale = ROPE_INIT_FUNCTIONS[rp["rope_type"]](cfg, "cpu")
        spec = ModelSpec.from_hf_config({**cfg.to_dict(), "architectures": ["MixtralForCausalLM"]})
        ours, scale = rope_inv_freq(spec.attention.rope, spec.attention.head_dim, spec.max_position_embeddings)
        assert torch.allclose(ours, ref.float(), rtol=1e-6), rp["rope_type"]
        assert abs(scale - ref_scale) < 1e-6
