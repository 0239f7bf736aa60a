"""RMSNorm and rotary in one launch each (kernels/triton/norm_rotary.py) against the torch expressions. On a CPU they
run in the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) at tiny sizes; on a GPU, compiled."""

import pytest
import torch

pytest.importorskip("triton")

from checks import DEVICE, torch_rms_norm  # noqa: E402


@pytest.mark.parametrize("rows,D", [(1, 64), (5, 48)])  # 48: a masked tail of the block
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_matches_the_torch_expression(poisoned_outputs, rows, D, dtype):
    """Equal to the torch expression up to its fp32 sum's order (one step of the output's rounding), at any scale
    of x; bf16 only against float64, as the interpreter truncates fp32 -> bf16."""
    from moeserve.kernels.triton.norm_rotary import rms_norm

    x = (torch.randn(rows, 3, D, device=DEVICE) * 10 ** torch.empty(rows, 3, 1, device=DEVICE).uniform_(-3, 3))
    x, weight = x.to(dtype), (1 + torch.randn(D, device=DEVICE) * 0.1).to(dtype)
    got = rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype and not got.isnan().any()
    if dtype == torch.bfloat16:
        x64 = x.double()
        ref = weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(got.double(), ref, atol=0, rtol=2 ** -6)
    else:
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got, torch_rms_norm(x, weight, 1e-6), atol=0, rtol=4 * eps)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[1:], 1e-6)
    assert rms_norm(x[:0], weight, 1e-6).shape == (0, 3, D)  # no rows: no launch


@pytest.mark.parametrize("rows,D", [(1, 64), (3, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_adds_the_residual_first(poisoned_outputs, rows, D, dtype):
    """rms_norm(x, w, residual=h) = (norm(x + h), x + h): the sum exactly as torch adds (rounded once to x's dtype),
    the norm of that sum as the plain kernel computes it."""
    from moeserve.kernels.triton.norm_rotary import rms_norm

    x, h = (torch.randn(rows, 2, D, device=DEVICE, dtype=dtype) * 4 for _ in range(2))
    weight = (1 + torch.randn(D, device=DEVICE) * 0.1).to(dtype)
    normed, total = rms_norm(x, weight, 1e-6, residual=h)
    assert torch.equal(total, x + h)
    torch.testing.assert_close(normed, rms_norm(x + h, weight, 1e-6), atol=0, rtol=0)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, weight, 1e-6, residual=h[:, :1])


@pytest.mark.parametrize("B,S,H,Dh", [(1, 1, 4, 16), (2, 3, 5, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_matches_apply_rotary_bitwise(poisoned_outputs, B, S, H, Dh, dtype):
    """The fused rotary on a transposed view (as Attention.qkv passes it) rounds where torch does: equal bits (bf16
    on a GPU: tests/test_gpu.py; the interpreter truncates to bf16)."""
    from moeserve.kernels.triton.norm_rotary import rotary
    from moeserve.model.layers import apply_rotary

    x = torch.randn(B, S, H, Dh, device=DEVICE).to(dtype).transpose(1, 2)  # [B, H, S, Dh], strided
    angle = torch.rand(B, S, Dh // 2, device=DEVICE) * 100
    cos, sin = (torch.cat((f(angle), f(angle)), -1).to(dtype) for f in (torch.cos, torch.sin))
    got = rotary(x, cos, sin)
    ref = apply_rotary(x.cpu(), cos.cpu(), sin.cpu())  # the torch expression
    assert got.shape == (B, H, S, Dh) and got.is_contiguous()
    assert torch.equal(got.cpu(), ref)
    with pytest.raises(ValueError, match="power-of-two"):
        rotary(x[..., :12], cos[..., :12], sin[..., :12])
    assert rotary(x[:, :0], cos, sin).shape == (B, 0, S, Dh)  # no heads: no launch


@pytest.mark.parametrize("B,H,Hkv,Dh", [(1, 4, 2, 16), (2, 6, 3, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_into_cache_matches_rotary_and_the_cache_writes(poisoned_outputs, B, H, Hkv, Dh, dtype):
    """One decode token per sequence: q rotated as apply_rotary does, k rotated and v copied into the caches at each
    sequence's own row and column (device tensors, rows out of order), every other entry untouched; qkv rows strided
    (a view of wider rows)."""
    from moeserve.model.layers import apply_rotary
    from moeserve.kernels.triton.norm_rotary import rotary_into_cache

    N = (H + 2 * Hkv) * Dh
    qkv = torch.randn(B, 1, N + 8, device=DEVICE).to(dtype)[..., :N]  # [B, 1, N], rows of stride N + 8
    angle = torch.rand(B, 1, Dh // 2, device=DEVICE) * 100
    cos, sin = (torch.cat((f(angle), f(angle)), -1).to(dtype) for f in (torch.cos, torch.sin))
    keys, values = (torch.randn(B + 2, Hkv, 5, Dh, device=DEVICE).to(dtype) for _ in range(2))  # [R, Hkv, S, Dh]
    old_k, old_v = keys.clone(), values.clone()
    rows, slots = torch.tensor([B + 1, 0][:B], device=DEVICE), torch.tensor([2, 4][:B], device=DEVICE)  # [B] each
    q = rotary_into_cache(qkv, cos, sin, H, keys, values, slots, rows)
    heads = qkv.cpu().view(B, 1, H + 2 * Hkv, Dh).transpose(1, 2)  # [B, heads, 1, Dh]
    assert torch.equal(q.cpu(), apply_rotary(heads[:, :H], cos.cpu(), sin.cpu()))
    written = torch.zeros(B + 2, 5, dtype=torch.bool)  # [R, S]
    for b, (r, c) in enumerate(zip(rows.tolist(), slots.tolist())):
        assert torch.equal(keys[r, :, c].cpu(), apply_rotary(heads[b:b + 1, H:H + Hkv], cos[b:b + 1].cpu(),
                                                             sin[b:b + 1].cpu())[0, :, 0])
        assert torch.equal(values[r, :, c].cpu(), heads[b, H + Hkv:, 0])
        written[r, c] = True
    assert torch.equal(keys.transpose(1, 2)[~written], old_k.transpose(1, 2)[~written])
    assert torch.equal(values.transpose(1, 2)[~written], old_v.transpose(1, 2)[~written])
    with pytest.raises(ValueError, match="rotary_into_cache"):
        rotary_into_cache(qkv, cos, sin, H + 1, keys, values, slots, rows)
