"""Small collectives the parallel modules share: an all-gather of uneven pieces, and an agreement on errors."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeserve.errors import MoeserveError


def all_gather_uneven(t: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's `t` along the last dim, rank r holding sizes[r] columns: padded to the widest,
    since all_gather wants equal shapes."""
    width = max(sizes)
    padded = F.pad(t, (0, width - t.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


def raise_if_any_failed(error: Exception | None, device: torch.device, group=None) -> None:
    """Collective: every rank says whether it failed; the failed ones raise their own error, the others a
    one-line error saying a peer failed, so no rank goes on to wait forever in the next collective."""
    failed = torch.tensor([error is not None], dtype=torch.int32, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if failed.item():
        raise MoeserveError("another rank failed (its error is printed above); stopping this one too")
