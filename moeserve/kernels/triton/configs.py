"""Launch configs of the Triton kernels: typed (LaunchConfig and one subclass per kernel family) and stored as data,
one JSON per GPU name: shipped with the package (configs/, written by `moeserve tune --out` and bench/kernels.py)
and in the user's tuning cache (tune_cache.py, written by `moeserve tune` and by the tuning a first run does,
autotune.py), whose entries win. Each entry of a table becomes a typed config once, when the table is first read; a
key no kernel reads raises ValueError there, naming the file, the entry and the key. Lookups fall back to defaults
made from the GPU's properties (device.py) for unknown devices or shapes."""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeserve.kernels.triton import tune_cache
from moeserve.kernels.triton.device import DEFAULT_SMS, DeviceInfo, device_slug

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


# prefill-sized batches where nothing is tuned and torch has no grouped GEMM (before sm90): the row-tile schedule
DEFAULT_TILES = ExpertsConfig.of(
    {"gate_up": dict(schedule="tiles", BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
     "down": dict(schedule="tiles", BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)}, FusedMoEConfig)

# the sections of a table: launch configs by shape and count (and whether an entry is an experts pair), or other data
LAUNCH_SECTIONS = {"fused_moe": (FusedMoEConfig, True), "lowbit": (LowbitConfig, False),
                   "lowbit_moe": (LowbitConfig, True)}
DATA_SECTIONS = ("device", "hardware", "max_tokens", "timings")


@functools.cache
def gpu_name(index: int) -> str:
    """Cached: asking CUDA for the name costs tens of microseconds, too much for every MoE layer."""
    return torch.cuda.get_device_name(index)


def shape_key(E: int, D: int, F: int) -> str:
    return f"E{E}_D{D}_F{F}"


def table_path(device_name: str) -> Path:
    """The shipped table of a GPU name."""
    return CONFIG_DIR / f"{device_slug(device_name)}.json"


@functools.cache
def device_table(device_name: str) -> dict:
    """This GPU's table: the shipped one ({} where there is none) with the user's tuning cache merged over it."""
    path = table_path(device_name)
    table = json.loads(path.read_text()) if path.is_file() else {}
    for cached in tune_cache.table_files(device_slug(device_name)):
        table = tune_cache.merged(table, tune_cache.read_table(cached, typed_sections), 3)
    return table


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
    for section in LAUNCH_SECTIONS:
        by_shape = table.get(section, {})
        for name, level in [(f"[{section}]", by_shape)] + [(f"[{section}][{s}]", v) for s, v in (
                by_shape.items() if isinstance(by_shape, dict) else ())]:
            if not isinstance(level, dict) or not all(isinstance(v, dict) for v in level.values()):
                raise ValueError(f"{where}: {name} must map names to objects")
    typed = {}
    for section, (kind, pair) in LAUNCH_SECTIONS.items():
        typed[section] = {
            shape: {count: (ExpertsConfig.of(entry, kind, f"{where} [{section}][{shape}][{count}]") if pair
                            else kind.of(entry, f"{where} [{section}][{shape}][{count}]"))
                    for count, entry in by_count.items()}
            for shape, by_count in table.get(section, {}).items()}
    return typed


def stored(device_name: str, section: str, shape: str, count: int) -> bool:
    """Whether this GPU's tables (shipped or cached) hold an entry for exactly this shape and count."""
    return str(count) in launch_tables(device_name)[section].get(shape, {})


def write_sections(device_name: str, sections: dict, path: Path | None = None) -> Path:
    """Merge tuned sections ({"lowbit": {shape: {count: config as a dict}}, ...}) into a table JSON (default: this
    GPU's shipped table; tune_cache.table_file: the user's cache): a tuned (shape, count) replaces its own entry
    only, so a run over a subset of shapes or counts keeps the rest; later lookups see them. The merged table is
    checked (typed_sections) before it is written, atomically, under a lock in the user's cache."""
    path = Path(path) if path is not None else table_path(device_name)
    tune_cache.write_merged(path, {"device": device_name, **sections}, typed_sections,
                            lock=path.parent != CONFIG_DIR)  # no lock files beside the shipped tables
    clear_lookups()
    return path


def clear_lookups() -> None:
    """Forget every table read and lookup made (after a table changed)."""
    for cached in (device_table, launch_tables, fused_max_tokens, fused_moe_config, lowbit_config, lowbit_moe_config):
        cached.cache_clear()


DEFAULT_MAX_TOKENS = 16  # untuned GPUs: the fused path for decode-sized batches only


@functools.cache
def fused_max_tokens(device_name: str, E: int, D: int, F: int) -> int:
    """Largest token count for which the fused kernels beat grouped GEMMs on this GPU and shape."""
    return int(device_table(device_name).get("max_tokens", {}).get(shape_key(E, D, F), DEFAULT_MAX_TOKENS))


def as_device(device: DeviceInfo | str) -> DeviceInfo:
    """A DeviceInfo, or one for a bare name (the interpreter's "cpu", a test's fake GPU): Hopper's SMs and shared
    memory, no TMA."""
    return device if isinstance(device, DeviceInfo) else DeviceInfo(name=device, capability=(0, 0))


FILL = 2  # programs per SM the defaults aim for at least (one waits on memory while the other computes)


@functools.cache
def fused_moe_config(device: DeviceInfo | str, E: int, D: int, F: int, tokens: int, top_k: int = 2) -> ExpertsConfig:
    """The tuned config for the largest tuned token count <= tokens (else the smallest), or fused_moe_default."""
    device = as_device(device)
    by_tokens = launch_tables(device.name)["fused_moe"].get(shape_key(E, D, F))
    return _at_most(by_tokens, tokens) if by_tokens else fused_moe_default(device, E, D, F, tokens, top_k)


# the bf16 decode schedule's tiles by token count, gate_up then down (BLOCK_M, BLOCK_N, BLOCK_K, warps): the tuned
# winners of an H100 at Mixtral's shape, the base that fused_moe_default narrows to fill other GPUs and shapes
FUSED_TILES = {1: ((16, 128, 128, 4), (16, 32, 512, 4)), 4: ((16, 64, 256, 4), (16, 64, 512, 8)),
               16: ((16, 32, 256, 4), (16, 64, 256, 4)), 64: ((64, 32, 128, 4), (64, 64, 256, 4))}


def fused_moe_default(device: DeviceInfo, E: int, D: int, F: int, tokens: int, top_k: int = 2) -> ExpertsConfig:
    """The decode schedule with the base tiles of the token range (FUSED_TILES), each projection's output block
    halved (down to 16) until the experts with rows have a program per SM (the H100's winners have 1.7-1.9)."""
    base = FUSED_TILES[max(t for t in FUSED_TILES if t <= max(tokens, 1))]
    active = min(E, top_k * max(tokens, 1))  # experts with rows
    parts = []
    for (bm, bn, bk, warps), N in zip(base, (F, D)):
        while bn > 16 and active * -(-N // bn) < device.sms:
            bn //= 2
        parts.append(FusedMoEConfig.of(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)))
    return ExpertsConfig(*parts)


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
# ... on dequantized tiles of whole groups with PIPE steps in flight through shared memory (lowbit/tiles.py)
LOWBIT_PIPED_DOT = LowbitConfig.of(dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3, PIPE=3))
# one token on Hopper, weights by TMA (lowbit/tma.py): 8 rows x 1024 inputs a step, many small programs
LOWBIT_TMA = LowbitConfig.of(dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3, TMA=1))
TMA_FILL = 8  # programs per SM for the one-token TMA kernels (their programs are small: more in flight)
WIDE_ROWS = 16  # rows an expert gets on average from which the pipelined tiles default to 128 rows and 8 warps
MAX_SPLIT_K = 8


def lowbit_shape_key(bits: int, N: int, K: int) -> str:
    return f"b{bits}_N{N}_K{K}"


def split_for(programs: int, steps: int, sms: int = DEFAULT_SMS, fill: int = FILL) -> int:
    """K slices so that `programs` output blocks become about fill x sms programs (1 when already many)."""
    return max(1, min(MAX_SPLIT_K, steps, -(-fill * sms // max(programs, 1))))


def pipe_stages(device: DeviceInfo, weight_rows: int, block_k: int, stages: int = 3, x_rows: int = 16) -> int:
    """Steps in flight that fit the shared memory of a block (a step: the dequantized 16-bit weight tile and the
    16-bit tile of x_rows rows of x); 0 when fewer than two fit (then the plain dot)."""
    fit = device.smem_per_block // ((weight_rows + x_rows) * block_k * 2)
    return min(stages, fit) if fit >= 2 else 0


@functools.cache
def lowbit_config(device: DeviceInfo | str, bits: int, rows: int, N: int, K: int) -> LowbitConfig:
    """Tuned config for the largest tuned row count <= rows (a one-row GEMV config serves one row only), else a
    default with SPLIT_K from the shape and the GPU's SMs."""
    device = as_device(device)
    by_rows = launch_tables(device.name)["lowbit"].get(lowbit_shape_key(bits, N, K), {})
    fits = [r for r in map(int, by_rows) if r <= rows and (r == 1) == (rows == 1)]
    if fits:
        return by_rows[str(max(fits))]
    cfg = LOWBIT_GEMV if rows == 1 else LOWBIT_GEMV_ROWS if rows <= 4 else LOWBIT_DOT
    return cfg.replace(SPLIT_K=split_for(-(-N // cfg.BLOCK_N), -(-K // cfg.BLOCK_K), device.sms))


def lowbit_moe_key(bits: int, E: int, D: int, F: int, lowrank: bool = False) -> str:
    """The table key of a low-bit MoE shape; `_lr`: experts with compensators (their kernels hold the low-rank term
    in registers through the weight stream, which moves the best tile)."""
    return f"b{bits}_{shape_key(E, D, F)}{'_lr' if lowrank else ''}"


@functools.cache
def lowbit_moe_config(device: DeviceInfo | str, bits: int, E: int, D: int, F: int, tokens: int, top_k: int = 2,
                      lowrank: bool = False, group: int = 64) -> ExpertsConfig:
    """The low-bit fused MoE's configs: tuned (largest tuned token count <= tokens; a one-token entry serves one token
    only; with compensators the `_lr` entry where there is one), else lowbit_moe_default."""
    device = as_device(device)
    table = launch_tables(device.name)["lowbit_moe"]
    for key in dict.fromkeys((lowbit_moe_key(bits, E, D, F, lowrank), lowbit_moe_key(bits, E, D, F))):
        fits = {t: cfg for t, cfg in table.get(key, {}).items() if (t == "1") == (tokens == 1)}  # GEMV: one token only
        if fits:
            return _at_most(fits, tokens)
    return lowbit_moe_default(device, bits, E, D, F, tokens, top_k, lowrank, group)


def lowbit_moe_default(device: DeviceInfo, bits: int, E: int, D: int, F: int, tokens: int, top_k: int = 2,
                       lowrank: bool = False, group: int = 64) -> ExpertsConfig:
    """A config from the shapes and the GPU (the kinds of tile that won on an H100, sized for this one), by the rows
    an expert gets on average: one token, the GEMV (on Hopper with group-64 experts fed by TMA, many small programs);
    up to 2 rows, CUDA-core tiles of that many rows of x (a GEMV of 2 rows costs far less than a tensor-core tile of
    16); more, tensor-core tiles on dequantized groups with as many steps in flight as the shared memory holds, from
    WIDE_ROWS rows 128 weight rows a tile on 8 warps (down; gate_up too above 3 bits: at 3 bits its paired 32-row
    tile kept winning in the H200 table).
    gate_up is never split (SiLU needs whole sums); down splits K until its programs fill the GPU (one token with
    compensators: no split, the low-rank term would be added once per slice)."""
    average = -(-tokens * top_k // E)  # rows an expert gets on average
    active = min(E, top_k * tokens)  # experts with rows
    fill = FILL
    if tokens == 1 and device.hopper and group == 64:
        gate_up = down = LOWBIT_TMA
        fill = TMA_FILL
        down_programs = active * -(-D // (2 * down.BLOCK_N))  # the TMA down kernel's programs take 2 BLOCK_N rows
    elif tokens == 1:
        gate_up = down = LOWBIT_GEMV
        down_programs = active * -(-D // down.BLOCK_N)
    elif average <= 2:
        fit = 1 << (average - 1).bit_length()  # rows of x per tile; more rows than that: more chunks
        gate_up = LOWBIT_GEMV_ROWS.replace(BLOCK_M=fit)
        down = LOWBIT_GEMV.replace(BLOCK_M=1)
        down_programs = active * -(-D // down.BLOCK_N)
    else:
        x_rows = min(64, max(16, 1 << (average - 1).bit_length()))  # a tensor-core tile's rows of x
        # 16+ rows an expert: wider tiles of 8 warps (each dequantized weight serves more rows; H100 and H200 tables)
        wide = ((128, 0, 8),) if average >= WIDE_ROWS else ()
        gate_up = _piped_dot(device, group, x_rows, (wide if bits > 3 else ()) + (
            (32 if bits <= 3 else 64, 1, 4), (32, 0, 4), (16, 0, 4)))
        down = _piped_dot(device, group, x_rows, wide + ((64, 0, 4), (32, 0, 4), (16, 0, 4)))
        down_programs = active * -(-D // down.BLOCK_N)
    split = 1 if tokens == 1 and lowrank else split_for(down_programs, -(-F // down.BLOCK_K), device.sms, fill)
    return ExpertsConfig(gate_up.replace(SPLIT_K=1), down.replace(SPLIT_K=split))


def _piped_dot(device: DeviceInfo, group: int, x_rows: int,
               tiles: tuple[tuple[int, int, int], ...]) -> LowbitConfig:
    """LOWBIT_PIPED_DOT with the first (BLOCK_N, PAIRED, num_warps) of `tiles` of which two steps or more fit the
    shared memory (as many as fit, up to its 3); the plain tensor-core tile where none does or a step cannot hold
    whole groups."""
    for block_n, paired, warps in tiles:
        stages = pipe_stages(device, block_n * (1 + paired), LOWBIT_PIPED_DOT.BLOCK_K, LOWBIT_PIPED_DOT.PIPE, x_rows)
        if stages and LOWBIT_PIPED_DOT.BLOCK_K % group == 0:
            return LOWBIT_PIPED_DOT.replace(BLOCK_N=block_n, PIPE=stages, PAIRED=paired, num_warps=warps)
    return LOWBIT_DOT
