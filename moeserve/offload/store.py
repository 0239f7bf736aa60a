"""Expert store: every routed expert in a high precision (the model's float weights) and a low precision
(HQQ-quantized, pack.py layout), held in slow memory - RAM, or safetensors files (one per layer) that are
memory-mapped so a store larger than RAM can be used. Built once from a loaded model."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from moeserve.checkpoint import save_safetensors_atomic
from moeserve.errors import MoeserveError
from moeserve.quant import hqq, pack
from moeserve.quant.qlinear import QuantizedLinear

META_FILE = "expert_store.json"
LOW_PARTS = ("qweight", "scale", "zero")
PROJECTIONS = ("gate_up", "down")
UNITS_LAYOUT = 2  # pack.py layout whose 3-bit rows are read by a permutation (pack.planar_from_units)


def _layer_file(path: Path, layer: int) -> Path:
    return path / f"experts-layer-{layer:05d}.safetensors"


def _meta(spec, layers: list[int], low_bits: int, group: int) -> dict:
    return {"layers": layers, "num_experts": spec.num_experts, "hidden": spec.hidden_size, "ffn": spec.expert_ffn,
            "low_bits": low_bits, "group": group, "pack_layout": pack.LAYOUT}


def layer_tensors(gate_up: torch.Tensor, down: torch.Tensor, low_bits: int, group: int) -> dict[str, torch.Tensor]:
    """One layer's experts, stacks gate_up [E, 2F, D] and down [E, D, F], in both precisions, on the CPU
    (quantized on the stacks' device: a GPU does it in milliseconds)."""
    state = {}
    for e in range(gate_up.shape[0]):
        for name, w in zip(PROJECTIONS, (gate_up[e], down[e])):
            state[f"{e}.high.{name}"] = w.detach().cpu().contiguous()
            q = QuantizedLinear.from_quantized(hqq.quantize_hqq(w.detach().float(), low_bits, group))
            state.update({f"{e}.low.{name}.{p}": getattr(q, p).cpu() for p in LOW_PARTS})
    return state


class ExpertStore:
    def __init__(self, meta: dict, tensors_of_layer):
        self.meta = meta  # layers, num_experts, hidden, ffn, low_bits, group
        self._tensors_of_layer = tensors_of_layer  # layer -> mapping name -> tensor (RAM dict or mmap handle)
        self._expert_bytes: dict[bool, int] = {}

    # ---- building and opening ----------------------------------------------------------------
    @classmethod
    def from_model(cls, model, low_bits: int = 4, group: int = 64, progress: bool = False) -> "ExpertStore":
        """Quantize every routed expert of a loaded model to `low_bits` (HQQ) and keep both copies in RAM."""
        moe = [(i, l.mlp.experts) for i, l in enumerate(model.model.layers) if hasattr(l.mlp, "experts")]
        layers = {i: layer_tensors(ex.gate_up_proj, ex.down_proj, low_bits, group)
                  for i, ex in tqdm(moe, desc="expert store", disable=not progress)}
        return cls(_meta(model.spec, sorted(layers), low_bits, group), layers.__getitem__)

    @classmethod
    def build(cls, model_path: str | Path, out: str | Path, low_bits: int = 4, group: int = 64,
              progress: bool = True) -> "ExpertStore":
        """Write the store of a checkpoint layer by layer (peak memory: one layer's experts), then open it."""
        from moeserve.checkpoint import CheckpointReader, read_tensor
        from moeserve.spec import ModelSpec

        spec = ModelSpec.from_dir(model_path)
        reader, out = CheckpointReader(model_path), Path(out)
        layers = [i for i, moe in enumerate(spec.moe_layers) if moe]
        for inputs in (spec.hidden_size, spec.expert_ffn):  # gate_up and down: fail before writing anything
            hqq.check_shape(torch.empty(1, inputs, device="meta"), low_bits, group)
        out.mkdir(parents=True, exist_ok=True)
        for i in tqdm(layers, desc="expert store", unit="layer", disable=not progress):
            if _layer_file(out, i).is_file():
                continue  # done by an earlier, interrupted run
            stacks = [read_tensor(reader, f"model.layers.{i}.mlp.experts.{n}", spec.family, spec.num_experts)
                      for n in ("gate_up_proj", "down_proj")]
            save_safetensors_atomic(layer_tensors(*stacks, low_bits, group), _layer_file(out, i))
        (out / META_FILE).write_text(json.dumps(_meta(spec, layers, low_bits, group)))
        return cls.open(out)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for layer in self.meta["layers"]:
            tensors = self._tensors_of_layer(layer)
            save_safetensors_atomic({k: tensors[k] for k in tensors}, _layer_file(path, layer))
        (path / META_FILE).write_text(json.dumps(self.meta))

    @classmethod
    def open(cls, path: str | Path) -> "ExpertStore":
        """Memory-map a saved store: nothing is read until an expert is loaded. A 3-bit store of pack layout 2
        is read too: each 3-bit weight is made word-planar when first read, then kept in RAM."""
        path = Path(path)
        if not (path / META_FILE).is_file():
            raise MoeserveError(f"{path} is not an expert store (no {META_FILE})")
        meta = json.loads((path / META_FILE).read_text())
        layout = meta.get("pack_layout", 1)
        from_units = meta["low_bits"] == 3 and layout == UNITS_LAYOUT  # 3-bit rows made word-planar as read
        if meta["low_bits"] == 3 and layout not in (UNITS_LAYOUT, pack.LAYOUT):
            raise MoeserveError(f"{path} holds 3-bit experts in a bit layout ({layout}) that this moeserve does not "
                                f"read; build the store again with `moeserve offload-prepare`")
        meta["pack_layout"] = pack.LAYOUT  # what this store hands out (and save() writes)

        class _Mapped:
            def __init__(self, handle):
                self.handle, self.converted = handle, {}

            def __getitem__(self, name):
                if not (from_units and name.endswith(".qweight")):
                    return self.handle.get_tensor(name)
                if name not in self.converted:  # once, then kept in RAM: its address keys the CPU kernels' repack
                    self.converted[name] = pack.planar_from_units(self.handle.get_tensor(name))
                return self.converted[name]

            def __iter__(self):
                return iter(self.handle.keys())

        mapped = {layer: _Mapped(safe_open(str(_layer_file(path, layer)), framework="pt"))
                  for layer in meta["layers"]}
        return cls(meta, mapped.__getitem__)

    # ---- reading one expert ----------------------------------------------------------------------
    def part_names(self, expert: int, low: bool) -> list[str]:
        """Tensor names of one expert, in the order of part_shapes()."""
        if not low:
            return [f"{expert}.high.{n}" for n in PROJECTIONS]
        return [f"{expert}.low.{n}.{p}" for n in PROJECTIONS for p in LOW_PARTS]

    def host_parts(self, layer: int, expert: int, low: bool) -> list[torch.Tensor]:
        """One expert's tensors in slow memory (pinned, RAM or mapped), no copy."""
        t = self._tensors_of_layer(layer)
        return [t[n] for n in self.part_names(expert, low)]

    def part_shapes(self, low: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each part of an expert at a precision (read from the first expert)."""
        return [(tuple(p.shape), p.dtype) for p in self.host_parts(self.meta["layers"][0], 0, low)]

    def quantized_modules(self, parts: list[torch.Tensor]) -> tuple[QuantizedLinear, QuantizedLinear]:
        """(gate_up, down) QuantizedLinear over a low-precision expert's parts (no copy)."""
        D, F, bits, group = self.meta["hidden"], self.meta["ffn"], self.meta["low_bits"], self.meta["group"]
        mods = []
        for i, (out_f, in_f) in enumerate(((2 * F, D), (D, F))):
            q = QuantizedLinear(in_f, out_f, bits, group)
            for p, t in zip(LOW_PARTS, parts[3 * i:3 * i + 3]):
                setattr(q, p, t)
            mods.append(q)
        return tuple(mods)

    def pin(self, progress: bool = False) -> int:
        """Copy the store into page-locked RAM so that loads are asynchronous DMA copies; returns the layers
        pinned. When pinning fails (out of pinned memory), the rest stays where it is (mapped or pageable:
        loads stage it through a small pinned buffer) and a warning says so."""
        pinned = {}
        for n, layer in enumerate(tqdm(self.meta["layers"], desc="pinning expert store", unit="layer",
                                       disable=not progress)):
            t = self._tensors_of_layer(layer)
            try:
                pinned[layer] = {k: t[k].pin_memory() for k in t}
            except RuntimeError as e:
                warnings.warn(f"moeserve: could not pin the expert store past layer {n} of "
                              f"{len(self.meta['layers'])} ({str(e).splitlines()[0]}); the other layers stay in "
                              "pageable/mapped memory and are staged through a pinned buffer (slower loads)",
                              stacklevel=2)
                break
        unpinned = self._tensors_of_layer
        self._tensors_of_layer = lambda layer: pinned[layer] if layer in pinned else unpinned(layer)
        return len(pinned)

    def expert_bytes(self, low: bool) -> int:
        """Bytes of one expert at a precision (measured once: on a mapped store it reads the tensors)."""
        if low not in self._expert_bytes:
            self._expert_bytes[low] = sum(p.nbytes for p in self.host_parts(self.meta["layers"][0], 0, low))
        return self._expert_bytes[low]
