"""Triton fused-MoE kernels against the plain-PyTorch expert loop. On a CPU they run in the Triton
interpreter (TRITON_INTERPRET=1, set by conftest) at tiny sizes; on a GPU, compiled."""

import math

import pytest
import torch

pytest.importorskip("triton")

from moeserve.kernels.routing import build_routing_table  # noqa: E402
from moeserve.kernels.triton.fused_moe import fused_experts  # noqa: E402
from moeserve.model.experts import ResidentExperts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = {"gate_up": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4),
         "down": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4)}


def experts(E, D, F):
    ex = ResidentExperts(E, D, F)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, D ** -0.5)
        ex.down_proj.normal_(0, F ** -0.5)
    return ex.to(DEVICE)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every buffer the kernels write starts as NaN, so a row they skip cannot pass as right."""
    real = torch.empty

    def poisoned(*a, **k):
        t = real(*a, **k)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("T,routing", [(1, "random"), (5, "random"), (19, "random"), (37, "one_expert"),
                                       (6, "two_experts")])
@pytest.mark.parametrize("E,k,D,F", [(4, 2, 64, 48), (6, 3, 40, 72)])  # 40, 72: not multiples of the blocks
def test_fused_experts_match_the_loop(poisoned_outputs, T, routing, E, k, D, F):
    ex = experts(E, D, F)
    x = torch.randn(T, D, device=DEVICE)
    if routing == "random":
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    elif routing == "one_expert":  # one expert gets every token (more rows than BLOCK_M): chunks loop
        ids = torch.stack([torch.cat([torch.tensor([E - 1]), torch.randperm(E - 1)[:k - 1]]) for _ in range(T)])
    else:  # only two experts used, the others get zero rows
        ids = torch.tensor([[0, 2] + list(range(3, 3 + k - 2))] * T)
    table = build_routing_table(ids.to(DEVICE), torch.rand(T, k, device=DEVICE), E)
    x_sorted = x[table.token_ids]
    got = fused_experts(x_sorted, ex.gate_up_proj.data, ex.down_proj.data, table, SMALL)
    ref = _loop(ex, x_sorted, table)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


def _loop(ex, x_sorted, table):
    """float64 reference: each slot through its own expert."""
    out = torch.empty(x_sorted.shape, dtype=torch.float64, device=x_sorted.device)
    gu, dn = ex.gate_up_proj.double(), ex.down_proj.double()
    expert_of_slot = torch.repeat_interleave(torch.arange(ex.num_experts, device=x_sorted.device), table.counts)
    for s, e in enumerate(expert_of_slot.tolist()):
        g, u = (gu[e] @ x_sorted[s].double()).chunk(2)
        out[s] = dn[e] @ (torch.nn.functional.silu(g) * u)
    return out


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("N,K,group", [(40, 96, 32), (70, 48, 16), (33, 128, 128)])  # K=48: padded packed rows
def test_lowbit_linear_matches_float64(poisoned_outputs, bits, N, K, group):
    from moeserve.kernels.triton.lowbit_linear import lowbit_linear
    from moeserve.quant import hqq
    from moeserve.quant.qlinear import QuantizedLinear

    qw = hqq.quantize_hqq(torch.randn(N, K), bits, group)
    layer = QuantizedLinear.from_quantized(qw).to(DEVICE)
    for M in (1, 5, 20):  # 20 rows: the 64-row block
        x = torch.randn(M, K, device=DEVICE)
        y = lowbit_linear(x, layer.qweight, layer.scale, layer.zero, bits, group, K, block_n=32, block_k=32)
        ref = x.double() @ hqq.dequantize(qw, torch.float64).to(DEVICE).T
        assert not y.isnan().any()
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
