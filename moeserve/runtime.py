"""The one run path's first half: RunConfig -> prepare (checks and the placement, nothing allocated) -> RunPlan,
which moeserve.build turns into the model as placed.

Every entry point takes it: the CLI commands (generate, eval ppl, serve, bench, trace record), the server's loader
and `moeserve.LLM`. `prepare` reads config.json only, so a run that cannot work fails before any weight is read:
the options (RunConfig.validate), the hybrid placement against the model's MoE layers, the planner's choice under a
GPU budget, the expert store against the checkpoint and the host RAM the experts need. The RunPlan then says per MoE
layer where its experts live and at which precision (RunPlan.layers): resident (float or a quantized checkpoint),
hybrid CPU/GPU experts, HOBBIT's offload cache, or one torchrun rank's part (--ep/--tp).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from moeserve.config import RunConfig, changed
from moeserve.engine.batching import DEFAULT_PREFILL_TOKENS
from moeserve.errors import MoeserveError
from moeserve.hybrid.memory import check_host_ram, read_precisions, store_precision
from moeserve.hybrid.placement import STREAM_FROM, HybridPlacement
from moeserve.kernels.cpu.machine import expert_cores
from moeserve.loader import resolve_device, resolve_dtype
from moeserve.offload.budget import available_ram, check_budget
from moeserve.offload.disk_cache import check_disk_budget
from moeserve.offload.store import ExpertStore
from moeserve.plan.footprint import engine_kv_rows, footprint, hybrid_layout
from moeserve.plan.hardware import load_or_measure
from moeserve.plan.layers import LayerPlacement, Shard, hybrid_layers, offload_layers, resident_layers
from moeserve.plan.placement import PlanRequest, check_dense_budget, moe_layer_count
from moeserve.plan.placement import plan_placement as choose_placement
from moeserve.quant.manifest import read_manifest
from moeserve.spec import ModelSpec
from moeserve.units import format_bytes


@dataclass(frozen=True)
class RunPlan:
    """What `prepare` decided: where the experts live and at which precision, before anything is allocated.

    hybrid: the CPU/GPU expert placement (None: experts on the model device, or offloaded); device: the device the
    run uses (a plan without a GPU says cpu); plan_line: the planner's one line (None without --gpu-memory); store:
    the expert store opened and checked against the checkpoint (hybrid with --offload, or offload); low_bits/group:
    the precision of the hybrid store's low-bit copies (hybrid_source; None without a hybrid placement);
    cache_budget: offload's slot budget in bytes (None: slots given); disk_budget: host RAM for the CPU layers'
    experts of a store read from disk (--cpu-memory: the disk tier; None: the store's mapping, or the store in RAM)."""
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
    group: int | None = None
    cache_budget: int | None = None
    disk_budget: int | None = None

    def layers(self, dtype_bytes: int) -> tuple[LayerPlacement, ...]:
        """Each MoE layer's placement (plan/layers.py) for a compute dtype of dtype_bytes: what the build makes."""
        config, spec = self.config, self.spec
        p = config.parallel
        if p.ranks > 1:
            return resident_layers(spec, dtype_bytes, read_manifest(Path(config.model)), Shard(p.ep, p.tp))
        if self.hybrid is not None:
            return hybrid_layers(spec, self.hybrid, dtype_bytes, self.low_bits, self.group,
                                 mapped=self.store is not None)
        if config.offload:
            return offload_layers(spec, dtype_bytes, mixed=not config.cache.all_high)
        return resident_layers(spec, dtype_bytes, read_manifest(Path(config.model)))


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
        len(expert_cores().cpus) if h.cpu_threads is None else h.cpu_threads, h.mixed_precision,
        16 if bits is None else bits, h.cache_policy, spec.moe.num_experts, STREAM_FROM if stream_from is None
        else stream_from, h.cpu_int8)


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
                      cache_slots=h.gpu_cache_experts, dense_bits=config.dense_bits, pass_tokens=largest_pass(plan),
                      blas_workspaces=blas_workspaces(plan))
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
    store to build from --model; then the host RAM the experts need is checked, before anything is allocated: with
    --cpu-memory (the disk tier) that budget, at least one layer's top-k experts, not the store."""
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
    layout = replace(hybrid_layout(spec, placement, plan.device, dtype.itemsize, engine_kv_rows(plan.kv_batch),
                                   plan.kv_tokens, low_bits, group, plan.dense_bits, mapped_float_bytes=mapped_bytes),
                     blas_workspaces=blas_workspaces(plan))
    disk_budget = config.hybrid.cpu_memory_bytes
    if disk_budget is not None:
        check_disk_budget(store, read_precisions(placement), spec.moe.top_k, disk_budget)
        if disk_budget > available_ram():
            raise MoeserveError(f"--cpu-memory {format_bytes(disk_budget)} is more than the "
                                f"{format_bytes(available_ram())} of host RAM available now; give at most that")
    else:
        check_host_ram(footprint(spec, layout).host["expert store"])
    return replace(plan, hybrid=placement, store=store, low_bits=low_bits, group=group, disk_budget=disk_budget)


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
                       plan.kv_tokens, pass_tokens=largest_pass(plan), blas_workspaces=blas_workspaces(plan))


def blas_workspaces(plan: RunPlan) -> int:
    """The cuBLAS workspaces the run's GPU holds (plan/footprint.py): the default stream's, and the capture stream's
    when decode steps run as CUDA graphs; none without a GPU."""
    if resolve_device(plan.device).type != "cuda":
        return 0
    return 2 if plan.config.cuda_graph else 1


def largest_pass(plan: RunPlan) -> int:
    """Tokens of the run's largest forward pass (the footprint's workspace): the engine's prefill chunk, or every
    token the KV cache holds when that is less."""
    return min(plan.kv_batch * plan.kv_tokens, DEFAULT_PREFILL_TOKENS)
