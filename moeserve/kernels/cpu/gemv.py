"""Low-bit y = x W^T on the CPU through the generated kernels: repacking once per weight, calling, and
the fallback decision used by QuantizedLinear.

Repacked layout (one-time, at the first CPU call): the pack.py words of output rows o..o+V-1 are
interleaved so that one vector load gives the same word of V rows ([out/V, words, V] int32); the fp16
scales and zeros likewise ([out/V, groups, V]). Outputs are padded to whole tiles with zero scales.
3-bit rows are first put unit after unit (pack.units_from_planar: a unit's three words side by side, where
pack.py stores them word-planar), so a kernel reads each 32-value unit from consecutive words at every width.
MXFP4 weights (pack_mxfp4_for_cpu) keep their checkpoint bytes as the words and their uint8 exponents as the scales.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from moeserve.kernels.cpu import build, codegen, pool, tuning
from moeserve.kernels.cpu.codegen_int8 import INT8_BITS
from moeserve.kernels.cpu.machine import INT8_ISA, ISAS, check_int8_dots, cpu_info, physical_cores
from moeserve.kernels.mxfp4_format import BLOCK
from moeserve.kernels.pack import pack, planar_from_units, units_from_planar
from moeserve.spec import ClampedSwiGLU

MAX_ROWS = 16  # more rows than this go to dequantize + BLAS matmul (compute bound by then)
TILE_SEARCH_BYTES = 512 << 20  # the tile search's weights: beyond the last-level caches of today's CPUs (300 MiB)


@dataclass
class PackedForCpu:
    """One weight in a kernel's layout: affine codes (fp16 scale and zero per group) or MXFP4 (E2M1 codes, a uint8
    E8M0 exponent per 32 values, no zero: `zero` None)."""

    words: torch.Tensor  # [out_pad / V, W, V] int32
    scale: torch.Tensor  # [out_pad / V, groups, V] float16, or uint8 (MXFP4)
    zero: torch.Tensor | None  # [out_pad / V, groups, V] float16; None for MXFP4
    out_features: int
    in_features: int
    bits: int
    group: int

    @property
    def mxfp4(self) -> bool:
        return self.zero is None

    @property
    def zero_ptr(self) -> int:
        """What the kernel's zero argument points at (MXFP4 kernels read none: the scales)."""
        return (self.scale if self.zero is None else self.zero).data_ptr()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scale, self.zero) if t is not None)

    def clone(self) -> PackedForCpu:
        """The same weight in other memory (benches rotate copies so the last-level cache holds none of them)."""
        return replace(self, words=self.words.clone(), scale=self.scale.clone(),
                       zero=None if self.zero is None else self.zero.clone())


class CpuKernel:
    """One compiled kernel: an ISA, a bit width and a register tile, for affine codes or (mxfp4) MXFP4 weights. The
    ISA INT8_ISA quantizes the inputs to int8 per 16 values and multiplies on VNNI's int8 dots (codegen_int8.py):
    about 0.5% relative error of one product, 1% of a gated expert, against the exact float kernels of the others."""

    def __init__(self, isa: str, bits: int, rows: int, vectors: int, mxfp4: bool = False):
        self.isa, self.bits, self.rows, self.vectors, self.mxfp4 = isa, bits, rows, vectors, mxfp4
        self.lanes = ISAS[isa][0]
        self.dll = build.load(build.build(codegen.generate(isa, bits, rows, vectors, mxfp4), isa))
        self.dll.moeserve_set_pool(*pool.entry_points())

    @property
    def tile_outputs(self) -> int:
        return self.lanes * self.vectors

    def __call__(self, x: torch.Tensor, packed: PackedForCpu, threads: int | None = None) -> torch.Tensor:
        """x [m, in] float32 -> y [m, out] float32."""
        x = x.contiguous()
        m = x.shape[0]
        n_vectors = packed.words.shape[0]
        y = torch.empty(m, n_vectors * self.lanes)
        kb = tuning.k_block(self.bits, self.tile_outputs, packed.group)
        rc = self.dll.qgemm(x.data_ptr(), m, x.shape[1], packed.in_features, packed.words.data_ptr(),
                            packed.scale.data_ptr(), packed.zero_ptr, packed.group, y.data_ptr(),
                            y.shape[1], n_vectors, kb, threads or torch.get_num_threads())
        if rc:
            raise RuntimeError(f"CPU kernel rejected its arguments (code {rc})")
        return y[:, :packed.out_features]


    def batch(self, x: torch.Tensor, rows: list[int], packed: list[PackedForCpu],
              threads: int | None = None) -> torch.Tensor:
        """x [sum(rows), in] float32, row blocks of rows[b] rows each through packed[b] (all of one shape) in one
        native call -> y [sum(rows), out] float32."""
        x = x.contiguous()
        first, n_vectors = packed[0], packed[0].words.shape[0]
        y = torch.empty(x.shape[0], n_vectors * self.lanes)
        starts = [0]
        for m in rows[:-1]:
            starts.append(starts[-1] + m)

        def pointers(values, ctype=ctypes.c_void_p):
            return (ctype * len(values))(*values)

        kb = tuning.k_block(self.bits, self.tile_outputs, first.group)
        rc = self.dll.qgemm_batch(
            len(rows), pointers([x[s].data_ptr() for s in starts]), pointers(rows, ctypes.c_int), x.shape[1],
            first.in_features, pointers([p.words.data_ptr() for p in packed]),
            pointers([p.scale.data_ptr() for p in packed]), pointers([p.zero_ptr for p in packed]), first.group,
            pointers([y[s].data_ptr() for s in starts]), y.shape[1], n_vectors, kb, threads or torch.get_num_threads())
        if rc:
            raise RuntimeError(f"CPU kernel rejected its arguments (code {rc})")
        return y[:, :first.out_features]


@dataclass
class LayerExperts:
    """A layer's E experts, repacked for one kernel, as the pointer arrays `moe_layer` reads (built once per layer),
    with their biases (float32, GPT-OSS) and gated activation (None: silu(gate) * up)."""

    gate_up: list[PackedForCpu]  # [E], out 2F (gate rows, then up rows)
    down: list[PackedForCpu]  # [E], out D
    arrays: tuple  # ctypes pointer arrays: gate_up words, scales, zeros, down words, scales, zeros, biases (or None)
    biases: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # [E] of [2F], [E] of [D] float32
    act: ClampedSwiGLU | None = None

    @classmethod
    def of(cls, gate_up: list[PackedForCpu], down: list[PackedForCpu],
           biases: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
           act: ClampedSwiGLU | None = None) -> "LayerExperts":
        def pointers(values):
            return (ctypes.c_void_p * len(values))(*values)

        if biases is not None:
            biases = tuple([b.float().contiguous() for b in part] for part in biases)
        arrays = tuple(pointers([get(p) for p in packs]) for packs in (gate_up, down)
                       for get in (lambda p: p.words.data_ptr(), lambda p: p.scale.data_ptr(), lambda p: p.zero_ptr))
        arrays += (None, None) if biases is None else tuple(pointers([b.data_ptr() for b in part]) for part in biases)
        return cls(gate_up, down, arrays, biases, act)

    @property
    def activation(self) -> tuple[int, float, float]:
        """(clamped, alpha, limit) as the native call takes them."""
        return (0, 0.0, 0.0) if self.act is None else (1, float(self.act.alpha), float(self.act.limit))


class PendingLayer:
    """A layer's CPU experts running on the native pool's helpers (moe_layer_start); result() waits for them. Holds
    the call's tensors until then (the native job reads and writes them)."""

    def __init__(self, kernel: "CpuKernel", handle: ctypes.c_void_p, out: torch.Tensor, keep: tuple):
        self.kernel, self.handle, self.out, self.keep = kernel, handle, out, keep

    def result(self) -> torch.Tensor:
        if self.handle is not None:
            self.kernel.dll.moe_layer_finish(self.handle)
            self.handle = self.keep = None
        return self.out


def moe_layer(kernel: CpuKernel, experts: LayerExperts, x: torch.Tensor, expert_ids: torch.Tensor,
              weights: torch.Tensor, mask: torch.Tensor | None = None, threads: int | None = None,
              start: bool = False) -> torch.Tensor | PendingLayer:
    """x [T, D] -> [T, D] float32: the sum over the pairs (t, j) (where mask [T, k] says so) of weights[t, j] times
    expert expert_ids[t, j] on x[t], every expert a gated FFN (model/experts.gated_ffn: the experts' biases and
    activation) of the layer's repacked low-bit or MXFP4 projections; one
    native call (kernel.moe_layer) on the calling thread and threads - 1 pool helpers. start: on `threads` helpers
    alone, returning at once a PendingLayer whose result() waits."""
    gu, dn = experts.gate_up[0], experts.down[0]
    T, k = expert_ids.shape
    x = x.float().contiguous()
    ids = expert_ids.to(torch.int64).contiguous()
    w = weights.float().contiguous()
    keep = mask.to(torch.uint8).contiguous() if mask is not None else None
    out = torch.empty(T, gu.in_features)
    kb_gu = tuning.k_block(kernel.bits, kernel.tile_outputs, gu.group)
    kb_dn = tuning.k_block(kernel.bits, kernel.tile_outputs, dn.group)
    args = (T, k, ids.data_ptr(), w.data_ptr(), keep.data_ptr() if keep is not None else None, len(experts.gate_up),
            x.data_ptr(), gu.in_features, dn.in_features, *experts.arrays[:3], gu.words.shape[0], kb_gu,
            *experts.arrays[3:6], dn.words.shape[0], kb_dn, gu.group, *experts.arrays[6:], *experts.activation,
            out.data_ptr(), threads or torch.get_num_threads())
    handle = ctypes.c_void_p()
    rc = kernel.dll.moe_layer_start(*args, ctypes.byref(handle)) if start else kernel.dll.moe_layer(*args)
    if rc:
        raise RuntimeError(f"CPU MoE kernel rejected its arguments (code {rc})")
    return PendingLayer(kernel, handle, out, (x, ids, w, keep, experts)) if start else out


def supports(in_features: int, group: int, bits: int) -> bool:
    """The kernels need whole 32-value units: inputs and group multiples of 32."""
    return bits in (2, 3, 4, 8) and in_features % 32 == 0 and group % 32 == 0 and in_features % group == 0


def pack_for_cpu(codes_or_words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
                 kernel: CpuKernel, packed_words: bool = False) -> PackedForCpu:
    """From uint8 codes [out, in] (or pack.py words [out, in*bits/32]) to the kernel's layout."""
    words = codes_or_words if packed_words else pack(codes_or_words, bits)
    if bits == 3:
        words = units_from_planar(words)  # word 3u + k = word k of unit u, as the kernels index it
    out, W = words.shape
    in_features = W * 32 // bits
    if not supports(in_features, group, bits):
        raise ValueError(f"CPU kernel needs inputs and group multiples of 32 (in={in_features}, group={group})")
    step = kernel.tile_outputs
    pad = -out % step
    V = kernel.lanes

    def interleave(t):  # [out, n] -> [out_pad / V, n, V]
        t = F.pad(t, (0, 0, 0, pad))
        return t.reshape(-1, V, t.shape[1]).transpose(1, 2).contiguous()

    return PackedForCpu(words=interleave(words), scale=interleave(scale.half()), zero=interleave(zero.half()),
                        out_features=out, in_features=in_features, bits=bits, group=group)


def packed_sizes(out_features: int, in_features: int, bits: int, group: int, kernel: CpuKernel) -> tuple[int, int, int]:
    """Bytes of the words, scale and zero pack_for_cpu makes of an [out, in] weight (rows padded to the kernel's
    output tile)."""
    rows = out_features + (-out_features % kernel.tile_outputs)
    groups = in_features // group
    return rows * (in_features * bits // 32) * 4, rows * groups * 2, rows * groups * 2


def unpacked_for_cpu(p: PackedForCpu) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_for_cpu's inverse for affine codes: (pack.py words [out, in*bits/32] int32 (3-bit: word-planar), scale,
    zero [out, groups] float16): the weight as a store holds it, from the kernel's layout (a permutation)."""
    def rows(t: torch.Tensor) -> torch.Tensor:  # [out_pad / V, n, V] -> [out, n]
        return t.transpose(1, 2).reshape(-1, t.shape[1])[:p.out_features].contiguous()

    words = rows(p.words)
    return (planar_from_units(words) if p.bits == 3 else words), rows(p.scale), rows(p.zero)


def pack_mxfp4_for_cpu(blocks: torch.Tensor, scales: torch.Tensor, kernel: CpuKernel) -> PackedForCpu:
    """From MXFP4 as the checkpoint ships it (blocks [out, in/32, 16] uint8, two E2M1 codes a byte, the low nibble
    first; scales [out, in/32] uint8 E8M0 exponents) to the layout of an mxfp4 kernel. Read as little-endian int32,
    a block's 16 bytes are 4 words holding its 32 codes at bits 4j of word i // 8: the 4-bit unit the generator
    reads, so the repack only interleaves rows (no code moves within a row). An exponent of 0 (2^-127, subnormal)
    reads as 0 and 255 (NaN in E8M0) as infinity: neither occurs in trained weights."""
    if not kernel.mxfp4:
        raise ValueError("pack_mxfp4_for_cpu needs an mxfp4 kernel")
    out, G, half = blocks.shape
    if half != BLOCK // 2 or scales.shape != (out, G) or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weight needs blocks [out, in/32, 16] and scales [out, in/32] uint8, got "
                         f"{tuple(blocks.shape)} {blocks.dtype} and {tuple(scales.shape)} {scales.dtype}")
    words = blocks.contiguous().view(torch.int32).reshape(out, G * 4)  # [out, in/8]
    pad = -out % kernel.tile_outputs
    V = kernel.lanes

    def interleave(t):  # [out, n] -> [out_pad / V, n, V]; padded rows: code 0 and exponent 0, so zeros
        t = F.pad(t, (0, 0, 0, pad))
        return t.reshape(-1, V, t.shape[1]).transpose(1, 2).contiguous()

    return PackedForCpu(words=interleave(words), scale=interleave(scales), zero=None, out_features=out,
                        in_features=G * BLOCK, bits=4, group=BLOCK)


# ---- tuning: the register tile is measured with the kernel itself (tuning.py holds the model and the store)


def search_tile(isa: str, rounds: int = 5, repeats: int = 6) -> tuple[int, int]:
    """Time each candidate tile (4-bit) on what a hybrid decode step runs: `moe_layer` over a layer of eight small
    experts (hidden 2304, FFN 768: about Qwen3-30B-A3B's), every expert on 1 and on 4 rows, weights read from DRAM
    (copies of the layer beyond the last-level cache, rotated), the pool's helpers pinned one per physical core as a
    hybrid run pins them; the tiles take turns, `rounds` rounds of `repeats` calls, so a passing state of the machine
    weighs on all alike. Keeps the lowest sum of the median times per row. Weights held in cache would reward the
    tiles with more rows (compute-bound there), which can read DRAM slower at one row (docs/kernels.md)."""
    g = torch.Generator().manual_seed(0)
    experts, hidden, ffn = 8, 2304, 768  # multiples of every tile's rows: one copy of the weights serves every tile

    def weight(out_f: int, in_f: int):
        return (torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8),
                torch.rand(out_f, in_f // 64, generator=g) * 0.01, torch.rand(out_f, in_f // 64, generator=g) * 15)

    cores = physical_cores()
    pool.configure(cores)  # helpers started from here on: pinned, as HybridRuntime pins them
    candidates = {tile: CpuKernel(isa, 4, *tile) for tile in tuning.register_tiles(isa)}
    first = next(iter(candidates.values()))
    gate_up = [pack_for_cpu(*weight(2 * ffn, hidden), 4, 64, first) for _ in range(experts)]
    down = [pack_for_cpu(*weight(hidden, ffn), 4, 64, first) for _ in range(experts)]
    n = max(2, TILE_SEARCH_BYTES // sum(p.nbytes for p in gate_up + down))
    layers = [LayerExperts.of(gate_up, down)] + [
        LayerExperts.of([p.clone() for p in gate_up], [p.clone() for p in down]) for _ in range(n - 1)]
    inputs = {m: (torch.randn(m, hidden, generator=g), torch.arange(experts).repeat(m, 1),  # [m, D], [m, E], [m, E]
                  torch.rand(m, experts, generator=g)) for m in (1, 4)}  # every expert on every row
    times, calls = {(tile, m): [] for tile in candidates for m in inputs}, 0
    for r in range(rounds):
        for tile, kernel in candidates.items():
            for m, (x, ids, gates) in inputs.items():
                for i in range(repeats + (r == 0)):  # the first call of a tile warms its code and the helpers
                    layer, calls = layers[calls % len(layers)], calls + 1  # every call on the next copy
                    t = time.perf_counter()
                    moe_layer(kernel, layer, x, ids, gates, threads=len(cores))
                    if r or i:
                        times[tile, m].append(time.perf_counter() - t)
    median = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
    timings = {f"{t[0]}x{t[1]}": round(1e3 * sum(median[t, m] / m for m in inputs), 4) for t in candidates}
    best = min(timings, key=timings.get)
    tile = tuple(int(v) for v in best.split("x"))
    tuning.store_tile(isa, tile, timings)
    return tile


def tile_for(isa: str) -> tuple[int, int]:
    """The stored tile for this CPU model and ISA, measuring it the first time (announced: it takes seconds)."""
    stored = tuning.stored_tile(isa)
    if stored:
        return stored
    print(f"[measuring the CPU kernels' register tile for {isa}: once per CPU model, then kept in "
          f"{tuning.tuning_file()}]", file=sys.stderr, flush=True)
    return search_tile(isa)


@functools.cache
def default_kernel(bits: int, mxfp4: bool = False, int8: bool = False) -> CpuKernel | None:
    """The best kernel for this CPU (tuned once per CPU model), or None with a one-time warning; mxfp4: the one of
    MXFP4 weights (bits 4). int8: the int8-activation kernel (a MoeserveError without VNNI) where the codes lie whole
    in bytes (2, 4, 8 bits, MXFP4); 3-bit weights keep the exact kernel."""
    if os.environ.get("MOESERVE_CPU_KERNELS", "1") == "0":
        return None
    if int8 and bits in INT8_BITS:
        check_int8_dots()
        isa = INT8_ISA
    else:
        isa = cpu_info().isas[0]
    try:
        return CpuKernel(isa, bits, *tile_for(isa), mxfp4=mxfp4)
    except (build.CompilerUnavailable, OSError) as e:
        _warn_once(str(e))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"moeserve: generated CPU kernels unavailable ({reason}); using the PyTorch path", stacklevel=3)


def applies(layer, x: torch.Tensor, rows: int | None) -> bool:
    """Whether quantized_linear takes rows rows like x through a generated kernel: a CPU tensor, at most MAX_ROWS
    rows (rows None: any number), a layout the kernels read, and a kernel that builds on this machine."""
    return (not x.is_cuda and (rows is None or rows <= MAX_ROWS)
            and supports(layer.in_features, layer.group, layer.bits) and default_kernel(layer.bits) is not None)


def packed_weight(layer, kernel: CpuKernel) -> PackedForCpu:
    """The layer's weight in the kernel's layout, repacked at the first call and kept on the layer (again when its
    buffers moved or another kernel reads it)."""
    key = (layer.qweight.data_ptr(), kernel.isa, kernel.tile_outputs)
    cached = getattr(layer, "_cpu_packed", None)
    if cached is None or cached[0] != key:
        packed = pack_for_cpu(layer.qweight, layer.scale, layer.zero, layer.bits, layer.group, kernel,
                              packed_words=True)
        layer._cpu_packed = cached = (key, packed)
    return cached[1]


def forget_packed(layer) -> None:
    """Drop the repacked weight packed_weight keeps on a layer: its buffers are about to hold another weight at the
    same address (a cache slot), which the kept copy's key cannot tell apart."""
    layer.__dict__.pop("_cpu_packed", None)


def quantized_linear(layer, x: torch.Tensor) -> torch.Tensor | None:
    """x @ dequant(W)^T through the generated kernel, or None when the kernel does not apply."""
    rows = x.numel() // layer.in_features
    if not applies(layer, x, rows):
        return None
    kernel = default_kernel(layer.bits)
    y = kernel(x.reshape(rows, layer.in_features).float(), packed_weight(layer, kernel))
    return y.reshape(*x.shape[:-1], layer.out_features).to(x.dtype)


def quantized_linear_batch(layers: list, x: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """Row blocks of x [sum(rows), in] (rows[b] rows each) through layers[b] (QuantizedLinear of one shape, no
    compensator; all with biases or none) in one native call, each block's bias added after it in torch ->
    [sum(rows), out] float32; None when the kernel does not read these layers (then each runs on its own). Blocks of
    any size: past a few rows the kernel is compute-bound, yet it beats dequantizing a whole expert's weight per call
    by far (bench/hybrid.py's prefill)."""
    first = layers[0]
    if not (all(m.rank == 0 and (m.bias is None) == (first.bias is None)
                and (m.bits, m.group, m.in_features, m.out_features) == (
                    first.bits, first.group, first.in_features, first.out_features) for m in layers)
            and applies(first, x, None)):
        return None
    kernel = default_kernel(first.bits)
    y = kernel.batch(x.float(), rows, [packed_weight(m, kernel) for m in layers])  # [sum(rows), out]
    if first.bias is None:
        return y
    return y + torch.cat([m.bias.float().expand(n, -1) for m, n in zip(layers, rows)])  # [sum(rows), out]
