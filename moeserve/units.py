"""Byte sizes as people write them ("512KB", "4MiB", "20GiB") and as we print them."""

from __future__ import annotations

import re

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int | None:
    """'4MiB' -> 4194304; None when `text` is not a size."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]i?b|b)", text.strip().lower())
    return int(float(m.group(1)) * UNITS[m.group(2)]) if m else None


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
