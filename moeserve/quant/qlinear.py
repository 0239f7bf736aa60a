"""QuantizedLinear: packed low-bit weight + group scale/zero + optional low-rank compensator (U, V).

forward(x) = x @ dequant(W)^T + (x @ V^T) @ U^T (+ bias). On a CPU, up to 16 rows go through the
generated low-bit kernels (kernels/cpu); on a GPU, up to 64 rows of 2/4/8-bit weights through the
Triton low-bit linear;
otherwise the plain-PyTorch path dequantizes the weight on every call (and is the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.cpu import gemv as cpu_gemv
from moeserve.model.experts import LoopedExperts, swiglu, triton_available
from moeserve.quant import milo
from moeserve.quant.hqq import QuantizedWeight, dequantize
from moeserve.quant.pack import pack, padded_length, unpack

TRITON_MAX_ROWS = 64  # GPU: up to this many rows dequantize in registers (Triton); more: dequantize + cuBLAS
TRITON_BITS = (2, 4, 8)  # 3-bit unpacking in the Triton kernel measured slower than dequantize + cuBLAS


class QuantizedLinear(nn.Module):
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
        """Dequantized weight [out, in] (without the compensator)."""
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_gemv.quantized_linear(self, x)  # generated CPU kernel for a few rows, else None
        if y is None and x.is_cuda and x.numel() // self.in_features <= TRITON_MAX_ROWS and triton_available():
            from moeserve.kernels.triton.lowbit_linear import lowbit_linear, supported

            if supported(self.group) and self.bits in TRITON_BITS:
                y = lowbit_linear(x, self.qweight, self.scale, self.zero, self.bits, self.group, self.in_features)
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
    """An expert backend over per-expert QuantizedLinear pairs (ranks may differ per expert)."""

    def __init__(self, gate_up: list[QuantizedLinear], down: list[QuantizedLinear]):
        super().__init__()
        self.num_experts = len(gate_up)
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)

    def expert_ffn(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return self.down[e](swiglu(self.gate_up[e](rows)))
