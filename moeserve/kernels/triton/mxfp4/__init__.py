"""MXFP4 (E2M1 values, E8M0 scales per 32; GPT-OSS's experts) fused MoE in Triton, decoded in registers.

    codes.py     jit: E2M1 codes -> pairs of 16-bit floats by moving bits, arithmetic on such pairs
    kernels.py   jit: x prepared for the CUDA-core programs, the CUDA-core (GEMV) and tensor-core gate/up (biases,
                 clamped SwiGLU or silu epilogue) and down kernels
    launch.py    host side: Mxfp4Weights, Mxfp4Config (defaults by token count), mxfp4_experts
Rows are expert-sorted (a RoutingTable); the grid walks only the experts hit, each program finds its expert's rows on
the GPU (kernels/triton/rows.py hit_rows), so a decode step that runs these kernels can be captured as a CUDA graph.
bench/gptoss.py --sweep times the configs on a GPU.
"""

from moeserve.kernels.triton.mxfp4.launch import Mxfp4Config, Mxfp4Weights, default_config, mxfp4_experts

__all__ = ["Mxfp4Config", "Mxfp4Weights", "default_config", "mxfp4_experts"]
