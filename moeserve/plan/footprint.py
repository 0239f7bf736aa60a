"""The footprint ledger: the bytes a run takes, per device (gpu, host) and per part, counted one way for the
planner, the budget checks, the cache-slot sizing and `moeserve plan`'s table.

A run is described as data (`RunLayout`): the device of the dense part, the compute dtype, per MoE layer where its
routed experts live and at which precision (`LayerExperts`), the GPU copies of experts the caches and the prompt
streamer hold (`Slots`), and the KV cache (rows x tokens). `footprint(spec, run)` turns it into a `Footprint`.

Counted once here:
  a matrix at a precision   float (dtype bytes per weight); HQQ (`QuantizedLinear`: int32 words of rows padded to
                            whole packing units, an fp16 scale and zero per group); MXFP4 (a block of 32 weights is
                            16 bytes of 4-bit codes and one E8M0 scale byte: 17 bytes)
  an expert                 gate_up [2F, D] and down [D, F] at its precision, biases [2F] and [D] in the float dtype
                            where the family has them (GPT-OSS)
  the dense part            every parameter but the routed experts (embeddings, LM head, attention, norms, routers,
                            shared experts, dense FFNs) in the compute dtype, the linear layers quant/dense.py
                            converts as 8-bit HQQ copies under --dense-bits 8
  the KV cache              num_layers x rows x heads x tokens x dim per tensor: keys and values (GQA, a sliding
                            window or sinks change nothing: every layer keeps the whole context), or one tensor of
                            latents (MLA); spec.attention.kv_cache_entry gives heads, dim and whether values are apart
  the workspace             activations of the largest forward pass (`activation_bytes`); under a budget at least
                            WORKSPACE_SHARE of it, for the allocator's slack and the kernels' scratch, which no
                            shape formula sees
  the cuBLAS workspaces     torch gives each (cuBLAS handle, stream) its own workspace from the caching allocator:
                            one for the default stream, one more for the stream CUDA graphs are captured on
                            (kernels/cuda_graph.py); `blas_workspace_bytes` (32 MiB, Hopper's default, unless
                            CUBLAS_WORKSPACE_CONFIG sets it; older GPUs take less, so this over-counts there)

Parts: gpu {dense weights, resident experts, KV cache, cache slots, stream ring, workspace, cuBLAS workspaces}; host
{expert store, pinned staging}, and on a CPU run the model device's parts too. Parts of zero bytes are left out of the table.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace

from moeserve.errors import MoeserveError
from moeserve.hybrid.memory import ring_slots
from moeserve.hybrid.placement import HybridPlacement
from moeserve.kernels.pack import padded_length
from moeserve.offload.transfer import STAGING_CHUNK
from moeserve.quant.dense import DENSE_GROUP, dense_linears
from moeserve.spec import ModelSpec
from moeserve.units import format_bytes

WORKSPACE_SHARE = 0.05  # of a GPU budget kept free at least: allocator slack, kernel scratch (module docstring)
LOW_SHARE = 0.25  # of the expert memory an offload cache gives its low-precision slots
GPU, HOST = "gpu", "host"
HOPPER_BLAS_WORKSPACE = 4096 * 1024 * 8  # torch's default cuBLAS workspace on compute capability 9.0 and later


def blas_workspace_bytes() -> int:
    """One stream's cuBLAS workspace (module docstring): CUBLAS_WORKSPACE_CONFIG's `:KiB:COUNT` pairs summed when
    set, else Hopper's default."""
    pairs = re.findall(r":(\d+):(\d+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    return sum(int(kib) * 1024 * int(n) for kib, n in pairs) if pairs else HOPPER_BLAS_WORKSPACE


@dataclass(frozen=True)
class Precision:
    """How a weight matrix is stored. kind: float (dtype_bytes per weight), hqq (bits, group; fp16 scale and zero
    per group) or mxfp4 (blocks of 32, 17 bytes); dtype_bytes is also the size of the biases beside it."""

    kind: str
    dtype_bytes: int = 2
    bits: int = 16
    group: int = 64

    @classmethod
    def float(cls, dtype_bytes: int) -> Precision:
        return cls("float", dtype_bytes)

    @classmethod
    def hqq(cls, bits: int, group: int, dtype_bytes: int = 2) -> Precision:
        return cls("hqq", dtype_bytes, bits, group)

    @classmethod
    def mxfp4(cls, dtype_bytes: int) -> Precision:
        return cls("mxfp4", dtype_bytes, 4, 32)

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Bytes of a [rows, cols] weight matrix at this precision, without bias."""
        if self.kind == "float":
            return rows * cols * self.dtype_bytes
        if self.kind == "hqq":
            return rows * padded_length(cols) * self.bits // 8 + 2 * rows * (cols // self.group) * 2
        if self.kind == "mxfp4":
            return rows * (cols // 32) * 17
        raise MoeserveError(f"unknown weight precision {self.kind!r}")


def checkpoint_precision(spec: ModelSpec, dtype_bytes: int) -> Precision:
    """Resident experts as the checkpoint ships them: MXFP4 blocks kept packed (GPT-OSS), else the compute dtype."""
    return Precision.mxfp4(dtype_bytes) if spec.moe.experts_mxfp4 else Precision.float(dtype_bytes)


def expert_precision(bits: int, dtype_bytes: int, group: int = 64) -> Precision:
    """An expert copy at `bits` (16: float in the compute dtype, else HQQ with `group`)."""
    return Precision.float(dtype_bytes) if bits == 16 else Precision.hqq(bits, group)


def expert_bytes(spec: ModelSpec, precision: Precision) -> int:
    """One routed expert: gate_up [2F, D] and down [D, F] at `precision`, and their biases [2F], [D] where the family
    has them, in the precision's float dtype."""
    D, F = spec.hidden_size, spec.moe.expert_ffn
    bias = (2 * F + D) * precision.dtype_bytes if spec.moe.expert_bias else 0
    return precision.matrix_bytes(2 * F, D) + precision.matrix_bytes(D, F) + bias


def dense_bytes(spec: ModelSpec, dtype_bytes: int, bits: int = 16) -> int:
    """Everything but the routed experts in the compute dtype; bits 8: the linear layers quant/dense.py converts
    (dense_linears) as 8-bit HQQ copies instead."""
    total = spec.parameter_counts()["dense"] * dtype_bytes
    if bits == 16:
        return total
    low = Precision.hqq(bits, DENSE_GROUP)
    return total - sum(out * inp * dtype_bytes - low.matrix_bytes(out, inp)
                       for out, inp in (t.shape for t in dense_linears(spec)))


def kv_cache_bytes(spec: ModelSpec, rows: int, tokens: int, dtype_bytes: int) -> int:
    """A KV cache of `rows` sequences x `tokens` positions (model/kv_cache.py): per layer and token, heads x dim
    values, twice when values are kept apart from keys (MLA keeps one latent)."""
    heads, dim, separate = spec.attention.kv_cache_entry()
    return spec.num_layers * rows * heads * tokens * dim * (2 if separate else 1) * dtype_bytes


def engine_kv_rows(batch: int) -> int:
    """KV cache rows the engine allocates for `batch` sequences decoded together: SlotKVCache's rows and its spare
    row, which padded batch entries write to."""
    return batch + 1


def qkv_width(spec: ModelSpec) -> int:
    """Values the pre-attention hands on per token: the core's query of every head (spec.attention.core) and the
    new cache entry (GQA: keys and values; MLA: one latent)."""
    heads, dim, separate = spec.attention.kv_cache_entry()
    return spec.attention.num_heads * spec.attention.core()[0] + heads * dim * (2 if separate else 1)


def activation_bytes(spec: ModelSpec, tokens: int, logit_rows: int, dtype_bytes: int) -> int:
    """Activations of one forward pass of `tokens` tokens, `logit_rows` of them through the LM head: per token the
    hidden state, its residual, the norm's output and the attention output (4 D), the queries and new KV entry
    (roofline's qkv width), the widest FFN's gate and up outputs (top-k experts plus a shared one, or the dense
    FFN), in the compute dtype; and fp32 logits."""
    ffn = max(spec.moe.top_k * spec.moe.expert_ffn + spec.moe.shared_expert_ffn, spec.moe.dense_ffn)
    return tokens * (4 * spec.hidden_size + qkv_width(spec) + 2 * ffn) * dtype_bytes + logit_rows * spec.vocab_size * 4


@dataclass(frozen=True)
class LayerExperts:
    """Where one MoE layer's routed experts live: the copy the model device holds (None: none there) and the copies
    host RAM holds of each (a store's float and low-bit copies, the CPU kernels' repacked copy, pages read from a
    mapped store)."""

    layer: int
    resident: Precision | None = None
    host: tuple[Precision, ...] = ()


@dataclass(frozen=True)
class Slots:
    """`count` GPU copies of single experts at `precision`: a cache pool (part "cache slots") or the ring prompts
    stream experts through (part "stream ring")."""

    part: str
    count: int
    precision: Precision


@dataclass(frozen=True)
class RunLayout:
    """A run's placement as data. device: where the dense part, the KV cache and resident experts live (cuda or cpu);
    kv_rows x kv_tokens: the KV cache allocated; pass_tokens / logit_rows: the largest forward pass (workspace);
    budget: the GPU budget the workspace's floor is a share of (None: no budget); staging: pinned host bytes the
    copier stages pageable sources through; blas_workspaces: the cuBLAS workspaces the run's GPU holds (2: decode in
    CUDA graphs, 1: without graphs, 0: no GPU)."""

    device: str
    dtype_bytes: int
    kv_rows: int
    kv_tokens: int
    dense_bits: int = 16
    experts: tuple[LayerExperts, ...] = ()
    slots: tuple[Slots, ...] = ()
    pass_tokens: int = 1
    logit_rows: int = 1
    budget: int | None = None
    staging: int = 0
    blas_workspaces: int = 2


@dataclass(frozen=True)
class Footprint:
    """Bytes per device per part (module docstring); zero parts are kept, the table leaves them out."""

    gpu: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def table(self) -> list[tuple[str, str, int]]:
        """(device, part, bytes) of every part that takes bytes, then a total row per device that has any."""
        rows = []
        for device, parts in ((GPU, self.gpu), (HOST, self.host)):
            kept = [(device, part, n) for part, n in parts.items() if n]
            rows += kept + ([(device, "total", sum(parts.values()))] if kept else [])
        return rows


def footprint(spec: ModelSpec, run: RunLayout) -> Footprint:
    """The bytes `run` takes (module docstring)."""
    main = {"dense weights": dense_bytes(spec, run.dtype_bytes, run.dense_bits),
            "resident experts": sum(spec.moe.experts_at(e.layer) * expert_bytes(spec, e.resident)
                                    for e in run.experts if e.resident is not None)}
    slots = {part: sum(s.count * expert_bytes(spec, s.precision) for s in run.slots if s.part == part)
             for part in ("cache slots", "stream ring")}
    main["KV cache"] = kv_cache_bytes(spec, run.kv_rows, run.kv_tokens, run.dtype_bytes)
    activations = activation_bytes(spec, run.pass_tokens, run.logit_rows, run.dtype_bytes)
    host = {"expert store": sum(spec.moe.experts_at(e.layer) * sum(expert_bytes(spec, p) for p in e.host)
                                for e in run.experts), "pinned staging": run.staging}
    gpu = {**main, **slots}
    if run.device != "cuda":  # the model device's parts are in host RAM
        return Footprint({}, {**gpu, "workspace": activations, **host})
    floor = 0 if run.budget is None else int(run.budget * WORKSPACE_SHARE)
    blas = blas_workspace_bytes() * run.blas_workspaces
    return Footprint({**gpu, "workspace": max(activations, floor), "cuBLAS workspaces": blas}, host)


def minimum_budget(without_workspace: int, activations: int) -> int:
    """The smallest GPU budget holding `without_workspace` bytes and the workspace (module docstring): the larger of
    the bytes plus the activations and the bytes over (1 - WORKSPACE_SHARE)."""
    return max(without_workspace + activations, int(without_workspace / (1 - WORKSPACE_SHARE)) + 1)


def gpu_room(spec: ModelSpec, run: RunLayout) -> int:
    """GPU bytes of run.budget left over by the run's footprint (negative: short by that much)."""
    return run.budget - footprint(spec, run).gpu_total


def gpu_minimum(spec: ModelSpec, run: RunLayout, extra: int = 0) -> int:
    """The smallest GPU budget that holds the run and `extra` bytes more (the workspace at that budget)."""
    need = footprint(spec, replace(run, budget=None))
    activations = need.gpu["workspace"]
    return minimum_budget(need.gpu_total - activations + extra, activations)


# ---- layouts of the run paths ------------------------------------------------------------------------


def resident_layout(spec: ModelSpec, device: str, dtype_bytes: int, kv_rows: int, kv_tokens: int,
                    dense_bits: int = 16, precision: Precision | None = None, budget: int | None = None,
                    experts: bool = True) -> RunLayout:
    """Every routed expert on the model device at `precision` (None: the checkpoint's); experts False: none
    (the dense part alone, what every placement needs)."""
    p = precision or checkpoint_precision(spec, dtype_bytes)
    layers = tuple(LayerExperts(i, p) for i in spec.moe.layer_indices()) if experts else ()
    return RunLayout(device, dtype_bytes, kv_rows, kv_tokens, dense_bits, layers, budget=budget)


def hybrid_layout(spec: ModelSpec, placement: HybridPlacement, device: str, dtype_bytes: int, kv_rows: int,
                  kv_tokens: int, low_bits: int, group: int, dense_bits: int = 16, streams: bool = False,
                  mapped_float_bytes: int | None = None, budget: int | None = None) -> RunLayout:
    """The hybrid backend's placement. Resident layers hold the checkpoint's experts (low-bit runs: the store's
    low-bit copies); host RAM holds, for a store built in RAM now (mapped_float_bytes None), every copy it is built
    with for the layers it holds (hybrid/setup.py store_layers; float copies in the compute dtype), or for a mapped
    store the pages the CPU reads (its float copies at mapped_float_bytes per weight) and a compute-dtype copy of
    those when the dtypes differ; a store built from an MXFP4 checkpoint for a float run keeps its experts packed as
    shipped. Low-bit and packed MXFP4 experts the CPU runs are also repacked once for its kernels. The GPU cache
    slots and the stream ring (streams) hold the precision the experts run at (MXFP4: packed)."""
    packed = spec.moe.experts_mxfp4 and mapped_float_bytes is None and not placement.low
    high = None if placement.low else Precision.mxfp4(dtype_bytes) if packed else Precision.float(dtype_bytes)
    low = (Precision.hqq(low_bits, group, mapped_float_bytes or dtype_bytes)  # biases as the store's floats
           if placement.needs_low_copies else None)
    run_at = low if placement.low else high
    cpu, stored = set(placement.cpu_layers), set(placement.moe_layers if placement.low else placement.cpu_layers)
    layers = []
    for i in placement.moe_layers:
        if mapped_float_bytes is None:
            copies = (high, low) if i in stored else ()
        else:
            read = None if placement.low else Precision.float(mapped_float_bytes)
            copies = (read, low, high if mapped_float_bytes != dtype_bytes else None) if i in cpu else ()
        copies += (low, high if packed else None) if i in cpu else ()  # the CPU kernels' repacked copies
        resident = None if i in cpu else (run_at if placement.low else checkpoint_precision(spec, dtype_bytes))
        layers.append(LayerExperts(i, resident, tuple(p for p in copies if p is not None)))
    slots = [Slots("cache slots", placement.cache_slots, run_at)]
    if streams and placement.cpu_layers:
        slots.append(Slots("stream ring", ring_slots(expert_bytes(spec, run_at), spec.moe.num_experts), run_at))
    return RunLayout(device, dtype_bytes, kv_rows, kv_tokens, dense_bits, tuple(layers), tuple(slots),
                     budget=budget)


def offload_layout(spec: ModelSpec, dtype_bytes: int, kv_rows: int, kv_tokens: int, high_slots: int,
                   low_slots: int, low: Precision | None, dense_bits: int = 16, budget: int | None = None,
                   pinned: bool = True) -> RunLayout:
    """HOBBIT's offload: every expert in a host store (float copies, and low-bit ones when `low`), high_slots float
    and low_slots low-bit GPU cache slots; a store that is not pinned is staged through the copier's two pinned
    chunks."""
    high = Precision.float(dtype_bytes)
    layers = tuple(LayerExperts(i, None, (high,) + ((low,) if low else ())) for i in spec.moe.layer_indices())
    slots = (Slots("cache slots", high_slots, high),) + ((Slots("cache slots", low_slots, low),) if low else ())
    return RunLayout("cuda", dtype_bytes, kv_rows, kv_tokens, dense_bits, layers, slots, budget=budget,
                     staging=0 if pinned else 2 * STAGING_CHUNK)


def plan_slots(spec: ModelSpec, base: RunLayout, high: int, low: int, reserve: int = 0,
               max_slots: int | None = None, low_share: float = LOW_SHARE) -> tuple[int, int]:
    """(high, low) cache capacities that fit base.budget beside `base` (the dense part and KV cache, no expert on
    the GPU), after `reserve` extra slots per pool (the cache's room for experts used once); high / low: bytes of
    one slot of each pool (low 0: no low pool). An error naming the minimum if not even the reserve fits;
    max_slots: no pool gets more slots than there are experts to hold."""
    fixed = reserve * (high + low)
    left = gpu_room(spec, base) - fixed
    if left < (0 if reserve else high):
        need = gpu_minimum(spec, base, fixed + (0 if reserve else high))
        raise MoeserveError(f"memory budget {format_bytes(base.budget)} is too small: non-expert weights, KV cache "
                            f"and {max(reserve, 1)} expert(s) in flight need {format_bytes(need)}; give at least that")
    n_low = int(left * low_share // low) if low else 0
    n_high = int((left - n_low * low) // high)
    if max_slots is not None:
        n_high, n_low = min(n_high, max_slots), min(n_low, max_slots)
    return n_high, n_low
