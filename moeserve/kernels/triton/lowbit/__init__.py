"""Low-bit (W{2,3,4,8}A16) matmuls in Triton for decode, dense or as a fused MoE, on the pack.py layout, and the
dequantized weight for calls of more rows.

Files import only downward:
    codes.py     packed words -> values (jit)                 layout.py   layout facts, input checks, StackedLowbit
    gemv.py      CUDA-core GEMV, 1..8 rows of x (jit)        launch.py   config -> Tile, x preparation, launches
    tiles.py     tensor-core tiles, tile_product (jit)        ops.py      lowbit_linear, lowbit_experts
    prepare.py   x prepared for the GEMV (jit)
    tma.py       the one-token GEMV fed by TMA (jit)
    kernels.py   the entry kernels (jit)
    dequant.py   packed rows -> float weight, for many rows (jit)
Row scheduling (which rows a program owns) is kernels/triton/rows.py, shared with the bf16 fused MoE; launch configs
are configs.LowbitConfig, per GPU: stored, tuned on first use (autotune.py) or made from the GPU's properties.
"""

from moeserve.kernels.triton.lowbit.launch import Preparation, prepare_x
from moeserve.kernels.triton.lowbit.layout import BITS, DTYPES, StackedLowbit, supported
from moeserve.kernels.triton.lowbit.ops import (DEQUANT_BITS, lowbit_dequantize, lowbit_experts, lowbit_linear,
                                                x_preparation)
from moeserve.kernels.triton.lowbit.prepare import prepare_step

__all__ = ["BITS", "DEQUANT_BITS", "DTYPES", "Preparation", "StackedLowbit", "lowbit_dequantize", "lowbit_experts",
           "lowbit_linear", "prepare_step", "prepare_x", "supported", "x_preparation"]
