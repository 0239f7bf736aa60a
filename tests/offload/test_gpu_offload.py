"""Offloading on a GPU: async loads on the copy stream (pinned and staged), prefetch and CPU cooperation
give the resident model's outputs; skipped without a GPU."""

import itertools

import pytest
import torch

import moeserve
from moeserve.offload.setup import enable_offload
from moeserve.offload.slot_cache import SlotCache
from moeserve.offload.store import ExpertStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])  # gpt_oss: biases and the clamped SwiGLU
@pytest.mark.parametrize("pin", [True, False])
@pytest.mark.parametrize("slots,prefetch,cooperative", [(0, 0, False), (2, 1, False), (5, 2, True)])
def test_gpu_offload_equals_resident(hf_checkpoints, tmp_path, monkeypatch, family, pin, slots, prefetch, cooperative):
    _, path = hf_checkpoints[family]
    ExpertStore.build(path, tmp_path, low_bits=4, group=16, progress=False)
    tokens = torch.randint(3, 97, (3, 6), device="cuda")
    expected = moeserve.load_model(path, device="cuda", dtype="float32")(tokens)
    model = moeserve.load_model(path, device="cuda", dtype="float32", routed_experts=False)
    cache = enable_offload(model, ExpertStore.open(tmp_path), high_slots=slots, policy="hobbit", mixed=False,
                           prefetch_layers=prefetch, cooperative=cooperative, pin=pin)
    if cooperative:  # every other miss on the CPU: both kinds, whatever the routing (GPT-OSS's tiny one: few experts)
        turns = itertools.count()
        monkeypatch.setattr(SlotCache, "_cpu_is_faster", lambda self, low, rows, busy: next(turns) % 2 == 0)
    for _ in range(3):  # later passes hit slots that were reloaded while earlier work was in flight
        torch.testing.assert_close(model(tokens), expected, atol=1e-4, rtol=1e-4)
    assert cache.copier.stream is not None and cache.stats.high_misses > 0
    assert (cache.cpu_experts > 0) == cooperative
