"""Compute kernels: routing, Triton GPU kernels (triton/), generated CPU kernels (cpu/)."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (the GPU kernels' dependency; CPU-only installs may lack it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_serves(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether a Triton inference kernel may take this call: x on CUDA, Triton importable, and no autograd through
    x or weight (the kernels have no backward)."""
    return x.is_cuda and triton_available() and not needs_grad(x, weight)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an op on these tensors (kernels without a backward must step aside)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1): no inline PTX there."""
    return os.environ.get("TRITON_INTERPRET") == "1"
