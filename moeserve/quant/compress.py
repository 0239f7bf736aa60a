"""Compressed checkpoints: quantize every linear weight of a checkpoint (RTN, HQQ or MiLo), write it
with a manifest, and rebuild a runnable model from it.

Work goes one layer at a time (peak memory about one layer), into `OUT.partial/`, one shard per
layer; an interrupted run resumes from the finished shards, and OUT appears only when complete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from moeserve.checkpoint import (INDEX_FILE, CheckpointReader, read_tensor, save_safetensors_atomic,
                                  validate_safetensors)
from moeserve.errors import MoeserveError
from moeserve.quant import hqq, milo
from moeserve.quant.pack import planar_from_units
from moeserve.quant.qlinear import QuantizedExperts, QuantizedLinear
from moeserve.quant.ranks import TensorInfo, assign_ranks, expert_frequency, parse_rank_policy, weight_kurtosis
from moeserve.spec import ModelSpec

MANIFEST = "moeserve_quant.json"
FORMAT = "moeserve-quant-3"  # 3: 3-bit rows word-planar (pack.py LAYOUT 3)
UNITS_FORMAT = "moeserve-quant-2"  # the same but 3-bit rows unit after unit: made word-planar on load
FIRST_FORMAT = "moeserve-quant-1"  # the same but 3-bit codes packed in order: not read at 3 bits
METHODS = ("rtn", "hqq", "milo")
KINDS = ("attention", "shared_expert", "dense_ffn", "expert")
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "byte_tokenizer.json", "heldout.txt", "special_tokens_map.json")


@dataclass(frozen=True)
class QuantConfig:
    bits: int = 3
    group: int = 64
    method: str = "milo"
    ranks: str = "dense=512,experts=kurtosis:16"
    compensator_bits: int = 16
    skip: tuple[str, ...] = ()  # tensor kinds left in full precision

    def validate(self) -> None:
        if self.bits not in (2, 3, 4, 8):
            raise MoeserveError(f"unsupported bit width {self.bits}; choose 2, 3, 4 or 8")
        if self.method not in METHODS:
            raise MoeserveError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.compensator_bits not in (3, 8, 16):
            raise MoeserveError(f"compensator bits must be 3, 8 or 16, got {self.compensator_bits}")
        bad = [k for k in self.skip if k not in KINDS]
        if bad:
            raise MoeserveError(f"cannot skip {bad[0]!r}; tensor kinds are {', '.join(KINDS)}")
        if self.method == "milo":
            parse_rank_policy(self.ranks)  # raises on a bad policy string


# ---- which tensors ---------------------------------------------------------------------------


def linear_tensors(spec: ModelSpec) -> list[TensorInfo]:
    """Every linear weight the quantizer handles, named by the module that will hold it."""
    D, H, Hkv, Dh = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    out = []
    for i, is_moe in enumerate(spec.moe_layers):
        a = f"model.layers.{i}.self_attn"
        for proj, shape in (("q", (H * Dh, D)), ("k", (Hkv * Dh, D)), ("v", (Hkv * Dh, D)), ("o", (D, H * Dh))):
            out.append(TensorInfo(f"{a}.{proj}_proj", "attention", i, None, shape))
        m = f"model.layers.{i}.mlp"
        if not is_moe:
            out += _mlp(f"{m}", "dense_ffn", i, D, spec.dense_ffn)
            continue
        if spec.shared_expert_ffn:
            out += _mlp(f"{m}.shared_expert", "shared_expert", i, D, spec.shared_expert_ffn)
        for e in range(spec.num_experts):
            out.append(TensorInfo(f"{m}.experts.gate_up.{e}", "expert", i, e, (2 * spec.expert_ffn, D)))
            out.append(TensorInfo(f"{m}.experts.down.{e}", "expert", i, e, (D, spec.expert_ffn)))
    return out


def _mlp(prefix: str, kind: str, layer: int, D: int, F: int) -> list[TensorInfo]:
    return [TensorInfo(f"{prefix}.gate_proj", kind, layer, None, (F, D)),
            TensorInfo(f"{prefix}.up_proj", kind, layer, None, (F, D)),
            TensorInfo(f"{prefix}.down_proj", kind, layer, None, (D, F))]


class LayerSource:
    """Float weights of one layer, read lazily from the checkpoint (expert stacks read once)."""

    def __init__(self, reader: CheckpointReader, spec: ModelSpec):
        self.reader, self.spec, self._stacks = reader, spec, {}

    def weight(self, info: TensorInfo) -> torch.Tensor:
        if info.kind != "expert":
            return read_tensor(self.reader, info.name + ".weight", self.spec.family, self.spec.num_experts)
        stack_name, e = info.name.rsplit(".", 1)
        stack_name = stack_name.replace(".experts.gate_up", ".experts.gate_up_proj").replace(
            ".experts.down", ".experts.down_proj")
        if stack_name not in self._stacks:
            self._stacks = {stack_name: read_tensor(self.reader, stack_name, self.spec.family, self.spec.num_experts)}
        return self._stacks[stack_name][int(e)]

    def bias(self, info: TensorInfo) -> torch.Tensor | None:
        name = info.name + ".bias"
        return self.reader.get(name) if name in self.reader else None


# ---- quantize one tensor ---------------------------------------------------------------------


def quantize_tensor(W: torch.Tensor, cfg: QuantConfig, rank: int, bias: torch.Tensor | None) -> QuantizedLinear:
    """W [out, in] (any float dtype, any device) -> QuantizedLinear on the CPU."""
    W = W.float()  # the quantizers reject a group size that does not divide the inputs
    if cfg.method == "rtn":
        qw, comp = hqq.quantize_rtn(W, cfg.bits, cfg.group), None
    elif cfg.method == "hqq" or rank == 0:
        qw, comp = hqq.quantize_hqq(W, cfg.bits, cfg.group), None
    else:
        qw, comp, _ = milo.fit(W, rank, lambda M: hqq.quantize_hqq(M, cfg.bits, cfg.group), cfg.compensator_bits)
    qw = hqq.QuantizedWeight(codes=qw.codes.cpu(), scale=qw.scale.cpu(), zero=qw.zero.cpu(), bits=qw.bits,
                             group=qw.group, shape=qw.shape)
    comp = {k: v.cpu() for k, v in comp.items()} if comp else None
    return QuantizedLinear.from_quantized(qw, comp, rank if comp else 0, cfg.compensator_bits,
                                          None if bias is None else bias.float())


# ---- the whole checkpoint --------------------------------------------------------------------


def source_fingerprint(path: Path) -> str:
    """sha256 over config.json and the safetensors headers: identifies the source cheaply."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(n))
    return h.hexdigest()


def plan_ranks(spec: ModelSpec, reader: CheckpointReader, tensors: list[TensorInfo], cfg: QuantConfig,
               frequency: dict | None, progress: bool) -> dict[str, int]:
    if cfg.method != "milo":
        return {t.name: 0 for t in tensors}
    policy = parse_rank_policy(cfg.ranks)
    kinds = {k for rule in policy if rule.signal == "kurtosis" for k in rule.kinds}
    kurtosis = None
    if kinds:
        source = LayerSource(reader, spec)
        kurtosis = {t.name: weight_kurtosis(source.weight(t))
                    for t in tqdm([t for t in tensors if t.kind in kinds], desc="weight kurtosis",
                                  disable=not progress, leave=False)}
    return assign_ranks(tensors, policy, kurtosis=kurtosis, frequency=frequency,
                        compensator_bits=cfg.compensator_bits)


def quantize_checkpoint(src: str | Path, out: str | Path, cfg: QuantConfig, *, force: bool = False,
                        device: torch.device | str = "cpu", frequency: dict | None = None,
                        progress: bool = True) -> dict:
    """Write a compressed copy of `src` to `out`; returns the manifest."""
    src, out = Path(src), Path(out)
    cfg.validate()
    spec = ModelSpec.from_dir(src)
    if out.exists() and not force:
        raise MoeserveError(f"output {str(out)!r} exists; pass --force to replace it")
    if out.resolve() == src.resolve():
        raise MoeserveError("output directory must differ from the model directory")
    reader = CheckpointReader(src)
    tensors = [t for t in linear_tensors(spec) if t.kind not in cfg.skip]
    for t in tensors:
        if t.shape[1] % cfg.group:
            raise MoeserveError(f"group size {cfg.group} does not divide the input dimension {t.shape[1]} of {t.name}")
    ranks = plan_ranks(spec, reader, tensors, cfg, frequency, progress)
    for t in tensors:
        if ranks[t.name] > min(t.shape):
            raise MoeserveError(f"rank {ranks[t.name]} is larger than {t.name} {t.shape}")
    fingerprint = source_fingerprint(src)
    partial = out.with_name(out.name + ".partial")
    job = json.loads(json.dumps({"source": fingerprint, "config": asdict(cfg), "format": FORMAT}))  # as read back
    if partial.exists():
        old = json.loads((partial / "job.json").read_text()) if (partial / "job.json").is_file() else None
        if old != job:
            shutil.rmtree(partial)  # a different job's leftovers (another source, config or format): start over
    partial.mkdir(parents=True, exist_ok=True)
    (partial / "job.json").write_text(json.dumps(job))

    t0 = time.perf_counter()
    by_layer = {}
    for t in tensors:
        by_layer.setdefault(t.layer, []).append(t)
    quantized_names = {t.name for t in tensors}
    bar = tqdm(total=len(tensors), desc="quantizing", unit="tensor", disable=not progress)
    source = LayerSource(reader, spec)
    for layer in range(spec.num_layers):
        shard = partial / f"layer-{layer:05d}.safetensors"
        todo = by_layer.get(layer, [])
        if shard.is_file():
            bar.update(len(todo))  # finished in an earlier run
            continue
        state = {}
        for t in todo:
            bias = source.bias(t)
            q = quantize_tensor(source.weight(t).to(device), cfg, ranks[t.name], bias)
            state.update({f"{t.name}.{k}": v for k, v in q.state_dict().items()})
            bar.update(1)
        save_safetensors_atomic(state, shard)
    bar.close()
    rest = {}
    with torch.device("meta"):
        from moeserve.model.transformer import MoETransformer

        names = [n for n, _ in MoETransformer(spec).named_parameters()]
    for name in names:
        if name.rsplit(".", 1)[0] not in quantized_names and not _in_quantized_experts(name, quantized_names):
            rest[name] = read_tensor(reader, name, spec.family, spec.num_experts)
    save_safetensors_atomic(rest, partial / "rest.safetensors")

    manifest = {
        "format": FORMAT, **asdict(cfg),
        "source": {"path": str(src), "sha256": fingerprint, "bytes": _safetensors_bytes(src)},
        "bytes": _safetensors_bytes(partial),
        "seconds": round(time.perf_counter() - t0, 2),
        "tensors": {t.name: {"kind": t.kind, "shape": list(t.shape), "rank": ranks[t.name]} for t in tensors},
    }
    _finish(partial, out, src, manifest, force)
    return manifest


def _safetensors_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def frequency_from_text(src: str | Path, text: str, device, max_tokens: int = 32768) -> dict:
    """Expert routing counts of the float model reading `text` (for frequency rank policies)."""
    from moeserve.loader import load_model
    from moeserve.tokenizer import load_tokenizer

    model = load_model(src, device=device)
    ids = load_tokenizer(src, model.spec.bos_token_id).encode(text)[:max_tokens]
    return expert_frequency(model, ids)


def _in_quantized_experts(name: str, quantized: set[str]) -> bool:
    """model.layers.i.mlp.experts.gate_up_proj is replaced when its per-expert parts are quantized."""
    stem = name.replace(".gate_up_proj", ".gate_up.0").replace(".down_proj", ".down.0")
    return stem != name and stem in quantized


def _finish(partial: Path, out: Path, src: Path, manifest: dict, force: bool) -> None:
    weight_map = {}
    for shard in sorted(partial.glob("*.safetensors")):
        for key in (k for k in validate_safetensors(shard) if k != "__metadata__"):
            weight_map[key] = shard.name
    (partial / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, partial / name)
    (partial / "job.json").unlink()
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out.exists() and force:
        shutil.rmtree(out)
    partial.rename(out)


# ---- loading ---------------------------------------------------------------------------------


def read_manifest(path: Path) -> dict | None:
    f = path / MANIFEST
    if not f.is_file():
        return None
    manifest = json.loads(f.read_text())
    found = manifest.get("format")
    if found == FIRST_FORMAT and 3 in (manifest.get("bits"), manifest.get("compensator_bits")):
        raise MoeserveError(f"{path} holds 3-bit codes in the 3-bit layout of {FIRST_FORMAT}, which this moeserve "
                            f"no longer reads (later formats pair the values for the GPU kernels); quantize the "
                            f"source checkpoint again with `moeserve quantize`")
    if found not in (FIRST_FORMAT, UNITS_FORMAT, FORMAT):
        raise MoeserveError(f"{f} has format {found!r}; this moeserve reads {FORMAT!r} and the earlier "
                            f"{UNITS_FORMAT!r} and {FIRST_FORMAT!r}")
    return manifest


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


def install_quantized_modules(model: nn.Module, manifest: dict) -> None:
    """Replace the float modules the manifest names by empty QuantizedLinear / QuantizedExperts."""
    cfg = dict(bits=manifest["bits"], group=manifest["group"], compensator_bits=manifest["compensator_bits"])
    experts: dict[str, dict[str, list]] = {}
    for name, t in manifest["tensors"].items():
        out_f, in_f = t["shape"]
        bias = getattr(model.get_submodule(name), "bias", None) is not None if t["kind"] != "expert" else False
        q = QuantizedLinear(in_f, out_f, rank=t["rank"], bias=bias, **cfg)
        if t["kind"] == "expert":
            stack, proj, e = name.rsplit(".", 2)
            experts.setdefault(stack, {"gate_up": [], "down": []})[proj].append((int(e), q))
        else:
            parent, leaf = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), leaf, q)
    for stack, parts in experts.items():
        parent, leaf = stack.rsplit(".", 1)
        gate_up = [q for _, q in sorted(parts["gate_up"], key=lambda p: p[0])]
        down = [q for _, q in sorted(parts["down"], key=lambda p: p[0])]
        setattr(model.get_submodule(parent), leaf, QuantizedExperts(gate_up, down))
