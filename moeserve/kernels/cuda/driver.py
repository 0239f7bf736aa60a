"""Loads PTX into the current CUDA context through the driver API (ctypes over libcuda) and launches its kernels on
torch's current stream, so CUDA graphs capture them like any other launch. No compiler at run time: the driver
compiles the PTX for the GPU it runs on (and caches it)."""

from __future__ import annotations

import ctypes
import functools

import torch

from moeserve.errors import MoeserveError


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise MoeserveError(f"the CUDA driver library libcuda.so.1 cannot be loaded: {exc}") from exc


def _check(rc: int, what: str) -> None:
    if rc:
        name = ctypes.c_char_p()
        _libcuda().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else rc}")


def _make_current(device: int) -> None:
    """Bind the device's primary context (the one torch uses) to this thread if no context is current."""
    lib = _libcuda()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        return
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class Module:
    """A PTX module loaded once per device; `function(name)` its kernels."""

    def __init__(self, ptx: str):
        self.ptx = ptx.encode() + b"\0"
        self._loaded: dict[int, ctypes.c_void_p] = {}
        self._functions: dict[tuple[int, str], ctypes.c_void_p] = {}

    def function(self, name: str, device: int) -> ctypes.c_void_p:
        key = (device, name)
        if key not in self._functions:
            with torch.cuda.device(device):
                torch.cuda.current_stream()  # torch's context exists
                _make_current(device)
                lib = _libcuda()
                if device not in self._loaded:
                    mod = ctypes.c_void_p()
                    _check(lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(self.ptx)), "cuModuleLoadData")
                    self._loaded[device] = mod
                fn = ctypes.c_void_p()
                _check(lib.cuModuleGetFunction(ctypes.byref(fn), self._loaded[device], name.encode()),
                       f"cuModuleGetFunction({name})")
                self._functions[key] = fn
        return self._functions[key]


Arg = torch.Tensor | int


def launch(fn: ctypes.c_void_p, grid: tuple[int, int, int], threads: int, args: tuple[Arg, ...],
           device: torch.device) -> None:
    """fn<<<grid, threads, 0, torch's current stream>>>(args): tensors as their data pointers, ints as int32."""
    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    stream = torch.cuda.current_stream(device).cuda_stream
    _make_current(device.index if device.index is not None else torch.cuda.current_device())
    _check(_libcuda().cuLaunchKernel(fn, *grid, threads, 1, 1, 0, ctypes.c_void_p(stream), params, None),
           "cuLaunchKernel")
