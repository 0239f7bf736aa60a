"""The 4-bit MMA MoE kernels (kernels/cuda): their weight layout against float64 (CPU: the layout decoded by the
m16n8k16 fragment map the kernel uses), the shipped PTX built from today's source, and on a GPU the kernels against
float64 and against the Triton low-bit MoE, with odd shapes and an expert that gets no rows."""

from __future__ import annotations

import gzip

import pytest
import torch

from moeserve.kernels.cuda import build
from moeserve.kernels.cuda.w4_layout import interleave_gate_up, mma_layout, reference_tile_product, supported
from moeserve.kernels.pack import pack

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def random_experts(E, N, K, group, device="cpu"):
    g = torch.Generator().manual_seed(N * 7 + K)
    codes = torch.randint(0, 16, (E, N, K), generator=g)
    scale = (torch.rand(E, N, K // group, generator=g) * 0.05 + 0.001).half()
    zero = (torch.rand(E, N, K // group, generator=g) * 15).half()
    return codes.to(device), scale.to(device), zero.to(device)


def dequantized(codes, scale, zero, group):
    E, N, K = codes.shape
    w = (codes.double().reshape(E, N, K // group, group) - zero.double()[..., None]) * scale.double()[..., None]
    return w.reshape(E, N, K)


@pytest.mark.parametrize("gate_up,group", [(False, 64), (True, 64), (False, 128)])
def test_layout_decodes_to_the_weight(gate_up, group):
    codes, scale, zero = random_experts(2, 64, 256, group)
    words, scales = mma_layout(pack(codes, 4), scale, zero, 256, gate_up)
    w = dequantized(codes, scale, zero, group)
    if gate_up:
        w = interleave_gate_up(w)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for e in range(2):
        got = reference_tile_product(words[e], scales[e], x, group)
        torch.testing.assert_close(got, x @ w[e].T, rtol=0, atol=1e-9)


def test_supported_shapes():
    assert supported(4, 64, 64, 128) and supported(4, 128, 32, 256)
    assert not supported(3, 64, 64, 128)  # 4-bit only
    assert not supported(4, 32, 64, 128)  # groups of whole 64-input chunks
    assert not supported(4, 64, 48, 128)  # whole pairs of 16-row tiles


def test_shipped_ptx_is_built_from_the_source():
    source = build.HERE / "w4_moe.cu"
    with gzip.open(build.shipped(source), "rt") as f:
        head = f.readline().strip()
    assert head == f"// source {build.source_hash(source)}", "rebuild: python -m moeserve.kernels.cuda.build"


@pytest.mark.skipif(not GPU, reason="needs an Ampere or later GPU")
@pytest.mark.parametrize("E,D,F,group,T,k,dtype", [(4, 256, 512, 64, 5, 2, torch.bfloat16),
                                                   (8, 512, 256, 128, 37, 3, torch.float16),
                                                   (6, 256, 128, 64, 70, 1, torch.bfloat16)])
def test_gpu_w4_experts_match_float64(E, D, F, group, T, k, dtype):
    from moeserve.kernels.cuda.w4_moe import W4Experts, W4Projection, w4_experts
    from moeserve.kernels.routing import build_routing_table

    dev = torch.device("cuda")
    gu, dn = random_experts(E, 2 * F, D, group, dev), random_experts(E, D, F, group, dev)
    experts = W4Experts(W4Projection.of(pack(gu[0], 4), gu[1], gu[2], group, D, True),
                        W4Projection.of(pack(dn[0], 4), dn[1], dn[2], group, F, False))
    ids = torch.stack([torch.randperm(E - 1, device=dev)[:k] for _ in range(T)])  # expert E - 1 gets no rows
    table = build_routing_table(ids, torch.rand(T, k, device=dev), E)
    x = torch.randn(T * k, D, device=dev, dtype=dtype)
    wg, wd = dequantized(*gu, group), dequantized(*dn, group)
    ends = table.offsets.tolist()
    ref = torch.full((T * k, D), float("nan"), dtype=torch.float64, device=dev)
    for e, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
        hh = x[a:b].double() @ wg[e].T
        h = (torch.nn.functional.silu(hh[:, :F]) * hh[:, F:]).to(dtype).double()
        ref[a:b] = h @ wd[e].T
    for split in (1, 3):
        y = w4_experts(x, experts, table.offsets, T, k, split=split).double()
        assert not y.isnan().any()
        torch.testing.assert_close(y, ref, rtol=0, atol=2e-3 * ref.abs().max().item())


@pytest.mark.skipif(not GPU, reason="needs an Ampere or later GPU")
def test_gpu_quantized_experts_take_the_mma_kernels(monkeypatch):
    """MOESERVE_MMA_MOE=1: QuantizedExperts runs 2..64 tokens on the MMA kernels, equal to the Triton path."""
    from checks import quantized
    from moeserve.kernels.cuda import w4_moe
    from moeserve.kernels.routing import build_routing_table
    from moeserve.quant.qlinear import QuantizedExperts

    e, dim, ffn, T, k = 8, 512, 1024, 24, 2
    ex = QuantizedExperts([quantized(2 * ffn, dim, 4, 64, 0) for _ in range(e)],
                          [quantized(dim, ffn, 4, 64, 0) for _ in range(e)]).cuda()
    ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(T)])
    table = build_routing_table(ids, torch.rand(T, k, device="cuda"), e)
    x = torch.randn(T * k, dim, device="cuda", dtype=torch.bfloat16)
    monkeypatch.delenv(w4_moe.ENV, raising=False)
    ref = ex.run_sorted(x, table)
    assert ex.mma_experts(x, T) is None
    monkeypatch.setenv(w4_moe.ENV, "1")
    assert ex.mma_experts(x, T) is not None
    got = ex.run_sorted(x, table)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-2 * ref.abs().max().item())
