"""Performance model for the CPU kernels (QIGen): register tile from the register count, measured among
a few candidates once per CPU model (the measuring, `gemv.search_tile`, lives with the kernel it times),
and the input block from the L1 size.

Register tile (m_u rows x t_u output vectors): m_u broadcasts of x, t_u weight vectors and two
accumulator sets (per group and total, for the s_g (<x,q> - z <x,1>) factorisation) must fit:
m_u + 2 m_u t_u + t_u <= vector registers; the int8-activation kernels (INT8_ISA) hold a third set, the int32 dots
of a unit: m_u + 3 m_u t_u + t_u. The non-dominated tiles are timed on 4-bit weights read from
DRAM at 1 and 4 rows (hybrid decoding's case) and the fastest is stored in `cache_dir()/tuning.json`
under the CPU model and ISA.

Cache block (m_b inputs x t_b outputs): 32 m_b + b m_b t_b + 32 t_b <= L1 bits, t_b = the tile's outputs,
m_b a multiple of the group size.
"""

from __future__ import annotations

import json
import os

from moeserve.kernels.cpu.build import cache_dir
from moeserve.kernels.cpu.machine import INT8_ISA, ISAS, cpu_info

MAX_TILE_VECTORS = 4
MAX_TILE_ROWS = 8
TILE_SEARCH = "dram, 1+4 rows"  # what the stored tiles were timed on: other entries are measured again


def register_tiles(isa: str) -> list[tuple[int, int]]:
    """Non-dominated (rows, vectors) tiles that fit the register file of `isa`."""
    regs, sets = ISAS[isa][1], 3 if isa == INT8_ISA else 2
    fits = [(m, t) for m in range(1, MAX_TILE_ROWS + 1) for t in range(1, MAX_TILE_VECTORS + 1)
            if m + sets * m * t + t <= regs]
    return [(m, t) for m, t in fits if not any(m2 >= m and t2 >= t and (m2, t2) != (m, t) for m2, t2 in fits)]


def k_block(bits: int, tile_outputs: int, group: int, l1_bytes: int | None = None) -> int:
    """Largest m_b (a multiple of `group`) with 32 m_b + bits m_b t_b + 32 t_b <= L1 bits."""
    l1_bits = 8 * (l1_bytes or cpu_info().l1d_bytes)
    m_b = (l1_bits - 32 * tile_outputs) // (32 + bits * tile_outputs)
    return max(group, m_b // group * group)


def tuning_file():
    return cache_dir() / "tuning.json"


def stored_tile(isa: str) -> tuple[int, int] | None:
    """The tile stored for this CPU model and ISA by the current search (TILE_SEARCH), else None."""
    try:
        entry = json.loads(tuning_file().read_text())[cpu_info().model][isa]
        if entry.get("search") != TILE_SEARCH:
            return None
        return int(entry["rows"]), int(entry["vectors"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def store_tile(isa: str, tile: tuple[int, int], timings: dict) -> None:
    path = tuning_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data.setdefault(cpu_info().model, {})[isa] = {"rows": tile[0], "vectors": tile[1], "timings_ms": timings,
                                                  "search": TILE_SEARCH}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
