"""QuantizedLinear: packed low-bit weight + group scale/zero + optional low-rank compensator (U, V).

forward(x) = x @ dequant(W)^T + (x @ V^T) @ U^T (+ bias). On a CPU, up to 16 rows go through the
generated low-bit kernels (kernels/cpu); on a GPU, up to 64 rows through the Triton low-bit kernel, with
the compensator's U^T applied in its epilogue; otherwise the plain-PyTorch path dequantizes the weight on
every call (and is the reference).

GPU compensators are dequantized once into the activation dtype and cached: (out + in) * r * 2 bytes per
layer in bf16 (int8/int3 storage is 2x/5x smaller than that cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels import needs_grad, triton_serves
from moeserve.kernels.cpu import gemv as cpu_gemv
from moeserve.kernels.pack import pack, padded_length, unpack
from moeserve.kernels.routing import slot_order_pays
from moeserve.model.experts import LoopedExperts, glu
from moeserve.quant import milo
from moeserve.quant.hqq import QuantizedWeight, dequantize
from moeserve.spec import ClampedSwiGLU

# Triton kernel modules are imported inside the functions that launch them: Triton is optional (triton_available).

LOWBIT_PATHS = ("lowbit_slots", "lowbit_sorted")
# GPU: up to this many rows dequantize in registers (Triton lowbit_linear, a weight pass per 64 rows); more: weight()
# + cuBLAS. bench/lowbit_rows.py on an H200: equal near 700-1000 rows for Mixtral's experts, 5x apart at 128.
TRITON_MAX_ROWS = 512
# tokens the fused low-bit MoE (lowbit_experts) takes: a prompt chunk too (its tiles walk an expert's rows 64 at a
# time, no host sync); more: the per-expert loop (each expert's rows through weight() + cuBLAS)
FUSED_MOE_MAX_TOKENS = TRITON_MAX_ROWS


def triton_applies(x: torch.Tensor, rows: int, bits: int, group: int, in_features: int,
                   max_rows: int = TRITON_MAX_ROWS) -> bool:
    """CUDA activations of a float dtype, at most max_rows rows, no autograd through x (the kernels have no
    backward), and a layout the Triton low-bit kernels read."""
    if not (rows <= max_rows and triton_serves(x)):
        return False
    from moeserve.kernels.triton.lowbit import DTYPES, supported

    return x.dtype in DTYPES and supported(bits, group) and in_features % group == 0


class QuantizedLinear(nn.Module):
    # True for a module over a cache slot's buffers, which other experts are copied into at the same addresses: its
    # compensator is dequantized on every call instead of cached by address (cached_compensator)
    reloaded = False

    def __init__(self, in_features: int, out_features: int, bits: int, group: int, rank: int = 0,
                 compensator_bits: int = 16, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group, self.rank, self.compensator_bits = bits, group, rank, compensator_bits
        n_groups = in_features // group
        packed_len = padded_length(in_features) * bits // 32
        self.register_buffer("qweight", torch.empty(out_features, packed_len, dtype=torch.int32))
        self.register_buffer("scale", torch.empty(out_features, n_groups, dtype=torch.float16))
        self.register_buffer("zero", torch.empty(out_features, n_groups, dtype=torch.float16))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if rank:
            for name, t in milo.compensator_buffers(out_features, in_features, rank, compensator_bits).items():
                self.register_buffer(name, t)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, compensator: dict[str, torch.Tensor] | None = None,
                       rank: int = 0, compensator_bits: int = 16, bias: torch.Tensor | None = None):
        out_features, in_features = qw.shape
        m = cls(in_features, out_features, qw.bits, qw.group, rank, compensator_bits, bias is not None)
        m.qweight = pack(F.pad(qw.codes, (0, padded_length(in_features) - in_features)), qw.bits)
        m.scale, m.zero = qw.scale.to(torch.float16), qw.zero.to(torch.float16)
        if bias is not None:
            m.bias = nn.Parameter(bias, requires_grad=False)
        for name, t in (compensator or {}).items():
            setattr(m, name, t)
        return m

    # ---- compute -----------------------------------------------------------------------------
    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized weight [out, in] (without the compensator): on a GPU in one Triton pass where it reads the
        width (2/4/8 bits), else through pack.unpack (the same values)."""
        if triton_serves(self.qweight):
            from moeserve.kernels.triton.lowbit import DEQUANT_BITS, lowbit_dequantize, supported

            if self.bits in DEQUANT_BITS and supported(self.bits, self.group):
                return lowbit_dequantize(self.qweight, self.scale, self.zero, self.bits, self.group, self.in_features,
                                         dtype)
        codes = unpack(self.qweight, self.bits, padded_length(self.in_features))[:, :self.in_features]  # [out, in] uint8
        qw = QuantizedWeight(codes=codes, scale=self.scale, zero=self.zero, bits=self.bits, group=self.group,
                             shape=(self.out_features, self.in_features))
        return dequantize(qw, dtype)

    def compensator(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(U [out, r], V [r, in]) in `dtype`, or None without a compensator."""
        if not self.rank:
            return None
        bufs = {n: getattr(self, n) for n in milo.compensator_buffers(1, 1, 1, self.compensator_bits)}
        u, v = milo.compensator_from_buffers(bufs, self.compensator_bits, self.out_features, self.in_features,
                                             self.rank)
        return u.to(dtype), v.to(dtype)

    def cached_compensator(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """compensator(dtype), dequantized once per (dtype, storage) and kept (see the module docstring)."""
        if not self.rank:
            return None
        if self.reloaded:
            return tuple(t.contiguous() for t in self.compensator(dtype))
        key = (dtype, self.comp_v.data_ptr() if self.compensator_bits == 16 else self.comp_v_q.data_ptr())
        cached = getattr(self, "_uv_cache", None)
        if cached is None or cached[0] != key:
            self._uv_cache = cached = (key, tuple(t.contiguous() for t in self.compensator(dtype)))
        return cached[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_applies(x, x.numel() // self.in_features, self.bits, self.group, self.in_features):
            from moeserve.kernels.triton.lowbit import lowbit_linear

            y = lowbit_linear(x, self.qweight, self.scale, self.zero, self.bits, self.group, self.in_features,
                              lowrank=self.cached_compensator(x.dtype))
            return y if self.bias is None else y + self.bias.to(y.dtype)
        y = cpu_gemv.quantized_linear(self, x)  # generated CPU kernel for a few rows, else None
        if y is None:
            y = F.linear(x, self.weight(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        uv = self.compensator(x.dtype)
        if uv is not None:
            y = y + F.linear(F.linear(x, uv[1]), uv[0])  # (x V^T) U^T
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group}, "
                f"rank={self.rank}, compensator_bits={self.compensator_bits}")


class QuantizedExperts(LoopedExperts):
    """An expert backend over per-expert QuantizedLinear pairs (ranks may differ per expert).

    On CUDA, for decode-sized batches, when all experts share bits and group: the Triton low-bit fused MoE
    over stacked weights. Stacking happens on first use; each expert's buffers then become views into the
    stack (no second copy). Compensators are zero-padded to the largest rank and cached in the activation
    dtype (cost: E * r_max * (N + K) * 2 bytes per projection in bf16)."""

    def __init__(self, gate_up: list[QuantizedLinear], down: list[QuantizedLinear], act: ClampedSwiGLU | None = None):
        """act: the gated activation (None: silu(gate) * up; GPT-OSS's clamped SwiGLU, with biases in the layers)."""
        super().__init__()
        self.num_experts, self.act = len(gate_up), act
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self._stacked = None
        self._mma = None

    def expert_ffn(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return self.down[e](glu(self.gate_up[e](rows), self.act))

    def kernel_path(self, x: torch.Tensor, num_tokens: int, expert_weights: torch.Tensor | None = None) -> str:
        """The path: on CUDA when all experts share bits and group, the Triton low-bit fused MoE, for one token in
        slot order ("lowbit_slots": no routing table and no gather, two launches fewer per layer; not under
        autograd through the gate weights, which its combine has no backward for), else over expert-sorted rows
        ("lowbit_sorted"; biases and GPT-OSS's clamped SwiGLU in its epilogues); elsewhere the per-expert loop, with
        the generated CPU kernels where they read this layout on this machine ("cpu_lowbit"), else "loop"."""
        layouts = {(m.bits, m.group, m.in_features): m for m in (*self.gate_up, *self.down)}.values()  # one each
        uniform = len({(m.bits, m.group) for m in layouts}) == 1
        if uniform and all(triton_applies(x, num_tokens, m.bits, m.group, m.in_features, FUSED_MOE_MAX_TOKENS)
                           for m in layouts):
            slots = slot_order_pays(num_tokens) and (expert_weights is None or not needs_grad(expert_weights))
            return "lowbit_slots" if slots else "lowbit_sorted"
        return "cpu_lowbit" if all(cpu_gemv.applies(m, x, 1) for m in layouts) else "loop"

    def stacked(self, dtype: torch.dtype):
        """(gate_up, down) StackedLowbit, rebuilt when the weights moved or the activation dtype changed."""
        from moeserve.kernels.triton.lowbit import StackedLowbit

        def key():  # stacking moves the buffers, so this is read again after it
            return dtype, self.gate_up[0].qweight.data_ptr(), self.down[0].qweight.data_ptr()

        if self._stacked is None or self._stacked[0] != key():
            stacks = tuple(StackedLowbit(**stack_layers(mods, dtype)) for mods in (self.gate_up, self.down))
            self._stacked = (key(), stacks)
        return self._stacked[1]

    def x_preparation(self, x: torch.Tensor, top_k: int):
        """How the lowbit_slots path will read x (a Preparation: MoEBlock has the router's launch prepare it), or
        None (another path, or one that reads x itself)."""
        if self.kernel_path(x, x.shape[0]) != "lowbit_slots" or self.gate_up[0].bias is not None:
            return None  # with biases one token takes the kernels that prepare x themselves, not the TMA path
        from moeserve.kernels.triton.lowbit import x_preparation

        return x_preparation(x, *self.stacked(x.dtype), top_k)

    def one_token(self, x: torch.Tensor, router) -> torch.Tensor | None:
        """The one-token layer path (kernels/triton/one_token.lowbit_one_token) where a call takes "lowbit_slots"."""
        if self.kernel_path(x, 1) != "lowbit_slots":
            return None
        from moeserve.kernels.triton.one_token import lowbit_one_token

        return lowbit_one_token(x, router, *self.stacked(x.dtype), act=self.act)[0]

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                prepared_x: torch.Tensor | None = None) -> torch.Tensor:
        """As kernel_path says; in slot order the kernels find each routed expert's slots among the ids.
        prepared_x: x prepared as x_preparation said (by the router's launch)."""
        if self.kernel_path(x, x.shape[0], expert_weights) != "lowbit_slots":
            return super().forward(x, expert_ids, expert_weights)
        from moeserve.kernels.triton.lowbit import lowbit_experts
        from moeserve.kernels.triton.routing_table import gather_combine

        y = lowbit_experts(x, *self.stacked(x.dtype), expert_ids, prepared_x=prepared_x,
                           act=self.act)  # [k, D] fp32, slot order
        return gather_combine(y, None, expert_weights, expert_ids.shape[1], x.dtype)

    def mma_experts(self, x: torch.Tensor, num_tokens: int):
        """The experts in the 4-bit MMA kernels' layout (kernels/cuda/w4_moe.py, built once, beside the packed
        copy) when those kernels take this call: switched on, 2..MAX_ROWS tokens of 16-bit x on an Ampere+ GPU,
        4-bit experts of whole 64-input groups with no biases, compensators or clamped SwiGLU; else None."""
        from moeserve.kernels.cuda import w4_moe

        if not (w4_moe.enabled() and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and self.act is None
                and 2 <= num_tokens <= w4_moe.MAX_ROWS and not needs_grad(x)):
            return None
        gate_up, down = self.stacked(x.dtype)
        shape = (gate_up.qweight.shape[1], down.qweight.shape[1])  # (2F, D)
        biased = gate_up.bias is not None or down.bias is not None
        lowrank = gate_up.u is not None or down.u is not None
        if not (w4_moe.applies(gate_up.bits, gate_up.group, shape, gate_up.in_features, biased, lowrank)
                and w4_moe.usable(x.device.index or 0)):
            return None
        key = (gate_up.qweight.data_ptr(), down.qweight.data_ptr())
        if self._mma is None or self._mma[0] != key:
            self._mma = (key, w4_moe.W4Experts(*(
                w4_moe.W4Projection.of(p.qweight, p.scale, p.zero, p.group, p.in_features, gate_up=p is gate_up)
                for p in (gate_up, down))))
        return self._mma[1]

    def run_sorted(self, x_sorted: torch.Tensor, table) -> torch.Tensor:
        if self.kernel_path(x_sorted, table.num_tokens) not in LOWBIT_PATHS:  # slots: forward's autograd fallback
            return super().run_sorted(x_sorted, table)
        mma = self.mma_experts(x_sorted, table.num_tokens)
        if mma is not None:
            from moeserve.kernels.cuda.w4_moe import w4_experts

            return w4_experts(x_sorted, mma, table.offsets, table.num_tokens,
                              x_sorted.shape[0] // table.num_tokens)  # [T*k, D] fp32
        from moeserve.kernels.triton.lowbit import lowbit_experts

        return lowbit_experts(x_sorted, *self.stacked(x_sorted.dtype), table, act=self.act)  # [T*k, D] fp32


def stack_layers(mods: nn.ModuleList, dtype: torch.dtype) -> dict:
    """Stack the experts' packed buffers (and re-point each expert's buffers to views of the stack), their
    compensators zero-padded to the largest rank and their biases (copies): the fields of a StackedLowbit."""
    stacks = {}
    for name in ("qweight", "scale", "zero"):
        stacks[name] = torch.stack([getattr(m, name) for m in mods])  # [E, N, ...]
        for e, m in enumerate(mods):
            setattr(m, name, stacks[name][e])
    first = mods[0]
    r = max(m.rank for m in mods)
    u = v = None
    if r:
        E, N, K = len(mods), first.out_features, first.in_features
        u = torch.zeros(E, N, r, dtype=dtype, device=first.qweight.device)  # [E, N, r]
        v = torch.zeros(E, r, K, dtype=dtype, device=first.qweight.device)  # [E, r, K]
        for e, m in enumerate(mods):
            if m.rank:
                u[e, :, :m.rank], v[e, :m.rank] = m.compensator(dtype)
        v = v.reshape(E * r, K)
    bias = None if first.bias is None else torch.stack([m.bias.detach() for m in mods])  # [E, N]
    return dict(**stacks, bits=first.bits, group=first.group, in_features=first.in_features, u=u, v=v, bias=bias)
