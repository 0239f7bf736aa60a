"""`moeserve tune`: the launch-config search for a model's MoE shapes ahead of time, on this GPU.

For each kind of experts the checkpoint holds (bf16, or its low-bit width with or without compensators; --bits
picks others) and each token bucket, random experts of the model's shape are timed through the same search and
cache as the tuning a first run does by itself (kernels/triton/autotune.py), with the full candidate lists. Each row
of the result says what a call took before (the stored or default config) and after. The winners go to the user's
tuning cache; `out` also merges them into a table file in the shipped format (kernels/triton/configs/*.json), which
is how the shipped tables are made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.errors import MoeserveError
from moeserve.kernels.triton import autotune, configs, fused_moe, tune_cache
from moeserve.kernels.triton.device import DeviceInfo, device_of
from moeserve.kernels.triton.lowbit import ops as lowbit_ops
from moeserve.quant import milo
from moeserve.quant.hqq import QuantizedWeight
from moeserve.quant.manifest import read_manifest
from moeserve.quant.qlinear import QuantizedExperts, QuantizedLinear
from moeserve.spec import ModelSpec

BF16 = 16  # --bits value of bf16 experts
TOKENS = (1, 2, 4, 8, 16, 32, 64)
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class ExpertKind:
    """How a model's routed experts are stored: bf16 (bits 16), or `bits`-bit codes in groups of `group` with
    compensators of rank `rank` (0: none)."""

    bits: int
    rank: int = 0
    group: int = 64

    def __str__(self) -> str:
        if self.bits == BF16:
            return "bf16"
        return f"{self.bits}-bit" + (f" + rank-{self.rank} compensators" if self.rank else "")


@dataclass(frozen=True)
class TuneRow:
    """One searched (experts kind, shape, token bucket): the call's GPU ms before and after, the search's seconds."""

    experts: str
    shape: str
    tokens: int
    default_ms: float
    tuned_ms: float
    seconds: float
    complete: bool

    @property
    def speedup(self) -> float:
        return self.default_ms / self.tuned_ms if self.tuned_ms > 0 else 1.0


def checkpoint_kinds(model_dir: str | Path, bits: list[int] | None = None, rank: int | None = None) -> list[ExpertKind]:
    """The expert kinds to tune: `bits` (16: bf16) if given, else the checkpoint's own (its quantized experts'
    width, group and largest rank, or bf16); `rank` overrides the compensator rank of low-bit kinds."""
    manifest = read_manifest(Path(model_dir))
    quantized = manifest is not None and "expert" not in manifest.get("skip", [])
    group = int(manifest.get("group", 64)) if quantized else 64
    if rank is None:
        ranks = [t.get("rank", 0) for t in (manifest or {}).get("tensors", {}).values() if t.get("kind") == "expert"]
        rank = max(ranks, default=0) if quantized else 0
    widths = bits or [int(manifest["bits"]) if quantized else BF16]
    return [ExpertKind(b, 0 if b == BF16 else rank, group) for b in widths]


def random_lowbit(N: int, K: int, kind: ExpertKind, device: torch.device) -> QuantizedLinear:
    """A random `kind` layer [N, K]: random codes, positive scales, mid-range zeros, a random bf16 compensator."""
    qw = QuantizedWeight(codes=torch.randint(0, 1 << kind.bits, (N, K), dtype=torch.uint8, device=device),
                         scale=(torch.rand(N, K // kind.group, device=device) * 0.01 + 1e-3).half(),
                         zero=(torch.rand(N, K // kind.group, device=device) * ((1 << kind.bits) - 1)).half(),
                         bits=kind.bits, group=kind.group, shape=(N, K))
    comp = (milo.compensator_to_buffers(torch.randn(N, kind.rank, device=device) * 0.01,
                                        torch.randn(kind.rank, K, device=device) * 0.01, 16) if kind.rank else None)
    return QuantizedLinear.from_quantized(qw, comp, kind.rank, 16).to(device)


def tune_kind(spec: ModelSpec, kind: ExpertKind, tokens: list[int], mode: str, budget_s: float | None,
              device: torch.device) -> tuple[DeviceInfo, list[TuneRow], list[autotune.Problem]]:
    """Search every bucket of `tokens` for random experts of this model's shape and kind."""
    E, k, D, F = spec.moe.num_experts, spec.moe.top_k, spec.hidden_size, spec.moe.expert_ffn
    if kind.bits == BF16:
        gate_up = torch.randn(E, 2 * F, D, device=device, dtype=torch.bfloat16) * WEIGHT_STD  # [E, 2F, D]
        down = torch.randn(E, D, F, device=device, dtype=torch.bfloat16) * WEIGHT_STD  # [E, D, F]
        section, shape = "fused_moe", configs.shape_key(E, D, F)

        def search(T):
            return fused_moe.tune_experts(gate_up, down, T, k, mode, budget_s)
    else:
        if D % kind.group or F % kind.group:
            raise MoeserveError(f"group {kind.group} does not divide the experts' inputs ({D} and {F})")
        experts = QuantizedExperts([random_lowbit(2 * F, D, kind, device) for _ in range(E)],
                                   [random_lowbit(D, F, kind, device) for _ in range(E)])
        gate_up, down = experts.stacked(torch.bfloat16)
        section, shape = "lowbit_moe", configs.lowbit_moe_key(kind.bits, E, D, F, kind.rank > 0)

        def search(T):
            return lowbit_ops.tune_experts(gate_up, down, T, k, mode, torch.bfloat16, budget_s)
    rows, problems = [], []
    for T in sorted({autotune.bucket(t) for t in tokens}):
        outcome = search(T)
        rows.append(TuneRow(str(kind), shape, T, outcome.default_ms, outcome.ms, outcome.seconds, outcome.complete))
        problems.append(autotune.Problem(section, shape, T))
    return device_of(gate_up if kind.bits == BF16 else gate_up.qweight), rows, problems


def tune_model(model_dir: str | Path, tokens: list[int], kinds: list[ExpertKind], mode: str = "full",
               budget_s: float | None = None, out: str | Path | None = None) -> list[TuneRow]:
    """Tune each kind at each token bucket on the current GPU; write the user's cache and, with `out`, the winners
    into that table file too (merged with what it holds)."""
    if not torch.cuda.is_available():
        raise MoeserveError("moeserve tune needs a CUDA GPU (it times the Triton kernels on it)")
    spec = ModelSpec.from_dir(model_dir)
    if not spec.moe.num_experts:
        raise MoeserveError(f"{model_dir} has no routed experts to tune")
    device = torch.device("cuda", torch.cuda.current_device())
    rows, problems, info = [], [], None
    with torch.inference_mode():
        for kind in kinds:
            info, kind_rows, kind_problems = tune_kind(spec, kind, tokens, mode, budget_s, device)
            rows += kind_rows
            problems += kind_problems
            torch.cuda.empty_cache()
    if out is not None and info is not None:
        write_shipped(info, problems, Path(out))
    return rows


def write_shipped(device: DeviceInfo, problems: list[autotune.Problem], out: Path) -> Path:
    """Merge the cached entries of `problems` into the table file `out` (the shipped format), with the GPU's
    hardware section."""
    cached = {}
    for path in tune_cache.table_files(device.slug):
        cached = tune_cache.merged(cached, tune_cache.read_table(path, configs.typed_sections), 3)
    sections: dict = {"hardware": device.as_dict()}
    for p in problems:
        entry = cached.get(p.section, {}).get(p.shape, {}).get(str(p.tokens))
        if entry is not None:
            sections.setdefault(p.section, {}).setdefault(p.shape, {})[str(p.tokens)] = entry
    return configs.write_sections(device.name, sections, out)


def format_rows(rows: list[TuneRow]) -> list[str]:
    """The before/after table, one line per row."""
    header = ("experts", "shape", "tokens", "default ms", "tuned ms", "speedup", "search s")
    cells = [header] + [(r.experts, r.shape, str(r.tokens), f"{r.default_ms:.4f}", f"{r.tuned_ms:.4f}",
                         f"{r.speedup:.2f}x", f"{r.seconds:.0f}" + ("" if r.complete else " (budget)"))
                        for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return ["  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in cells]

