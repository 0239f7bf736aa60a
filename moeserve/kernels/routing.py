"""Token -> expert mapping table: group the (token, slot) pairs by expert, stably.

No one-hot tensors in memory: on a GPU with Triton, batches up to about 2M (slot, expert) pairs get the table in
one launch (kernels/triton/routing_table.py); otherwise it comes from a sort of the T*k expert ids, a count and a prefix
sum, so its cost is independent of the number of experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.kernels import needs_grad, triton_available

# Triton kernel modules are imported inside the functions that launch them: Triton is optional (triton_available).


@dataclass
class RoutingTable:
    token_ids: torch.Tensor  # [T*k] source token of each expert-sorted slot
    weights: torch.Tensor  # [T*k] gate weight of each expert-sorted slot
    counts: torch.Tensor  # [E] slots per expert
    offsets: torch.Tensor  # [E] exclusive end offsets (cumsum of counts), int32 for grouped GEMMs
    num_tokens: int  # T: also the most slots one expert can have (a token picks an expert once)
    slot_of: torch.Tensor | None = None  # [T*k] int32 place of slot (t, j) in the sorted order (one-launch table)


def one_launch(expert_ids: torch.Tensor, num_experts: int) -> bool:
    """Whether the Triton table serves these [T, k] ids: CUDA, Triton, a batch it builds faster than the sort."""
    if not (expert_ids.is_cuda and triton_available()):
        return False
    from moeserve.kernels.triton.routing_table import serves

    return serves(expert_ids.numel(), num_experts)


def build_routing_table(expert_ids: torch.Tensor, expert_weights: torch.Tensor, num_experts: int) -> RoutingTable:
    """expert_ids/expert_weights [T, k] -> slots sorted by expert (stable, so token order is kept)."""
    if one_launch(expert_ids, num_experts):
        from moeserve.kernels.triton.routing_table import table_tensors

        return RoutingTable(**table_tensors(expert_ids, expert_weights, num_experts), num_tokens=expert_ids.shape[0])
    # on a GPU, slot_of lets combine gather (no zeroed output, no bf16 atomics)
    return sorted_table(expert_ids, expert_weights, num_experts, inverse=expert_ids.is_cuda and triton_available())


def sorted_table(expert_ids: torch.Tensor, expert_weights: torch.Tensor, num_experts: int,
                 inverse: bool = False, mask: torch.Tensor | None = None) -> RoutingTable:
    """The table from a stable sort: any size, any device (the reference for the one-launch table); inverse: with
    slot_of, the sort's inverse permutation; mask [T, k] bool: only these pairs are in the table (no inverse)."""
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)  # [T*k]
    if mask is None:
        order = torch.argsort(flat, stable=True)  # [T*k]
    else:
        assert not inverse, "a masked table has no inverse permutation"
        kept = mask.reshape(-1).nonzero().squeeze(1)  # [n]
        order = kept[torch.argsort(flat[kept], stable=True)]  # [n]
        flat = flat[kept]
    # scatter-add, not bincount: bincount sizes its output from the data, a host sync on CUDA
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))  # [E]
    return RoutingTable(
        token_ids=order // k,
        weights=expert_weights.reshape(-1)[order],
        counts=counts,
        offsets=torch.cumsum(counts, 0).to(torch.int32),
        num_tokens=expert_ids.shape[0],
        slot_of=torch.empty_like(order, dtype=torch.int32).scatter_(
            0, order, torch.arange(order.numel(), dtype=torch.int32, device=order.device)) if inverse else None,
    )


def combine(expert_out: torch.Tensor, table: RoutingTable, num_tokens: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Scale each expert-sorted row by its gate weight and add it back to its token: [T, D]."""
    if table.slot_of is not None and not needs_grad(expert_out, table.weights):
        # one launch: gather each token's rows (no zeroed output, no atomics; no backward, so not under autograd)
        from moeserve.kernels.triton.routing_table import gather_combine

        return gather_combine(expert_out, table.slot_of, table.weights, table.slot_of.numel() // num_tokens,
                              out_dtype)
    scaled = (expert_out * table.weights[:, None]).to(out_dtype)  # [T*k, D]
    out = torch.zeros(num_tokens, expert_out.shape[1], dtype=out_dtype, device=expert_out.device)
    return out.index_add_(0, table.token_ids, scaled)


def slot_order_pays(tokens: int) -> bool:
    """Whether the MoE kernels should take rows in slot order (expert ids) rather than expert-sorted (a routing table):
    for one token, where dropping the table and gather launches saves ~10 us a layer (H100, Mixtral 4-bit: 112 vs
    122 us); with more, multi-row 3-bit CUDA-core tiles lose to sorted rows (2 tokens: 331 vs 284 us)."""
    return tokens == 1
