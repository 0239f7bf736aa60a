"""The footprint ledger's GPU total against torch's peak allocation: the demo model and a tiny Mixtral loaded on the
GPU in bf16 in each placement (resident, --cpu-moe, --n-cpu-moe 1 with cache slots, --offload), then a short greedy
generate, with and without CUDA graphs; the peak since before the load is within 5% of footprint's GPU total for that
run. Each run starts without cuBLAS workspaces, as a fresh process does. CPU checks of each part:
tests/plan/test_footprint.py."""

from __future__ import annotations

import gc

import pytest
import torch

import moeserve
from moeserve.engine.params import SamplingParams
from moeserve.offload.store import ExpertStore
from moeserve.plan.footprint import (RunLayout, engine_kv_rows, footprint, hybrid_layout, offload_layout,
                                     resident_layout)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT, NEW = 24, 8
PLACEMENTS = {"resident": {}, "cpu_moe": {"cpu_moe": True},
              "n_cpu_moe_cache": {"n_cpu_moe": 1, "gpu_cache_experts": 2},
              "offload": {"offload": "{store}", "high_slots": 4, "all_high": True}}


@pytest.fixture(scope="module")
def models(hf_checkpoints, tmp_path_factory):
    """name -> (checkpoint, its expert store)."""
    out = {}
    for name, path in (("demo", moeserve.DEMO_MODEL), ("tiny_mixtral", hf_checkpoints["mixtral"][1])):
        store = tmp_path_factory.mktemp(f"store-{name}")
        ExpertStore.build(path, store, low_bits=4, group=16)
        out[name] = (str(path), str(store))
    return out


def layout(run: moeserve.LLM, placement: str) -> RunLayout:
    """The ledger's description of the loaded run: a KV cache for one prompt of PROMPT + NEW tokens (generate's),
    the prompt as the largest pass."""
    spec, plan = run.model.spec, run.plan
    rows, tokens = engine_kv_rows(1), PROMPT + NEW
    if placement == "resident":
        out = resident_layout(spec, "cuda", 2, rows, tokens)
    elif placement == "offload":
        out = offload_layout(spec, 2, rows, tokens, 4 + spec.moe.top_k, 0, None, pinned=plan.config.cache.pin)
    else:
        store = run.runtime.hybrid.host.store
        out = hybrid_layout(spec, plan.hybrid, "cuda", 2, rows, tokens, store.meta["low_bits"], store.meta["group"],
                            streams=run.runtime.hybrid.streamer is not None)
    blas = 2 if plan.config.cuda_graph else 1
    return RunLayout(**{**vars(out), "pass_tokens": PROMPT, "logit_rows": 1, "blas_workspaces": blas})


@pytest.mark.parametrize("graph", [True, False])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("name", ["demo", "tiny_mixtral"])
def test_gpu_total_matches_the_peak(models, name, placement, graph):
    path, store = models[name]
    options = {k: store if v == "{store}" else v for k, v in PLACEMENTS[placement].items()}
    gc.collect()  # an earlier run's tensors freed during this one would hide part of its peak
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run = moeserve.LLM(path, max_batch=1, context=PROMPT + NEW, device="cuda", dtype="bfloat16",
                       cuda_graph=graph, **options)
    prompt = torch.randint(3, min(run.model.spec.vocab_size, 97), (PROMPT,), generator=torch.Generator().manual_seed(0))
    run.generate([prompt.tolist()], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    need = footprint(run.model.spec, layout(run, placement))
    assert need.gpu_total == pytest.approx(peak, rel=0.05), (name, placement, need.table(), peak)
    del run
    gc.collect()
    torch.cuda.empty_cache()
