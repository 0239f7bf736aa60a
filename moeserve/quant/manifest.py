"""A moeserve compressed checkpoint as the loaders read it: the manifest (format, bits, group, the quantized
tensors and their ranks), its checks, the module swap that makes a float model take the stored weights, and
the conversion of older stored layouts. compress.py writes what this module reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from moeserve.errors import MoeserveError
from moeserve.kernels.pack import planar_from_units
from moeserve.quant.qlinear import QuantizedExperts, QuantizedLinear

MANIFEST = "moeserve_quant.json"
FORMAT = "moeserve-quant-3"  # 3: 3-bit rows word-planar (pack.py LAYOUT 3)
UNITS_FORMAT = "moeserve-quant-2"  # the same but 3-bit rows unit after unit: made word-planar on load
FIRST_FORMAT = "moeserve-quant-1"  # the same but 3-bit codes packed in order: not read at 3 bits
KINDS = ("attention", "shared_expert", "dense_ffn", "expert")


def refuse_quantized(path: Path, command: str) -> None:
    """A moeserve quantized checkpoint cannot be the source of `command`: its weights are already low-bit."""
    if (path / MANIFEST).is_file():
        raise MoeserveError(f"{str(path)!r} is a moeserve quantized checkpoint (it has {MANIFEST}); {command} needs "
                            f"the original checkpoint it was made from")


def is_quantized_expert(name: str) -> bool:
    """A tensor of one routed expert's low-bit layer, as quantized_experts names them
    (model.layers.0.mlp.experts.gate_up.3.qweight)."""
    return re.search(r"\.mlp\.experts\.(gate_up|down)\.\d+\.\w+$", name) is not None


def read_manifest(path: Path) -> dict | None:
    f = path / MANIFEST
    if not f.is_file():
        return None
    try:
        manifest = json.loads(f.read_text())
    except (OSError, ValueError) as e:  # a UnicodeDecodeError is a ValueError
        raise MoeserveError(f"{f} is unreadable ({e}); quantize the source checkpoint again") from None
    _check_manifest(f, manifest)
    found = manifest.get("format")
    if found == FIRST_FORMAT and 3 in (manifest.get("bits"), manifest.get("compensator_bits")):
        raise MoeserveError(f"{path} holds 3-bit codes in the 3-bit layout of {FIRST_FORMAT}, which this moeserve "
                            f"no longer reads (later formats pair the values for the GPU kernels); quantize the "
                            f"source checkpoint again with `moeserve quantize`")
    if found not in (FIRST_FORMAT, UNITS_FORMAT, FORMAT):
        raise MoeserveError(f"{f} has format {found!r}; this moeserve reads {FORMAT!r} and the earlier "
                            f"{UNITS_FORMAT!r} and {FIRST_FORMAT!r}")
    return manifest


def _check_manifest(f: Path, manifest) -> None:
    """The fields install_quantized_dense and quantized_experts read are there and well-formed: a damaged manifest
    is named, once."""
    problem = None
    if not isinstance(manifest, dict):
        problem = "it does not hold a JSON object"
    else:
        missing = [k for k in ("format", "bits", "group", "compensator_bits", "tensors") if k not in manifest]
        tensors = manifest.get("tensors")
        if missing:
            problem = f"it lacks {', '.join(missing)}"
        elif not isinstance(tensors, dict) or not all(
                isinstance(t, dict) and t.get("kind") in KINDS and isinstance(t.get("rank"), int)
                and isinstance(t.get("shape"), list) and len(t["shape"]) == 2 for t in tensors.values()):
            problem = "its tensor list is malformed"
    if problem:
        raise MoeserveError(f"{f} is damaged ({problem}); quantize the source checkpoint again")


def stored_to_current(manifest: dict | None, name: str, t: torch.Tensor) -> torch.Tensor:
    """Tensor `name` as stored in a compressed checkpoint -> as this moeserve holds it. Format 2 stored 3-bit rows
    (packed weights, INT3 compensator codes) unit after unit: a permutation makes them word-planar, so older
    checkpoints load without quantizing again."""
    if not manifest or manifest["format"] != UNITS_FORMAT:
        return t
    leaf = name.rsplit(".", 1)[1]  # a QuantizedLinear buffer (see milo.compensator_buffers for the comp_ names)
    three_bit = ((leaf == "qweight" and manifest["bits"] == 3)
                 or (leaf in ("comp_u_q", "comp_v_q") and manifest["compensator_bits"] == 3))
    return planar_from_units(t) if three_bit else t


def quantized_config(manifest: dict) -> dict:
    """QuantizedLinear's keyword arguments every layer of the manifest shares."""
    return dict(bits=manifest["bits"], group=manifest["group"], compensator_bits=manifest["compensator_bits"])


def install_quantized_dense(model: nn.Module, manifest: dict) -> None:
    """Replace the dense modules the manifest names by empty QuantizedLinear layers (their experts:
    quantized_experts)."""
    for name, t in manifest["tensors"].items():
        if t["kind"] == "expert":
            continue
        out_f, in_f = t["shape"]
        bias = getattr(model.get_submodule(name), "bias", None) is not None
        parent, leaf = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), leaf, QuantizedLinear(in_f, out_f, rank=t["rank"], bias=bias,
                                                                   **quantized_config(manifest)))


def quantized_experts(spec, manifest: dict, layer: int) -> QuantizedExperts:
    """Empty QuantizedExperts of MoE layer `layer` as the manifest stores them (one QuantizedLinear per expert and
    projection, ranks as recorded; the float stack's per-expert biases, where the family has them, become each
    layer's own), created on the current default device."""
    stack = f"model.layers.{layer}.mlp.experts"
    parts: dict[str, list] = {"gate_up": [], "down": []}
    for name, t in manifest["tensors"].items():
        if t["kind"] != "expert" or not name.startswith(stack + "."):
            continue
        _, proj, e = name.rsplit(".", 2)
        out_f, in_f = t["shape"]
        parts[proj].append((int(e), QuantizedLinear(in_f, out_f, rank=t["rank"], bias=spec.moe.expert_bias,
                                                    **quantized_config(manifest))))
    gate_up, down = ([q for _, q in sorted(parts[p], key=lambda p: p[0])] for p in ("gate_up", "down"))
    return QuantizedExperts(gate_up, down, spec.moe.expert_act)
