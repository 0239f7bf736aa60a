"""Execution paths: the named ways a call can run, and which one each layer takes on this machine.

Each component decides its path in one function that returns a name from the tables below: an expert backend in
`kernel_path(x, num_tokens)` (model/experts.py, quant/qlinear.py, offload/, hybrid/, parallel/), the router in
`TopKRouter.kernel_path`, dense projections in `layers.linears_path`. The components then run the path they named,
so what `explain` reports is what runs. Whether a decode step can be captured as a CUDA graph follows from the
expert paths (GRAPH_SAFE): a path that reads the device from the host cannot be captured.

`moeserve info --explain` prints `explain(model, ...)`; with MOESERVE_LOG=debug each MoE block logs the expert
path of every new (layer, tokens) it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.model.layers import MLP, linears_path

EXPERT_PATHS = {
    "fused": "Triton fused MoE over 16-bit experts (token counts up to the tuned limit of this GPU and shape)",
    "grouped_mm": "two torch grouped GEMMs over expert-sorted rows (CUDA sm90+, bf16)",
    "tiles": "Triton row-tile kernels with default configs (GPUs without grouped GEMMs)",
    "lowbit_slots": "Triton low-bit fused MoE, one token in slot order (no routing table, no gather); behind a softmax "
                    "top-k router on CUDA, with MOESERVE_ONE_TOKEN_MOE=1, the whole layer in three launches "
                    "(kernels/triton/one_token.py)",
    "lowbit_sorted": "Triton low-bit fused MoE over expert-sorted rows",
    "cpu_lowbit": "per-expert loop; an expert's rows run through the generated low-bit CPU kernels when they are "
                  "few (decode), else dequantize + matmul",
    "loop": "per-expert loop in PyTorch (reads the expert counts on the host)",
    "mxfp4_triton": "Triton MXFP4 fused MoE over expert-sorted rows, E2M1 decoded in registers (GPT-OSS's experts); "
                    "one token behind a softmax top-k router, with MOESERVE_ONE_TOKEN_MOE=1: the whole layer in three "
                    "launches (one_token.py)",
    "mxfp4_loop": "per-expert loop; each expert's MXFP4 weights dequantized by table lookup, then matmuls",
    "offload": "expert cache: hits run on GPU slots, misses are copied in or run on the CPU",
    "hybrid": "experts computed where they lie: those cached on the model device in one routed pass there, the "
              "rest by the CPU worker from host RAM, meanwhile",
    "hybrid_linked": "experts computed on the CPU from host RAM, asked for and waited on by the device through "
                     "page-locked memory (no host wait: capturable)",
    "expert_parallel": "tokens sent to the ranks that hold their experts (all-to-all)",
    "tensor_parallel": "every rank computes its slice of each expert's FFN, then an all-reduce",
}
# paths that never read the device from the host: a decode step made only of these can be a CUDA graph
GRAPH_SAFE = frozenset({"fused", "grouped_mm", "tiles", "lowbit_slots", "lowbit_sorted", "mxfp4_triton",
                        "hybrid_linked"})
ROUTER_PATHS = {
    "triton_topk": "one Triton launch: gate matmul, softmax, top-k (and the experts' x preparation)",
    "torch": "PyTorch ops",
}
LINEAR_PATHS = {
    "skinny": "the layer's projections side by side in one Triton split-K launch (decode rows)",
    "torch": "one cuBLAS/CPU matmul per projection",
}


@dataclass(frozen=True)
class LayerPaths:
    """The paths of one decoder layer for calls of each probed token count."""

    layer: int
    attention: dict[int, str]  # tokens -> LINEAR_PATHS name of the projections of the layer input (q/k/v)
    router: dict[int, str] | None  # tokens -> ROUTER_PATHS name (None: a dense layer)
    experts: dict[int, str] | None  # tokens -> EXPERT_PATHS name (None: a dense layer)
    ffn: dict[int, str] | None  # tokens -> LINEAR_PATHS name of the dense FFN or shared expert (None: none)

    def row(self) -> tuple:
        """The paths as one comparable tuple (layers with equal rows are printed together)."""
        return tuple(tuple(sorted(d.items())) if d is not None else None
                     for d in (self.attention, self.router, self.experts, self.ffn))


def explain(model, tokens: tuple[int, ...]) -> list[LayerPaths]:
    """Which path each layer of `model` takes for a call of each token count in `tokens`, on its device and dtype.
    Decides with probe tensors; runs nothing."""
    D = model.spec.hidden_size
    probes = {t: torch.empty(t, D, device=model.device, dtype=model.dtype) for t in tokens}  # [T, D] each
    out = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        attention = {t: linears_path(x, attn.input_projections()) for t, x in probes.items()}
        mlp = layer.mlp
        dense = mlp if isinstance(mlp, MLP) else getattr(mlp, "shared_expert", None)
        ffn = ({t: linears_path(x, (dense.gate_proj, dense.up_proj)) for t, x in probes.items()}
               if dense is not None else None)
        experts = getattr(mlp, "experts", None)
        out.append(LayerPaths(
            layer=i, attention=attention,
            router={t: mlp.gate.kernel_path(x) for t, x in probes.items()} if experts is not None else None,
            experts={t: experts.kernel_path(x, t) for t, x in probes.items()} if experts is not None else None,
            ffn=ffn))
    return out

