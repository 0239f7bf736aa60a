"""The one factory of a MoE layer's experts module, keyed by its LayerPlacement (plan/layers.py): residency x
precision x whether the experts come from the host store. A combination missing from FACTORY is refused with one
line, so a placement is either built here or refused here.

Modules over the model's own tensors are made empty on the meta device (the build's read pass fills them, and under
--ep/--tp the parallel wrappers cut them to a rank's part first); modules over the store are made once the store
and its backend exist: the hybrid runtime (HybridExperts), the offload cache (OffloadedExperts, which also hold the
next layers' routers for prefetching) or the store's low-bit copies on the model device (a low-bit hybrid run's
resident layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moeserve.errors import MoeserveError
from moeserve.offload.experts import OffloadedExperts
from moeserve.offload.store import ExpertStore, layer_experts
from moeserve.plan.layers import CACHED, GPU, HOST, SHARD, LayerPlacement
from moeserve.quant.manifest import quantized_experts
from moeserve.quant.mxfp4 import stored_experts
from moeserve.quant.qlinear import QuantizedExperts
from moeserve.spec import ModelSpec


@dataclass
class ExpertSources:
    """What the factory builds experts from. manifest: a quantized checkpoint's; store: the host expert store;
    hybrid: the hybrid.runtime.HybridRuntime its host layers share; cache: the offload.slot_cache.SlotCache its cached
    layers share; model: the model whose routers cached layers read to prefetch the next prefetch_layers layers'
    experts; device: where resident low-bit copies go."""

    spec: ModelSpec
    manifest: dict | None = None
    store: ExpertStore | None = None
    hybrid: object | None = None
    cache: object | None = None
    model: nn.Module | None = None
    prefetch_layers: int = 0
    device: torch.device | None = None


def checkpoint_experts(p: LayerPlacement, src: ExpertSources) -> nn.Module:
    """Empty float or MXFP4 experts on the meta device, as the checkpoint stores them."""
    with torch.device("meta"):
        return stored_experts(src.spec, src.spec.moe.experts_at(p.layer))


def manifest_experts(p: LayerPlacement, src: ExpertSources) -> nn.Module:
    """Empty low-bit experts on the meta device, as the quantized checkpoint's manifest describes them."""
    with torch.device("meta"):
        return quantized_experts(src.spec, src.manifest, p.layer)


def store_low_copies(p: LayerPlacement, src: ExpertSources) -> nn.Module:
    """The store's low-bit copies of the layer's experts (with their biases, if any) on the model device, computed
    with the store's gated activation."""
    store = src.store
    pairs = [store.expert_modules(p.layer, e, src.device) for e in range(layer_experts(store.meta, p.layer))]
    return QuantizedExperts([g for g, _ in pairs], [d for _, d in pairs], store.act)


def host_experts(p: LayerPlacement, src: ExpertSources) -> nn.Module:
    """Experts computed where they lie in host RAM, or in the hybrid runtime's GPU cache slots."""
    from moeserve.hybrid.experts import HybridExperts  # its runtime's device link needs triton

    return HybridExperts(p.layer, src.spec.moe.experts_at(p.layer), src.hybrid)


def cached_experts(p: LayerPlacement, src: ExpertSources) -> nn.Module:
    """Experts copied from the store into the offload cache as they are used; the next prefetch_layers MoE layers'
    routers (stacked) predict what to prefetch."""
    moe = src.spec.moe.layer_indices()
    n = moe.index(p.layer)
    following = moe[n + 1:n + 1 + src.prefetch_layers]
    layers = src.model.model.layers
    gates = torch.cat([layers[j].mlp.gate.weight for j in following]).detach() if following else None
    return OffloadedExperts(p.layer, src.spec.moe.experts_at(p.layer), src.spec.moe.top_k, src.cache, following,
                            gates)


# (residency, precision kind, from the store) -> the experts module. A shard starts as the resident module, which
# the parallel wrappers cut to the rank's part before the read pass fills it.
FACTORY: dict[tuple[str, str, bool], Callable[[LayerPlacement, ExpertSources], nn.Module]] = {
    (GPU, "float", False): checkpoint_experts,
    (GPU, "mxfp4", False): checkpoint_experts,
    (GPU, "hqq", False): manifest_experts,
    (GPU, "hqq", True): store_low_copies,
    (HOST, "float", True): host_experts,
    (HOST, "mxfp4", True): host_experts,
    (HOST, "hqq", True): host_experts,
    (CACHED, "float", True): cached_experts,
    (SHARD, "float", False): checkpoint_experts,
    (SHARD, "mxfp4", False): checkpoint_experts,
    (SHARD, "hqq", False): manifest_experts,
}


def check_layers(layers: tuple[LayerPlacement, ...]) -> None:
    """A one-line MoeserveError for the first layer whose combination the factory does not build."""
    for p in layers:
        if p.key not in FACTORY:
            raise MoeserveError(f"MoE layer {p.layer}: no expert backend runs experts placed {p.describe()}; "
                                f"choose another placement for them")


def experts_module(p: LayerPlacement, src: ExpertSources) -> nn.Module:
    """The experts module of one MoE layer placed `p` (module docstring)."""
    check_layers((p,))
    return FACTORY[p.key](p, src)


def place_experts(model: nn.Module, layers: tuple[LayerPlacement, ...], src: ExpertSources) -> None:
    """Give each layer of `layers` its experts module from the factory."""
    check_layers(layers)
    for p in layers:
        model.model.layers[p.layer].mlp.experts = FACTORY[p.key](p, src)
