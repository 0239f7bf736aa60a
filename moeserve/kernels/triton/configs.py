"""Launch configs of the Triton kernels: typed (LaunchConfig and one subclass per kernel family) and stored as data,
one JSON per GPU name, written by bench/tune_fused_moe.py, bench/tune_lowbit_moe.py and bench/kernels.py. Each
entry of a table becomes a typed config once, when the table is first read; a key no kernel reads raises
ValueError there, naming the file, the entry and the key. Lookups fall back to the defaults here for unknown
devices or shapes."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What every kernel launch config holds: tile sizes, warps, software-pipeline stages, operands by TMA, and the
    GPU time the tuner measured for it (`ms`, data only: no kernel reads it). The subclasses add their family's keys
    and defaults. `of` builds one from a table entry; `as_dict` gives the entry back as written (its keys, in their
    order), so a tuner writes the JSON it would read; `replace` changes fields and keeps that record."""

    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int = 3
    TMA: int = 0  # 1: operands through TMA descriptors
    ms: float | None = None
    given: tuple[str, ...] = field(default=(), compare=False, repr=False)  # the keys it was written with

    def __post_init__(self):
        if not self.given:  # built in code: the keys that differ from their defaults
            object.__setattr__(self, "given", tuple(
                f.name for f in config_fields(type(self))
                if f.default is dataclasses.MISSING or getattr(self, f.name) != f.default))

    @classmethod
    def of(cls, entry: dict | LaunchConfig, where: str = "a launch config") -> LaunchConfig:
        """The config a table entry ({"BLOCK_N": 32, ...}) describes; ValueError naming `where` and the key for a key
        this family does not read, a value of the wrong type, or a missing key without a default."""
        if isinstance(entry, cls):
            return entry
        fields = {f.name: f for f in config_fields(cls)}
        hints = typing.get_type_hints(cls)
        for key, value in entry.items():
            if key not in fields:
                raise ValueError(f"{where}: unknown key {key!r} in {dict(entry)} (a {cls.__name__} takes "
                                 f"{', '.join(fields)})")
            if not _is_a(value, hints[key]):
                raise ValueError(f"{where}: {key} = {value!r} is not {hints[key]}")
        missing = [name for name, f in fields.items() if f.default is dataclasses.MISSING and name not in entry]
        if missing:
            raise ValueError(f"{where}: {dict(entry)} has no {', '.join(missing)}")
        return cls(**entry, given=tuple(entry))

    def as_dict(self) -> dict:
        """The table entry: the keys it was written with (and those `replace` added), less the ones set to None."""
        return {key: getattr(self, key) for key in self.given if getattr(self, key) is not None}

    def replace(self, **changes) -> LaunchConfig:
        """A copy with these fields changed ({**entry, **changes} on the table entry; None drops an optional key)."""
        return dataclasses.replace(self, **changes, given=self.given + tuple(k for k in changes if k not in self.given))


@dataclass(frozen=True, kw_only=True)
class FusedMoEConfig(LaunchConfig):
    """One projection of the bf16/fp16 fused MoE (fused_moe.py)."""

    BLOCK_M: int  # rows per tile (the decode schedule loops over an expert's rows in chunks of BLOCK_M)
    schedule: str = "decode"  # "decode": a program per (expert, output block); "tiles": per (row tile, output block)

    def __post_init__(self):
        super().__post_init__()
        if self.schedule not in ("decode", "tiles"):
            raise ValueError(f"schedule must be 'decode' or 'tiles', got {self.schedule!r}")


@dataclass(frozen=True, kw_only=True)
class LowbitConfig(LaunchConfig):
    """A low-bit matmul launch (lowbit/): a dense layer, or one projection of the low-bit MoE."""

    BLOCK_M: int | None = None  # rows of x per CUDA-core tile (1, 2, 4, 8); None: one row there, more on tensor cores
    SPLIT_K: int = 1  # K slices (fp32 atomics into a zeroed output when > 1)
    SUB: int = 1  # CUDA cores: interleaved sub-tiles of the BLOCK_N rows
    AHEAD: int = 1  # CUDA cores: steps of words and scale/zero loaded ahead into registers (1 or 2)
    PIPE: int = 0  # > 0: words (CUDA cores) or whole dequantized groups (tensor cores) through PIPE smem stages
    HALF: int = 1  # 16-bit x: fp16 pairs (CUDA cores) or 16-bit codes (tensor cores) where they apply; 0: fp32
    PAIRED: int = 0  # MoE gate_up: a tile's gate rows and their up rows through one load pipeline
    BLOCK_R: int = 32  # compensator rank per step


def config_fields(cls: type) -> list[dataclasses.Field]:
    """A config class's keys: its dataclass fields less `given`."""
    return [f for f in dataclasses.fields(cls) if f.name != "given"]


def _is_a(value, hint) -> bool:
    """Whether a JSON value fits a field's type (ints serve float fields)."""
    kinds = typing.get_args(hint) or (hint,)
    return isinstance(value, kinds) or (float in kinds and isinstance(value, int))


@dataclass(frozen=True)
class ExpertsConfig:
    """The launch configs of an MoE's two projections (gate_up: x -> h, down: h -> y): one table entry."""

    gate_up: LaunchConfig
    down: LaunchConfig

    @classmethod
    def of(cls, entry: dict | ExpertsConfig, kind: type[LaunchConfig],
           where: str = "an experts config") -> ExpertsConfig:
        """{"gate_up": {...}, "down": {...}} -> the two configs of `kind`; ValueError as LaunchConfig.of, and for any
        key but the two projections."""
        if isinstance(entry, cls):
            return entry
        if set(entry) != {"gate_up", "down"}:
            unknown = sorted(set(entry) - {"gate_up", "down"})
            raise ValueError(f"{where}: " + (f"unknown key {unknown[0]!r}" if unknown else "needs gate_up and down")
                             + " (an experts config holds gate_up and down)")
        return cls(kind.of(entry["gate_up"], f"{where} gate_up"), kind.of(entry["down"], f"{where} down"))

    def as_dict(self) -> dict:
        return {"gate_up": self.gate_up.as_dict(), "down": self.down.as_dict()}


DEFAULT = ExpertsConfig.of({"gate_up": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4),
                            "down": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4)}, FusedMoEConfig)
# prefill-sized batches where nothing is tuned and torch has no grouped GEMM (before sm90): the row-tile schedule
DEFAULT_TILES = ExpertsConfig.of(
    {"gate_up": dict(schedule="tiles", BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
     "down": dict(schedule="tiles", BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)}, FusedMoEConfig)

# the sections of a table: launch configs by shape and count (and whether an entry is an experts pair), or other data
LAUNCH_SECTIONS = {"fused_moe": (FusedMoEConfig, True), "lowbit": (LowbitConfig, False),
                   "lowbit_moe": (LowbitConfig, True)}
DATA_SECTIONS = ("device", "max_tokens", "timings")


@functools.cache
def gpu_name(index: int) -> str:
    """Cached: asking CUDA for the name costs tens of microseconds, too much for every MoE layer."""
    return torch.cuda.get_device_name(index)


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shape_key(E: int, D: int, F: int) -> str:
    return f"E{E}_D{D}_F{F}"


def table_path(device_name: str) -> Path:
    return CONFIG_DIR / f"{device_slug(device_name)}.json"


@functools.cache
def device_table(device_name: str) -> dict:
    """This GPU's table as stored (JSON), {} where there is none."""
    path = table_path(device_name)
    return json.loads(path.read_text()) if path.is_file() else {}


@functools.cache
def launch_tables(device_name: str) -> dict[str, dict[str, dict[str, LaunchConfig | ExpertsConfig]]]:
    """This GPU's launch sections, {section: {shape: {count: config}}}, each entry typed once (typed_sections)."""
    return typed_sections(device_table(device_name), table_path(device_name).name)


def typed_sections(table: dict, where: str) -> dict[str, dict[str, dict[str, LaunchConfig | ExpertsConfig]]]:
    """A table's launch sections as typed configs; ValueError naming `where`, the entry and the key for an unknown
    section or an entry the kernels would not read as written."""
    unknown = sorted(set(table) - set(LAUNCH_SECTIONS) - set(DATA_SECTIONS))
    if unknown:
        raise ValueError(f"{where}: unknown section {unknown[0]!r} (a table holds "
                         f"{', '.join([*LAUNCH_SECTIONS, *DATA_SECTIONS])})")
    typed = {}
    for section, (kind, pair) in LAUNCH_SECTIONS.items():
        typed[section] = {
            shape: {count: (ExpertsConfig.of(entry, kind, f"{where} [{section}][{shape}][{count}]") if pair
                            else kind.of(entry, f"{where} [{section}][{shape}][{count}]"))
                    for count, entry in by_count.items()}
            for shape, by_count in table.get(section, {}).items()}
    return typed


def _merged(old, new, depth: int):
    """new over old, dicts merged `depth` levels deep."""
    if depth == 0 or not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    return {**old, **{k: _merged(old.get(k), v, depth - 1) for k, v in new.items()}}


def write_sections(device_name: str, sections: dict) -> Path:
    """Merge tuned sections ({"lowbit": {shape: {count: config as a dict}}, ...}) into this GPU's config JSON: a
    tuned (shape, count) replaces its own entry only, so a run over a subset of shapes or counts keeps the rest;
    later lookups see them. The merged table is checked (typed_sections) before it is written."""
    path = table_path(device_name)
    table = json.loads(path.read_text()) if path.is_file() else {}
    table = _merged(table, {"device": device_name, **sections}, 3)
    typed_sections(table, path.name)
    CONFIG_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    for cached in (device_table, launch_tables, fused_max_tokens, fused_moe_config, lowbit_config,
                   lowbit_moe_config):
        cached.cache_clear()
    return path


DEFAULT_MAX_TOKENS = 16  # untuned GPUs: the fused path for decode-sized batches only


@functools.cache
def fused_max_tokens(device_name: str, E: int, D: int, F: int) -> int:
    """Largest token count for which the fused kernels beat grouped GEMMs on this GPU and shape."""
    return int(device_table(device_name).get("max_tokens", {}).get(shape_key(E, D, F), DEFAULT_MAX_TOKENS))


@functools.cache
def fused_moe_config(device_name: str, E: int, D: int, F: int, tokens: int) -> ExpertsConfig:
    """The tuned config for the largest tuned token count <= tokens (else the smallest), or the default."""
    by_tokens = launch_tables(device_name)["fused_moe"].get(shape_key(E, D, F))
    return _at_most(by_tokens, tokens) if by_tokens else DEFAULT


def _at_most(by_count: dict, n: int):
    """The entry of {"count": config} for the largest count <= n (else the smallest count)."""
    counts = sorted(int(c) for c in by_count)
    return by_count[str(max((c for c in counts if c <= n), default=counts[0]))]


# ---- low-bit matmul (kernels/triton/lowbit/) ---------------------------------------------------------------
# one row, CUDA cores: 4 sub-tiles of 8 rows x 512 inputs
LOWBIT_GEMV = LowbitConfig.of(dict(BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=3, SUB=4))
# 2..4 rows, CUDA cores: each code decoded once for up to 4 rows of x
LOWBIT_GEMV_ROWS = LowbitConfig.of(dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=3, SUB=2, BLOCK_M=4))
# more rows, padded to >= 16: tensor cores
LOWBIT_DOT = LowbitConfig.of(dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3))
TARGET_PROGRAMS = 264  # two per SM on a 132-SM H100: split K until the grid has about this many programs
MAX_SPLIT_K = 8


def lowbit_shape_key(bits: int, N: int, K: int) -> str:
    return f"b{bits}_N{N}_K{K}"


def split_for(programs: int, steps: int) -> int:
    """K slices so that `programs` output blocks become about TARGET_PROGRAMS programs (1 when already many)."""
    return max(1, min(MAX_SPLIT_K, steps, -(-TARGET_PROGRAMS // max(programs, 1))))


@functools.cache
def lowbit_config(device_name: str, bits: int, rows: int, N: int, K: int) -> LowbitConfig:
    """Tuned config for the largest tuned row count <= rows (a one-row GEMV config serves one row only), else a
    default with SPLIT_K from the shape."""
    by_rows = launch_tables(device_name)["lowbit"].get(lowbit_shape_key(bits, N, K), {})
    fits = [r for r in map(int, by_rows) if r <= rows and (r == 1) == (rows == 1)]
    if fits:
        return by_rows[str(max(fits))]
    cfg = LOWBIT_GEMV if rows == 1 else LOWBIT_GEMV_ROWS if rows <= 4 else LOWBIT_DOT
    return cfg.replace(SPLIT_K=split_for(-(-N // cfg.BLOCK_N), -(-K // cfg.BLOCK_K)))


def lowbit_moe_key(bits: int, E: int, D: int, F: int, lowrank: bool = False) -> str:
    """The table key of a low-bit MoE shape; `_lr`: experts with compensators (their kernels hold the low-rank term
    in registers through the weight stream, which moves the best tile)."""
    return f"b{bits}_{shape_key(E, D, F)}{'_lr' if lowrank else ''}"


@functools.cache
def lowbit_moe_config(device_name: str, bits: int, E: int, D: int, F: int, tokens: int, top_k: int = 2,
                      lowrank: bool = False) -> ExpertsConfig:
    """The low-bit fused MoE's configs: tuned (largest tuned token count <= tokens, by bench/tune_lowbit_moe.py; a
    one-token entry serves one token only; with compensators the `_lr` entry where there is one), else the dense
    low-bit config of the same matrix shapes (gate_up tiles F x D, down D x F) for the rows an expert gets on
    average; gate_up is never split (SiLU needs whole sums), down splits K to fill the GPU."""
    table = launch_tables(device_name)["lowbit_moe"]
    for key in dict.fromkeys((lowbit_moe_key(bits, E, D, F, lowrank), lowbit_moe_key(bits, E, D, F))):
        fits = {t: cfg for t, cfg in table.get(key, {}).items() if (t == "1") == (tokens == 1)}  # GEMV: one token only
        if fits:
            return _at_most(fits, tokens)
    average = -(-tokens * top_k // E)  # rows an expert gets on average
    if tokens == 1:
        rows = 1  # the GEMV
    elif average <= 2:
        rows = 2  # CUDA-core tiles of 1-2 rows (a GEMV of 2 rows costs far less than a tensor-core tile of 16)
    else:
        rows = max(average, 16)  # tensor-core tiles
    gate_up, down = lowbit_config(device_name, bits, rows, F, D), lowbit_config(device_name, bits, rows, D, F)
    if rows == 2:
        fit = 1 << (average - 1).bit_length()  # more rows than that: more chunks
        gate_up, down = gate_up.replace(BLOCK_M=fit), down.replace(BLOCK_M=fit)
    active = min(E, top_k * tokens)  # experts with rows
    return ExpertsConfig(gate_up.replace(SPLIT_K=1),
                         down.replace(SPLIT_K=split_for(active * -(-D // down.BLOCK_N), -(-F // down.BLOCK_K))))
