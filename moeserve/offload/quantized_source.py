"""A moeserve quantized checkpoint's routed experts as an expert store holds them: taken as the checkpoint stores them
(no re-quantization, no float round trip).

Each expert is the store's one copy, named as a low-bit copy (`<e>.low.<projection>.<part>`: qweight, scale, zero at
the checkpoint's bits and group) and served for either precision. MiLo checkpoints add each projection's compensator
buffers (milo.compensator_buffers' names, at the checkpoint's compensator bits) as further parts, zero-padded to the
largest expert rank of the store so that every expert has one shape (a cache slot holds any of them); the meta keeps
each expert's own rank, so the CPU computes exactly the compensator the resident model does. The meta's "quantized"
field records the compensator bits, that padded rank, the ranks and a digest of the checkpoint's quantization (its
settings, its source's fingerprint and its tensor list), which ExpertStore.check_model compares with the checkpoint.
"""

from __future__ import annotations

import hashlib
import json

import torch

from moeserve.checkpoint import CheckpointReader, tensors_digest
from moeserve.errors import MoeserveError
from moeserve.kernels.pack import padded_length
from moeserve.quant import milo
from moeserve.quant.manifest import stored_to_current

LOW_PARTS = ("qweight", "scale", "zero")  # a projection's HQQ copy (QuantizedLinear's buffers)
PROJECTIONS = ("gate_up", "down")
IDENTITY_FIELDS = ("format", "bits", "group", "method", "ranks", "compensator_bits", "skip")


def checkpoint_identity(manifest: dict) -> str:
    """sha256 of what makes a quantized checkpoint's experts what they are: its quantization settings, the fingerprint
    of the source it was made from and its tensor list (kinds, shapes, ranks)."""
    source = manifest.get("source")
    record = {"settings": {k: manifest.get(k) for k in IDENTITY_FIELDS}, "tensors": manifest["tensors"],
              "source": source.get("sha256") if isinstance(source, dict) else None}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def expert_ranks(manifest: dict, layer: int, num_experts: int) -> list[list[int]]:
    """[[gate_up rank, down rank] per expert] of one MoE layer, as the manifest records them (a routed expert left in
    full precision by `quantize --skip expert` is refused: the store takes only quantized experts)."""
    ranks = []
    for e in range(num_experts):
        pair = []
        for proj in PROJECTIONS:
            entry = manifest["tensors"].get(f"model.layers.{layer}.mlp.experts.{proj}.{e}")
            if entry is None:
                raise MoeserveError(f"the quantized checkpoint keeps the routed experts of layer {layer} in full "
                                    f"precision (quantize --skip expert); the host-resident placements need them "
                                    f"quantized: run it resident, or quantize them")
            pair.append(int(entry["rank"]))
        ranks.append(pair)
    return ranks


def quantized_form(manifest: dict, spec, layers: list[int]) -> dict:
    """The meta field "quantized" of a store of these MoE layers (module docstring)."""
    ranks = {str(i): expert_ranks(manifest, i, spec.moe.experts_at(i)) for i in layers}
    rank = max((r for layer in ranks.values() for pair in layer for r in pair), default=0)
    return {"compensator_bits": int(manifest["compensator_bits"]), "rank": rank, "ranks": ranks,
            "checkpoint": checkpoint_identity(manifest)}


def part_leaves(form: dict) -> list[str]:
    """The parts of one projection: LOW_PARTS, then the compensator's buffers when the store has any."""
    if not form["rank"]:
        return list(LOW_PARTS)
    return list(LOW_PARTS) + list(milo.compensator_buffers(1, 1, 1, form["compensator_bits"]))


def projection_shapes(form: dict, bits: int, group: int, out_f: int, in_f: int) -> dict[str, list[int]]:
    """part leaf -> shape of one projection [out_f, in_f] as the store holds it (compensators at the padded rank)."""
    shapes = {"qweight": [out_f, padded_length(in_f) * bits // 32], "scale": [out_f, in_f // group],
              "zero": [out_f, in_f // group]}
    if form["rank"]:
        shapes.update({n: list(t.shape) for n, t in milo.compensator_buffers(
            out_f, in_f, form["rank"], form["compensator_bits"]).items()})
    return shapes


def read_layer(reader: CheckpointReader, manifest: dict, spec, layer: int, form: dict,
               dtype: torch.dtype | None = None, biased: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """(the store's tensors of one MoE layer, the digest of the checkpoint tensors they were read from): each expert's
    packed weight, scale and zero as stored, its compensator padded to the form's rank, and its biases (GPT-OSS) in
    `dtype` (default: as stored)."""
    tensors, read = {}, []
    leaves = milo.compensator_buffers(1, 1, 1, form["compensator_bits"])
    for e, ranks in enumerate(form["ranks"][str(layer)]):
        for proj, rank in zip(PROJECTIONS, ranks):
            prefix = f"model.layers.{layer}.mlp.experts.{proj}.{e}"

            def get(leaf: str) -> torch.Tensor:
                t = stored_to_current(manifest, f"{prefix}.{leaf}", reader.get(f"{prefix}.{leaf}"))
                read.append(t)
                return t

            tensors.update({f"{e}.low.{proj}.{p}": get(p).contiguous() for p in LOW_PARTS})
            if form["rank"]:
                bufs = ({n: get(n) for n in leaves} if rank else
                        milo.compensator_buffers(*_shape(spec, proj), 0, form["compensator_bits"]))
                padded = milo.padded_compensator(bufs, form["compensator_bits"], rank, form["rank"])
                tensors.update({f"{e}.low.{proj}.{n}": t for n, t in padded.items()})
            if biased:
                bias = get("bias")
                tensors[f"{e}.bias.{proj}"] = (bias if dtype is None else bias.to(dtype)).contiguous()
    return tensors, tensors_digest(read)


def _shape(spec, proj: str) -> tuple[int, int]:
    D, F = spec.hidden_size, spec.moe.expert_ffn
    return (2 * F, D) if proj == "gate_up" else (D, F)
