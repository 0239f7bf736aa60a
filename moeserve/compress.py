"""Compressed checkpoints (`moeserve quantize`): quantize every linear weight of a checkpoint (RTN, HQQ or MiLo)
with quant/'s algorithms, write it with a manifest (quant/manifest.py reads it back into a runnable model). It
loads models, so it sits above the loader, not inside quant/.

Work goes one layer at a time (peak memory about one layer), into `OUT.partial/`, one shard per
layer; an interrupted run resumes from the finished shards, and OUT appears only when complete. Each
shard records the sha256 of the source tensors it was made from and their ranks; a resumed run keeps a
shard only when the source it reads now has the same digest, so a rerun on another checkpoint of the
same architecture (same headers) never mixes the two.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moeserve.checkpoint import (INDEX_FILE, CheckpointReader, check_output_dir, checkpoint_expert_sample,
                                  read_as_stored, read_tensor, save_safetensors_atomic, tensor_experts, tensors_digest,
                                  update_digest, validate_safetensors)
from moeserve.errors import MoeserveError
from moeserve.loader import load_model, tensors_to_load
from moeserve.model.transformer import MoETransformer
from moeserve.progress import Progress, track
from moeserve.quant import hqq, milo, mxfp4
from moeserve.quant.dense import layer_linears
from moeserve.quant.manifest import FORMAT, KINDS, MANIFEST, refuse_quantized
from moeserve.quant.qlinear import QuantizedLinear
from moeserve.quant.ranks import (TensorInfo, assign_ranks, clamp_ranks, expert_frequency, parse_rank_policy,
                                  weight_kurtosis)
from moeserve.spec import ModelSpec
from moeserve.tokenizer import load_tokenizer

METHODS = ("rtn", "hqq", "milo")
JOB_FILE = "job.json"  # in OUT.partial: the settings of the interrupted job
SHARD_RECORD = "moeserve_source"  # safetensors metadata key of a shard: its source digest and ranks
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
        if self.group < 1:
            raise MoeserveError(f"group size must be a positive number of inputs, got {self.group}")
        if self.compensator_bits not in (3, 8, 16):
            raise MoeserveError(f"compensator bits must be 3, 8 or 16, got {self.compensator_bits}")
        bad = [k for k in self.skip if k not in KINDS]
        if bad:
            raise MoeserveError(f"cannot skip {bad[0]!r}; tensor kinds are {', '.join(KINDS)}")
        if self.method == "milo":
            parse_rank_policy(self.ranks)  # raises on a bad policy string


# ---- which tensors ---------------------------------------------------------------------------


def linear_tensors(spec: ModelSpec) -> list[TensorInfo]:
    """Every linear weight the quantizer handles, named by the module that will hold it: each layer's dense ones
    (attention, then dense FFN or shared expert), then its experts'."""
    D = spec.hidden_size
    out = []
    for i, is_moe in enumerate(spec.moe.layers):
        out += layer_linears(spec, i)
        if not is_moe:
            continue
        m = f"model.layers.{i}.mlp"
        for e in range(spec.moe.experts_at(i)):
            out.append(TensorInfo(f"{m}.experts.gate_up.{e}", "expert", i, e, (2 * spec.moe.expert_ffn, D)))
            out.append(TensorInfo(f"{m}.experts.down.{e}", "expert", i, e, (D, spec.moe.expert_ffn)))
    return out


class LayerSource:
    """Float weights of one layer, read lazily from the checkpoint (expert stacks read once)."""

    def __init__(self, reader: CheckpointReader, spec: ModelSpec):
        self.reader, self.spec, self._stacks = reader, spec, {}

    def weight(self, info: TensorInfo) -> torch.Tensor:
        if info.kind != "expert":
            return read_tensor(self.reader, info.name + ".weight", self.spec.family,
                               self.spec.moe.experts_at(info.layer))
        stack_name, e = self._stack(info)
        if self.spec.moe.experts_mxfp4:  # quantized again from the float values the MXFP4 blocks hold
            return mxfp4.dequantize(self._read(f"{stack_name}_blocks", info)[e], self._read(f"{stack_name}_scales",
                                                                                          info)[e])
        return self._read(stack_name, info)[e]

    def bias(self, info: TensorInfo) -> torch.Tensor | None:
        if info.kind == "expert":  # a stack of per-expert biases (GPT-OSS), or none
            stack_name, e = self._stack(info)
            return self._read(f"{stack_name}_bias", info)[e] if self.spec.moe.expert_bias else None
        name = info.name + ".bias"
        return self.reader.get(name) if name in self.reader else None

    @staticmethod
    def _stack(info: TensorInfo) -> tuple[str, int]:
        """(the float stack an expert tensor comes from, its expert): ...experts.gate_up.3 -> ...gate_up_proj, 3."""
        stack_name, e = info.name.rsplit(".", 1)
        return stack_name.replace(".experts.gate_up", ".experts.gate_up_proj").replace(
            ".experts.down", ".experts.down_proj"), int(e)

    def _read(self, name: str, info: TensorInfo) -> torch.Tensor:
        """A stacked expert tensor, read once while the layer's tensors that use it are quantized."""
        if name not in self._stacks:
            if not any(n.startswith(f"model.layers.{info.layer}.") for n in self._stacks):
                self._stacks = {}  # a new layer: the last one's stacks go
            self._stacks[name] = read_tensor(self.reader, name, self.spec.family, self.spec.moe.experts_at(info.layer))
        return self._stacks[name]

    def inputs(self, tensors: list[TensorInfo], digest):
        """(info, weight, bias) of each tensor, its weight and bias fed to the hashlib object `digest` as read:
        the one order in which a layer's source digest is computed, whether it is quantized or checked."""
        for t in tensors:
            w, bias = self.weight(t), self.bias(t)
            update_digest(digest, w)
            if bias is not None:
                update_digest(digest, bias)
            yield t, w, bias


# ---- quantize one tensor ---------------------------------------------------------------------


def quantize_weight(W: torch.Tensor, cfg: QuantConfig,
                    rank: int) -> tuple[hqq.QuantizedWeight, dict[str, torch.Tensor] | None]:
    """W [out, in] (any float dtype) -> its quantized weight and MiLo compensator buffers (None at rank 0), on W's
    device: what a checkpoint stores for the tensor, before packing."""
    W = W.float()  # the quantizers reject a group size that does not divide the inputs
    if cfg.method == "rtn":
        return hqq.quantize_rtn(W, cfg.bits, cfg.group), None
    if cfg.method == "hqq" or rank == 0:
        return hqq.quantize_hqq(W, cfg.bits, cfg.group), None
    qw, comp, _ = milo.fit(W, rank, lambda M: hqq.quantize_hqq(M, cfg.bits, cfg.group), cfg.compensator_bits)
    return qw, comp


def quantize_tensor(W: torch.Tensor, cfg: QuantConfig, rank: int, bias: torch.Tensor | None) -> QuantizedLinear:
    """W [out, in] (any float dtype, any device) -> QuantizedLinear on the CPU."""
    qw, comp = quantize_weight(W, cfg, rank)
    qw = hqq.QuantizedWeight(codes=qw.codes.cpu(), scale=qw.scale.cpu(), zero=qw.zero.cpu(), bits=qw.bits,
                             group=qw.group, shape=qw.shape)
    comp = {k: v.cpu() for k, v in comp.items()} if comp else None
    return QuantizedLinear.from_quantized(qw, comp, rank if comp else 0, cfg.compensator_bits,
                                          None if bias is None else bias.float())


# ---- the whole checkpoint --------------------------------------------------------------------


def headers_fingerprint(path: Path) -> str:
    """sha256 over config.json and the safetensors headers: tells another job's leftovers apart at once (two
    checkpoints of one architecture share it: the shards' data digests tell those apart)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(n))
    return h.hexdigest()


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _is_our_job(path: Path) -> bool:
    """`path` is an interrupted quantize job's directory (its job.json names a moeserve format) or empty."""
    if not path.is_dir():
        return False
    try:
        job = json.loads((path / JOB_FILE).read_text())
    except (OSError, ValueError):
        return not any(path.iterdir())
    return isinstance(job, dict) and str(job.get("format", "")).startswith("moeserve-quant")


def _replaceable(out: Path) -> bool:
    """--force replaces only what moeserve wrote: a quantized checkpoint, a job directory, or an empty directory."""
    return out.is_dir() and ((out / MANIFEST).is_file() or _is_our_job(out))


def check_job(src: str | Path, out: str | Path, cfg: QuantConfig, force: bool) -> ModelSpec:
    """Everything about a quantize job that can fail before any work (settings, source, output directory);
    returns the source's spec. Called first, so that a bad --out fails before minutes of loading."""
    cfg.validate()
    out = check_output_dir(out)
    src = Path(src)
    spec = ModelSpec.from_dir(src)
    refuse_quantized(src, "quantize")
    if out.resolve() == src.resolve():
        raise MoeserveError("output directory must differ from the model directory")
    if out.exists() and not force:
        raise MoeserveError(f"output {str(out)!r} exists; pass --force to replace it")
    if out.exists() and not _replaceable(out):
        raise MoeserveError(f"--force replaces only a moeserve quantized checkpoint or an empty directory; "
                            f"{str(out)!r} is neither (no {MANIFEST}): remove it yourself or choose another output")
    partial = partial_dir(out)
    if partial.exists() and not _is_our_job(partial):
        raise MoeserveError(f"{str(partial)!r} exists and is not an interrupted moeserve quantize job; remove it or "
                            f"choose another output")
    for t in linear_tensors(spec):
        if t.kind not in cfg.skip and t.shape[1] % cfg.group:
            raise MoeserveError(f"group size {cfg.group} does not divide the input dimension {t.shape[1]} of {t.name}")
    return spec


def plan_ranks(spec: ModelSpec, reader: CheckpointReader, tensors: list[TensorInfo], cfg: QuantConfig,
               frequency: dict | None, progress: bool, note: Callable[[str], None] | None = None) -> dict[str, int]:
    """Rank per tensor, clamped to what each matrix allows; note(message) hears once what was clamped."""
    if cfg.method != "milo":
        return {t.name: 0 for t in tensors}
    policy = parse_rank_policy(cfg.ranks)
    kinds = {k for rule in policy if rule.signal == "kurtosis" for k in rule.kinds}
    kurtosis = None
    if kinds:
        source = LayerSource(reader, spec)
        kurtosis = {t.name: weight_kurtosis(source.weight(t))
                    for t in track([t for t in tensors if t.kind in kinds], "weight kurtosis", "tensors", progress,
                                   transient=True)}
    asked = assign_ranks(tensors, policy, kurtosis=kurtosis, frequency=frequency,
                         compensator_bits=cfg.compensator_bits)
    ranks, clamp = clamp_ranks(tensors, asked)
    if clamp is not None and note is not None:
        note(f"rank policy {cfg.ranks!r}: {clamp.message()}")
    return ranks


def quantize_checkpoint(src: str | Path, out: str | Path, cfg: QuantConfig, *, force: bool = False,
                        device: torch.device | str = "cpu", frequency: dict | None = None,
                        progress: bool = True, note: Callable[[str], None] | None = None) -> dict:
    """Write a compressed copy of `src` to `out`; returns the manifest. note(message): one-line remarks on
    the settings (ranks clamped to small matrices). On an error nothing this run started is left behind
    (an interrupted run keeps OUT.partial to resume)."""
    spec = check_job(src, out, cfg, force)
    src, out = Path(src), Path(out)
    reader = CheckpointReader(src)
    tensors = [t for t in linear_tensors(spec) if t.kind not in cfg.skip]
    ranks = plan_ranks(spec, reader, tensors, cfg, frequency, progress, note)
    partial = partial_dir(out)
    job = json.loads(json.dumps({"source": headers_fingerprint(src), "config": asdict(cfg), "format": FORMAT}))
    created = _open_job(partial, job)
    try:
        t0 = time.perf_counter()
        digests = _quantize_layers(LayerSource(reader, spec), tensors, spec.num_layers, partial, cfg, ranks, device,
                                   progress)
        rest_digest = _write_rest(reader, spec, {t.name for t in tensors}, partial)
        fingerprint = hashlib.sha256((src / "config.json").read_bytes() + "".join(digests + [rest_digest]).encode())
        manifest = {
            "format": FORMAT, **asdict(cfg),
            "source": {"path": str(src), "sha256": fingerprint.hexdigest(), "bytes": _safetensors_bytes(src),
                       "experts_sample": checkpoint_expert_sample(reader, spec)},
            "bytes": _safetensors_bytes(partial),
            "seconds": round(time.perf_counter() - t0, 2),
            "tensors": {t.name: {"kind": t.kind, "shape": list(t.shape), "rank": ranks[t.name]} for t in tensors},
        }
        _finish(partial, out, src, manifest, force)
    except MoeserveError:
        if created:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _open_job(partial: Path, job: dict) -> bool:
    """Make OUT.partial hold `job`, keeping an interrupted run of the same job; True when it was created here."""
    if partial.exists():
        try:
            old = json.loads((partial / JOB_FILE).read_text())
        except (OSError, ValueError):
            old = None
        if old == job:
            return False
        shutil.rmtree(partial)  # a different job's leftovers (another source, config or format): start over
    partial.mkdir(parents=True)
    (partial / JOB_FILE).write_text(json.dumps(job))
    return True


def _shard_record(digest: str, ranks: dict[str, int]) -> dict:
    return {"source_sha256": digest, "ranks": ranks}


def _read_shard_record(shard: Path) -> dict | None:
    """The record a finished shard carries, or None for a damaged or foreign file."""
    try:
        return json.loads(validate_safetensors(shard).get("__metadata__", {})[SHARD_RECORD])
    except (MoeserveError, KeyError, ValueError):
        return None


def _quantize_layers(source: LayerSource, tensors: list[TensorInfo], num_layers: int, partial: Path,
                     cfg: QuantConfig, ranks: dict[str, int], device, progress: bool) -> list[str]:
    """Quantize each layer into its shard and return each layer's source digest. A shard of an earlier run is
    kept only when the source reads the same now and its ranks are the planned ones (proof, not trust)."""
    by_layer: dict[int, list[TensorInfo]] = {}
    for t in tensors:
        by_layer.setdefault(t.layer, []).append(t)
    digests = []
    with Progress(len(tensors), "quantizing", "tensors", progress) as bar:
        for layer in range(num_layers):
            shard = partial / f"layer-{layer:05d}.safetensors"
            todo = by_layer.get(layer, [])
            plan = {t.name: ranks[t.name] for t in todo}
            if shard.is_file():
                digest = hashlib.sha256()
                for _ in source.inputs(todo, digest):
                    pass
                if _read_shard_record(shard) == _shard_record(digest.hexdigest(), plan):
                    digests.append(digest.hexdigest())
                    bar.update(len(todo))  # finished in an earlier run, from this very source
                    continue
            digest, state = hashlib.sha256(), {}
            for t, w, bias in source.inputs(todo, digest):
                q = quantize_tensor(w.to(device), cfg, plan[t.name], bias)
                state.update({f"{t.name}.{k}": v for k, v in q.state_dict().items()})
                bar.update(1)
            digests.append(digest.hexdigest())
            record = _shard_record(digests[-1], plan)
            save_safetensors_atomic(state, shard, metadata={SHARD_RECORD: json.dumps(record)})
    return digests


def _write_rest(reader: CheckpointReader, spec: ModelSpec, quantized_names: set[str], partial: Path) -> str:
    """Copy the tensors left in full precision (embeddings, norms, routers, skipped kinds), each in the form the
    loader reads back as it reads the source (read_as_stored: skipped GPT-OSS experts as stored, MXFP4 ones packed);
    returns their digest."""
    rest = {name: read_as_stored(reader, name, spec.family, tensor_experts(spec, name)) for name in _model_tensors(spec)
            if name.rsplit(".", 1)[0] not in quantized_names and not _in_quantized_experts(name, quantized_names)}
    save_safetensors_atomic(rest, partial / "rest.safetensors")
    return tensors_digest(rest.values())


def _model_tensors(spec: ModelSpec) -> list[str]:
    """The names of the tensors the loader reads for a model of `spec` (loader.tensors_to_load: every parameter once,
    and the packed buffers of the modules that keep weights as stored, MXFP4 experts' blocks and scales)."""
    with torch.device("meta"):
        model = MoETransformer(spec)
        mxfp4.use_stored_experts(model)
    return [names[0] for names, _, _ in tensors_to_load(model)]


def _safetensors_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def frequency_from_text(src: str | Path, text: str, device, max_tokens: int = 32768) -> dict:
    """Expert routing counts of the float model reading `text` (for frequency rank policies)."""
    model = load_model(src, device=device)
    ids = load_tokenizer(src).encode(text)[:max_tokens]
    return expert_frequency(model, ids)


def _in_quantized_experts(name: str, quantized: set[str]) -> bool:
    """model.layers.i.mlp.experts.gate_up_proj (and its _bias, _blocks, _scales) is replaced when its per-expert
    parts are quantized."""
    stem = re.sub(r"_(bias|blocks|scales)$", "", name).replace(".gate_up_proj", ".gate_up.0").replace(
        ".down_proj", ".down.0")
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
    config = json.loads((partial / "config.json").read_text())
    experts_quantized = any(t["kind"] == "expert" for t in manifest["tensors"].values())  # not MXFP4 any more
    if experts_quantized and (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        del config["quantization_config"]
        (partial / "config.json").write_text(json.dumps(config, indent=2))
    (partial / JOB_FILE).unlink()
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out.exists():
        if not (force and _replaceable(out)):  # appeared while this job ran
            raise MoeserveError(f"output {str(out)!r} appeared while quantizing and is not a moeserve quantized "
                                f"checkpoint; remove it or choose another output")
        shutil.rmtree(out)
    partial.rename(out)
