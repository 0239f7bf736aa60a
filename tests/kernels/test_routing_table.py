"""The one-launch routing table and the gather-combine (kernels/triton/routing_table.py) against the sort and the
scatter. On a CPU they run in the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) at tiny sizes;
on a GPU, compiled."""

import math

import pytest
import torch

pytest.importorskip("triton")

from checks import DEVICE  # noqa: E402


@pytest.mark.parametrize("T,k,E,block", [(1, 2, 8, 64), (37, 3, 9, 16), (40, 6, 64, 32), (5, 2, 3, 64),
                                         (300, 2, 8, 64), (70, 6, 128, 32)])  # past RANK_MAX_SLOTS: counting
@pytest.mark.parametrize("counting", [False, True])
def test_one_launch_routing_table_equals_the_sort(T, k, E, block, counting):
    """Ranks by comparison or by counting (several programs, several chunks) give the stable sort's table
    exactly."""
    from moeserve.kernels.routing import sorted_table
    from moeserve.kernels.triton.routing_table import table_tensors

    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(DEVICE)  # [T, k]
    if T > 5:
        ids[: T // 2, 0] = E - 1  # a crowded expert
    w = torch.rand(T, k, device=DEVICE)
    got = table_tensors(ids, w, E, block=block, chunk=block, count_chunk=block if counting else None)
    ref = sorted_table(ids, w, E)
    for name in ("token_ids", "weights", "counts", "offsets"):
        assert torch.equal(got[name], getattr(ref, name)), name
    order = torch.argsort(ids.reshape(-1), stable=True)
    assert torch.equal(got["slot_of"][order].long(), torch.arange(T * k, device=DEVICE))  # the inverse permutation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_combine_equals_the_scatter(dtype):
    """Each token's rows gathered and weighted equal the float64 scatter, from expert-sorted rows and from the same rows
    in slot order; a weight-0 slot's NaN row adds nothing."""
    from moeserve.kernels.routing import RoutingTable, combine
    from moeserve.kernels.triton.routing_table import gather_combine, table_tensors

    T, k, E, D = 9, 3, 5, 40  # D: not a multiple of the block
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(DEVICE)
    w = torch.rand(T, k, device=DEVICE)
    w[4, 1] = 0.0
    fields = table_tensors(ids, w, E)
    rows = torch.randn(T * k, D, device=DEVICE)
    rows[fields["slot_of"][4 * k + 1]] = math.nan
    got = combine(rows, RoutingTable(**fields, num_tokens=T), T, dtype)
    in_slot_order = gather_combine(rows[fields["slot_of"].long()], None, w, k, dtype)
    ref = torch.zeros(T, D, dtype=torch.float64, device=DEVICE)
    for t in range(T):
        for j in range(k):
            if w[t, j] != 0:
                ref[t] += w[t, j].double() * rows[fields["slot_of"][t * k + j]].double()
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
    assert torch.equal(in_slot_order, got)
