"""Compute kernels: routing, Triton GPU kernels (triton/), generated CPU kernels (cpu/)."""

from __future__ import annotations

import functools
import os


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (the GPU kernels' dependency; CPU-only installs may lack it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1): no inline PTX there."""
    return os.environ.get("TRITON_INTERPRET") == "1"
