"""The one run path's second half: RunPlan -> build -> Runtime, the model as the plan places it.

  1. RunPlan.layers: one LayerPlacement per MoE layer (where its experts live, at which precision, whether from the
     host store);
  2. the model on the meta device, the experts of the layers the checkpoint's own tensors fill made by the factory
     (moeserve/factory.py); under --ep/--tp, this rank's part (parallel/loading.py);
  3. one read pass over the checkpoint: the model's tensors, and for a hybrid run without a store on disk the store
     layers' experts, handed to the store as they are read (ExpertStore.from_sources), so no tensor is read twice;
  4. the host-resident backend over the store (the hybrid runtime, or HOBBIT's offload cache), whose layers' experts
     the factory makes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.checkpoint import CheckpointReader
from moeserve.config import check_cache_slots
from moeserve.errors import MoeserveError
from moeserve.factory import check_layers
from moeserve.kernels.cpu.machine import expert_cores
from moeserve.loader import meta_model, read_model, resolve_device, resolve_dtype, unread_layers
from moeserve.offload.setup import offload_cache, place_offloaded
from moeserve.offload.slot_cache import SlotCache
from moeserve.offload.store import ExpertStore, layer_experts, source_layers
from moeserve.parallel.launch import init_from_env
from moeserve.parallel.loading import load_parallel_model
from moeserve.plan.footprint import plan_slots
from moeserve.plan.placement import dense_layout
from moeserve.quant.manifest import read_manifest
from moeserve.runtime import RunPlan, dense_request


@dataclass
class Runtime:
    """A loaded run: the model, and the expert cache or hybrid runtime that serves its experts (for their stats)."""
    plan: RunPlan
    model: object
    cache: object | None = None  # offload.slot_cache.SlotCache of an --offload run
    hybrid: object | None = None  # hybrid.runtime.HybridRuntime of a hybrid run
    seed: int | None = None  # under --ep/--tp: a sampling seed every rank shares (rank 0's), when none was given

    def placement_name(self) -> str:
        """A few words on where the experts live, for bench's table and the Python API."""
        p, model = self.plan, self.model
        dtype = str(model.dtype).removeprefix("torch.")
        dense = f", dense part {p.dense_bits}-bit" if p.dense_bits != 16 else ""
        if p.plan_line:
            return p.plan_line.removeprefix("[plan: ").split(";")[0] + f"{dense} ({model.device.type}, {dtype})"
        if p.hybrid is not None:
            return p.hybrid.describe(model.device.type, host_experts_format(p, dtype), dense_bits=p.dense_bits,
                                     cores=expert_cores().describe()).removeprefix("[placement: ").removesuffix("]")
        if p.config.offload:
            c = p.config.cache
            return f"offload ({p.config.gpu_memory or f'{c.high_slots}+{c.low_slots} slots'}, {dtype})"
        ranks = p.config.parallel
        across = f", --tp {ranks.tp} --ep {ranks.ep}" if ranks.ranks > 1 else ""
        return f"resident ({model.device.type}, {dtype}{across})"


def build(plan: RunPlan, progress: bool = True) -> Runtime:
    """The model as the plan places it (module docstring): one process (resident, hybrid or offloaded experts) or
    this torchrun rank's part (--ep/--tp)."""
    config = plan.config
    if config.parallel.ranks > 1:
        return build_parallel(plan, progress)
    device = resolve_device(plan.device)
    dtype = resolve_dtype(config.dtype, device)
    layers = plan.layers(dtype.itemsize)
    check_layers(layers)
    from_store = tuple(p for p in layers if p.stored)  # their experts are made once the store's backend exists
    model = meta_model(config.model, tuple(p for p in layers if not p.stored))
    reader = CheckpointReader(config.model)
    read_model(model, reader, device, dtype, plan.dense_bits, unread_layers([p.layer for p in from_store]), progress)
    if plan.hybrid is not None:
        from moeserve.hybrid.setup import enable_hybrid  # its device link needs triton

        store = plan.store or read_store(reader, plan, dtype, device, progress)
        return Runtime(plan, model, hybrid=enable_hybrid(model, store, plan.hybrid, warm=True,
                                                         disk_budget=plan.disk_budget))
    if config.offload:
        cache = planned_cache(model, plan)
        place_offloaded(model, cache, max(config.cache.prefetch, 0))
        return Runtime(plan, model, cache=cache)
    return Runtime(plan, model)


def read_store(reader: CheckpointReader, plan: RunPlan, dtype: torch.dtype, device: torch.device,
               progress: bool) -> ExpertStore:
    """The hybrid placement's store in RAM (hybrid/setup.py store_settings), its experts read by the build's read
    pass through `reader`, one layer at a time."""
    from moeserve.hybrid.setup import store_settings  # its device link needs triton

    manifest = read_manifest(reader.path)
    s = store_settings(plan.spec, plan.hybrid, device, manifest is not None)
    if manifest is not None:  # a quantized checkpoint's experts, as stored
        return ExpertStore.from_quantized(reader.path, manifest, list(s.layers), dtype, s.pin, progress)
    return ExpertStore.from_sources(plan.spec, source_layers(reader, plan.spec, list(s.layers), progress), s.low_bits,
                                    s.group, dtype, s.device, s.high, s.pin, mxfp4=True)


def build_parallel(plan: RunPlan, progress: bool) -> Runtime:
    """This rank's part of the model (TP slices, EP experts), and a sampling seed every rank shares."""
    config, p = plan.config, plan.config.parallel
    rank, world, device = init_from_env(plan.device, p.collective_timeout)
    layers = plan.layers(resolve_dtype(config.dtype, device).itemsize)
    check_layers(layers)
    model = load_parallel_model(config.model, rank, world, tp=p.tp, ep=p.ep, device=device, dtype=config.dtype,
                                hierarchical=p.hierarchical_a2a, progress=progress and rank == 0,
                                static_max_tokens=max(p.static_dispatch_tokens, 0), dense_bits=plan.dense_bits,
                                collective_timeout=p.collective_timeout, layers=layers)
    seed = [int.from_bytes(os.urandom(4), "little")]  # every rank must sample the same tokens: rank 0's seed
    dist.broadcast_object_list(seed, src=0)
    return Runtime(plan, model, seed=seed[0])


def planned_cache(model, plan: RunPlan) -> SlotCache:
    """HOBBIT's expert cache over the plan's store, its slots given or planned from the budget left after the
    loaded model and the KV cache."""
    c, store = plan.config.cache, plan.store
    if plan.cache_budget is None:
        high, low = c.high_slots, c.low_slots
    else:
        base = dense_layout(model.spec, dense_request(plan, plan.cache_budget), plan.dense_bits, plan.cache_budget)
        high, low = plan_slots(model.spec, base, store.expert_bytes(low=False),
                               0 if c.all_high else store.expert_bytes(low=True), reserve=model.spec.moe.top_k,
                               max_slots=sum(layer_experts(store.meta, i) for i in store.meta["layers"]))
    check_cache_slots(high, low, c.t1, c.t2)
    try:
        return offload_cache(model, store, high_slots=high, low_slots=low, policy=c.policy, mixed=not c.all_high,
                             t1=c.t1, t2=c.t2, cooperative=c.cooperative, pin=c.pin, per_layer=c.per_layer)
    except ValueError as e:
        raise MoeserveError(str(e)) from None


def describe_hybrid(runtime: Runtime) -> str | None:
    """The hybrid placement's one line (`[placement: ...]`), when the run has one and no plan line said it."""
    p, model = runtime.plan, runtime.model
    if p.hybrid is None or p.plan_line:
        return None
    return p.hybrid.describe(model.device.type, host_experts_format(p, str(model.dtype).removeprefix("torch.")),
                             p.low_bits, p.dense_bits, expert_cores().describe())


def host_experts_format(plan: RunPlan, dtype: str) -> str:
    """The format float CPU experts compute in: MXFP4 as shipped when the build reads them from an MXFP4 checkpoint
    (plan/layers.py hybrid_layers), else the compute dtype (an --offload store holds float copies)."""
    return "MXFP4" if plan.spec.moe.experts_mxfp4 and plan.store is None else dtype
