"""GPTQ against a float64 Optimal Brain Surgeon reference written the plain way (explicit inverse Hessian, downdated
column by column, no lazy blocks, no Cholesky), and against RTN's output error on the calibration inputs."""

import pytest
import torch

from moeserve.errors import MoeserveError
from moeserve.quant import gptq
from moeserve.quant.hqq import dequantize, minmax_scale_zero, quantize_rtn


def calibration(n: int, cols: int, seed: int) -> torch.Tensor:
    """[n, cols] correlated inputs with a few loud channels, as activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cols, generator=g, dtype=torch.float64) @ torch.randn(cols, cols, generator=g,
                                                                              dtype=torch.float64) / cols ** 0.5
    x[:, :3] *= 6
    return x


def obs_reference(W: torch.Tensor, X: torch.Tensor, bits: int, group: int, damp: float) -> torch.Tensor:
    """Dequantized weights by OBS: quantize column c, spread its error over the later columns by H^-1, remove c
    from H^-1; each group's RTN grid fitted on its columns when the first is reached. float64 throughout."""
    W = W.clone()
    H = 2 * X.T @ X
    H += damp * H.diagonal().mean() * torch.eye(H.shape[0], dtype=H.dtype)
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    qmax = (1 << bits) - 1
    for c in range(W.shape[1]):
        if c % group == 0:
            scale, zero = minmax_scale_zero(W[:, c:c + group], bits)
            scale, zero = scale.half().double(), zero.half().double()
        q = torch.round(W[:, c:c + 1] / scale + zero).clamp(0, qmax)
        Q[:, c] = ((q - zero) * scale)[:, 0]
        e = (W[:, c] - Q[:, c]) / Hinv[c, c]
        W[:, c + 1:] -= e[:, None] * Hinv[c, c + 1:][None]
        Hinv = Hinv - Hinv[:, c:c + 1] @ Hinv[c:c + 1, :] / Hinv[c, c]
    return Q


@pytest.mark.parametrize("bits, group, block", [(3, 16, 32), (4, 32, 16)])
def test_gptq_matches_the_float64_obs_reference_and_beats_rtn(bits, group, block):
    g = torch.Generator().manual_seed(bits)
    W = torch.randn(24, 64, generator=g, dtype=torch.float64) * 0.05
    X = calibration(512, 64, bits)
    H = torch.zeros(64, 64, dtype=torch.float64)
    gptq.accumulate_hessian(H, X)
    qw = gptq.quantize_gptq(W, H, bits, group, block=block, damp=0.01)
    ours = gptq.dequantize_batched(qw, torch.float64)
    ref = obs_reference(W, X, bits, group, 0.01)
    assert (ours - ref).abs().max() < 1e-9
    assert torch.equal(dequantize(qw, torch.float64), ours)  # the codes read back as RTN's layout

    def out_err(Wq):
        return ((X @ W.T - X @ Wq.T) ** 2).sum().item()

    rtn = dequantize(quantize_rtn(W.float(), bits, group), torch.float64)
    assert out_err(ours) < 0.8 * out_err(rtn)


def test_batched_experts_equal_one_call_each_and_a_dead_input_is_no_failure():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, 16, 64, generator=g) * 0.05
    H = torch.stack([2 * calibration(256, 64, s).float().T @ calibration(256, 64, s).float() for s in range(3)])
    H[1, 5, :] = H[1, :, 5] = 0  # an input expert 1 never saw
    batched = gptq.dequantize_batched(gptq.quantize_gptq(W, H, 4, 32))
    for e in range(3):
        one = gptq.dequantize_batched(gptq.quantize_gptq(W[e], H[e], 4, 32))
        assert torch.allclose(batched[e], one, atol=1e-6)
    qw = gptq.quantize_gptq(W[1], H[1], 4, 32)
    assert batched.isfinite().all() and ((batched[1, :, 5]).abs() <= qw.scale[:, 0].float() / 2 + 1e-6).all()


def test_bad_block_and_group_are_refused():
    with pytest.raises(MoeserveError, match="block 48 and group 32"):
        gptq.quantize_gptq(torch.randn(4, 64), torch.eye(64), 4, 32, block=48)
