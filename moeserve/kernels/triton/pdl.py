"""Programmatic dependent launch (Hopper and later): a decode kernel launches while the kernel before it finishes.

Decoding one token runs hundreds of launches, many of them tiny (router, prepare_x, combine) and the rest a few tens
of microseconds; between two of them the GPU idles for the next launch. A kernel launched with launch_pdl may be
scheduled before the previous kernel completes; after_previous, at its top before it touches memory, waits
(griddepcontrol.wait) until that kernel has completed and its writes are visible, so the stream's order of reads and
writes is kept and only launch latency overlaps. It also lets the next kernel launch at once (launch_dependents),
which takes effect when all of this kernel's programs have started, i.e. in the last wave.

H100, Mixtral-8x7B-shaped decode in a CUDA graph (bench/lowbit_decode.py, one machine): 4-bit 154 -> 171 tok/s,
3-bit + rank-32 compensators 128 -> 130. The compensators' x V^T (skinny.py) stays out: launched early behind a big
kernel it cost up to 25 us a block (3-bit + rank 32 decode 124 tok/s with it), cause not found.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from moeserve.kernels import triton_interpreting

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # Triton before 3.4: no PDL
    HAS_GDC = False

ENV = "MOESERVE_PDL"  # "0" turns it off (A/B benchmarks, debugging)


@functools.cache
def _hopper_index(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def hopper(device: torch.device) -> bool:
    """Whether a CUDA device has compute capability 9.0 or later (PDL, TMA); asked once per device."""
    return _hopper_index(device.index if device.index is not None else torch.cuda.current_device())


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch dependent: CUDA with compute capability >= 9.0, a Triton with grid
    dependency control, not the interpreter, and not switched off with MOESERVE_PDL=0."""
    return (device.type == "cuda" and HAS_GDC and not triton_interpreting() and os.environ.get(ENV, "1") != "0"
            and hopper(device))


def dependent_launch(device: torch.device) -> dict:
    """The PDL constexpr and launch option for a kernel that calls after_previous(PDL) first."""
    return dict(PDL=True, launch_pdl=True) if pdl_enabled(device) else dict(PDL=False)


@triton.jit
def after_previous(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one to complete (no-op without PDL)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
