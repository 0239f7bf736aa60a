"""Quirks of Phi-MoE, Granite-MoE, DBRX and Llama-4 that the generic parity tests (tests/model/test_hf_parity.py,
over their FAMILIES entries) do not reach on their own: LongRoPE past the original context, checkpoint layouts
read under moeserve's names, what moeserve refuses for them and why."""

import pytest
import torch

import moeserve
from hf_models import PHIMOE, longrope
from moeserve.model.kv_cache import KVCache


def hf_model(config_cls: str, kw: dict, seed: int = 0):
    """A tiny random transformers model of config_cls(**kw), every weight random (as hf_models.build_hf_model)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**kw))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.08 + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()


def test_phimoe_longrope_past_the_original_context_uses_the_long_factors(tmp_path):
    """A pass that reaches past original_max_position_embeddings (16 here) rotates with the long factors and the
    long scale; cached keys keep theirs. transformers 5.24's Phimoe derives its frequencies from the short factors
    at every length (only the scale follows the length), so the reference past the original context is its twin
    whose short factors are the long ones, on the same weights and cache."""
    hf = hf_model("PhimoeConfig", dict(PHIMOE, rope_parameters=longrope(16)))
    hf.save_pretrained(tmp_path)
    long_only = longrope(16)
    long_only["short_factor"] = long_only["long_factor"]
    twin = hf_model("PhimoeConfig", dict(PHIMOE, rope_parameters=long_only))
    twin.load_state_dict(hf.state_dict())
    ours = moeserve.load_model(tmp_path, dtype=torch.float32)
    tokens = torch.randint(3, 97, (2, 24))
    with torch.no_grad():
        past = ours(tokens)  # one pass of 24 positions: all long
        assert (past - twin(tokens).logits).abs().max() < 1e-4
        assert (past - hf(tokens).logits).abs().max() > 1e-2  # the factors matter
        # prefill 10 (short), then cached decode steps across position 16 (long from there on)
        from transformers import DynamicCache

        kv, cache = KVCache(ours.spec, 2, 24, "cpu", torch.float32), DynamicCache(config=hf.config)
        ref = [hf(tokens[:, :10], cache=cache, use_cache=True).logits]
        got = [ours(tokens[:, :10], kv=kv)]
        for i in range(10, 24):
            ref.append((twin if i >= 16 else hf)(tokens[:, i:i + 1], cache=cache, use_cache=True).logits)
            got.append(ours(tokens[:, i:i + 1], kv=kv))
    assert (torch.cat(got, 1) - torch.cat(ref, 1)).abs().max() < 1e-4


def test_granite_checkpoint_answers_for_moeserve_names(hf_checkpoints):
    """Granite's fused shared MLP and renamed experts/router read as moeserve's tensors, whole and in part."""
    from moeserve.checkpoint import CheckpointReader

    reader = CheckpointReader(hf_checkpoints["granitemoeshared"][1])
    stored = reader.get("model.layers.1.shared_mlp.input_linear.weight")  # [2F, D]
    assert torch.equal(reader.get("model.layers.1.mlp.shared_expert.up_proj.weight"), stored[24:])
    experts = reader.get("model.layers.1.block_sparse_moe.input_linear.weight")  # [E, 2F, D]
    part = reader.get_slice("model.layers.1.mlp.experts.gate_up_proj", (slice(2, 4), slice(0, 5)))
    assert torch.equal(part, experts[2:4, :5])
    assert "model.layers.1.mlp.gate.weight" in reader and "model.layers.1.mlp.shared_expert.gate_proj.weight" in reader


def test_batch_pipeline_refuses_granite_multipliers_by_name(hf_checkpoints, tmp_path, expect_cli_error):
    expect_cli_error(["plan", "--for", "batch", "--model", hf_checkpoints["granitemoe"][1], "--gpu-memory", "1GiB",
                      "--profile", tmp_path / "none.json"], "granitemoe's embedding, residual, attention and logits")


def test_dbrx_clip_qkv_clips_as_transformers(hf_checkpoints):
    """The tiny DBRX's fused qkv values reach well past clip_qkv (0.5); both clip them the same way, and without
    the clipping moeserve's logits would be others."""
    hf, path = hf_checkpoints["dbrx"]
    seen = []
    hook = hf.transformer.blocks[0].norm_attn_norm.attn.Wqkv.register_forward_hook(
        lambda module, args, out: seen.append(out.abs().max().item()))
    tokens = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = moeserve.load_model(path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(tokens).logits
        hook.remove()
        got = ours(tokens)
        for layer in ours.model.layers:
            layer.self_attn.clip_qkv = None
        unclipped = ours(tokens)
    assert max(seen) > 1.0
    assert (got - ref).abs().max() < 1e-4 and (unclipped - ref).abs().max() > 1e-2


def test_dbrx_refuses_an_expert_weight_norm_other_than_l1(hf_checkpoints, tmp_path, expect_cli_error):
    import json
    import shutil

    src = hf_checkpoints["dbrx"][1]
    for f in src.iterdir():
        shutil.copy(f, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg["ffn_config"]["moe_normalize_expert_weights"] = 2.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    expect_cli_error(["info", "--model", tmp_path], "moe_normalize_expert_weights 2.0 is not supported")
