"""Compute kernels: routing, Triton GPU kernels (triton/), generated CPU kernels (cpu/)."""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (the GPU kernels' dependency; CPU-only installs may lack it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
