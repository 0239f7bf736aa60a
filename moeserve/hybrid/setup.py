"""Turn a loaded model into a hybrid one: its CPU layers' experts become HybridExperts sharing one runtime."""

from __future__ import annotations

from pathlib import Path

import torch

from moeserve.errors import MoeserveError
from moeserve.hybrid.experts import HybridExperts
from moeserve.hybrid.memory import store_precision
from moeserve.hybrid.placement import HybridPlacement
from moeserve.hybrid.runtime import HybridRuntime
from moeserve.offload.host_compute import HostExperts
from moeserve.offload.precision import HOBBIT_T1, HOBBIT_T2
from moeserve.offload.store import ExpertStore, layer_experts
from moeserve.quant.manifest import read_manifest
from moeserve.quant.qlinear import QuantizedExperts
from moeserve.spec import ModelSpec


def store_layers(placement: HybridPlacement) -> list[int]:
    """The MoE layers whose experts the store holds (and the loader leaves unread): the CPU layers; with low-bit
    experts every MoE layer (the resident layers' experts are the store's low-bit copies, moved to the model
    device)."""
    return list(placement.moe_layers if placement.low else placement.cpu_layers)


def build_store(model_path: str | Path, placement: HybridPlacement, dtype: torch.dtype, device: torch.device,
                progress: bool = True) -> ExpertStore:
    """The experts the placement needs, read from the checkpoint into RAM (no store on disk): unless the experts
    run low-bit, the high copies: MXFP4 blocks kept as shipped (GPT-OSS: the CPU computes them packed), else floats
    in the compute dtype; low-bit copies for low-bit experts or mixed precision (quantized on a GPU when there is
    one: milliseconds a layer there, seconds to minutes on a CPU); page-locked when a GPU cache or the prompt
    streamer copies from them. A moeserve quantized checkpoint's experts are taken as stored."""
    stored = read_manifest(Path(model_path)) is not None  # its bits and group: from_checkpoint takes them
    low_bits, group = (0, 0) if stored else store_precision(ModelSpec.from_dir(model_path), placement)
    on_gpu = device.type == "cuda" and bool(low_bits)
    pin = device.type == "cuda" and bool(placement.cache_slots or placement.stream_from)
    return ExpertStore.from_checkpoint(model_path, store_layers(placement), low_bits, group, dtype=dtype,
                                       device=device if on_gpu else None, high=not placement.low, pin=pin,
                                       progress=progress, mxfp4=True)


def check_moe_layers(spec: ModelSpec, placement: HybridPlacement) -> None:
    """A MoeserveError naming the placement's layers that have no routed experts (a dense FFN instead)."""
    dense = sorted(set(placement.moe_layers) - set(spec.moe.layer_indices()))
    if dense:
        raise MoeserveError(f"the hybrid placement names layers {dense}, which have a dense FFN and no routed experts; "
                            f"its layers must be the model's MoE layers {spec.moe.layer_indices()}")


def resident_lowbit(store: ExpertStore, layer: int, device: torch.device) -> QuantizedExperts:
    """A resident layer of a low-bit run: the store's low-bit copies of its experts (with their biases, if any) on
    the model device, computed with the store's gated activation."""
    pairs = [store.expert_modules(layer, e, device) for e in range(layer_experts(store.meta, layer))]
    return QuantizedExperts([g for g, _ in pairs], [d for _, d in pairs], store.act)


def enable_hybrid(model, store: ExpertStore, placement: HybridPlacement, *, t1: float = HOBBIT_T1,
                  t2: float = HOBBIT_T2, threaded: bool | None = None, host: HostExperts | None = None,
                  warm: bool = False, stream: bool | None = None) -> HybridRuntime:
    """Replace the experts of the placement's CPU layers by HybridExperts sharing one runtime (returned; the options
    are HybridRuntime's); in a low-bit run the other MoE layers' experts become the store's low-bit copies on the
    model device. A placement naming a layer without routed experts is refused: that layer would stay dense and the
    runtime would count experts it never runs."""
    check_moe_layers(model.spec, placement)
    runtime = HybridRuntime(store, placement, model.spec.num_layers, model.spec.moe.top_k, model.device, model.dtype,
                            t1, t2, threaded, host, warm, stream)
    layers = model.model.layers
    for i in placement.cpu_layers:
        layers[i].mlp.experts = HybridExperts(i, model.spec.moe.experts_at(i), runtime)
    if placement.low:
        for i in sorted(set(placement.moe_layers) - set(placement.cpu_layers)):
            layers[i].mlp.experts = resident_lowbit(store, i, model.device)
    model.step_hooks.append(runtime.before_step)
    return runtime
