"""Assertions and torch references shared by the CPU-interpreter and GPU test modules."""

import torch


def assert_same_top_k(ids: torch.Tensor, ref_ids: torch.Tensor, logits: torch.Tensor) -> None:
    """ids [T, k] pick experts with exactly the reference's top-k softmax probabilities, best first, each once:
    the same choice up to the order of ties (bf16 logits of 64 experts tie often; torch.topk orders ties freely)."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids))
    assert all(len(set(row)) == len(row) for row in ids.tolist())


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model/layers.py's RMSNorm expression (HF's) in plain torch, on any device: the fused kernel's reference."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
