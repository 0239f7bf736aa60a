"""MXFP4 (E2M1 values, E8M0 scales per 32; GPT-OSS's experts) fused MoE in Triton, decoded in registers.

    kernels.py   jit only: the E2M1 decode, the tile product, the gate/up kernel (biases, clamped SwiGLU or silu
                 epilogue) and the down kernel
    launch.py    host side: Mxfp4Weights, Mxfp4Config (defaults by token count), mxfp4_experts
Rows are expert-sorted (a RoutingTable) and found on the GPU by kernels/triton/rows.py, so a decode step that runs
these kernels can be captured as a CUDA graph.
"""

from moeserve.kernels.triton.mxfp4.launch import Mxfp4Config, Mxfp4Weights, default_config, mxfp4_experts

__all__ = ["Mxfp4Config", "Mxfp4Weights", "default_config", "mxfp4_experts"]
