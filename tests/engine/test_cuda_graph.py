"""The static decode step (what CUDA graphs capture) must compute what the dynamic forward computes.

On the CPU the static step runs eagerly; tests/test_gpu.py replays it as a graph."""

import pytest
import torch

import moeserve
from hf_models import FAMILIES
from moeserve.cli import DEMO_DIR
from moeserve.engine import batching, cuda_graph
from moeserve.engine.cuda_graph import SlotDecoder, graph_safe
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.engine.sequence import left_padded
from moeserve.model.kv_cache import SlotKVCache
from moeserve.model.paths import GRAPH_SAFE


@pytest.mark.parametrize("family", FAMILIES)
def test_static_decode_step_matches_dynamic_forward(family, hf_checkpoints, monkeypatch):
    """Prompts of 9, 4 and 1 tokens in rows of a SlotKVCache, 8 decode steps (past mixtral_sliding's window of 5),
    sequence 1 leaving after step 2 (the padded batch shrinks). The static step (SlotDecoder, eagerly) whole and cut
    at every MoE layer's experts (on the CPU every MoE layer's expert path is a host one, as hybrid and offloaded
    layers are on a GPU), against the dynamic forward."""
    model = moeserve.load_model(hf_checkpoints[family][1], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (9, 4, 1)]
    tokens, valid, positions = left_padded(prompts, model.spec)  # [B, S] each
    steps = torch.randint(3, 97, (8, 3), generator=g)  # [steps, B] teacher-forced decode tokens
    caches = [SlotKVCache(model.spec, 3, 9 + 8, "cpu", torch.float32) for _ in range(3)]
    dynamic = SlotDecoder(model, caches[0], graph=False, static=False)
    whole, cut = (SlotDecoder(model, kv, graph=False, static=True) for kv in caches[1:])
    assert cuda_graph.host_layers(model, 3) == [i for i, moe in enumerate(model.spec.moe.layers) if moe]

    def whole_step(*inputs):
        with monkeypatch.context() as m:
            m.setattr(cuda_graph, "host_layers", lambda model, batch: [])
            return whole(*inputs)

    with torch.inference_mode():
        for kv in caches:
            kv.use([0, 1, 2], tokens.shape[1])
            model(tokens, positions, kv=kv, valid=valid, last_only=True)
        for i, step in enumerate(steps):
            rows = [0, 1, 2] if i < 3 else [0, 2]
            inputs = ([int(step[r]) for r in rows], [len(prompts[r]) + i for r in rows], rows)
            expected = dynamic(*inputs)  # [B, V]
            torch.testing.assert_close(whole_step(*inputs), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cut(*inputs), expected, rtol=1e-5, atol=1e-5)
    assert sorted(whole.runners) == sorted(cut.runners) == [2, 3]
    assert not whole.cut_sizes() and cut.cut_sizes() == [2, 3]


def static_decoding(monkeypatch) -> None:
    """Make generate() decode through the static step (eagerly), as it does through graphs on a GPU."""
    monkeypatch.setattr(batching, "SlotDecoder",
                        lambda model, kv, graph: SlotDecoder(model, kv, graph=False, static=True))


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
