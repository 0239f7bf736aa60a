"""The one-launch softmax -> top-k router (kernels/triton/topk_router.py) against torch's, and the experts' x it
prepares in the same launch. On a CPU they run in the Triton interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py) at tiny sizes; on a GPU, compiled."""

import pytest
import torch

pytest.importorskip("triton")

from checks import DEVICE, assert_same_top_k  # noqa: E402


@pytest.mark.parametrize("T,E,k,D,normalize,weights_fp32", [(1, 8, 2, 64, True, True), (5, 60, 6, 40, False, False),
                                                            (3, 64, 8, 200, True, False), (2, 3, 3, 16, True, True)])
def test_fused_router_matches_softmax_topk(poisoned_outputs, T, E, k, D, normalize, weights_fp32):
    """One launch (E, D not powers of two, several D steps, k = E) gives the experts, weights and logits of the torch
    router; the returned weights come in the dtype TopKRouter hands on."""
    from moeserve.kernels.triton.topk_router import fused_router
    from moeserve.model.router import softmax_topk

    x = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(E, D, device=DEVICE, dtype=torch.bfloat16) * D ** -0.5
    ids, weights, logits = fused_router(x, weight, k, normalize, torch.float32 if weights_fp32 else x.dtype)
    ref_logits = (x.double() @ weight.double().T).to(x.dtype)  # exact sum, rounded as F.linear's output is
    assert logits.dtype == x.dtype and weights.dtype == (torch.float32 if weights_fp32 else x.dtype)
    torch.testing.assert_close(logits, ref_logits, atol=0, rtol=2 ** -7)  # one bf16 rounding step at most
    ref_ids, ref_weights = softmax_topk(logits, k, normalize)  # the torch router on these logits
    assert_same_top_k(ids, ref_ids, logits)
    rtol = 1e-6 if weights_fp32 else 2 ** -7  # bf16 weights: the fp32 value rounded once (one ulp)
    torch.testing.assert_close(weights.float(), ref_weights, atol=0, rtol=rtol)
    with pytest.raises(ValueError, match="top-"):
        fused_router(x, weight, E + 1, normalize, torch.float32)


@pytest.mark.parametrize("T,E,k,D,bits,block_k,half", [(1, 8, 2, 256, 3, 128, True), (3, 60, 6, 320, 4, 64, False),
                                                       (2, 5, 2, 96, 2, 64, True), (1, 16, 4, 192, 8, 128, True)])
def test_fused_router_prepares_x_as_prepare_x(poisoned_outputs, T, E, k, D, bits, block_k, half):
    """The router's launch with prepared: more programs write x prepared for the experts' CUDA-core kernels, exactly
    what prepare_x writes (a last step past the row at D = 320 and 96), and the routing is the same."""
    from moeserve.kernels.triton.lowbit import Preparation, prepare_x
    from moeserve.kernels.triton.topk_router import fused_router

    x = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(E, D, device=DEVICE, dtype=torch.bfloat16) * D ** -0.5
    prep = Preparation(bits, block_k, half)
    xw = prep.buffer(T, D, x.device)
    got = fused_router(x, weight, k, True, torch.float32, (prep, xw))
    assert torch.equal(xw, prepare_x(x, bits, block_k, half))
    for a, b in zip(got, fused_router(x, weight, k, True, torch.float32)):
        assert torch.equal(a, b)
