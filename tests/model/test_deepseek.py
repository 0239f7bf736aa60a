"""DeepSeek-V2/V3 and GLM-4.5 beyond the generic family tests (hf parity, static decode, hybrid, serve iterate over
their FAMILIES entries): MLA's latent cache and its two ways to attend, the routers, FP8 block-scaled checkpoints,
the MTP layer of V3 checkpoints, quantized MLA, and configs moeserve refuses."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import moeserve
from moeserve.checkpoint import CheckpointReader, to_per_expert
from moeserve.model.kv_cache import KVCache
from moeserve.model.mla import MLAttention
from moeserve.model.router import grouped_topk
from moeserve.compress import QuantConfig, quantize_checkpoint
from moeserve.quant.qlinear import QuantizedLinear
from moeserve.plan.footprint import kv_cache_bytes
from moeserve.spec import ModelSpec, RouterSpec


def test_latent_cache_holds_kv_lora_rank_plus_rope_values_per_token(hf_checkpoints):
    spec = ModelSpec.from_dir(hf_checkpoints["deepseek_v3"][1])
    kv = KVCache(spec, 2, 10, "cpu", torch.float32)
    assert kv.k.shape == (spec.num_layers, 2, 1, 10, 32 + 8) and kv.v is None
    assert kv_cache_bytes(spec, 1, 1, 2) == spec.num_layers * 40 * 2
    glm = ModelSpec.from_dir(hf_checkpoints["glm4_moe"][1])
    assert kv_cache_bytes(glm, 1, 1, 2) == glm.num_layers * 2 * glm.attention.num_kv_heads * glm.attention.head_dim * 2


def test_long_prefill_expands_then_decode_absorbs_both_as_transformers(hf_checkpoints):
    """A 40-token prefill into the cache (past the absorb threshold: keys and values expanded from the cached
    latents), then 10 absorbed decode steps over the latent cache: fp32 logits of transformers'."""
    hf, path = hf_checkpoints["deepseek_v2"]  # q LoRA, YaRN softmax scale
    model = moeserve.load_model(path, dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    assert not attn.absorbs(40) and attn.absorbs(1)
    tokens = torch.randint(3, 97, (2, 50))
    kv = KVCache(model.spec, 2, 50, "cpu", torch.float32)
    with torch.no_grad():
        ref = hf(tokens).logits
        got = torch.cat([model(tokens[:, :40], kv=kv)] + [model(tokens[:, i:i + 1], kv=kv) for i in range(40, 50)], 1)
    assert (got - ref).abs().max() < 1e-4


@pytest.mark.parametrize("boolean", [True, False], ids=["bool-mask", "additive-mask"])
def test_absorbed_and_expanded_attention_agree_in_float64(hf_checkpoints, boolean):
    spec = ModelSpec.from_dir(hf_checkpoints["deepseek_v3"][1])
    torch.manual_seed(0)
    attn = MLAttention(spec, 0).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_()
    B, S, S_total, H = 2, 3, 11, spec.attention.num_heads
    q_nope = torch.randn(B, S, H, attn.nope, dtype=torch.float64)
    q_rope = torch.randn(B, H, S, attn.rope, dtype=torch.float64)
    entry = torch.randn(B, S_total, attn.rank + attn.rope, dtype=torch.float64)
    mask = torch.rand(B, 1, S, S_total) < 0.7
    mask[..., 0] = True  # every query sees a key
    if not boolean:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill_(~mask, float("-inf"))
    q = torch.cat((q_nope.transpose(1, 2), q_rope), dim=-1)  # [B, H, S, nope + rope]
    with torch.no_grad():
        absorbed = attn.core_output(attn.core_attention(attn.core_query(q), entry[:, None], None, mask))
        torch.testing.assert_close(absorbed, attn._expanded(q, entry, mask), rtol=1e-10, atol=1e-10)


def test_noaux_tc_bias_steers_the_choice_and_the_weights_stay_unbiased():
    """Hand-made scores: 4 groups of 2 experts, keep 2 groups, top-2. The bias lifts expert 7's group past
    group 0 and expert 7 past expert 0; the weights are the unbiased sigmoid scores, normalised, scaled by 2."""
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.1, 0.7, 0.6, 0.1, 0.2]])
    logits = torch.log(scores / (1 - scores))  # sigmoid(logits) = scores
    rs = RouterSpec(scoring="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.0,
                    correction_bias=True)
    ids, w = grouped_topk(logits, 2, rs, normalize=True)
    assert sorted(ids[0].tolist()) == [0, 1]
    bias = torch.tensor([0.0, 0, 0, 0, 0, 0, 0.5, 1.0])  # group 3: 0.6 + 1.2 beats group 2's 1.3, group 0's 1.7
    ids, w = grouped_topk(logits, 2, rs, normalize=True, bias=bias)
    assert sorted(ids[0].tolist()) == [0, 7]
    expected = torch.tensor([0.9, 0.2]) / 1.1 * 2.0
    torch.testing.assert_close(w[0].sort(descending=True).values, expected.sort(descending=True).values)
    limited = RouterSpec(scoring="softmax", topk_method="group_limited_greedy", n_group=4, topk_group=1)
    ids, w = grouped_topk(logits, 2, limited, normalize=False)  # only group 0 (best expert 0.9): experts 0 and 1
    assert sorted(ids[0].tolist()) == [0, 1]
    torch.testing.assert_close(w[0], logits.softmax(-1)[0, ids[0]])


def _fp8_blocks(w: torch.Tensor, block: int):
    """w [N, K] -> (float8_e4m3fn codes, scale_inv [ceil(N/b), ceil(K/b)]) as DeepSeek-V3 ships its weights."""
    N, K = w.shape
    pad = torch.zeros(-(-N // block) * block, -(-K // block) * block)
    pad[:N, :K] = w
    blocks = pad.view(pad.shape[0] // block, block, pad.shape[1] // block, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0  # [N/b, K/b]
    codes = (blocks / scale[:, None, :, None]).view_as(pad)[:N, :K].to(torch.float8_e4m3fn)
    return codes, scale


def _dequant(codes, scale, block):
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:codes.shape[0], :codes.shape[1]]
    return codes.float() * full


@pytest.fixture(scope="module")
def fp8_pair(hf_checkpoints, tmp_path_factory):
    """(FP8 checkpoint, its dequantized float twin) of the tiny V3: every linear weight but embeddings, head and
    routers in float8 with 16 x 16 block scales (blocks cut at the edges: 40-row kv_a_proj), experts per expert."""
    src = hf_checkpoints["deepseek_v3"][1]
    fp8, twin = tmp_path_factory.mktemp("v3_fp8"), tmp_path_factory.mktemp("v3_twin")
    state = to_per_expert(moeserve.load_model(src).state_dict(), "deepseek_v3")
    state = {k.replace(".shared_expert.", ".shared_experts."): v for k, v in state.items()}
    quantized, floats = {}, {}
    for name, t in state.items():
        if t.ndim == 2 and "_proj." in name:
            codes, scale = _fp8_blocks(t, 16)
            quantized[name], quantized[name + "_scale_inv"] = codes, scale
            floats[name] = _dequant(codes, scale, 16)
        else:
            quantized[name] = floats[name] = t
    cfg = json.loads((src / "config.json").read_text())
    for out, tensors, extra in ((fp8, quantized, {"quantization_config": {
            "quant_method": "fp8", "weight_block_size": [16, 16], "activation_scheme": "dynamic", "fmt": "e4m3"}}),
                                (twin, floats, {})):
        save_file(tensors, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps({**cfg, **extra}))
    return fp8, twin


def test_fp8_block_scaled_checkpoint_loads_as_its_dequantized_twin(fp8_pair, hf_checkpoints):
    fp8, twin = fp8_pair
    tokens = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        got, want = moeserve.load_model(fp8)(tokens), moeserve.load_model(twin)(tokens)
        original = moeserve.load_model(hf_checkpoints["deepseek_v3"][1])(tokens)
    assert torch.equal(got, want)
    assert not torch.allclose(got, original, atol=1e-4)  # the weights did go through float8
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # [40, 64]: a part across block edges
    part = CheckpointReader(fp8).get_slice(name, (slice(5, 37), slice(3, 50)))
    assert torch.equal(part, load_file(twin / "model.safetensors")[name][5:37, 3:50])


def test_quantize_takes_fp8_checkpoints_and_mla_projections(fp8_pair, tmp_path):
    """`moeserve quantize` from the FP8 checkpoint writes what it writes from the float twin; MLA's projections are
    quantized like any dense linear (the absorbed decode reads kv_b_proj's weight dequantized)."""
    fp8, twin = fp8_pair
    cfg = QuantConfig(bits=8, group=8, method="rtn")
    outs = [quantize_checkpoint(src, tmp_path / src.name, cfg, progress=False) for src in (fp8, twin)]
    assert outs[0]["tensors"] == outs[1]["tensors"]
    assert {"model.layers.1.self_attn.kv_b_proj", "model.layers.1.self_attn.q_a_proj"} <= set(outs[0]["tensors"])
    q8, q8_twin, dense = (moeserve.load_model(p) for p in (tmp_path / fp8.name, tmp_path / twin.name, twin))
    assert isinstance(q8.model.layers[1].self_attn.kv_b_proj, QuantizedLinear)
    # fixed tokens: with some draws an 8-bit rounding flips a router near a tie, and the logits move by more
    tokens = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    kv = KVCache(q8.spec, 2, 10, "cpu", torch.float32)
    with torch.no_grad():
        a, b, f = q8(tokens), q8_twin(tokens), dense(tokens)
        cached = torch.cat([q8(tokens[:, :5], kv=kv)] + [q8(tokens[:, i:i + 1], kv=kv) for i in range(5, 9)], 1)
    assert torch.equal(a, b)
    assert ((a - f).norm() / f.norm()) < 0.02
    torch.testing.assert_close(cached, a, rtol=1e-4, atol=1e-4)


def test_mtp_layer_of_v3_checkpoints_is_not_read(hf_checkpoints, tmp_path):
    """V3 checkpoints carry the multi-token-prediction module as layer num_hidden_layers: moeserve skips it."""
    src = hf_checkpoints["deepseek_v3"][1]
    shutil.copytree(src, tmp_path / "v3", dirs_exist_ok=True)
    L = ModelSpec.from_dir(src).num_layers
    save_file({f"model.layers.{L}.eh_proj.weight": torch.randn(64, 128),
               f"model.layers.{L}.self_attn.kv_b_proj.weight": torch.randn(3, 3)}, tmp_path / "v3" / "mtp.safetensors")
    tokens = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        assert torch.equal(moeserve.load_model(tmp_path / "v3")(tokens), moeserve.load_model(src)(tokens))


@pytest.mark.parametrize("family,change,message", [
    ("deepseek_v3", {"topk_method": "bogus"}, "topk_method 'bogus' is not supported; supported: greedy, "
                                              "group_limited_greedy, noaux_tc"),
    ("deepseek_v2", {"scoring_func": "softplus"}, "scoring_func 'softplus' is not supported; supported: softmax, "
                                                  "sigmoid"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
     "rope type 'dynamic' is not supported; supported: default, linear, llama3, yarn"),
    ("deepseek_v3", {"n_group": 3}, "split the experts evenly"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq' is not supported"),
])
def test_bad_configs_name_the_value_and_what_is_supported(hf_checkpoints, tmp_path, expect_cli_error, family,
                                                           change, message):
    src = hf_checkpoints[family][1]
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, **change}))
    expect_cli_error(["info", "--model", tmp_path / "m"], message)


def test_expert_stores_take_fp8_checkpoints(fp8_pair, tmp_path):
    """offload-prepare's store and the hybrid backend's store read the FP8 experts as float: the offloaded model
    (all experts in high precision) and the hybrid one (every MoE layer's experts on the CPU) compute what the
    resident model of the dequantized twin computes."""
    from moeserve.hybrid.placement import HybridPlacement
    from moeserve.hybrid.setup import build_store, enable_hybrid
    from moeserve.offload.setup import enable_offload
    from moeserve.offload.store import ExpertStore

    fp8, twin = fp8_pair
    tokens = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        want = moeserve.load_model(twin)(tokens)
        model = moeserve.load_model(fp8, routed_experts=False)
        enable_offload(model, ExpertStore.build(fp8, tmp_path / "store", low_bits=4, group=8, progress=False),
                       high_slots=3, policy="lru", mixed=False)
        torch.testing.assert_close(model(tokens), want, atol=1e-5, rtol=1e-5)
        layers = [i for i, moe in enumerate(model.spec.moe.layers) if moe]
        placement = HybridPlacement.choose(layers, n_cpu_moe=len(layers), cache_slots=0, num_experts=16)
        model = moeserve.load_model(fp8, routed_experts=False)
        enable_hybrid(model, build_store(fp8, placement, model.dtype, model.device, progress=False), placement)
        torch.testing.assert_close(model(tokens), want, atol=1e-5, rtol=1e-5)


def test_explain_names_the_paths_of_mla_layers(hf_checkpoints, capsys):
    from moeserve.cli import main

    assert main(["info", "--explain", "--json", "--model", str(hf_checkpoints["deepseek_v2"][1]), "--tokens", "1"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert [layer["router"] for layer in layers] == [None, {"1": "torch"}, {"1": "torch"}]  # dense first layer
    assert all(layer["attention"] == {"1": "torch"} for layer in layers)
