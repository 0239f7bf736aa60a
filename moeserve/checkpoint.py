"""Read and write HF safetensors checkpoints lazily (mmap), one tensor at a time.

Opening a checkpoint reads only the headers, so a model larger than RAM can be opened and its
tensors streamed to wherever they live. Expert weights come in two spellings and both are read:
  per-expert (classic HF):  ...experts.{j}.w1/w3/w2.weight (Mixtral), ...experts.{j}.gate_proj/up_proj/down_proj.weight
  fused (transformers 5.x): ...experts.gate_up_proj [E, 2F, D] and ...experts.down_proj [E, D, F]
moeserve's own names are the fused transformers-5 names, so a model's state_dict is itself a checkpoint.
FP8 checkpoints (DeepSeek-V3's: float8_e4m3 weights, each with a `<name>_scale_inv` of one float per 128 x 128 block)
read as float32: every reader of weights (loading, quantize, expert stores) takes them as it takes float ones.
Fingerprints (sha256 of tensors as stored, or of a fixed sample of expert rows) let an artifact made from a
checkpoint (a quantized copy, an expert store) prove which weights it was made from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve.errors import MoeserveError
from moeserve.families import SUPPORTED_ARCHITECTURES, fp8_block_size, lookup
from moeserve.layouts import stored_views
from moeserve.spec import ModelSpec

INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"  # FP8 block scales: stored weight * scale = float weight
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # a header's dtype names


def validate_safetensors(path: Path) -> dict:
    """Parse the header and check the file holds every byte it promises; returns the header."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise MoeserveError(f"{path} is truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise MoeserveError(f"{path} is truncated (header promises {n} bytes, file has {size})")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MoeserveError(f"{path} is not a safetensors file (unreadable header)") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise MoeserveError(f"{path} is truncated: tensors need {8 + n + end} bytes, the file has {size}")
    return header


class CheckpointReader:
    """Name -> tensor access over one or many safetensors files, opened lazily."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise MoeserveError(f"{index} is not a valid safetensors index: {e}") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise MoeserveError(f"{str(self.path)!r} holds no *.safetensors weights")
            weight_map = None
        self._file_of: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            fpath = self.path / name
            if not fpath.is_file():
                raise MoeserveError(f"checkpoint shard {name} listed in {INDEX_FILE} is missing")
            header = validate_safetensors(fpath)
            for key, meta in header.items():
                if key != "__metadata__" and (weight_map is None or weight_map.get(key) == name):
                    self._file_of[key] = name
                    self.shapes[key] = tuple(meta["shape"])
        self._handles: dict[str, object] = {}
        cfg = _config(self.path)
        self.fp8_block = fp8_block_size(cfg) if cfg else None  # (rows, columns) of a scale's block, or None
        # moeserve names of tensors a family stores otherwise (layouts.py): computed from the stored ones
        self.views = {}
        family = stored_family(cfg)
        if family is not None and family.layout is not None:
            self.views = stored_views(family.layout(ModelSpec.from_hf_config(cfg)), self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of or name in self.views

    def keys(self):
        return self._file_of.keys()

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored, or as float32 where it is an FP8 weight with block scales; a view (a tensor
        moeserve names that the checkpoint stores otherwise) computed from the stored tensors."""
        if name not in self._file_of and name in self.views:
            view = self.views[name]
            return view.build(*(CheckpointReader.get(self, source) for source in view.sources))
        if self._scaled(name):
            return self.get_slice(name, (slice(None), slice(None)))
        return self._handle(name).get_tensor(name)

    def get_slice(self, name: str, index: tuple) -> torch.Tensor:
        """Only the part `index` (a tuple of slices) of a tensor: the rest is never read (sharded loading). An FP8
        weight reads the blocks that cover the part, and their scales; a view reads its stored tensors whole
        (a renamed or transposed one only the part: View.part)."""
        if name not in self._file_of and name in self.views:
            view = self.views[name]
            if view.part is not None:
                return view.build(CheckpointReader.get_slice(self, view.sources[0], view.part(index)))
            return CheckpointReader.get(self, name)[index]
        if not self._scaled(name):
            return self._handle(name).get_slice(name)[index]
        (bm, bn), (N, K) = self.fp8_block, self.shapes[name]
        (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(tuple(index) + (slice(None),) * 2, (N, K)))
        rb, cb = slice(r0 // bm, -(-r1 // bm)), slice(c0 // bn, -(-c1 // bn))  # the blocks that cover the part
        codes = self._handle(name).get_slice(name)[rb.start * bm:rb.stop * bm, cb.start * bn:cb.stop * bn]
        scale = self._handle(name + SCALE_SUFFIX).get_slice(name + SCALE_SUFFIX)[rb, cb].float()
        w = codes.float() * scale.repeat_interleave(bm, 0)[:codes.shape[0]].repeat_interleave(bn, 1)[:, :codes.shape[1]]
        return w[r0 - rb.start * bm:r1 - rb.start * bm, c0 - cb.start * bn:c1 - cb.start * bn]

    def _scaled(self, name: str) -> bool:
        """Whether `name` is an FP8 weight with block scales (needs the config's weight_block_size)."""
        if self.fp8_block is None or name + SCALE_SUFFIX not in self._file_of:
            return False
        (bm, bn), (N, K) = self.fp8_block, self.shapes[name]
        if self.shapes[name + SCALE_SUFFIX] != (-(-N // bm), -(-K // bn)):
            raise MoeserveError(f"{name}{SCALE_SUFFIX} has shape {self.shapes[name + SCALE_SUFFIX]}; a {N} x {K} "
                                f"weight in {bm} x {bn} blocks needs ({-(-N // bm)}, {-(-K // bn)})")
        return True

    def _handle(self, name: str):
        if name not in self._file_of:
            raise MoeserveError(f"checkpoint {str(self.path)!r} lacks the tensor {name!r}")
        fname = self._file_of[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(str(self.path / fname), framework="pt", device="cpu")
        return self._handles[fname]


def _config(path: Path) -> dict | None:
    """config.json beside the weights; None where it is missing or unreadable (ModelSpec says why)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def stored_family(cfg: dict | None):
    """The family (moeserve.families.Family) that config.json's architectures name, None where they name none:
    whose layout the stored names follow."""
    archs = (cfg or {}).get("architectures") or []
    return next((lookup(a) for a in archs if a in SUPPORTED_ARCHITECTURES), None)


# ---- name mapping: moeserve (= transformers-5 fused) names <- checkpoint names ---------------

_FUSED = re.compile(r"^(model\.layers\.(\d+)\.mlp)\.experts\.(gate_up_proj|down_proj)$")
# Which names a family's checkpoints use (classic per-expert names, mlp.shared_experts, mlp.router, interleaved
# experts) is its Family record's (moeserve/families/): lookup(family).
_EXPERT_TENSOR = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\w+)$")


def from_interleaved(leaf: str, t: torch.Tensor) -> torch.Tensor:
    """A GPT-OSS expert tensor as stored -> moeserve's layout. gate_up_proj [E, D, 2F], its columns gate and up in
    turn (gate j at 2j, up j at 2j + 1) -> [E, 2F, D], the gate rows then the up rows; down_proj [E, F, D] ->
    [E, D, F]; gate_up_proj_bias [E, 2F] and MXFP4's gate_up_proj_blocks [E, 2F, D/32, 16] and _scales
    [E, 2F, D/32] (stored [E, out, ..]) reordered along their out axis alike; the rest as stored."""
    if leaf == "down_proj":
        return t.transpose(1, 2).contiguous()
    if leaf == "gate_up_proj":
        t = t.transpose(1, 2)
    if leaf.startswith("gate_up_proj"):
        return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()
    return t


def read_interleaved_part(reader: CheckpointReader, name: str, experts: range, ffn: range, full_ffn: int,
                          block: int = 32) -> torch.Tensor:
    """Experts `experts`, FFN rows `ffn`, of the interleaved expert tensor moeserve calls `name` (...experts.<leaf>),
    read as that part only and turned into moeserve's layout (from_interleaved): gate_up's stored columns (or
    output rows) 2a..2b hold gate and up of rows a..b side by side; down's FFN axis is its stored dim 1 (float) or,
    in MXFP4 blocks of `block` values, dim 2; down's bias is whole."""
    leaf = name.rsplit(".", 1)[1]
    e, whole = slice(experts.start, experts.stop), ffn.start == 0 and ffn.stop == full_ffn
    if whole or leaf == "down_proj_bias":
        index = (e,)
    elif leaf == "gate_up_proj":  # [E, D, 2F]
        index = (e, slice(None), slice(2 * ffn.start, 2 * ffn.stop))
    elif leaf.startswith("gate_up_proj"):  # bias [E, 2F], blocks/scales [E, 2F, ..]
        index = (e, slice(2 * ffn.start, 2 * ffn.stop))
    elif leaf == "down_proj":  # [E, F, D]
        index = (e, slice(ffn.start, ffn.stop))
    else:  # down_proj_blocks [E, D, F / block, 16], _scales [E, D, F / block]
        if ffn.start % block or ffn.stop % block:
            raise MoeserveError(f"{name}: FFN rows {ffn.start}..{ffn.stop - 1} do not cover whole blocks of {block}")
        index = (e, slice(None), slice(ffn.start // block, ffn.stop // block))
    return from_interleaved(leaf, reader.get_slice(name, index))


def _classic_moe_prefix(name: str, family: str) -> str:
    return name.replace(".mlp.", f".{lookup(family).expert_names.block}.", 1)


def tensor_experts(spec, name: str) -> int:
    """The routed experts of the layer tensor `name` belongs to (spec.moe.num_experts outside the layers): what
    read_tensor assembles a per-expert layer from when layers differ (PR-MoE's pyramid)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return spec.moe.experts_at(int(m.group(1))) if m else spec.moe.num_experts


def _stored_names(name: str, family: str) -> tuple[str, ...]:
    """Where a checkpoint may hold the tensor moeserve calls `name`, whole (not assembled from per-expert parts)."""
    names = (name, _classic_moe_prefix(name, family))  # the latter e.g. Mixtral's block_sparse_moe.gate
    if lookup(family).router_named:
        names += (name.replace(".mlp.gate.", ".mlp.router.", 1),)
    if lookup(family).shared_experts_plural:
        names += (name.replace(".mlp.shared_expert.", ".mlp.shared_experts.", 1),)
    return names


def read_tensor(reader: CheckpointReader, name: str, family: str, num_experts: int,
                index: tuple | None = None) -> torch.Tensor:
    """The tensor moeserve calls `name`, assembled from whichever spelling the checkpoint uses.

    index: read only that part (a tuple of slices) of a tensor stored whole under one name (tensor-parallel
    slices of dense weights; routed experts are read shard-wise by moeserve.parallel.loading)."""
    expert = _EXPERT_TENSOR.match(name) if lookup(family).interleaved_experts else None
    if expert is not None:
        if index is not None:
            raise MoeserveError(f"{family} experts are read whole here, in parts by read_interleaved_part ({name})")
        return from_interleaved(expert.group(1), reader.get(name))
    for stored in _stored_names(name, family):
        if stored in reader:
            return reader.get(stored) if index is None else reader.get_slice(stored, index)
    m = _FUSED.match(name)
    if m is None:
        return reader.get(name)  # raises a clear "lacks the tensor" error
    layer, which = int(m.group(2)), m.group(3)
    names = [per_expert_names(layer, family, j) for j in range(num_experts)]
    if which == "down_proj":  # [E, D, F]
        return torch.stack([reader.get(down) for _, _, down in names])
    return torch.stack([torch.cat([reader.get(gate), reader.get(up)]) for gate, up, _ in names])  # [E, 2F, D]


def read_as_stored(reader: CheckpointReader, name: str, family: str, num_experts: int) -> torch.Tensor:
    """The tensor moeserve calls `name` in the form that read_tensor reads back unchanged from a copy written under
    `name`: interleaved experts (GPT-OSS's float or MXFP4 ones, which read_tensor converts on every read) as stored,
    the rest as read_tensor gives them (moeserve's layout, read as written)."""
    if lookup(family).interleaved_experts and _EXPERT_TENSOR.match(name):
        return reader.get(name)
    return read_tensor(reader, name, family, num_experts)


def read_expert_row(reader: CheckpointReader, family: str, layer: int, expert: int, projection: str, row: int,
                    ffn: int) -> torch.Tensor:
    """Row `row` of one expert's gate_up [2F, D] ("gate_up") or down [D, F] ("down") weight, read without the
    rest of the layer's experts, from whichever spelling the checkpoint uses. Interleaved experts (GPT-OSS): the
    stored column or output that becomes that row (from_interleaved); in MXFP4, that output's block and scale
    bytes as numbers (they identify the weights; nothing compares them with a loaded model's floats)."""
    fused = f"model.layers.{layer}.mlp.experts.{projection}_proj"
    if lookup(family).interleaved_experts:
        out = row if projection == "down" else 2 * row if row < ffn else 2 * (row - ffn) + 1  # the stored output
        if f"{fused}_blocks" in reader:  # [E, out, K/32, 16] and [E, out, K/32]
            return torch.cat([reader.get_slice(f"{fused}{part}", (slice(expert, expert + 1), slice(out, out + 1)))
                              .reshape(-1) for part in ("_blocks", "_scales")])
        return reader.get_slice(fused, (slice(expert, expert + 1), slice(None), slice(out, out + 1))).reshape(-1)
    for stored in (fused, _classic_moe_prefix(fused, family)):
        if stored in reader:
            return reader.get_slice(stored, (slice(expert, expert + 1), slice(row, row + 1))).reshape(-1)
    gate, up, down = per_expert_names(layer, family, expert)
    name, row = (down, row) if projection == "down" else (gate, row) if row < ffn else (up, row - ffn)
    return reader.get_slice(name, (slice(row, row + 1),)).reshape(-1)


def per_expert_names(layer: int, family: str, expert: int) -> tuple[str, str, str]:
    """Classic HF names of one expert's (gate [F, D], up [F, D], down [D, F]) weights."""
    n = lookup(family).expert_names
    base = f"model.layers.{layer}.{n.block}.experts.{expert}"
    return f"{base}.{n.gate}.weight", f"{base}.{n.up}.weight", f"{base}.{n.down}.weight"


def to_per_expert(state: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """Classic per-expert HF names (what every HF-format tool reads) from moeserve's fused names."""
    n = lookup(family).expert_names
    out = {}
    for name, t in state.items():
        m = _FUSED.match(name)
        if m is None:
            out[_classic_moe_prefix(name, family) if ".mlp.gate." in name else name] = t
            continue
        block = m.group(1).replace(".mlp", f".{n.block}", 1)
        for j in range(t.shape[0]):
            if m.group(3) == "down_proj":
                out[f"{block}.experts.{j}.{n.down}.weight"] = t[j]
            else:
                g, u = t[j].chunk(2, dim=0)
                out[f"{block}.experts.{j}.{n.gate}.weight"] = g
                out[f"{block}.experts.{j}.{n.up}.weight"] = u
    return out


# ---- fingerprints: which source an artifact was made from ------------------------------------

SAMPLED_EXPERTS = 8  # experts per layer whose rows identify a checkpoint's experts (expert_sample_digest)


def update_digest(h, t: torch.Tensor) -> None:
    """Feed a tensor as stored (dtype, shape and bytes) to the hashlib object h."""
    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())


def tensors_digest(tensors) -> str:
    """sha256 of tensors as stored, in order: proves an artifact was made from exactly these weights."""
    h = hashlib.sha256()
    for t in tensors:
        update_digest(h, t)
    return h.hexdigest()


def expert_sample_rows(spec) -> list[tuple[int, int, str, int]]:
    """(layer, expert, projection, row): one gate_up and one down row of up to SAMPLED_EXPERTS experts per MoE
    layer, spread over the experts and the rows. A few KiB per layer, read in milliseconds, yet two different
    trainings (or a fine-tune of the experts) differ in every one of them."""
    rows = []
    for layer in spec.moe.layer_indices():
        E = spec.moe.experts_at(layer)
        for e in range(0, E, max(1, E // SAMPLED_EXPERTS))[:SAMPLED_EXPERTS]:
            k = 7919 * layer + 104729 * e + 13
            rows += [(layer, e, "gate_up", k % (2 * spec.moe.expert_ffn)), (layer, e, "down", k % spec.hidden_size)]
    return rows


def expert_sample_digest(spec, row_of) -> str:
    """sha256 of the sampled expert rows (expert_sample_rows) as float32 values, so a checkpoint and a model
    loaded from it at a wider dtype agree; row_of(layer, expert, projection, row) -> 1-D tensor."""
    h = hashlib.sha256()
    for layer, e, projection, row in expert_sample_rows(spec):
        h.update(row_of(layer, e, projection, row).float().contiguous().numpy().tobytes())
    return h.hexdigest()


def checkpoint_expert_sample(reader: CheckpointReader, spec) -> str:
    """expert_sample_digest of the routed experts stored in a float checkpoint (reads only the sampled rows)."""
    return expert_sample_digest(spec, lambda layer, e, projection, row: read_expert_row(
        reader, spec.family, layer, e, projection, row, spec.moe.expert_ffn))


# ---- writing ---------------------------------------------------------------------------------


def check_output_dir(path: str | Path) -> Path:
    """The output directory `path` exists as a directory or can be created there, and is writable: checked
    before any work, so that a bad output path fails at once rather than after minutes of loading."""
    if not str(path).strip():
        raise MoeserveError("the output path is empty; name a directory")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise MoeserveError(f"output {str(out)!r} exists and is not a directory")
    nearest = out.absolute()
    while not nearest.exists():
        nearest = nearest.parent
    if not nearest.is_dir():
        raise MoeserveError(f"cannot create the output directory {str(out)!r}: {str(nearest)!r} is a file")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise MoeserveError(f"cannot create the output directory {str(out)!r}: {str(nearest)!r} is not writable")
    return out


def write_text_atomic(text: str, path: Path) -> None:
    """Write a small text file (a manifest) by a temporary name and a rename: never half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_safetensors_atomic(state: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    """Write to a temporary name then rename, so an interrupted save never leaves a half file. metadata: extra
    strings for the header's __metadata__ (e.g. what the file was made from)."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt", **(metadata or {})})
    os.replace(tmp, path)
