"""Quirks of Phi-MoE, Granite-MoE, DBRX and Llama-4 that the generic parity tests (tests/model/test_hf_parity.py,
over their FAMILIES entries) do not reach on their own: LongRoPE past the original context, checkpoint layouts
read under moeserve's names, that each Llama-4 quirk changes the test's logits, what moeserve refuses for them
and why."""

import json
import shutil

import pytest
import torch

import moeserve
from hf_models import LLAMA4, PHIMOE, longrope
from moeserve.engine.sequence import left_padded
from moeserve.model.kv_cache import KVCache
from moeserve.model.transformer import Span


def randomized(model):
    """model with every weight random (as hf_models.build_hf_model), in eval mode."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.08 + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()


def hf_model(config_cls: str, kw: dict, seed: int = 0):
    """A tiny random transformers model of config_cls(**kw)."""
    import transformers

    torch.manual_seed(seed)
    return randomized(transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**kw)))


def copy_with_config(src, dst, **changes):
    """The checkpoint src copied to dst with config.json's top-level fields changed."""
    for f in src.iterdir():
        shutil.copy(f, dst)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))


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
    src = hf_checkpoints["dbrx"][1]
    ffn = json.loads((src / "config.json").read_text())["ffn_config"]
    copy_with_config(src, tmp_path, ffn_config={**ffn, "moe_normalize_expert_weights": 2.0})
    expect_cli_error(["info", "--model", tmp_path], "moe_normalize_expert_weights 2.0 is not supported")


def switch_off(model, quirk: str) -> None:
    """Make moeserve's Llama-4 model ignore one of its quirks."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if quirk == "chunked attention":
            layer.span = Span(layer.span.window, None)
        elif quirk == "NoPE layers":
            attn.rotary = True
        elif quirk == "attention temperature":
            attn.tempered = False
        elif quirk == "qk-norm":
            attn.qk_norm = None
        elif quirk == "interleaved rotary pairs":
            attn.interleaved = False
        elif quirk == "gate weight on the expert input" and hasattr(mlp, "scales_input"):
            mlp.scales_input = False


@pytest.mark.parametrize("quirk", ["chunked attention", "NoPE layers", "attention temperature", "qk-norm",
                                   "interleaved rotary pairs", "gate weight on the expert input"])
def test_llama4_each_quirk_changes_the_logits(hf_checkpoints, quirk):
    """The tiny Llama-4's quirks all matter at the generic tests' lengths (17 positions: chunks of 6, a temperature
    that changes every 3): moeserve matches transformers, and without the quirk it would not."""
    hf, path = hf_checkpoints["llama4"]
    ours = moeserve.load_model(path, dtype=torch.float32)
    tokens = torch.randint(3, 97, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        assert (ours(tokens) - ref).abs().max() < 1e-4
        switch_off(ours, quirk)
        assert (ours(tokens) - ref).abs().max() > 1e-2


def test_llama4_left_padded_prompt_gives_what_it_gives_alone(hf_checkpoints):
    """moeserve's attention temperature follows each sequence's own positions, as its rotary and chunks do, so a
    left-padded prompt's logits are those it has alone. transformers counts the pads as positions for the
    temperature (its rotary and chunks take the positions), so its padded batch is not the greedy reference for
    Llama-4 (hf_models.UNPADDED_REFERENCE)."""
    hf, path = hf_checkpoints["llama4"]
    ours = moeserve.load_model(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (12, 5)]
    tokens, valid, positions = left_padded(prompts, ours.spec)  # [2, 12] each; 7 pads before the short prompt
    padded_hf = lambda: hf(tokens, attention_mask=valid.long(), position_ids=positions).logits[1, -5:]  # noqa: E731
    with torch.no_grad():
        alone = hf(torch.tensor(prompts[1:])).logits[0]  # [5, V]
        theirs = padded_hf()
        padded = ours(tokens, positions, valid=valid)[1, -5:]
        try:  # transformers without the temperature: then its padded batch gives what the prompt gives alone
            for layer in hf.model.layers:
                layer.self_attn.attn_temperature_tuning = False
            untempered = padded_hf() - hf(torch.tensor(prompts[1:])).logits[0]
        finally:
            for layer in hf.model.layers:
                layer.self_attn.attn_temperature_tuning = True
    assert (padded - alone).abs().max() < 1e-4
    assert (theirs - alone).abs().max() > 1e-2 and untempered.abs().max() < 1e-4


# a tiny vision tower for Llama4ForConditionalGeneration, whose tensors moeserve leaves unread
TINY_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                   vision_output_dim=32, image_size=28, patch_size=14, projector_input_dim=32, projector_output_dim=32)


def test_llama4_conditional_generation_checkpoint_loads_its_text_model(tmp_path):
    """A Llama4ForConditionalGeneration checkpoint (text_config, `language_model.` tensors beside `vision_model.`
    and `multi_modal_projector.` ones) loads as its text model: logits as transformers' language model."""
    import transformers

    from moeserve.checkpoint import CheckpointReader

    torch.manual_seed(0)
    hf = randomized(transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=LLAMA4, vision_config=TINY_VISION)))
    hf.save_pretrained(tmp_path)
    stored = CheckpointReader(tmp_path).keys()
    assert any(n.startswith("vision_model.") for n in stored) and not any(n.startswith("model.") for n in stored)
    ours = moeserve.load_model(tmp_path, dtype=torch.float32)
    tokens = torch.randint(3, 97, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(tokens) - hf.language_model(tokens).logits).abs().max() < 1e-4


def test_llama4_fused_experts_read_in_part_and_quantize(hf_checkpoints, tmp_path):
    """Llama-4's experts, stored [E, D, 2F] and [E, F, D], answer for moeserve's [E, 2F, D] and [E, D, F], whole and
    in part (an expert's row for the expert stores, slices for parallel loading); `moeserve quantize` reads them
    and its 8-bit checkpoint runs close to the float model."""
    from moeserve.checkpoint import CheckpointReader, read_expert_row
    from moeserve.compress import QuantConfig, quantize_checkpoint
    from moeserve.quant.qlinear import QuantizedExperts, QuantizedLinear

    _, path = hf_checkpoints["llama4"]
    reader = CheckpointReader(path)
    gate_up = reader.get("model.layers.1.feed_forward.experts.gate_up_proj")  # [E, D, 2F]
    down = reader.get("model.layers.3.feed_forward.experts.down_proj")  # [E, F, D]
    assert torch.equal(reader.get("model.layers.1.mlp.experts.gate_up_proj"), gate_up.transpose(1, 2))
    part = reader.get_slice("model.layers.1.mlp.experts.gate_up_proj", (slice(2, 4), slice(5, 40)))
    assert torch.equal(part, gate_up[2:4, :, 5:40].transpose(1, 2))
    assert torch.equal(read_expert_row(reader, "llama4", 3, 6, "down", 7, 32), down[6, :, 7])
    assert torch.equal(read_expert_row(reader, "llama4", 1, 2, "gate_up", 40, 32), gate_up[2, :, 40])
    quantize_checkpoint(path, tmp_path / "q8", QuantConfig(bits=8, group=8, method="rtn"), progress=False)
    q, f = moeserve.load_model(tmp_path / "q8"), moeserve.load_model(path)
    assert isinstance(q.model.layers[0].mlp.gate_proj, QuantizedLinear)  # a dense layer's MLP
    assert isinstance(q.model.layers[1].mlp.experts, QuantizedExperts)
    tokens = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = q(tokens), f(tokens)
    assert (a - b).norm() / b.norm() < 0.02


def test_llama4_refuses_more_than_one_expert_per_token(hf_checkpoints, tmp_path, expect_cli_error):
    copy_with_config(hf_checkpoints["llama4"][1], tmp_path, num_experts_per_tok=2)
    expect_cli_error(["info", "--model", tmp_path], "one expert per token")
