"""GPT-OSS beyond the generic family tests (hf parity, bf16, greedy, static decode iterate over its FAMILIES entry):
the spec's quirks, a prefill across the sliding window, the server's slot cache, sink attention in query chunks, MXFP4
experts as shipped against their dequantized twin, and its experts in host RAM (hybrid) and offloaded from a store.
GPU: tests/model/test_gpu_gpt_oss.py, tests/kernels/test_mxfp4.py."""

import json

import pytest
import torch

import moeserve
from hf_models import write_mxfp4_pair
from moeserve.engine.batching import ContinuousBatch, Request
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.model import sinks
from moeserve.model.kv_cache import KVCache
from moeserve.quant.mxfp4 import Mxfp4Experts, dequantize, quantize


@pytest.fixture(scope="module")
def gpt_oss(hf_checkpoints):
    """(HF fp32 model, its save_pretrained directory): the FAMILIES entry (the generic parity, bf16, greedy and static
    decode tests take it too)."""
    return hf_checkpoints["gpt_oss"]


@pytest.fixture(scope="module")
def mxfp4_pair(gpt_oss, tmp_path_factory):
    """(MXFP4 checkpoint, its dequantized float twin) of the tiny GPT-OSS (hf_models.write_mxfp4_pair)."""
    packed, twin = tmp_path_factory.mktemp("gpt_oss_mxfp4"), tmp_path_factory.mktemp("gpt_oss_twin")
    write_mxfp4_pair(gpt_oss[1], packed, twin)
    return packed, twin


def test_spec_reads_the_quirks(gpt_oss):
    spec = moeserve.ModelSpec.from_dir(gpt_oss[1])
    assert spec.attention.sliding_windows == (8, None, 8, None) and spec.attention.sinks and spec.norm.fp32
    assert spec.moe.router_bias and spec.moe.expert_bias and spec.moe.expert_act.limit == 1.0
    assert spec.attention.rope.type == "yarn"
    assert spec.attention.qkv_bias and spec.attention.o_bias and not spec.moe.experts_mxfp4
    hf = gpt_oss[0]
    assert spec.parameter_counts()["total"] == sum(p.numel() for p in hf.parameters())


def test_long_prefill_and_cached_decode_match_hf_fp32(gpt_oss):
    """A 14-token prefill (past the window of 8: the generic test's prefill of 7 is not) and 10 cached decode steps."""
    hf, path = gpt_oss
    ours = moeserve.load_model(path, dtype=torch.float32)
    tokens = torch.randint(3, 97, (2, 24))
    with torch.no_grad():
        ref = hf(tokens).logits
        kv = KVCache(ours.spec, 2, 24, "cpu", torch.float32)
        got = torch.cat([ours(tokens[:, :14], kv=kv)] + [ours(tokens[:, i:i + 1], kv=kv) for i in range(14, 24)], 1)
    assert (got - ref).abs().max() < 1e-4


def test_continuous_batching_over_slot_cache_equals_generate(gpt_oss):
    """SlotKVCache (the server's): three prompts through two rows, prompts read in chunks, 14 greedy tokens each:
    each prompt's tokens as generate gives them alone."""
    model = moeserve.load_model(gpt_oss[1], dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (11, 3, 7)]
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    batch = ContinuousBatch(model, None, slots=2, context=32, prefill_tokens=12, cuda_graph=False)
    got = {}
    requests = [Request(p, params, lambda r, u: got.setdefault(id(r), []).extend(u.token_ids)) for p in prompts]
    for r in requests:
        batch.add(r)
    while batch.step():
        pass
    assert [got[id(r)] for r in requests] == [generate(model, [p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("boolean", [True, False], ids=["bool-mask", "additive-mask"])
def test_sink_attention_in_query_chunks_equals_float64_softmax(monkeypatch, boolean):
    """The explicit softmax with a sink column, in chunks of 3 queries (SCORE_ELEMENTS made small), against the
    definition in float64 with the keys repeated per head."""
    torch.manual_seed(0)
    B, H, Hkv, S, S_total, Dh = 2, 4, 2, 7, 11, 8
    q, k, v = torch.randn(B, H, S, Dh), torch.randn(B, Hkv, S_total, Dh), torch.randn(B, Hkv, S_total, Dh)
    s = torch.randn(H) * 2
    allowed = torch.rand(B, 1, S, S_total) < 0.6
    allowed[..., 0] = True
    mask = allowed if boolean else torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    monkeypatch.setattr(sinks, "SCORE_ELEMENTS", B * H * S_total * 3)
    got = sinks.sink_attention(q, k, v, mask, s)
    kk, vv = (t.double().repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    z = (q.double() @ kk.transpose(2, 3) * Dh ** -0.5).masked_fill(~allowed, float("-inf"))
    e = torch.exp(z)
    want = (e / (e.sum(-1, keepdim=True) + torch.exp(s.double()).view(1, H, 1, 1))) @ vv
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_dequantize_agrees_with_transformers_reading_of_the_blocks():
    """Our E2M1 table, nibble order and E8M0 bias against transformers' MXFP4 reader on random bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (3, 8, 2), dtype=torch.uint8, generator=g)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantize(blocks, scales), theirs.transpose(1, 2))
    w = torch.randn(2, 5, 64)
    assert torch.equal(dequantize(*quantize(dequantize(*quantize(w)))), dequantize(*quantize(w)))
    assert ((dequantize(*quantize(w)) - w).norm() / w.norm()) < 0.15


def test_mxfp4_checkpoint_computes_its_dequantized_twin(mxfp4_pair, gpt_oss):
    """Experts kept packed (uint8 blocks and scales, as stored) compute the logits of the float checkpoint holding
    their dequantized values: prefill and cached decode, greedy tokens."""
    packed, twin = mxfp4_pair
    q, f = moeserve.load_model(packed), moeserve.load_model(twin)
    experts = q.model.layers[0].mlp.experts
    assert isinstance(experts, Mxfp4Experts) and q.spec.moe.experts_mxfp4
    assert experts.gate_up_proj_blocks.dtype == torch.uint8 and experts.gate_up_proj_blocks.shape == (8, 64, 2, 16)
    assert experts.kernel_path(torch.empty(1, 64), 1) == "mxfp4_loop"
    tokens = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        want = f(tokens)
        kv = KVCache(q.spec, 2, 20, "cpu", torch.float32)
        got = torch.cat([q(tokens[:, :12], kv=kv)] + [q(tokens[:, i:i + 1], kv=kv) for i in range(12, 20)], 1)
        original = moeserve.load_model(gpt_oss[1])(tokens)
    assert (got - want).abs().max() < 1e-5
    assert not torch.allclose(want, original, atol=1e-3)  # the experts did go through E2M1
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompts = [tokens[0, :9].tolist(), tokens[1, :4].tolist()]
    assert [r.token_ids for r in generate(q, prompts, params)] == [r.token_ids for r in generate(f, prompts, params)]


def test_quantize_keeps_biases_and_clamped_swiglu_from_float_or_mxfp4(mxfp4_pair, gpt_oss, tmp_path):
    """`quantize` of the MXFP4 checkpoint and of its float twin write the same model: HQQ experts with their biases
    and the clamped SwiGLU, equal to quantizing the twin's experts in memory; 8-bit RTN stays near the float model."""
    from moeserve.compress import QuantConfig, quantize_checkpoint, quantize_tensor
    from moeserve.quant.qlinear import QuantizedExperts

    packed, twin = mxfp4_pair
    cfg = QuantConfig(bits=4, group=16, method="hqq", ranks="uniform:0", skip=("attention",))  # the experts only
    for src, out in ((packed, tmp_path / "from_mxfp4"), (twin, tmp_path / "from_twin")):
        quantize_checkpoint(src, out, cfg, progress=False)
    a, b = moeserve.load_model(tmp_path / "from_mxfp4"), moeserve.load_model(tmp_path / "from_twin")
    experts = a.model.layers[1].mlp.experts
    assert isinstance(experts, QuantizedExperts) and experts.act == a.spec.moe.expert_act
    assert not a.spec.moe.experts_mxfp4
    assert experts.gate_up[0].bias is not None and experts.down[0].bias is not None
    ref = moeserve.load_model(twin)
    for layer in ref.model.layers:
        ex = layer.mlp.experts
        layer.mlp.experts = QuantizedExperts(
            [quantize_tensor(ex.gate_up_proj[e], cfg, 0, ex.gate_up_proj_bias[e]) for e in range(ex.num_experts)],
            [quantize_tensor(ex.down_proj[e], cfg, 0, ex.down_proj_bias[e]) for e in range(ex.num_experts)], ex.act)
    tokens = torch.randint(3, 97, (2, 14))
    with torch.no_grad():
        want, got = ref(tokens), a(tokens)
        assert torch.equal(got, b(tokens)) and (got - want).abs().max() < 1e-4
        assert not torch.allclose(got, moeserve.load_model(twin)(tokens), atol=1e-3)  # the experts were quantized
    quantize_checkpoint(gpt_oss[1], tmp_path / "q8", QuantConfig(bits=8, group=16, method="rtn"), progress=False)
    with torch.no_grad():
        near, f = moeserve.load_model(tmp_path / "q8")(tokens), moeserve.load_model(gpt_oss[1])(tokens)
    assert ((near - f).norm() / f.norm()) < 0.02
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [tokens[0, :9].tolist(), tokens[1, :4].tolist()]
    assert [r.token_ids for r in generate(a, prompts, params)] == [r.token_ids for r in generate(ref, prompts, params)]


@pytest.fixture(scope="module")
def byte_gpt_oss(tmp_path_factory):
    """source -> directory: the tiny GPT-OSS with the byte vocabulary, a byte tokenizer and a random held-out text,
    as float ("float") and with MXFP4 experts ("mxfp4", hf_models.write_mxfp4_pair): what the CLI commands read."""
    from hf_models import build_hf_model
    from moeserve.tokenizer import ByteTokenizer

    dirs = {name: tmp_path_factory.mktemp(f"byte_gpt_oss_{name}") for name in ("float", "mxfp4", "twin")}
    build_hf_model("gpt_oss", seed=7, vocab_size=258, bos_token_id=256, eos_token_id=257).save_pretrained(dirs["float"])
    write_mxfp4_pair(dirs["float"], dirs["mxfp4"], dirs["twin"])
    letters = torch.randint(0, 27, (400,), generator=torch.Generator().manual_seed(7)).tolist()
    text = "".join(" " if c == 26 else chr(97 + c) for c in letters)
    for path in dirs.values():
        ByteTokenizer().save(path)
        (path / "heldout.txt").write_text(text)
    return dirs


@pytest.mark.parametrize("source", ["float", "mxfp4"])
def test_quantize_skip_expert_keeps_the_experts_as_stored(byte_gpt_oss, source, tmp_path, capsys):
    """`quantize --skip expert` copies the experts as the source stores them (MXFP4 blocks and scales with their
    quantization_config): the written checkpoint computes the source with its dense layers quantized alike in memory,
    and `eval ppl` prints that model's perplexity; `generate` and `info --explain` run on it."""
    from moeserve.cli import main
    from moeserve.evaluate import perplexity
    from moeserve.compress import QuantConfig, linear_tensors, quantize_tensor
    from moeserve.quant.dense import replace_module
    from moeserve.tokenizer import load_tokenizer

    src, out = byte_gpt_oss[source], tmp_path / "q"
    cfg = QuantConfig(bits=4, group=16, method="hqq", skip=("expert",))
    assert main(["quantize", "--model", str(src), "--out", str(out), "--bits", "4", "--group", "16", "--method", "hqq",
                 "--skip", "expert"]) == 0
    capsys.readouterr()
    assert main(["eval", "ppl", "--model", str(out), "--device", "cpu", "--window", "32"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", str(out), "--device", "cpu", "--greedy", "--max-new-tokens", "4", "ab"]) == 0
    assert main(["info", "--model", str(out), "--explain", "--device", "cpu"]) == 0
    ref = moeserve.load_model(src, device="cpu")
    for t in linear_tensors(ref.spec):
        if t.kind not in cfg.skip:
            linear = ref.get_submodule(t.name)
            replace_module(ref, t.name, quantize_tensor(linear.weight, cfg, 0, linear.bias))
    q = moeserve.load_model(out, device="cpu")
    assert isinstance(q.model.layers[0].mlp.experts, Mxfp4Experts) == (source == "mxfp4")
    tokens = torch.randint(3, 255, (2, 14))
    with torch.no_grad():
        assert torch.equal(q(tokens), ref(tokens))
    ids = load_tokenizer(src).encode((src / "heldout.txt").read_text())
    assert got["perplexity"] == round(perplexity(ref, ids, 32, progress=False)["perplexity"], 4)


@pytest.mark.parametrize("source", ["float", "mxfp4"])
def test_hybrid_and_offload_equal_the_resident_model(byte_gpt_oss, source, tmp_path, capsys):
    """Experts in host RAM (--cpu-moe, --n-cpu-moe 1, the planner's --gpu-memory: read from the checkpoint, or from a
    store) and offloaded from a store (offload-prepare, then generate --offload --high-slots 2 --all-high), float or
    MXFP4 as shipped (the store's float copies dequantized): greedy tokens equal the resident model's and `eval ppl`
    agrees to 1e-4; 4-bit experts (--experts-bits 4, mixed precision) run near it. The store records the biases and
    the clamped SwiGLU, and is refused for a model whose experts compute otherwise."""
    from moeserve.cli import main
    from moeserve.offload.store import META_FILE, ExpertStore

    src, store = byte_gpt_oss[source], tmp_path / "store"

    def run(*argv) -> str:
        assert main([str(a) for a in argv]) == 0
        return capsys.readouterr().out

    assert json.loads(run("offload-prepare", "--model", src, "--out", store, "--group", "32"))["layers"] == 4
    meta = json.loads((store / META_FILE).read_text())
    assert meta["expert_bias"] and meta["expert_act"] == {"alpha": 1.702, "limit": 1.0}
    gen = ["generate", "--model", src, "--device", "cpu", "--greedy", "--max-new-tokens", "8", "--ignore-eos", "ab c"]
    ppl = ["eval", "ppl", "--model", src, "--device", "cpu", "--max-tokens", "48"]
    tokens, want = run(*gen), json.loads(run(*ppl))["perplexity"]
    for extra in (["--cpu-moe"], ["--n-cpu-moe", "1"], ["--offload", store, "--high-slots", "2", "--all-high"],
                  ["--gpu-memory", "1GiB", "--n-cpu-moe", "2"]):  # the planner's placement (no GPU here)
        assert run(*gen, *extra) == tokens, extra
    for extra in (["--cpu-moe"], ["--n-cpu-moe", "1", "--offload", store]):  # eval's --offload: the hybrid's store
        assert json.loads(run(*ppl, *extra))["perplexity"] == pytest.approx(want, rel=1e-4), extra
    for extra in (["--cpu-moe", "--offload", store, "--experts-bits", "4"], ["--n-cpu-moe", "2", "--mixed-precision"]):
        assert json.loads(run(*ppl, *extra))["perplexity"] == pytest.approx(want, rel=0.1), extra
    (store / META_FILE).write_text(json.dumps({k: v for k, v in meta.items() if k != "expert_act"}))
    with pytest.raises(moeserve.MoeserveError, match="computed otherwise.*silu.*clamped SwiGLU alpha 1.702 limit 1.0"):
        ExpertStore.open(store).check_model(moeserve.ModelSpec.from_dir(src), src)
