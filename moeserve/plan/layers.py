"""Where each MoE layer's routed experts live and at which precision, as data the builder reads: one
LayerPlacement per MoE layer, derived once from a run's placement (resident, hybrid, offload or a rank's shard).

residency: gpu (on the model device, whichever that is), host (host RAM, computed on the CPU or in the hybrid's
GPU cache slots), cached (offload: copied into the GPU cache on demand) or shard (this rank's part under --ep/--tp).
precision: the ledger's Precision (plan/footprint.py) the experts compute at: float, mxfp4 (blocks as shipped) or
hqq (bits, group; a quantized checkpoint's, compensators included, or the store's low-bit copies). stored: the
experts come from the host expert store (read into it by the build, or an --offload store on disk), not from the
model's own tensors. The factory (moeserve/factory.py) builds one experts module per (residency, precision kind,
stored) and refuses any other combination.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.hybrid.placement import HybridPlacement
from moeserve.plan.footprint import Precision, checkpoint_precision
from moeserve.spec import ModelSpec

GPU, HOST, CACHED, SHARD = "gpu", "host", "cached", "shard"


@dataclass(frozen=True)
class Shard:
    """This rank's part of the experts: EP over `ep` ranks, TP over `tp` ranks."""

    ep: int = 1
    tp: int = 1


@dataclass(frozen=True)
class LayerPlacement:
    """One MoE layer's routed experts (module docstring). mixed: HOBBIT's per-token high / low / skip choice over
    the store's low-bit copies."""

    layer: int
    residency: str
    precision: Precision
    stored: bool = False
    mixed: bool = False
    shard: Shard | None = None

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the factory's table is keyed by."""
        return self.residency, self.precision.kind, self.stored

    def describe(self) -> str:
        """A few words for an error: `host, hqq 4-bit (group 64), from the store`."""
        p = self.precision
        precision = f"hqq {p.bits}-bit (group {p.group})" if p.kind == "hqq" else p.kind
        source = ", from the store" if self.stored else ""
        shard = f", ep {self.shard.ep} tp {self.shard.tp}" if self.shard else ""
        return f"{self.residency}, {precision}{source}{shard}"


def manifest_precision(manifest: dict) -> Precision:
    """The precision of a quantized checkpoint's experts (their compensators are the manifest's too)."""
    return Precision.hqq(manifest["bits"], manifest["group"])


def quantized_layers(manifest: dict | None) -> set[int]:
    """The MoE layers whose routed experts a quantized checkpoint stores low-bit (none for a float checkpoint)."""
    if not manifest:
        return set()
    return {int(name.split(".")[2]) for name, t in manifest["tensors"].items() if t["kind"] == "expert"}


def resident_layers(spec: ModelSpec, dtype_bytes: int, manifest: dict | None = None,
                    shard: Shard | None = None) -> tuple[LayerPlacement, ...]:
    """Every MoE layer's experts as the checkpoint stores them, on the model device (shard: this rank's part)."""
    low = quantized_layers(manifest)
    return tuple(LayerPlacement(i, SHARD if shard else GPU,
                                manifest_precision(manifest) if i in low else checkpoint_precision(spec, dtype_bytes),
                                shard=shard)
                 for i in spec.moe.layer_indices())


def hybrid_layers(spec: ModelSpec, placement: HybridPlacement, dtype_bytes: int, low_bits: int, group: int,
                  mapped: bool = False) -> tuple[LayerPlacement, ...]:
    """A hybrid placement's layers: the CPU layers in host RAM, the others on the model device as the checkpoint
    stores them, or, in a low-bit run, as the store's low-bit copies. mapped: the store is an --offload store on
    disk (float high copies), else one the build reads from the checkpoint (MXFP4 experts kept packed)."""
    packed = spec.moe.experts_mxfp4 and not mapped
    high = Precision.mxfp4(dtype_bytes) if packed else Precision.float(dtype_bytes)
    run_at = Precision.hqq(low_bits, group) if placement.low else high
    cpu = set(placement.cpu_layers)
    return tuple(LayerPlacement(i, HOST, run_at, stored=True, mixed=placement.mixed) if i in cpu
                 else LayerPlacement(i, GPU, run_at, stored=True) if placement.low
                 else LayerPlacement(i, GPU, checkpoint_precision(spec, dtype_bytes))
                 for i in placement.moe_layers)


def offload_layers(spec: ModelSpec, dtype_bytes: int, mixed: bool) -> tuple[LayerPlacement, ...]:
    """HOBBIT's offload: every MoE layer's experts in the store, copied into the GPU cache as they are used."""
    return tuple(LayerPlacement(i, CACHED, Precision.float(dtype_bytes), stored=True, mixed=mixed)
                 for i in spec.moe.layer_indices())

