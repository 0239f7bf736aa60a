"""Expert store: every routed expert in a high precision (the model's float weights) and a low precision
(HQQ-quantized, pack.py layout), held in slow memory - RAM, or safetensors files (one per layer) that are
memory-mapped so a store larger than RAM can be used. Built once from a checkpoint or a loaded model.

Experts shipped as MXFP4 blocks (GPT-OSS) are quantized into the low-bit copies from their dequantized floats (exact
in bf16). Their high copies are those floats, or, in a store built with mxfp4=True (the hybrid's, for float experts:
meta "high_mxfp4"), the blocks and scales as shipped (`<e>.high.<projection>.blocks` [N, K/32, 16] and `.scales`
[N, K/32] uint8: 4.25 bits a weight where bf16 takes 16), which the CPU computes with its MXFP4 kernels and a GPU
slot dequantizes as it computes (quant/mxfp4.Mxfp4Expert). Experts with biases (GPT-OSS) keep them beside both copies
(`<e>.bias.gate_up` [2F], `<e>.bias.down` [D]), and the meta records them and the family's gated activation
(expert_bias, expert_act), which every backend computing from the store applies; stores of other families hold
neither the tensors nor the fields.

A store built from a moeserve quantized checkpoint (offload/quantized_source.py) holds the checkpoint's experts as
they are: one low-bit copy at its bits and group (meta "quantized"), with MiLo's compensators as further parts, served
for either precision.

Provenance, so that a store never silently serves another model's experts:
  - each layer file records in its header the sha256 of the source experts it was made from and its
    low-precision settings; a rebuild reuses a file only when both match the source and settings it has now;
  - expert_store.json records the model's shape (layers, hidden, FFN, experts), those per-layer digests
    (open() checks every file against them: header reads only) and a digest of a sample of the source's
    expert rows (checkpoint.expert_sample_rows), which check_model() compares with the checkpoint given to
    `generate --offload`: a few KiB read per layer, so generate never re-hashes the experts it offloads.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from moeserve.checkpoint import (CheckpointReader, check_output_dir, checkpoint_expert_sample, expert_sample_digest,
                                 read_tensor, save_safetensors_atomic, tensors_digest, validate_safetensors,
                                 write_text_atomic)
from moeserve.errors import MoeserveError
from moeserve.kernels import pack
from moeserve.offload.quantized_source import (LOW_PARTS, PROJECTIONS, part_leaves, projection_shapes,
                                               quantized_form, read_layer)
from moeserve.progress import track
from moeserve.quant import hqq, milo, mxfp4
from moeserve.quant.manifest import read_manifest
from moeserve.quant.qlinear import QuantizedLinear
from moeserve.spec import ClampedSwiGLU, ModelSpec

META_FILE = "expert_store.json"
MXFP4_PARTS = ("blocks", "scales")  # a projection's high copy in a store that keeps MXFP4 as shipped
UNITS_LAYOUT = 2  # pack.py layout whose 3-bit rows are read by a permutation (pack.planar_from_units)
PROVENANCE = "moeserve_expert_store"  # safetensors metadata key of a layer file: what it was made from
META_FIELDS = ("layers", "num_experts", "hidden", "ffn", "low_bits", "group")
DEFAULT_LOW_BITS, DEFAULT_GROUP = 4, 64  # offload-prepare's low-bit copies of a float checkpoint


def _layer_file(path: Path, layer: int) -> Path:
    return path / f"experts-layer-{layer:05d}.safetensors"


def _provenance(source_sha256: str, low_bits: int, group: int) -> dict:
    return {"source_sha256": source_sha256, "low_bits": low_bits, "group": group, "pack_layout": pack.LAYOUT}


def store_meta(spec, layers: list[int], low_bits: int, group: int, source: dict | None = None) -> dict:
    """The content of expert_store.json. source (store_source): what the experts were made from; a store
    without it (a synthetic one, or an older moeserve's) cannot be matched to a checkpoint."""
    meta = {"layers": sorted(layers), "num_layers": spec.num_layers, "num_experts": spec.moe.num_experts,
            "hidden": spec.hidden_size, "ffn": spec.moe.expert_ffn, "low_bits": low_bits, "group": group,
            "pack_layout": pack.LAYOUT}
    if spec.moe.layer_experts:  # layers differ (PR-MoE): each layer's own count
        meta["layer_experts"] = {str(i): spec.moe.experts_at(i) for i in sorted(layers)}
    meta.update(expert_form(spec))
    return meta if source is None else {**meta, "source": source}


def expert_form(spec) -> dict:
    """The meta fields that say how an expert computes beyond silu(x Wg) * (x Wu) Wd, as `spec` has it: biases
    ("expert_bias": true) and GPT-OSS's clamped SwiGLU ("expert_act": {alpha, limit}); none for other families."""
    form = {"expert_bias": True} if spec.moe.expert_bias else {}
    if spec.moe.expert_act is not None:
        form["expert_act"] = {"alpha": spec.moe.expert_act.alpha, "limit": spec.moe.expert_act.limit}
    return form


def meta_act(meta: dict) -> ClampedSwiGLU | None:
    """The gated activation a store's meta records (None: silu(gate) * up)."""
    act = meta.get("expert_act")
    return None if act is None else ClampedSwiGLU(alpha=float(act["alpha"]), limit=float(act["limit"]))


def layer_experts(meta: dict, layer: int) -> int:
    """The experts a store holds of `layer` (num_experts unless the meta lists each layer's)."""
    return meta.get("layer_experts", {}).get(str(layer), meta["num_experts"])


def store_source(layer_digests: dict[int, str], experts_sample: str | None = None) -> dict:
    """What a store's experts were made from: each layer's source digest and, when known, the sampled rows' digest
    of the checkpoint (checkpoint.expert_sample_rows)."""
    sample = {} if experts_sample is None else {"experts_sample": experts_sample}
    return {**sample, "layers_sha256": {str(i): d for i, d in sorted(layer_digests.items())}}


def _rebuild_hint(path: Path) -> str:
    return f"build the store again with `moeserve offload-prepare --out {path}`"


def read_meta(path: Path) -> dict:
    """expert_store.json, checked for the fields the store reads (a damaged file is named, not a KeyError)."""
    f = path / META_FILE
    if not f.is_file() and any(path.glob("experts-layer-*.safetensors")):
        raise MoeserveError(f"expert store {path} is incomplete (no {META_FILE}: an offload-prepare did not finish); "
                            f"run it again")
    if not f.is_file():
        raise MoeserveError(f"{path} is not an expert store (no {META_FILE})")
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise MoeserveError(f"{f} is unreadable ({e}); {_rebuild_hint(path)}") from None
    if not _well_formed(meta):
        raise MoeserveError(f"{f} is damaged (missing or malformed fields); {_rebuild_hint(path)}")
    return meta


def _well_formed(meta) -> bool:
    """The fields every store has, and the provenance a store of this moeserve has (older ones lack it)."""
    if not isinstance(meta, dict) or any(k not in meta for k in META_FIELDS):
        return False
    layers, source, act = meta["layers"], meta.get("source", {}), meta.get("expert_act")
    quantized = meta.get("quantized", {"rank": 0, "compensator_bits": 16, "ranks": {}})
    return (isinstance(layers, list) and bool(layers) and all(isinstance(i, int) for i in layers)
            and isinstance(quantized, dict) and isinstance(quantized.get("rank"), int)
            and quantized.get("compensator_bits") in (3, 8, 16) and isinstance(quantized.get("ranks"), dict)
            and isinstance(source, dict) and isinstance(source.get("layers_sha256", {}), dict)
            and isinstance(meta.get("expert_bias", False), bool)
            and (act is None or isinstance(act, dict) and all(isinstance(act.get(k), (int, float))
                                                              for k in ("alpha", "limit"))))


def check_layer_file(path: Path, layer: int, meta: dict) -> None:
    """One layer file is there, complete, shaped as the meta says and (for a store that records provenance) made
    from the source and settings the meta records. Reads the header only."""
    f = _layer_file(path, layer)
    if not f.is_file():
        raise MoeserveError(f"expert store {path} is incomplete: {f.name} is missing; {_rebuild_hint(path)}")
    try:
        header = validate_safetensors(f)
    except MoeserveError as e:  # truncated or not safetensors
        raise MoeserveError(f"{e}; {_rebuild_hint(path)}") from None
    D, F = meta["hidden"], meta["ffn"]
    for e in range(layer_experts(meta, layer)):
        shapes = (quantized_shapes(meta, e) if "quantized" in meta else [(f"{e}.high.{n}.{p}", [rows, cols // mxfp4.BLOCK] + ([mxfp4.BLOCK // 2] if p == "blocks" else []))
                   for n, (rows, cols) in zip(PROJECTIONS, ((2 * F, D), (D, F))) for p in MXFP4_PARTS]
                  if meta.get("high_mxfp4") else [(f"{e}.high.gate_up", [2 * F, D]), (f"{e}.high.down", [D, F])])
        if meta.get("expert_bias"):
            shapes += [(f"{e}.bias.gate_up", [2 * F]), (f"{e}.bias.down", [D])]
        for name, shape in shapes:
            if header.get(name, {}).get("shape") != shape:
                raise MoeserveError(f"{f} does not hold the experts {META_FILE} describes ({name}: "
                                    f"{header.get(name, {}).get('shape')}, expected {shape}); {_rebuild_hint(path)}")
    if "source" in meta:
        recorded = meta["source"].get("layers_sha256", {}).get(str(layer))
        if read_provenance(f, header) != _provenance(recorded, meta["low_bits"], meta["group"]):
            raise MoeserveError(f"{f} was not built with the source and settings {META_FILE} records; "
                                f"{_rebuild_hint(path)}")


def quantized_shapes(meta: dict, e: int) -> list[tuple[str, list[int]]]:
    """(name, shape) of expert e's parts in a store of a quantized checkpoint (biases aside)."""
    D, F, form = meta["hidden"], meta["ffn"], meta["quantized"]
    return [(f"{e}.low.{n}.{leaf}", shape) for n, (rows, cols) in zip(PROJECTIONS, ((2 * F, D), (D, F)))
            for leaf, shape in projection_shapes(form, meta["low_bits"], meta["group"], rows, cols).items()]


class SourceExperts:
    """One MoE layer's routed experts as their source holds them: gate_up and down as float stacks [E, 2F, D] and
    [E, D, F], or as MXFP4 (blocks, scales) pairs ([E, 2F, D/32, 16], [E, 2F, D/32] and [E, D, F/32, 16],
    [E, D, F/32]; GPT-OSS as shipped) dequantized one expert at a time; and their biases gate_up [E, 2F], down
    [E, D] (GPT-OSS), or None."""

    def __init__(self, gate_up, down, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None):
        self.gate_up, self.down = gate_up, down
        self.bias = None if gate_up_bias is None else (gate_up_bias, down_bias)

    @property
    def mxfp4(self) -> bool:
        return isinstance(self.gate_up, tuple)

    @property
    def num_experts(self) -> int:
        return (self.gate_up[0] if self.mxfp4 else self.gate_up).shape[0]

    def weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2F, D], down [D, F]) floats (MXFP4: dequantized to bf16, which holds them exactly)."""
        if not self.mxfp4:
            return self.gate_up[e], self.down[e]
        return tuple(mxfp4.dequantize(blocks[e], scales[e], torch.bfloat16) for blocks, scales in (self.gate_up,
                                                                                                     self.down))

    def biases(self, e: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Expert e's (gate_up [2F], down [D]) biases, or None."""
        return None if self.bias is None else (self.bias[0][e], self.bias[1][e])

    def tensors(self) -> list[torch.Tensor]:
        """The tensors as read, in the order the layer's source digest hashes them."""
        weights = [*self.gate_up, *self.down] if self.mxfp4 else [self.gate_up, self.down]
        return weights + list(self.bias or ())

    def digest(self) -> str:
        return tensors_digest(self.tensors())

    def to(self, device) -> "SourceExperts":
        """These experts on `device` (None: where they are)."""
        if device is None:
            return self
        moved = [tuple(t.to(device) for t in w) if self.mxfp4 else w.to(device) for w in (self.gate_up, self.down)]
        biases = (None, None) if self.bias is None else tuple(t.to(device) for t in self.bias)
        return SourceExperts(*moved, *biases)

    @classmethod
    def of_module(cls, experts) -> "SourceExperts":
        """A loaded model's experts: ResidentExperts' stacks or Mxfp4Experts' blocks, with their biases."""
        if hasattr(experts, "gate_up_proj_blocks"):
            gate_up = (experts.gate_up_proj_blocks, experts.gate_up_proj_scales)
            down = (experts.down_proj_blocks, experts.down_proj_scales)
        else:
            gate_up, down = experts.gate_up_proj, experts.down_proj
        return cls(gate_up, down, experts.gate_up_proj_bias, experts.down_proj_bias)

    def sample_row(self, e: int, projection: str, row: int) -> torch.Tensor:
        """Row `row` of expert e's gate_up or down as checkpoint.read_expert_row reads it (MXFP4: the row's block and
        scale bytes as numbers)."""
        w = self.gate_up if projection == "gate_up" else self.down
        if not self.mxfp4:
            return w[e, row].detach().cpu()
        return torch.cat([t[e, row].reshape(-1) for t in w]).cpu()


def read_source_experts(reader: CheckpointReader, spec, layer: int) -> SourceExperts:
    """The routed experts of one MoE layer as the checkpoint stores them (float or MXFP4), in moeserve's layout."""
    def read(leaf: str) -> torch.Tensor:
        return read_tensor(reader, f"model.layers.{layer}.mlp.experts.{leaf}", spec.family, spec.moe.experts_at(layer))

    if spec.moe.experts_mxfp4:
        gate_up, down = ((read(f"{p}_blocks"), read(f"{p}_scales")) for p in ("gate_up_proj", "down_proj"))
    else:
        gate_up, down = read("gate_up_proj"), read("down_proj")
    biases = (read("gate_up_proj_bias"), read("down_proj_bias")) if spec.moe.expert_bias else (None, None)
    return SourceExperts(gate_up, down, *biases)


def source_layers(reader: CheckpointReader, spec, layers: list[int], progress: bool):
    """(layer, its SourceExperts, their source digest) of each MoE layer in `layers`, read one layer at a time from
    the checkpoint (peak memory: one layer's experts as stored)."""
    for i in track(layers, "expert store", "layers", progress):
        experts = read_source_experts(reader, spec, i)
        yield i, experts, experts.digest()


def _write_layers(reader: CheckpointReader, spec, out: Path, low_bits: int, group: int,
                  progress: bool) -> dict[int, str]:
    """Each MoE layer's file: kept when it records the digest of the source experts read now and these settings,
    else built (again); returns the source digest of each layer."""
    digests = {}
    for i, experts, digests[i] in source_layers(reader, spec, spec.moe.layer_indices(), progress):
        provenance = _provenance(digests[i], low_bits, group)
        f = _layer_file(out, i)
        if read_provenance(f) == provenance:
            continue  # built by an earlier run from these very experts and settings
        (out / META_FILE).unlink(missing_ok=True)  # incomplete until every layer matches the new meta
        save_safetensors_atomic(layer_tensors(experts, low_bits, group), f,
                                metadata={PROVENANCE: json.dumps(provenance)})
    return digests


def _form_text(form: dict) -> str:
    act = form.get("expert_act")
    return (f"{'with' if form.get('expert_bias') else 'without'} biases, "
            f"{'silu(gate) * up' if act is None else 'clamped SwiGLU alpha {alpha} limit {limit}'.format(**act)}")


def _shape_text(num_layers, layers, hidden, ffn, experts) -> str:
    return f"{num_layers} layers ({len(layers)} MoE), hidden {hidden}, expert FFN {ffn}, {experts} experts (per layer)"


def model_expert_sample(path: Path, spec) -> str:
    """The sampled-expert-rows digest of the checkpoint at path; for a moeserve quantized checkpoint, the one its
    manifest records of the float checkpoint it was made from (its experts are stored low-bit)."""
    manifest = read_manifest(path)
    if manifest is None:
        return checkpoint_expert_sample(CheckpointReader(path), spec)
    sample = manifest["source"].get("experts_sample") if isinstance(manifest.get("source"), dict) else None
    if sample is None:
        raise MoeserveError(f"{path} does not record which checkpoint it was quantized from (an older moeserve made "
                            f"it); pass that checkpoint as --model, or quantize it again")
    return sample


def quantized_meta(spec, manifest: dict, form: dict, digests: dict[int, str], path: Path) -> dict:
    """expert_store.json of a store of a quantized checkpoint's experts (offload/quantized_source.py)."""
    source = store_source(digests, model_expert_sample(path, spec))
    meta = store_meta(spec, list(digests), manifest["bits"], manifest["group"], source)
    return {**meta, "quantized": form}


def check_stored_bits(path, manifest: dict, bits: int | None, group: int | None, asked: str) -> None:
    """A MoeserveError naming the stored bits and group when `asked` wants other ones of a quantized checkpoint
    (None: not asked)."""
    stored = (manifest["bits"], manifest["group"])
    if bits not in (None, stored[0]) or group not in (None, stored[1]):
        raise MoeserveError(f"{asked} {bits or stored[0]}/{group or stored[1]}: {path} is a moeserve quantized "
                            f"checkpoint of {stored[0]}-bit experts (group {stored[1]}), which the store takes as "
                            f"they are; give {stored[0]}/{stored[1]} or leave them out")


def read_provenance(f: Path, header: dict | None = None) -> dict | None:
    """What a layer file says it was made from, or None for a damaged, truncated or unmarked file."""
    try:
        header = header or validate_safetensors(f)
        return json.loads(header.get("__metadata__", {})[PROVENANCE])
    except (MoeserveError, OSError, KeyError, ValueError):
        return None


def layer_tensors(experts: SourceExperts, low_bits: int, group: int, dtype: torch.dtype | None = None,
                  high: bool = True, mxfp4: bool = False) -> dict[str, torch.Tensor]:
    """One layer's experts in both precisions, and their biases if they have any, on the CPU (quantized on the
    source's device: a GPU does it in milliseconds). A store for experts that never run at one precision may leave
    it out: low_bits 0 (no low-bit copies) or high=False (no high copies). dtype: the float copies' and the biases'
    dtype (default: the source's floats'). mxfp4: MXFP4 experts' high copies are their blocks and scales as
    shipped (MXFP4_PARTS), not floats."""
    state = {}
    packed = mxfp4 and experts.mxfp4
    for e in range(experts.num_experts):
        if high and packed:
            for name, pair in zip(PROJECTIONS, (experts.gate_up, experts.down)):
                state.update({f"{e}.high.{name}.{p}": t[e].detach().to("cpu").contiguous()
                              for p, t in zip(MXFP4_PARTS, pair)})
        for name, w in zip(PROJECTIONS, experts.weights(e) if low_bits or high and not packed else ()):
            if high and not packed:
                state[f"{e}.high.{name}"] = w.detach().to("cpu", dtype or w.dtype).contiguous()
            if low_bits:
                q = QuantizedLinear.from_quantized(hqq.quantize_hqq(w.detach().float(), low_bits, group))
                state.update({f"{e}.low.{name}.{p}": getattr(q, p).cpu() for p in LOW_PARTS})
        for name, b in zip(PROJECTIONS, experts.biases(e) or ()):
            state[f"{e}.bias.{name}"] = b.detach().to("cpu", dtype or b.dtype).contiguous()
    return state


def _pin_layer(tensors, where: str) -> dict | None:
    """A page-locked copy of one layer's tensors (a mapping: RAM dict or mapped file); None, with a warning saying
    `where` the store stops being pinned, when the OS refuses: the rest stays pageable or mapped, and loads stage it
    through a small pinned buffer."""
    try:
        return {k: tensors[k].pin_memory() for k in tensors}
    except RuntimeError as e:
        warnings.warn(f"moeserve: could not pin the expert store {where} ({str(e).splitlines()[0]}); the rest stays "
                      "in pageable/mapped memory and is staged through a pinned buffer (slower loads)", stacklevel=3)
        return None


class ExpertStore:
    def __init__(self, meta: dict, tensors_of_layer, path: Path | None = None):
        self.meta = meta  # layers, num_layers, num_experts, hidden, ffn, low_bits, group, pack_layout, source
        self.path = path  # the directory of an opened store, None for one in RAM
        self._tensors_of_layer = tensors_of_layer  # layer -> mapping name -> tensor (RAM dict or mmap handle)
        self._expert_bytes: dict[bool, int] = {}

    # ---- building and opening ----------------------------------------------------------------
    @classmethod
    def from_model(cls, model, low_bits: int = 4, group: int = 64, progress: bool = False) -> "ExpertStore":
        """Quantize every routed expert of a loaded model to `low_bits` (HQQ) and keep both copies in RAM;
        its provenance is that of the model's weights as loaded (their dtype included)."""
        moe = {i: SourceExperts.of_module(l.mlp.experts) for i, l in enumerate(model.model.layers)
               if hasattr(l.mlp, "experts")}
        layers = {i: layer_tensors(ex, low_bits, group)
                  for i, ex in track(list(moe.items()), "expert store", "layers", progress)}
        digests = {i: ex.digest() for i, ex in moe.items()}
        sample = expert_sample_digest(model.spec, lambda layer, e, projection, row: moe[layer].sample_row(
            e, projection, row))
        return cls(store_meta(model.spec, list(layers), low_bits, group, store_source(digests, sample)),
                   layers.__getitem__)

    @classmethod
    def from_checkpoint(cls, model_path: str | Path, layers: list[int] | None = None, low_bits: int = 4,
                        group: int = 64, dtype: torch.dtype | None = None, device=None, high: bool = True,
                        pin: bool = False, progress: bool = True, mxfp4: bool = False) -> "ExpertStore":
        """The store of a checkpoint's MoE layers `layers` (default: all) built in RAM, nothing written: what
        offload-prepare writes, for a run that has no store on disk (from_sources says what the options do). A
        moeserve quantized checkpoint's experts are taken as stored (from_quantized): low_bits must be its bits (or
        0), group, device, high and mxfp4 are moot."""
        manifest = read_manifest(Path(model_path))
        if manifest is not None:
            check_stored_bits(model_path, manifest, low_bits or None, None, "the low-bit experts")
            return cls.from_quantized(model_path, manifest, layers, dtype, pin, progress)
        spec = ModelSpec.from_dir(model_path)
        reader = CheckpointReader(model_path)
        chosen = spec.moe.layer_indices() if layers is None else sorted(layers)
        return cls.from_sources(spec, source_layers(reader, spec, chosen, progress), low_bits, group, dtype, device,
                                high, pin, mxfp4, checkpoint_expert_sample(reader, spec))

    @classmethod
    def from_sources(cls, spec, sources, low_bits: int = 4, group: int = 64, dtype: torch.dtype | None = None,
                     device=None, high: bool = True, pin: bool = False, mxfp4: bool = False,
                     sample: str | None = None) -> "ExpertStore":
        """The store of the MoE layers `sources` yields as (layer, SourceExperts, their digest), read by the caller
        (one layer at a time: peak memory one layer's experts as stored), built in RAM. low_bits 0 / high=False leave
        out the low-bit / float copies (layer_tensors); dtype: the float copies' and the biases' dtype (the compute
        dtype: no conversion when the CPU runs them); device: where the low-bit copies are quantized and MXFP4 blocks
        dequantized (a GPU takes milliseconds per layer, a CPU seconds); pin: page-lock each layer as it is built
        (copies to a GPU are then DMA; pin() later would hold two copies at once); mxfp4: where the checkpoint ships
        MXFP4 experts, their high copies stay packed as shipped (meta "high_mxfp4"); sample: the checkpoint's
        sampled-rows digest (checkpoint_expert_sample) the source records, None for a store matched to no checkpoint
        (a run's own, built from the rows it reads anyway)."""
        mxfp4 = mxfp4 and high and spec.moe.experts_mxfp4
        if low_bits:
            for inputs in (spec.hidden_size, spec.moe.expert_ffn):
                hqq.check_shape(torch.empty(1, inputs, device="meta"), low_bits, group)
        tensors, digests = {}, {}
        for i, experts, digests[i] in sources:
            tensors[i] = layer_tensors(experts.to(device), low_bits, group, dtype, high, mxfp4)
            if pin:
                pinned = _pin_layer(tensors[i], f"from layer {i} on")
                pin = pinned is not None  # once refused, the rest stays pageable
                tensors[i] = pinned if pin else tensors[i]
        meta = store_meta(spec, sorted(tensors), low_bits, group, store_source(digests, sample))
        return cls({**meta, "high_mxfp4": True} if mxfp4 else meta, tensors.__getitem__)

    @classmethod
    def from_quantized(cls, model_path: str | Path, manifest: dict, layers: list[int] | None = None,
                       dtype: torch.dtype | None = None, pin: bool = False,
                       progress: bool = True) -> "ExpertStore":
        """The store of a moeserve quantized checkpoint's MoE layers `layers` (default: all) in RAM: its experts as
        stored (offload/quantized_source.py), biases in `dtype`; pin as from_checkpoint's."""
        spec, reader = ModelSpec.from_dir(model_path), CheckpointReader(model_path)
        chosen = spec.moe.layer_indices() if layers is None else sorted(layers)
        form = quantized_form(manifest, spec, chosen)
        tensors, digests = {}, {}
        for i in track(chosen, "expert store", "layers", progress):
            tensors[i], digests[i] = read_layer(reader, manifest, spec, i, form, dtype, spec.moe.expert_bias)
            if pin:
                pinned = _pin_layer(tensors[i], f"from layer {i} on")
                pin = pinned is not None
                tensors[i] = pinned if pin else tensors[i]
        return cls(quantized_meta(spec, manifest, form, digests, Path(model_path)), tensors.__getitem__)

    @classmethod
    def build(cls, model_path: str | Path, out: str | Path, low_bits: int | None = None, group: int | None = None,
              progress: bool = True) -> "ExpertStore":
        """Write the store of a checkpoint layer by layer (peak memory: one layer's experts), then open it. low_bits
        and group: the low-bit copies' (default DEFAULT_LOW_BITS, DEFAULT_GROUP); a moeserve quantized checkpoint's
        experts are taken as stored, so only its own bits and group are accepted.

        Into an existing store (an interrupted or earlier build) a layer file is reused only when it records
        the digest of the source experts read now and these settings; any other is built again. A user error
        met on the way removes the directory if this call created it."""
        out = check_output_dir(out)
        spec = ModelSpec.from_dir(model_path)
        manifest = read_manifest(Path(model_path))
        if manifest is not None:
            check_stored_bits(model_path, manifest, low_bits, group, "--low-bits/--group")
            return cls._build_quantized(model_path, manifest, spec, out, progress)
        low_bits = DEFAULT_LOW_BITS if low_bits is None else low_bits
        group = DEFAULT_GROUP if group is None else group
        for inputs in (spec.hidden_size, spec.moe.expert_ffn):  # gate_up and down: fail before writing anything
            hqq.check_shape(torch.empty(1, inputs, device="meta"), low_bits, group)
        reader = CheckpointReader(model_path)
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        try:
            digests = _write_layers(reader, spec, out, low_bits, group, progress)
            meta = store_meta(spec, list(digests), low_bits, group,
                              store_source(digests, checkpoint_expert_sample(reader, spec)))
            write_text_atomic(json.dumps(meta), out / META_FILE)
        except MoeserveError:
            if created:
                shutil.rmtree(out, ignore_errors=True)
            raise
        return cls.open(out)

    @classmethod
    def _build_quantized(cls, model_path: str | Path, manifest: dict, spec, out: Path,
                         progress: bool) -> "ExpertStore":
        """build() of a quantized checkpoint: each layer file kept when it records the digest of the checkpoint
        tensors read now, else written; then the meta, then the store opened."""
        reader, layers = CheckpointReader(model_path), spec.moe.layer_indices()
        form = quantized_form(manifest, spec, layers)
        bits, group = manifest["bits"], manifest["group"]
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        try:
            digests = {}
            for i in track(layers, "expert store", "layers", progress):
                tensors, digests[i] = read_layer(reader, manifest, spec, i, form, None, spec.moe.expert_bias)
                provenance = _provenance(digests[i], bits, group)
                if read_provenance(_layer_file(out, i)) != provenance:
                    (out / META_FILE).unlink(missing_ok=True)
                    save_safetensors_atomic(tensors, _layer_file(out, i), metadata={PROVENANCE: json.dumps(provenance)})
            write_text_atomic(json.dumps(quantized_meta(spec, manifest, form, digests, Path(model_path))),
                              out / META_FILE)
        except MoeserveError:
            if created:
                shutil.rmtree(out, ignore_errors=True)
            raise
        return cls.open(out)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        digests = self.meta.get("source", {}).get("layers_sha256", {})
        for layer in self.meta["layers"]:
            tensors = self._tensors_of_layer(layer)
            provenance = (_provenance(digests[str(layer)], self.meta["low_bits"], self.meta["group"])
                          if str(layer) in digests else None)
            save_safetensors_atomic({k: tensors[k] for k in tensors}, _layer_file(path, layer),
                                    metadata={PROVENANCE: json.dumps(provenance)} if provenance else None)
        write_text_atomic(json.dumps(self.meta), path / META_FILE)

    @classmethod
    def open(cls, path: str | Path) -> "ExpertStore":
        """Memory-map a saved store: nothing is read until an expert is loaded, but every layer file's header
        is checked first (present, complete, the shapes and provenance expert_store.json records). A 3-bit store
        of pack layout 2 is read too: each 3-bit weight is made word-planar when first read, then kept in RAM."""
        path = Path(path)
        meta = read_meta(path)
        for layer in meta["layers"]:
            check_layer_file(path, layer, meta)
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
        return cls(meta, mapped.__getitem__, path)

    def check_model(self, spec, model_path: str | Path) -> None:
        """This store holds the routed experts of the checkpoint at model_path: the same layers and shapes, and
        the same sampled expert rows (checkpoint.expert_sample_rows: a few KiB per layer, read from the
        checkpoint, or recorded in a moeserve quantized checkpoint's manifest from its source); a store of a quantized
        checkpoint's experts only for that checkpoint (the same quantization: quantized_source.checkpoint_identity),
        while a float store of the source serves its quantized checkpoints too. A store that records no sample (an
        older moeserve's) cannot be matched and is refused."""
        m, path, where = self.meta, Path(model_path), self.path or "(in memory)"
        ours = (m.get("num_layers"), m["layers"], m["hidden"], m["ffn"],
                ",".join(str(layer_experts(m, i)) for i in m["layers"]))
        theirs = (spec.num_layers, spec.moe.layer_indices(), spec.hidden_size,
                  spec.moe.expert_ffn, ",".join(str(spec.moe.experts_at(i)) for i in spec.moe.layer_indices()))
        if "source" not in m:
            raise MoeserveError(f"expert store {where} records no source fingerprint (an older moeserve built "
                                f"it); build it again with `moeserve offload-prepare --model {path} --out "
                                f"{self.path}`")
        if ours != theirs:
            raise MoeserveError(f"expert store {where} was built for another model: {_shape_text(*ours)}; "
                                f"{path} has {_shape_text(*theirs)}")
        recorded = {k: m[k] for k in ("expert_bias", "expert_act") if k in m}
        if recorded != expert_form(spec):
            raise MoeserveError(f"expert store {where} holds experts computed otherwise than {path}'s "
                                f"({_form_text(m)}; {path}: {_form_text(expert_form(spec))}); build one for it with "
                                f"`moeserve offload-prepare --model {path} --out DIR`")
        if model_expert_sample(path, spec) != m["source"].get("experts_sample"):
            raise MoeserveError(f"expert store {where} was built from another checkpoint than {path} (their "
                                f"expert weights differ); build one for it with `moeserve offload-prepare "
                                f"--model {path} --out DIR`")
        if "quantized" not in m:
            return  # float experts (and HQQ copies) of the source: they serve its quantized checkpoints too
        manifest = read_manifest(path)
        if manifest is None:
            raise MoeserveError(f"expert store {where} holds a moeserve quantized checkpoint's experts and {path} is "
                                f"the float checkpoint; run that quantized checkpoint with it, or build a store for "
                                f"{path} with `moeserve offload-prepare --model {path} --out DIR`")
        if (quantized_form(manifest, spec, m["layers"])["checkpoint"], m["low_bits"], m["group"]) != (
                m["quantized"].get("checkpoint"), manifest["bits"], manifest["group"]):
            raise MoeserveError(f"expert store {where} was built from another quantized checkpoint than {path} (its "
                                f"quantization differs); build one for it with `moeserve offload-prepare --model "
                                f"{path} --out DIR`")

    # ---- reading one expert ----------------------------------------------------------------------
    @property
    def act(self) -> ClampedSwiGLU | None:
        """The experts' gated activation (model/experts.glu): None for silu(gate) * up."""
        return meta_act(self.meta)

    @property
    def mxfp4(self) -> bool:
        """Whether the high copies are MXFP4 as shipped (Mxfp4Expert parts), not floats."""
        return bool(self.meta.get("high_mxfp4"))

    @property
    def quantized(self) -> bool:
        """Whether the store holds a quantized checkpoint's experts: one low-bit copy, served for either precision."""
        return "quantized" in self.meta

    @property
    def biased(self) -> bool:
        """Whether each expert has biases (GPT-OSS): the last two parts of either precision."""
        return bool(self.meta.get("expert_bias"))

    def part_names(self, expert: int, low: bool) -> list[str]:
        """Tensor names of one expert, in the order of part_shapes(): high gate_up, down (an MXFP4 store: gate_up's
        and down's MXFP4_PARTS), or low gate_up's and down's LOW_PARTS; then, for biased experts, gate_up's and
        down's biases."""
        leaves = part_leaves(self.meta["quantized"]) if self.quantized else LOW_PARTS
        names = ([f"{expert}.low.{n}.{p}" for n in PROJECTIONS for p in leaves] if low or self.quantized
                 else [f"{expert}.high.{n}.{p}" for n in PROJECTIONS for p in MXFP4_PARTS] if self.mxfp4
                 else [f"{expert}.high.{n}" for n in PROJECTIONS])
        return names + ([f"{expert}.bias.{n}" for n in PROJECTIONS] if self.biased else [])

    def layer_file(self, layer: int) -> Path:
        """The safetensors file of one layer of a store on disk (the disk tier reads experts from it)."""
        if self.path is None:
            raise MoeserveError("this expert store is in RAM: it has no layer files")
        return _layer_file(self.path, layer)

    def host_parts(self, layer: int, expert: int, low: bool) -> list[torch.Tensor]:
        """One expert's tensors in slow memory (pinned, RAM or mapped), no copy."""
        t = self._tensors_of_layer(layer)
        return [t[n] for n in self.part_names(expert, low)]

    def part_shapes(self, low: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each part of an expert at a precision (read from the first expert)."""
        return [(tuple(p.shape), p.dtype) for p in self.host_parts(self.meta["layers"][0], 0, low)]

    def slot_parts(self, low: bool, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each buffer of a device slot holding one expert at a precision: float high copies (and
        the biases beside them) in the compute dtype, packed parts (low-bit, MXFP4) as stored."""
        parts = self.part_shapes(low)
        return parts if low or self.quantized else [(shape, t if t == torch.uint8 else dtype) for shape, t in parts]

    def slot_weights(self, low: bool):
        """parts -> what a slot computes with (offload/slot_compute.slot_ffn): QuantizedLinear modules (low),
        an Mxfp4Expert (an MXFP4 store's high copy), else the float tensors themselves."""
        if low or self.quantized:
            return lambda parts: self.quantized_modules(parts, reloaded=True)
        return mxfp4.Mxfp4Expert.of_parts if self.mxfp4 else tuple

    def quantized_modules(self, parts: list[torch.Tensor], ranks: tuple[int, int] | None = None,
                          reloaded: bool = False) -> tuple[QuantizedLinear, QuantizedLinear]:
        """(gate_up, down) QuantizedLinear over a low-precision expert's parts, with their biases if any (no copy).
        A quantized checkpoint's compensators: at the store's padded rank, or cut to `ranks` (the expert's own,
        expert_ranks: the resident model's compensator exactly). reloaded: the parts are a cache slot's buffers
        (QuantizedLinear.reloaded)."""
        D, F, bits, group = self.meta["hidden"], self.meta["ffn"], self.meta["low_bits"], self.meta["group"]
        form = self.meta.get("quantized", {"rank": 0, "compensator_bits": 16})
        leaves = part_leaves(form) if self.quantized else LOW_PARTS
        n = len(leaves)
        biases = parts[2 * n:] or (None, None)
        mods = []
        for i, (out_f, in_f) in enumerate(((2 * F, D), (D, F))):
            named = dict(zip(leaves, parts[n * i:n * i + n]))
            comp = {k: t for k, t in named.items() if k not in LOW_PARTS}
            rank = form["rank"] if ranks is None else ranks[i]
            if comp and ranks is not None:
                comp = milo.compensator_slice(comp, rank)
            q = QuantizedLinear(in_f, out_f, bits, group, rank if comp else 0, form["compensator_bits"])
            for p in LOW_PARTS:
                setattr(q, p, named[p])
            for p, t in comp.items() if rank else ():
                setattr(q, p, t)
            q.bias = biases[i]  # a view of the part: a slot's module reads what is loaded into it
            q.reloaded = reloaded
            mods.append(q)
        return tuple(mods)

    def expert_ranks(self, layer: int, expert: int) -> tuple[int, int] | None:
        """A quantized checkpoint's (gate_up, down) compensator ranks of one expert (None for other stores)."""
        if not self.quantized:
            return None
        return tuple(self.meta["quantized"]["ranks"][str(layer)][expert])

    def expert_modules(self, layer: int, expert: int, device=None) -> tuple[QuantizedLinear, QuantizedLinear]:
        """(gate_up, down) QuantizedLinear of one expert's low-bit copy on `device` (None: where it is, no copy), as
        the resident model computes it (a quantized checkpoint's compensators at the expert's own ranks)."""
        parts = self.host_parts(layer, expert, low=True)
        parts = parts if device is None else [p.to(device) for p in parts]
        return self.quantized_modules(parts, self.expert_ranks(layer, expert))

    def pin(self, progress: bool = False) -> int:
        """Copy the store into page-locked RAM so that loads are asynchronous DMA copies; returns the layers
        pinned. When pinning fails (out of pinned memory), the rest stays where it is (mapped or pageable:
        loads stage it through a small pinned buffer) and a warning says so."""
        pinned = {}
        for n, layer in enumerate(track(self.meta["layers"], "pinning expert store", "layers", progress)):
            layer_pinned = _pin_layer(self._tensors_of_layer(layer), f"past layer {n} of {len(self.meta['layers'])}")
            if layer_pinned is None:
                break
            pinned[layer] = layer_pinned
        unpinned = self._tensors_of_layer
        self._tensors_of_layer = lambda layer: pinned[layer] if layer in pinned else unpinned(layer)
        return len(pinned)

    def expert_bytes(self, low: bool) -> int:
        """Bytes of one expert at a precision (measured once: on a mapped store it reads the tensors)."""
        if low not in self._expert_bytes:
            self._expert_bytes[low] = sum(p.nbytes for p in self.host_parts(self.meta["layers"][0], 0, low))
        return self._expert_bytes[low]
