"""The static decode step (what CUDA graphs capture) must compute what the dynamic forward computes.

On the CPU the static step runs eagerly; tests/test_gpu.py replays it as a graph."""

import pytest
import torch

import moeserve
from hf_models import FAMILIES
from moeserve.cli import DEMO_DIR
from moeserve.engine import generate as generate_mod
from moeserve.engine.cuda_graph import SegmentedDecoder, StaticDecoder, graph_safe, host_layers
from moeserve.model.paths import GRAPH_SAFE
from moeserve.engine.generate import generate, left_padded
from moeserve.engine.sampling import SamplingParams
from moeserve.model.kv_cache import KVCache


@pytest.mark.parametrize("family", FAMILIES)
def test_static_decode_step_matches_dynamic_forward(family, hf_checkpoints):
    """Left-padded prompts of 9, 4 and 1 tokens, 8 decode steps (past mixtral_sliding's window of 5);
    sequence 1 finishes after step 2 (its later slots are invalid, as generate marks them). The static step whole
    and cut at every MoE layer's experts (SegmentedDecoder's pieces; on the CPU every MoE layer's expert path is a
    host one)."""
    model = moeserve.load_model(hf_checkpoints[family][1], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (9, 4, 1)]
    tokens, valid, positions = left_padded(prompts, model.spec)
    steps = torch.randint(3, 97, (8, 3, 1), generator=g)  # [steps, B, 1] teacher-forced decode tokens
    caches = [KVCache(model.spec, 3, tokens.shape[1] + 8, "cpu", torch.float32) for _ in range(3)]
    static = StaticDecoder(model, caches[1], graph=False)
    layers = host_layers(model, 3)
    assert layers == [i for i, moe in enumerate(model.spec.moe_layers) if moe]
    segmented = SegmentedDecoder(model, caches[2], layers, graph=False)
    alive = torch.ones(3, 1, dtype=torch.bool)
    with torch.inference_mode():
        first = [model(tokens, positions, kv=kv, valid=valid, last_only=True) for kv in caches]
        assert torch.equal(first[0], first[1])
        pos = positions[:, -1:] + 1  # [B, 1]
        for i, tok in enumerate(steps):
            alive[1] = i < 3
            dynamic = model(tok, pos, kv=caches[0], valid=alive, last_only=True)  # [B, 1, V]
            torch.testing.assert_close(static(tok, pos, alive), dynamic, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(segmented(tok, pos, alive), dynamic, rtol=1e-5, atol=1e-5)
            pos = pos + 1
    assert caches[0].length == caches[1].length == caches[2].length == tokens.shape[1] + 8
    assert torch.equal(caches[0].valid, caches[1].valid) and torch.equal(caches[0].valid, caches[2].valid)


def static_decoding(monkeypatch) -> None:
    """Make generate() decode through the static step (eagerly), as it does through a graph on a GPU."""
    monkeypatch.setattr(generate_mod, "_decoder",
                        lambda model, kv, batch, cuda_graph: StaticDecoder(model, kv, graph=False))


def test_generate_static_equals_dynamic_with_padding_and_early_finish(hf_checkpoints, monkeypatch):
    model = moeserve.load_model(hf_checkpoints["mixtral"][1], dtype=torch.float32)
    prompts = [[5, 17, 33, 8, 61, 12, 9], [44, 3], [70, 71, 72, 73]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    dynamic = generate(model, prompts, params)
    eos = dynamic[1].token_ids[3]  # sequence 1 ends early on this token (others may too)
    dynamic = generate(model, prompts, SamplingParams(max_new_tokens=12), eos_ids=[eos])
    assert dynamic[1].finish_reason == "eos" and len(dynamic[1].token_ids) <= 3
    static_decoding(monkeypatch)
    static = generate(model, prompts, SamplingParams(max_new_tokens=12), eos_ids=[eos])
    assert [(g.token_ids, g.finish_reason) for g in static] == [(g.token_ids, g.finish_reason) for g in dynamic]


def test_demo_greedy_tokens_static_equal_dynamic_fp32(monkeypatch):
    model = moeserve.load_model(DEMO_DIR, device="cpu", dtype=torch.float32)
    prompts = [list(b"HAMLET. To be, or not"), list(b"KING.")]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    dynamic = generate(model, prompts, params)
    static_decoding(monkeypatch)
    assert [g.token_ids for g in generate(model, prompts, params)] == [g.token_ids for g in dynamic]


def test_graph_safe_needs_cuda_and_sync_free_experts(hf_checkpoints):
    model = moeserve.load_model(hf_checkpoints["mixtral"][1], dtype=torch.float32)
    assert not graph_safe(model, 1)  # CPU: the expert loop reads routing counts on the host
    x = torch.empty(1, model.spec.hidden_size)
    assert model.model.layers[0].mlp.experts.kernel_path(x, 1) == "loop" and "loop" not in GRAPH_SAFE


def test_static_step_refuses_a_full_cache(hf_checkpoints):
    model = moeserve.load_model(hf_checkpoints["mixtral"][1], dtype=torch.float32)
    kv = KVCache(model.spec, 1, 2, "cpu", torch.float32)
    step = StaticDecoder(model, kv, graph=False)
    one = torch.ones(1, 1, dtype=torch.long)
    with torch.inference_mode():
        step(one, one * 0, one.bool())
        step(one, one, one.bool())
        with pytest.raises(ValueError, match="KV cache full"):
            step(one, one * 2, one.bool())


def test_a_failed_capture_falls_back_to_eager_steps(hf_checkpoints, monkeypatch):
    """If capturing raises (a backend was not sync-free after all), the step warns once and runs eagerly."""
    model = moeserve.load_model(hf_checkpoints["mixtral"][1], dtype=torch.float32)
    kvs = [KVCache(model.spec, 1, 4, "cpu", torch.float32) for _ in range(2)]
    eager, graphed = StaticDecoder(model, kvs[0], graph=False), StaticDecoder(model, kvs[1], graph=True)

    def capture(*inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed.runner, "_capture", capture)
    tok = torch.randint(3, 97, (1, 1))
    with torch.inference_mode():
        with pytest.warns(UserWarning, match="capture of the decode step failed"):
            torch.testing.assert_close(graphed(tok, tok * 0, tok.bool()), eager(tok, tok * 0, tok.bool()))
        torch.testing.assert_close(graphed(tok, tok * 0 + 1, tok.bool()), eager(tok, tok * 0 + 1, tok.bool()))
    assert not graphed.use_graph and not graphed.runner.graphed
