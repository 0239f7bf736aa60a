"""The one run path: RunConfig -> prepare (checks and the placement, nothing allocated) -> load (the model as placed).

Every entry point takes it: the CLI commands (generate, eval ppl, serve, bench, trace record), the server's loader
and `moeserve.LLM`. `prepare` reads config.json only, so a run that cannot work fails before any weight is read:
the options (RunConfig.validate), the hybrid placement against the model's MoE layers, the planner's choice under a
GPU budget, the expert store against the checkpoint and the host RAM the experts need. `load` then builds the model
in the one way the RunPlan names: resident (float or a quantized checkpoint), hybrid CPU/GPU experts, HOBBIT's
offload cache, or one torchrun rank's part (--ep/--tp).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch.distributed as dist

from moeserve.config import RunConfig, changed, check_cache_slots
from moeserve.engine.batching import DEFAULT_PREFILL_TOKENS
from moeserve.errors import MoeserveError
from moeserve.hybrid.memory import check_host_ram, store_precision
from moeserve.hybrid.placement import STREAM_FROM, HybridPlacement
from moeserve.kernels.cpu.machine import physical_cores
from moeserve.loader import load_model, resolve_device, resolve_dtype
from moeserve.offload.budget import available_ram, check_budget
from moeserve.offload.experts import enable_offload as enable_cache
from moeserve.offload.store import ExpertStore, layer_experts
from moeserve.parallel.launch import init_from_env
from moeserve.parallel.loading import load_parallel_model
from moeserve.plan.footprint import engine_kv_rows, footprint, hybrid_layout, plan_slots
from moeserve.plan.hardware import load_or_measure
from moeserve.plan.placement import PlanRequest, check_dense_budget, dense_layout, moe_layer_count
from moeserve.plan.placement import plan_placement as choose_placement
from moeserve.quant.manifest import read_manifest
from moeserve.spec import ModelSpec


@dataclass(frozen=True)
class RunPlan:
    """What `prepare` decided: where the experts live and at which precision, before anything is allocated.

    hybrid: the CPU/GPU expert placement (None: experts on the model device, or offloaded); device: the device the
    run uses (a plan without a GPU says cpu); plan_line: the planner's one line (None without --gpu-memory); store:
    the expert store opened and checked against the checkpoint (hybrid with --offload, or offload); low_bits/group:
    the precision of the hybrid's low-bit copies (None: float only); cache_budget: offload's slot budget in bytes
    (None: slots given)."""
    config: RunConfig
    spec: ModelSpec
    kv_batch: int
    kv_tokens: int
    device: str
    dense_bits: int = 16
    hybrid: HybridPlacement | None = None
    plan_line: str | None = None
    store: object | None = None
    low_bits: int | None = None
    cache_budget: int | None = None


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
            return p.hybrid.describe(model.device.type, dtype, dense_bits=p.dense_bits).removeprefix(
                "[placement: ").removesuffix("]")
        if p.config.offload:
            c = p.config.cache
            return f"offload ({p.config.gpu_memory or f'{c.high_slots}+{c.low_slots} slots'}, {dtype})"
        ranks = p.config.parallel
        across = f", --tp {ranks.tp} --ep {ranks.ep}" if ranks.ranks > 1 else ""
        return f"resident ({model.device.type}, {dtype}{across})"


def prepare(config: RunConfig, spec: ModelSpec | None = None, kv_batch: int = 1,
            kv_tokens: int | None = None) -> RunPlan:
    """The run's plan for a KV cache of kv_batch x kv_tokens tokens (default: one sequence of the model's context),
    after every check that needs no weights; a MoeserveError names the first problem."""
    config.validate()
    spec = spec or ModelSpec.from_dir(config.model)
    kv_tokens = spec.max_position_embeddings if kv_tokens is None else kv_tokens
    plan = RunPlan(config, spec, kv_batch, kv_tokens, config.device,
                   16 if config.dense_bits is None else config.dense_bits)
    if config.hybrid.requested:
        plan = replace(plan, hybrid=hybrid_placement(config, spec))
    if config.planning:
        plan = plan_placement(plan)
    if plan.hybrid is not None:
        return hybrid_source(plan)
    if config.offload:
        return open_offload_store(plan)
    return plan


def hybrid_placement(config: RunConfig, spec: ModelSpec, every: bool | None = None, n: int | None = None,
                     bits: int | None = None, slots: int | None = None,
                     stream_from: int | None = None) -> HybridPlacement:
    """HybridPlacement.choose from the config's hybrid options; the arguments given override them (a plan's)."""
    h = config.hybrid
    if every is None:
        every, n = h.cpu_moe, h.n_cpu_moe
    bits = h.experts_bits if bits is None else bits
    slots = h.gpu_cache_experts if slots is None else slots
    stream_from = h.stream_from if stream_from is None else stream_from
    return HybridPlacement.choose(
        spec.moe.layer_indices(), every, n, slots or 0,
        len(physical_cores()) if h.cpu_threads is None else h.cpu_threads, h.mixed_precision,
        16 if bits is None else bits, h.cache_policy, spec.moe.num_experts, STREAM_FROM if stream_from is None
        else stream_from)


def plan_placement(plan: RunPlan) -> RunPlan:
    """Under a GPU budget without a store: where the experts live, chosen by the planner (plan/placement.py) from
    this machine's hardware profile within the budget and the RAM available now; the config's --cpu-moe/--n-cpu-moe,
    --experts-bits, --gpu-cache-experts and --dense-bits narrow the candidates."""
    config, spec = plan.config, plan.spec
    budget = config.gpu_memory_bytes
    stored = stored_experts(config)
    if stored is not None:  # the planner places a quantized checkpoint's experts at their stored bits
        check_stored_bits(config, stored[0])
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if device.type == "cuda":
        check_budget(budget, device)
    h = config.hybrid
    req = PlanRequest(budget if device.type == "cuda" else None, available_ram(), dtype.itemsize,
                      str(dtype).removeprefix("torch."), plan.kv_batch, plan.kv_tokens,
                      bits=h.experts_bits if stored is None else stored[0], group=None if stored is None else stored[1],
                      cpu_layers=None if plan.hybrid is None else len(plan.hybrid.cpu_layers),
                      cache_slots=h.gpu_cache_experts, dense_bits=config.dense_bits, pass_tokens=largest_pass(plan))
    placement_plan = choose_placement(spec, load_or_measure(), req)
    chosen = placement_plan.chosen
    hybrid = None
    if chosen.hybrid:
        stream_from = 0 if not chosen.streams and h.stream_from is None else None  # no room for the ring
        every = chosen.cpu_layers == moe_layer_count(spec)
        hybrid = hybrid_placement(config, spec, every, None if every else chosen.cpu_layers, chosen.bits,
                                  chosen.cache_slots, stream_from)
    else:
        given = [f for f in ("--cache-policy", "--cpu-threads", "--mixed-precision", "--stream-from")
                 if f in changed(config.hybrid)]  # --experts-bits and --gpu-cache-experts narrowed the plan
        if given:
            raise MoeserveError(f"{given[0]} applies to experts on the CPU, and the plan keeps them all on the "
                                f"{'CPU' if chosen.kind == 'cpu' else 'GPU'} unquantized ({chosen.where()}); give "
                                f"--n-cpu-moe N or leave {given[0]} out")
    return replace(plan, hybrid=hybrid, dense_bits=chosen.dense_bits, plan_line=placement_plan.describe(),
                   device="cpu" if chosen.kind == "cpu" else plan.device)


def hybrid_source(plan: RunPlan) -> RunPlan:
    """The hybrid's store (--offload STORE, checked against the model and the placement) or the precision of the
    store to build from --model; then the host RAM the experts need is checked, before anything is allocated."""
    config, spec, placement = plan.config, plan.spec, plan.hybrid
    dtype = resolve_dtype(config.dtype, resolve_device(plan.device))
    store, mapped_bytes = None, None
    if config.offload:
        store = ExpertStore.open(config.offload)
        store.check_model(spec, config.model)
        if store.quantized:  # a quantized checkpoint's experts run at its bits
            placement = stored_placement(config, placement, store.meta["low_bits"])
        low_bits, group = store.meta["low_bits"], store.meta["group"]
        if placement.low and low_bits != placement.bits:
            raise MoeserveError(f"--experts-bits {placement.bits}: the store {config.offload} holds {low_bits}-bit "
                                f"copies; give --experts-bits {low_bits} or 16, or build a {placement.bits}-bit store "
                                f"(`moeserve offload-prepare --low-bits {placement.bits}`)")
        mapped_bytes = store.part_shapes(low=False)[0][1].itemsize
    else:
        stored = stored_experts(config)
        if stored is not None:  # a quantized checkpoint's experts run at its bits, from a store of its experts
            placement = stored_placement(config, placement, stored[0])
        low_bits, group = stored or store_precision(spec, placement)
    layout = hybrid_layout(spec, placement, plan.device, dtype.itemsize, engine_kv_rows(plan.kv_batch),
                           plan.kv_tokens, low_bits, group, plan.dense_bits, mapped_float_bytes=mapped_bytes)
    check_host_ram(footprint(spec, layout).host["expert store"])
    return replace(plan, hybrid=placement, store=store, low_bits=low_bits)


def stored_experts(config: RunConfig) -> tuple[int, int] | None:
    """(bits, group) of a moeserve quantized checkpoint's experts, which a placement without a float store runs as
    stored; None for a float checkpoint."""
    manifest = read_manifest(Path(config.model))
    return None if manifest is None else (manifest["bits"], manifest["group"])


def stored_placement(config: RunConfig, placement: HybridPlacement, bits: int) -> HybridPlacement:
    """The placement with its experts at a quantized checkpoint's `bits` (check_stored_bits)."""
    check_stored_bits(config, bits)
    return replace(placement, bits=bits)


def check_stored_bits(config: RunConfig, bits: int) -> None:
    """A quantized checkpoint's experts run at their stored `bits`: --experts-bits other than those is refused,
    naming them."""
    asked = config.hybrid.experts_bits
    if asked is not None and asked != bits:
        raise MoeserveError(f"--experts-bits {asked}: {config.model} is a moeserve quantized checkpoint of {bits}-bit "
                            f"experts, which run as stored; give --experts-bits {bits} or leave it out")


def open_offload_store(plan: RunPlan) -> RunPlan:
    """--offload STORE: the store checked against the model (layers, shapes, source) and the budget against the
    device's memory and the dense part, all before the model loads."""
    config, spec = plan.config, plan.spec
    store = ExpertStore.open(config.offload)
    store.check_model(spec, config.model)
    if config.cache.high_slots is not None:
        return replace(plan, store=store)
    budget = config.gpu_memory_bytes  # given: validate asks for it or --high-slots
    device = resolve_device(plan.device)
    check_budget(budget, device)
    check_dense_budget(spec, dense_request(plan, budget), plan.dense_bits)
    return replace(plan, store=store, cache_budget=budget)


def dense_request(plan: RunPlan, budget: int) -> PlanRequest:
    """The plan's KV cache and compute dtype as a planner request for `budget` (the dense part's checks and the
    offload cache's slots count it with plan/footprint.py)."""
    dtype = resolve_dtype(plan.config.dtype, resolve_device(plan.device))
    return PlanRequest(budget, available_ram(), dtype.itemsize, str(dtype).removeprefix("torch."), plan.kv_batch,
                       plan.kv_tokens, pass_tokens=largest_pass(plan))


def largest_pass(plan: RunPlan) -> int:
    """Tokens of the run's largest forward pass (the footprint's workspace): the engine's prefill chunk, or every
    token the KV cache holds when that is less."""
    return min(plan.kv_batch * plan.kv_tokens, DEFAULT_PREFILL_TOKENS)


def load(plan: RunPlan, progress: bool = True) -> Runtime:
    """The model as the plan places it: one process (resident, hybrid or offloaded experts) or this torchrun rank's
    part (--ep/--tp)."""
    if plan.hybrid is not None:
        return load_hybrid(plan, progress)
    if plan.config.parallel.ranks > 1:
        return load_parallel(plan, progress)

    config = plan.config
    model = load_model(config.model, device=plan.device, dtype=config.dtype, progress=progress,
                       routed_experts=not config.offload, dense_bits=plan.dense_bits)
    cache = enable_offload(model, plan) if config.offload else None
    return Runtime(plan, model, cache=cache)


def load_parallel(plan: RunPlan, progress: bool) -> Runtime:
    """This rank's part of the model (TP slices, EP experts), and a sampling seed every rank shares."""

    config, p = plan.config, plan.config.parallel
    rank, world, device = init_from_env(plan.device)
    model = load_parallel_model(config.model, rank, world, tp=p.tp, ep=p.ep, device=device, dtype=config.dtype,
                                hierarchical=p.hierarchical_a2a, progress=progress and rank == 0,
                                static_max_tokens=max(p.static_dispatch_tokens, 0), dense_bits=plan.dense_bits)
    seed = [int.from_bytes(os.urandom(4), "little")]  # every rank must sample the same tokens: rank 0's seed
    dist.broadcast_object_list(seed, src=0)
    return Runtime(plan, model, seed=seed[0])


def load_hybrid(plan: RunPlan, progress: bool) -> Runtime:
    """The model with its CPU layers' experts in host RAM (the plan's store, or read from the checkpoint)."""
    from moeserve.hybrid.setup import build_store, enable_hybrid, store_layers  # its device link needs triton

    config, placement = plan.config, plan.hybrid
    device = resolve_device(plan.device)
    dtype = resolve_dtype(config.dtype, device)
    stored = set(store_layers(placement))
    model = load_model(config.model, device=device, dtype=dtype, progress=progress,
                       routed_experts=[i for i in placement.moe_layers if i not in stored], dense_bits=plan.dense_bits)
    store = plan.store or build_store(config.model, placement, dtype, device, progress=progress)
    return Runtime(plan, model, hybrid=enable_hybrid(model, store, placement, warm=True))


def enable_offload(model, plan: RunPlan):
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
        return enable_cache(model, store, high_slots=high, low_slots=low, policy=c.policy, mixed=not c.all_high,
                            t1=c.t1, t2=c.t2, prefetch_layers=max(c.prefetch, 0), cooperative=c.cooperative,
                            pin=c.pin, per_layer=c.per_layer)
    except ValueError as e:
        raise MoeserveError(str(e)) from None


def describe_hybrid(runtime: Runtime) -> str | None:
    """The hybrid placement's one line (`[placement: ...]`), when the run has one and no plan line said it."""
    p, model = runtime.plan, runtime.model
    if p.hybrid is None or p.plan_line:
        return None
    return p.hybrid.describe(model.device.type, str(model.dtype).removeprefix("torch."), p.low_bits, p.dense_bits)
