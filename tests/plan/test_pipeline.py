"""CGOPipe executor (plan/pipeline.py): same tokens and logits as the plain engine under every schedule;
balanced micro-batches; `moeserve batch` end to end (bad lines, resume, a cut-off last line)."""

import json
import random
import time

import pytest
import torch

import moeserve
from moeserve.cli import main
from moeserve.engine.generate import iterate
from moeserve.engine.params import SamplingParams
from moeserve.engine.scheduler import balanced_micro_batches
from moeserve.plan import layer_weights
from moeserve.plan import pipeline as pipeline_module
from moeserve.plan.cpu_attention import gqa_attention
from moeserve.plan.pipeline import SCHEDULES, Pipeline, Staging, host_kv_bytes, pack
from moeserve.plan.policy import ThroughputPolicy

PROMPTS = [[5, 9, 13, 7, 21, 3, 8], [11, 4], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], [6, 17, 19, 23]]


def plain(model, prompts, params):
    """Greedy tokens and the logits [B, V] of every step from engine.generate (eager: a CUDA graph's replays would
    run no hook)."""
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: logits.append(out[:, -1].clone()))
    for gens, _ in iterate(model, prompts, params, cuda_graph=False):
        pass
    hook.remove()
    return [g.token_ids for g in gens], logits


def piped(model, policy, prompts, params):
    pipeline = Pipeline(model, policy, "cpu")
    logits = []
    for gens, _, step_logits in pipeline.generate(prompts, params):
        logits.append(step_logits.clone())
    pipeline.close()
    return [g.token_ids for g in gens], logits


@pytest.mark.parametrize("family", ["mixtral", "mixtral_sliding", "qwen2_moe", "llama4"])  # llama4: chunks, NoPE
def test_pipeline_matches_plain_engine(hf_checkpoints, family):
    model = moeserve.load_model(hf_checkpoints[family][1], device="cpu", dtype="float32")
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    ref_tokens, ref_logits = plain(model, PROMPTS, params)
    cases = [(s, f, n) for s in SCHEDULES for f, n in ((0.0, 1), (0.5, 2), (1.0, 2))] + [("cgopipe", 0.0, 4)]
    for schedule, fraction, n in cases:
        policy = ThroughputPolicy(batch_size=4, micro_batch=n, weights_gpu_fraction=fraction, **SCHEDULES[schedule])
        tokens, logits = piped(model, policy, PROMPTS, params)
        assert tokens == ref_tokens, (schedule, fraction, n)
        for a, b in zip(logits, ref_logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_pipeline_cpu_ffn_and_mixed_kv(hf_checkpoints):
    """The FFN on the CPU, and half of the micro-batches keeping their KV cache on the GPU."""
    model = moeserve.load_model(hf_checkpoints["qwen3_moe"][1], device="cpu", dtype="float32")
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    ref_tokens, _ = plain(model, PROMPTS, params)
    for policy in (ThroughputPolicy(4, 2, False, False, 0.5, 0.0), ThroughputPolicy(4, 1, False, True, 0.0, 0.5),
                   ThroughputPolicy(4, 2, True, True, 0.5, 0.5)):
        assert piped(model, policy, PROMPTS, params)[0] == ref_tokens, policy


def test_pipeline_sampling_and_eos_match(hf_checkpoints):
    """Seeded sampling: each sequence draws from its own generator, as the engine loop does; EOS stops."""
    model = moeserve.load_model(hf_checkpoints["mixtral"][1], device="cpu", dtype="float32")
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    policy = ThroughputPolicy(4, 2, False, True, 0.5, 0.0)
    assert piped(model, policy, PROMPTS, params)[0] == plain(model, PROMPTS, params)[0]


def test_pipeline_buffers_reused_across_steps_and_batches(hf_checkpoints, monkeypatch):
    """One pipeline runs two batches of fresh random prompts, 10 steps each, with a worker slowed down (so a
    buffer or cache slot reused too early would show): every step's logits equal the plain engine's."""
    model = moeserve.load_model(hf_checkpoints["mixtral"][1], device="cpu", dtype="float32")
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    attention, host_kv = pipeline_module.cpu_attention, Pipeline._host_kv
    monkeypatch.setattr(pipeline_module, "cpu_attention", lambda *a: (time.sleep(0.002), attention(*a))[1])
    monkeypatch.setattr(Pipeline, "_host_kv", lambda *a: (time.sleep(0.002), host_kv(*a))[1])
    rng = random.Random(7)
    for schedule in ("cgopipe", "flexgen"):
        pipeline = Pipeline(model, ThroughputPolicy(6, 2, weights_gpu_fraction=0.5, **SCHEDULES[schedule]), "cpu")
        for _ in range(2):
            prompts = [[rng.randrange(model.spec.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(5)]
            ref_tokens, ref_logits = plain(model, prompts, params)
            steps = [(gens, logits.clone()) for gens, _, logits in pipeline.generate(prompts, params)]
            assert [g.token_ids for g in steps[-1][0]] == ref_tokens, schedule
            for (_, a), b in zip(steps, ref_logits, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        pipeline.close()


def test_pipeline_paged_weight_streaming(hf_checkpoints, monkeypatch):
    """Streamed layers copied in pages of a few hundred bytes give the same outputs."""
    monkeypatch.setattr(layer_weights, "PAGE_BYTES", 256)
    model = moeserve.load_model(hf_checkpoints["qwen2_moe"][1], device="cpu", dtype="float32")
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    policy = ThroughputPolicy(4, 2, **SCHEDULES["cgopipe"], weights_gpu_fraction=0.0)
    assert piped(model, policy, PROMPTS, params)[0] == plain(model, PROMPTS, params)[0]


def test_paged_pairs_cover_tensors():
    """Contiguous pairs split into pages of 12 floats; the pair with a transposed side stays whole."""
    dst = [torch.empty(5, 7), torch.empty(3, 4).t(), torch.empty(2)]
    src = [torch.randn(5, 7), torch.randn(4, 3), torch.randn(2)]
    dst_pages, src_pages = layer_weights.paged(dst, src, page_bytes=48)
    assert [p.numel() for p in dst_pages] == [12, 12, 11, 12, 2] and len(src_pages) == len(dst_pages)
    assert all(d.shape == s.shape for d, s in zip(dst_pages, src_pages))
    for d, s in zip(dst_pages, src_pages):
        d.copy_(s)
    for d, s in zip(dst, src):
        torch.testing.assert_close(d, s, rtol=0, atol=0)


def test_host_weight_bytes_counts_shared_storages_once_and_pinned_rounding():
    shared = torch.nn.Linear(24, 24, bias=False)  # 2304 B
    model = torch.nn.ModuleDict({"a": shared, "b": shared, "c": torch.nn.Linear(10, 10)})  # 400 B + 40 B bias
    assert layer_weights.host_weight_bytes(model, pinned=False) == 2304 + 400 + 40
    assert layer_weights.host_weight_bytes(model, pinned=True) == 4096 + 512 + 64


def test_host_kv_bytes_counts_what_the_pipeline_allocates(hf_checkpoints):
    model = moeserve.load_model(hf_checkpoints["mixtral"][1], device="cpu", dtype="float32")
    policy = ThroughputPolicy(6, 2, False, True, 0.0, 1 / 3)  # one micro-batch of three keeps its KV on the GPU
    pipeline = Pipeline(model, policy, "cpu")
    prompts = [[1, 2, 3]] * 6
    mbs = [pipeline._micro_batch(prompts, g, 5, m < 1) for m, g in enumerate([[0, 1], [2, 3], [4, 5]])]
    pipeline.close()
    allocated = sum(t.nbytes for mb in mbs if not mb.kv_on_gpu for t in (mb.kv.k, mb.kv.v, mb.staging.qkv,
                                                                          mb.staging.out))
    assert host_kv_bytes(model.spec, policy, 3 + 5, 4, pinned=False) == allocated
    assert [layer_weights.pinned_size(n) for n in (0, 1, 3, 4, 5, 4096)] == [0, 1, 4, 4, 8, 4096]


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_staging_pack_unpack_round_trip(hf_checkpoints, family):
    """A decode token's cache entry (GQA: k and v; MLA: the latent, no v) and the core's query, packed into one row
    of the Staging buffer and read back as views."""
    spec = moeserve.ModelSpec.from_dir(hf_checkpoints[family][1])
    staging = Staging(spec, 3, torch.float32, pin=False, cpu_attends=True)
    heads, dim, separate = spec.attention.kv_cache_entry()
    k, q = torch.randn(3, heads, 1, dim), torch.randn(3, spec.attention.num_heads, 1, spec.attention.core()[0])
    v = torch.randn(3, heads, 1, dim) if separate else None
    staging.qkv[1].copy_(pack(k, v, q))
    got = staging.unpack(1)
    assert (got[1] is None) == (v is None)
    for a, b in zip(got, (k, v, q)):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("S,scale", [(1, None), (3, None), (1, 0.2)])  # 0.2: Granite's attention multiplier
def test_gqa_attention_equals_sdpa(S, scale):
    """Also over a strided slice of a cache, as the CPU attention reads it."""
    torch.manual_seed(0)
    q, cache = torch.randn(3, 8, S, 16), torch.randn(2, 3, 2, 12, 16)  # cache [kv, n, Hkv, S_max, Dh]
    k, v = cache[0, :, :, :9], cache[1, :, :, :9]
    mask = torch.rand(3, 1, S, 9) > 0.3
    mask[..., -1] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
    torch.testing.assert_close(gqa_attention(q, k, v, mask, scale), ref.transpose(1, 2).reshape(3, S, 128))


def test_balanced_micro_batches_bound():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 5)
        lengths = [rng.choice((rng.randint(1, 8), rng.randint(1, 600))) for _ in range(rng.randint(1, 24))]
        groups = balanced_micro_batches(lengths, n)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert len(groups) == -(-len(lengths) // n) and all(1 <= len(g) <= n for g in groups)
        fullest = max(sum(lengths[i] for i in g) for g in groups)
        assert fullest <= sum(lengths) / len(groups) + max(lengths)
    assert balanced_micro_batches([100, 90, 10, 5], 2) == [[0, 3], [1, 2]]


def _batch(tmp_path, capsys, *extra):
    status = main(["batch", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                   "--device", "cpu", "--max-new-tokens", "5", "--batch-size", "2", "--micro-batch", "1",
                   "--ignore-eos", *extra])
    return status, capsys.readouterr().err


def _lines(tmp_path):
    return [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]


def test_batch_cli_bad_lines_and_resume(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "To be"}\n{"prompt": "HAMLET."}\n{"prompt": 3}\n'
                                       '{broken\n\n{"id": 9, "prompt": "Words, words"}\n')
    status, err = _batch(tmp_path, capsys, "--on-bad-line", "stop")
    assert status == 2 and "in.jsonl:3:" in err and not (tmp_path / "out.jsonl").exists()

    status, err = _batch(tmp_path, capsys)
    assert status == 0 and "in.jsonl:3:" in err and "in.jsonl:4:" in err
    first = _lines(tmp_path)
    assert sorted(map(str, (r["id"] for r in first))) == ["2", "9", "a"]
    assert all(r["completion_tokens"] == 5 and r["finish_reason"] == "length" for r in first)

    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in first[:-1]))  # the last request is lost
    status, err = _batch(tmp_path, capsys)
    assert status == 0 and "1 requests (2 already done)" in err
    assert _lines(tmp_path) == first

    text = out.read_text()
    out.write_text(text[:-20])  # a write cut short: a partial last line
    status, err = _batch(tmp_path, capsys)
    assert status == 0 and "1 requests (2 already done)" in err
    assert _lines(tmp_path) == first


def test_batch_cli_auto_policy_from_a_profile(tmp_path, capsys):
    """--auto plans with a hardware profile (here the H100's, from a file) and runs what it planned."""
    from checks import H100

    (tmp_path / "h100.json").write_text(json.dumps(H100))
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("KING.", "To be", "Ay")))
    status, err = _batch(tmp_path, capsys, "--auto", "--profile", str(tmp_path / "h100.json"), "--gpu-memory", "2GiB")
    assert status == 0, err
    assert "[policy: batch of " in err and "no GPU (cpu): attention, the MoE FFN" in err
    assert len(_lines(tmp_path)) == 3


def test_batch_gpu_memory_without_a_gpu_says_what_it_limits(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"prompt": "KING."}\n')
    status, err = _batch(tmp_path, capsys, "--gpu-memory", "1GiB")
    assert status == 0, err
    assert err.splitlines()[0] == ("moeserve: note: the run has no GPU, so --gpu-memory 1GiB limits host memory as "
                                   "if it were the GPU's: the policy's share of the layer weights held whole (the "
                                   "rest copied layer by layer) and its batch")
