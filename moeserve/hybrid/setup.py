"""The hybrid backend for a model whose store layers' experts were left unread: the store's settings, and one
HybridRuntime whose CPU layers' experts the factory makes as HybridExperts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.errors import MoeserveError
from moeserve.factory import ExpertSources, place_experts
from moeserve.hybrid.memory import store_precision
from moeserve.hybrid.placement import HybridPlacement
from moeserve.hybrid.runtime import HybridRuntime
from moeserve.offload.host_compute import HostExperts
from moeserve.offload.precision import HOBBIT_T1, HOBBIT_T2
from moeserve.offload.store import ExpertStore
from moeserve.plan.layers import hybrid_layers
from moeserve.quant.manifest import read_manifest
from moeserve.spec import ModelSpec


def store_layers(placement: HybridPlacement) -> list[int]:
    """The MoE layers whose experts the store holds (and the loader leaves unread): the CPU layers; with low-bit
    experts every MoE layer (the resident layers' experts are the store's low-bit copies, moved to the model
    device)."""
    return list(placement.moe_layers if placement.low else placement.cpu_layers)


@dataclass(frozen=True)
class StoreSettings:
    """How a hybrid run's store is built from the checkpoint (ExpertStore.from_sources' options): low_bits / group
    of its low-bit copies (0: none), high: whether it holds float (or MXFP4) copies, device: where the low-bit copies
    are quantized (None: the CPU), pin: page-locked as it is built."""

    layers: tuple[int, ...]
    low_bits: int
    group: int
    high: bool
    device: torch.device | None
    pin: bool


def store_settings(spec: ModelSpec, placement: HybridPlacement, device: torch.device,
                   quantized: bool = False) -> StoreSettings:
    """The experts the placement needs in RAM: unless the experts run low-bit, the high copies (MXFP4 blocks kept as
    shipped: GPT-OSS's CPU computes them packed; else floats in the compute dtype); low-bit copies for low-bit
    experts or mixed precision (quantized on a GPU when there is one: milliseconds a layer there, seconds to minutes
    on a CPU); page-locked when a GPU cache or the prompt streamer copies from them. quantized: a moeserve quantized
    checkpoint's, whose experts the store takes as stored (low_bits and group 0: its own)."""
    low_bits, group = (0, 0) if quantized else store_precision(spec, placement)
    on_gpu = device.type == "cuda" and bool(low_bits)
    pin = device.type == "cuda" and bool(placement.cache_slots or placement.stream_from)
    return StoreSettings(tuple(store_layers(placement)), low_bits, group, not placement.low,
                         device if on_gpu else None, pin)


def build_store(model_path: str | Path, placement: HybridPlacement, dtype: torch.dtype, device: torch.device,
                progress: bool = True) -> ExpertStore:
    """The store the placement needs (store_settings), read from the checkpoint on its own (no store on disk)."""
    s = store_settings(ModelSpec.from_dir(model_path), placement, device, read_manifest(Path(model_path)) is not None)
    return ExpertStore.from_checkpoint(model_path, list(s.layers), s.low_bits, s.group, dtype=dtype, device=s.device,
                                       high=s.high, pin=s.pin, progress=progress, mxfp4=True)


def check_moe_layers(spec: ModelSpec, placement: HybridPlacement) -> None:
    """A MoeserveError naming the placement's layers that have no routed experts (a dense FFN instead)."""
    dense = sorted(set(placement.moe_layers) - set(spec.moe.layer_indices()))
    if dense:
        raise MoeserveError(f"the hybrid placement names layers {dense}, which have a dense FFN and no routed experts; "
                            f"its layers must be the model's MoE layers {spec.moe.layer_indices()}")


def hybrid_runtime(model, store: ExpertStore, placement: HybridPlacement, *, t1: float = HOBBIT_T1,
                   t2: float = HOBBIT_T2, threaded: bool | None = None, host: HostExperts | None = None,
                   warm: bool = False, stream: bool | None = None, disk_budget: int | None = None) -> HybridRuntime:
    """The one runtime the placement's CPU layers share (the options are HybridRuntime's), its bookkeeping the
    model's step hook. A placement naming a layer without routed experts is refused: that layer would stay dense and
    the runtime would count experts it never runs."""
    check_moe_layers(model.spec, placement)
    runtime = HybridRuntime(store, placement, model.spec.num_layers, model.spec.moe.top_k, model.device, model.dtype,
                            t1, t2, threaded, host, warm, stream, disk_budget)
    model.step_hooks.append(runtime.before_step)
    return runtime


def enable_hybrid(model, store: ExpertStore, placement: HybridPlacement, **options) -> HybridRuntime:
    """hybrid_runtime (returned), and the experts of the layers the store holds made by the factory: HybridExperts
    for the CPU layers; in a low-bit run the store's low-bit copies on the model device for the others. For a model
    whose store layers' experts were left unread (tests and benchmarks; a run builds through moeserve.build)."""
    runtime = hybrid_runtime(model, store, placement, **options)
    layers = hybrid_layers(model.spec, placement, model.dtype.itemsize, store.meta["low_bits"], store.meta["group"],
                           mapped=store.path is not None)
    place_experts(model, tuple(p for p in layers if p.stored),
                  ExpertSources(model.spec, store=store, hybrid=runtime, device=model.device))
    return runtime
