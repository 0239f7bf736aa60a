"""The token -> expert mapping table and the weighted combine in one Triton launch each.

The sort-based table (kernels/routing.py) costs about ten small launches (radix sort, count, prefix sum,
gathers); at one token they take longer than reading an expert's weights, and in eager prefill their host time
exceeds a many-expert layer's GPU time. Here a slot's place in the expert-sorted order is its rank under the key
(expert, slot). Decode sizes count it by comparing against every slot, O((T k)^2) work that is nothing there;
larger batches by counting per expert (each program scans all expert ids once for the counts overall and
before its chunk of slots, then ranks its chunk's slots among themselves), O(T k E) work per program. The
combine gathers each token's k expert rows through the inverse permutation instead of scattering with atomics
into a zeroed output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton.pdl import after_previous, dependent_launch

RANK_MAX_SLOTS = 256  # T * k above this, counting: the rank loop took 29 us at 2048 slots on an H100 (64 per program)
# counting programs each scan all T*k ids against every expert: above this T*k*E the sort is faster (H100, eager:
# 1.5M took 108 us vs the sort's 254, 4.2M 293-364 us vs 161-250)
MAX_COUNT_WORK = 1 << 21


def serves(slots: int, num_experts: int) -> bool:
    """Whether one launch builds the table for `slots` (token, expert) pairs over num_experts experts."""
    return slots <= RANK_MAX_SLOTS or slots * triton.next_power_of_2(num_experts) <= MAX_COUNT_WORK


@triton.jit
def _place(i, i_ok, rank, w_ptr, token_ptr, w_sorted_ptr, slot_of_ptr, K: tl.constexpr):
    """Slots i (where i_ok) go to their ranks: token_ids[rank] = i // K, weights[rank] = w[i], slot_of[i] = rank."""
    tl.store(token_ptr + rank, (i // K).to(tl.int64), mask=i_ok)
    tl.store(w_sorted_ptr + rank, tl.load(w_ptr + i, mask=i_ok), mask=i_ok)
    tl.store(slot_of_ptr + i, rank, mask=i_ok)


@triton.jit
def _table_kernel(ids_ptr, w_ptr, token_ptr, w_sorted_ptr, slot_of_ptr, counts_ptr, offsets_ptr, n, E,
                  K: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Slots [pid * BLOCK, +BLOCK) of the flat [T*k] expert ids: rank = #slots j with (id_j, j) < (id_i, i); slot i
    goes to token_ids[rank] = i // K, weights[rank], slot_of[i] = rank. Program 0 also writes counts and offsets."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    i_ok = i < n
    key = tl.load(ids_ptr + i, mask=i_ok, other=0).to(tl.int64) * n + i  # [BLOCK]
    rank = tl.zeros((BLOCK,), dtype=tl.int32)
    for j0 in range(0, n, CHUNK):
        j = j0 + tl.arange(0, CHUNK)  # [CHUNK]
        key_j = tl.load(ids_ptr + j, mask=j < n, other=0).to(tl.int64) * n + j
        key_j = tl.where(j < n, key_j, tl.cast(2**62, tl.int64))  # past the end: larger than every key
        rank += tl.sum((key_j[None, :] < key[:, None]).to(tl.int32), axis=1)  # [BLOCK]
    _place(i, i_ok, rank, w_ptr, token_ptr, w_sorted_ptr, slot_of_ptr, K)
    if tl.program_id(0) == 0:
        e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
        counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for j0 in range(0, n, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            id_j = tl.load(ids_ptr + j, mask=j < n, other=-1)
            counts += tl.sum((id_j[None, :] == e[:, None]).to(tl.int32), axis=1)  # [BLOCK_E]
        tl.store(counts_ptr + e, counts.to(tl.int64), mask=e < E)
        tl.store(offsets_ptr + e, tl.cumsum(counts, axis=0), mask=e < E)


@triton.jit
def _combine_kernel(y_ptr, slot_of_ptr, w_ptr, out_ptr, D, K: tl.constexpr, SORTED: tl.constexpr,
                    BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out[t, d] = sum over token t's K slots of w * y[row, d]: the rows are gathered, summed in fp32, written once.
    SORTED: y and w in expert-sorted order, slot (t, j) at row slot_of[t * K + j]; else in slot order (row t * K + j).
    A slot with weight 0 (a masked-out expert) adds nothing, whatever its row holds. All K weights are loaded before
    any row, and the rows without a branch between them, so the loads overlap (H100, one-token MoE blocks as CUDA
    graphs, a branch per slot before: top-6 DeepSeek-like 3-bit 37.1 -> 36.3 us, bf16 73.3 -> 72.4; top-2 Mixtral
    3-bit 80.2 -> 79.8-80.1)."""
    after_previous(PDL)
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = d < D
    slots = ()
    weights = ()  # [BLOCK_D] each: the weight broadcast over the block
    for j in tl.static_range(K):
        slot = t.to(tl.int64) * K + j
        if SORTED:
            slot = tl.load(slot_of_ptr + slot).to(tl.int64)
        slots = slots + (slot,)
        weights = weights + (tl.zeros((BLOCK_D,), dtype=tl.float32) + tl.load(w_ptr + slot).to(tl.float32),)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(y_ptr + slots[j] * D + d, mask=d_ok & (weights[j] != 0), other=0.0)  # [BLOCK_D]
        acc += weights[j] * row.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * D + d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _count_table_kernel(ids_ptr, w_ptr, token_ptr, w_sorted_ptr, slot_of_ptr, counts_ptr, offsets_ptr, n, E,
                        K: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Slots [pid * CHUNK, +CHUNK) of the flat [T*k] expert ids, by counting: rank of slot i = (slots of smaller
    experts) + (slots of its expert before this chunk) + (slots of its expert before i in this chunk). Outputs as
    _table_kernel's."""
    c0 = tl.program_id(0) * CHUNK
    e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    before = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for j0 in range(0, n, CHUNK):
        j = j0 + tl.arange(0, CHUNK)  # [CHUNK]
        id_j = tl.load(ids_ptr + j, mask=j < n, other=-1)
        hits = tl.sum((id_j[:, None] == e[None, :]).to(tl.int32), axis=0)  # [BLOCK_E]
        total += hits
        before += tl.where(j0 < c0, hits, 0)
    end = tl.cumsum(total, axis=0)  # [BLOCK_E] each expert's end in the sorted order
    i = c0 + tl.arange(0, CHUNK)  # [CHUNK]
    i_ok = i < n
    onehot = (tl.load(ids_ptr + i, mask=i_ok, other=-1)[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
    within = tl.cumsum(onehot, axis=0) - onehot  # slots of the same expert earlier in the chunk
    rank = tl.sum(onehot * (within + (end - total + before)[None, :]), axis=1)  # [CHUNK]
    _place(i, i_ok, rank, w_ptr, token_ptr, w_sorted_ptr, slot_of_ptr, K)
    if tl.program_id(0) == 0:
        tl.store(counts_ptr + e, total.to(tl.int64), mask=e < E)
        tl.store(offsets_ptr + e, end, mask=e < E)


def table_tensors(expert_ids: torch.Tensor, expert_weights: torch.Tensor, num_experts: int, block: int = 64,
                  chunk: int = 64, count_chunk: int | None = None) -> dict:
    """expert_ids/expert_weights [T, k] -> the RoutingTable fields (token_ids, weights, counts, offsets) and
    slot_of [T*k] (each slot's place in the sorted order), in one launch: ranks by comparison up to RANK_MAX_SLOTS
    slots (programs of `block` slots comparing `chunk` at a time), by counting above (programs of count_chunk
    slots, default: a [count_chunk, experts] tile of about 16K values)."""
    n = expert_ids.numel()
    if not serves(n, num_experts):
        raise ValueError(f"the one-launch routing table takes T * k * experts <= {MAX_COUNT_WORK}, got {n} slots "
                         f"over {num_experts} experts")
    dev = expert_ids.device
    ids, w = expert_ids.reshape(-1).contiguous(), expert_weights.reshape(-1).contiguous()
    out = dict(token_ids=torch.empty(n, dtype=torch.long, device=dev), weights=torch.empty_like(w),
               counts=torch.empty(num_experts, dtype=torch.long, device=dev),
               offsets=torch.empty(num_experts, dtype=torch.int32, device=dev),
               slot_of=torch.empty(n, dtype=torch.int32, device=dev))
    args = (ids, w, out["token_ids"], out["weights"], out["slot_of"], out["counts"], out["offsets"], n, num_experts)
    block_e = triton.next_power_of_2(num_experts)
    if n <= RANK_MAX_SLOTS and count_chunk is None:
        _table_kernel[(triton.cdiv(n, block),)](*args, K=expert_ids.shape[1], BLOCK=block, CHUNK=chunk,
                                                BLOCK_E=block_e)
    else:
        count_chunk = count_chunk or max(16, min(256, 16384 // block_e))
        _count_table_kernel[(triton.cdiv(n, count_chunk),)](*args, K=expert_ids.shape[1], CHUNK=count_chunk,
                                                            BLOCK_E=block_e)
    return out


def gather_combine(expert_out: torch.Tensor, slot_of: torch.Tensor | None, weights: torch.Tensor, k: int,
                   out_dtype: torch.dtype, block_d: int = 1024) -> torch.Tensor:
    """expert_out [T*k, D] -> [T, D]: each token's k rows times their gate weights, summed. Rows and weights
    expert-sorted (slot_of: each slot's sorted place), or with slot_of None in slot order (weights [T, k])."""
    n, D = expert_out.shape
    out = torch.empty(n // k, D, dtype=out_dtype, device=expert_out.device)
    block_d = min(block_d, triton.next_power_of_2(D))
    _combine_kernel[(n // k, triton.cdiv(D, block_d))](
        expert_out.contiguous(), weights if slot_of is None else slot_of, weights.contiguous(), out, D, K=k,
        SORTED=slot_of is not None, BLOCK_D=block_d, num_warps=4, **dependent_launch(out.device))
    return out
