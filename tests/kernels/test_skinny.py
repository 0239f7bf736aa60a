"""x W^T for a few rows in one launch (kernels/triton/skinny.py) against float64, and when the model's projections take
it. On a CPU they run in the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) at tiny sizes; on a
GPU, compiled."""

import pytest
import torch

pytest.importorskip("triton")

from checks import DEVICE  # noqa: E402


@pytest.mark.parametrize("M,N,K,block_n", [(1, 7, 33, 1), (3, 20, 100, 2), (8, 5, 64, 4), (2, 9, 1500, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_matches_float64(poisoned_outputs, M, N, K, block_n, dtype):
    """Few rows of x times a wide W: N and K not multiples of the blocks (1500: a partial last K block)."""
    from moeserve.kernels.triton.skinny import skinny_linear

    x, w = torch.randn(M, K, device=DEVICE, dtype=dtype), torch.randn(N, K, device=DEVICE, dtype=dtype)
    got = skinny_linear(x, w, block_n)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, atol=1e-4 * K ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("M,sizes,K,block_n,bias", [(1, (8, 4, 4), 40, 2, False), (2, (6, 3, 5), 100, 4, True),
                                                    (1, (16, 8), 2100, 8, True), (2, (7,), 33, 2, False)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_skinny_linears_side_by_side_match_float64(poisoned_outputs, M, sizes, K, block_n, bias, out_dtype):
    """Up to three weights in one launch (decode's q, k and v): outputs side by side, biases added, a block size
    that does not divide every weight's rows (5, 3, 7: halved to what does), a partial last K block (2100)."""
    from moeserve.kernels.triton.skinny import skinny_linears

    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    ws = [torch.randn(n, K, device=DEVICE, dtype=torch.bfloat16) for n in sizes]
    bs = [torch.randn(n, device=DEVICE, dtype=torch.bfloat16) for n in sizes] if bias else None
    got = skinny_linears(x, ws, bs, out_dtype=out_dtype, block_n=block_n, stages=4)
    ref = torch.cat([x.double() @ w.double().T + (bs[i].double() if bias else 0) for i, w in enumerate(ws)], dim=1)
    assert got.shape == (M, sum(sizes)) and got.dtype == out_dtype
    tol = 1e-4 * K ** 0.5 if out_dtype == torch.float32 else 2 ** -7 * ref.abs().max().item()
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=1e-5 if out_dtype == torch.float32 else 2 ** -7)


@pytest.mark.parametrize("x_shape,w_shape,dtypes,match", [((9, 16), (4, 16), None, "1..8"),
                                                          ((2, 16), (4, 15), None, r"w \[N, K\]"),
                                                          ((2, 16), (4, 16), (torch.float32, torch.float16), "dtype")])
def test_skinny_linear_rejects_what_it_cannot_run(x_shape, w_shape, dtypes, match):
    from moeserve.kernels.triton.skinny import skinny_linear

    dx, dw = dtypes or (torch.float32, torch.float32)
    with pytest.raises(ValueError, match=match):
        skinny_linear(torch.randn(x_shape, dtype=dx), torch.randn(w_shape, dtype=dw))


@pytest.mark.parametrize("M,E,r,ids", [(1, 8, 4, (5, 2)), (2, 6, 8, (0, 3, 5)), (1, 4, 2, (3,))])
def test_skinny_linear_computes_only_the_listed_groups(poisoned_outputs, M, E, r, ids):
    """One token's compensator inputs x V^T for its experts only: the listed experts' r columns as the full product,
    the others left unwritten (NaN here: no program wrote them)."""
    from moeserve.kernels.triton.skinny import skinny_linear

    x, v = torch.randn(M, 40, device=DEVICE), torch.randn(E * r, 40, device=DEVICE)
    got = skinny_linear(x, v, block_n=4, groups=(torch.tensor(ids, device=DEVICE), r))
    cols = torch.cat([torch.arange(e * r, (e + 1) * r) for e in ids]).to(DEVICE)
    torch.testing.assert_close(got[:, cols].double(), x.double() @ v[cols].double().T, atol=1e-5, rtol=1e-5)
    rest = torch.ones(E * r, dtype=torch.bool, device=DEVICE)
    rest[cols] = False
    assert got[:, rest].isnan().all()
    with pytest.raises(ValueError, match="groups"):
        skinny_linear(x, v, groups=(torch.tensor(ids, device=DEVICE), 3 * r + 1))


def test_linears_take_one_launch_only_for_plain_layers_and_few_rows():
    """Decode's projections go through one skinny launch only where that is exactly x W^T + b and measured faster:
    one row,
    plain nn.Linear (a subclass, e.g. tensor parallel's row-parallel layer, or a hooked layer does more), one dtype,
    biases on all or none, no autograd."""
    from moeserve.model.layers import skinny_serves

    class Closing(torch.nn.Linear):
        pass

    q, k = torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 4, bias=False)
    x = torch.randn(1, 1, 16)
    with torch.no_grad():
        assert skinny_serves(x, (q, k)) and skinny_serves(torch.randn(1, 16), (q,))
        assert not skinny_serves(torch.randn(2, 1, 16), (q,))
        assert not skinny_serves(x, (q, Closing(16, 4, bias=False)))
        assert not skinny_serves(x, (q, torch.nn.Linear(16, 4)))  # bias on one only
        assert not skinny_serves(x.bfloat16(), (q, k))
        assert not skinny_serves(x, (q, k, q, k))
        handle = k.register_forward_hook(lambda *a: None)
        assert not skinny_serves(x, (q, k))
        handle.remove()
    assert not skinny_serves(x, (q, k))  # autograd would record through the weights


def test_skinny_linears_reject_what_they_cannot_run():
    from moeserve.kernels.triton.skinny import skinny_linears

    x, w = torch.randn(1, 16), torch.randn(4, 16)
    with pytest.raises(ValueError, match="1..3 weights"):
        skinny_linears(x, [w] * 4)
    with pytest.raises(ValueError, match="one bias"):
        skinny_linears(x, [w, w], [torch.randn(4)])
