"""The int8-activation CPU kernels (INT8_ISA, AVX512-VNNI; codegen_int8.py): against a float64 emulation of their
algebra (inputs rounded to int8 per block of ACT_BLOCK values, then exact) to float rounding, and against the exact
float64 product of the dequantized weights within a bounded error (2/4/8-bit affine codes and MXFP4, 1..16 rows, odd
output counts, groups 32..128); the batched and whole-layer calls; the one-line error without VNNI. Kernel tests skip
on CPUs without VNNI."""

import pytest
import torch

from moeserve.errors import MoeserveError
from moeserve.kernels.cpu import codegen_int8, machine, tuning
from moeserve.kernels.cpu.gemv import CpuKernel, LayerExperts, moe_layer, pack_for_cpu, pack_mxfp4_for_cpu
from moeserve.kernels.cpu.machine import INT8_ISA, CpuInfo, check_int8_dots, cpu_info
from moeserve.quant import hqq
from moeserve.quant.mxfp4 import dequantize

TILE = (4, 2)  # rows x vectors: partial row and vector tiles occur below
# measured here (AMD EPYC Zen4), Gaussian inputs: relative (Frobenius) error of one product 0.35-0.75%, of a layer
# of gated experts 0.8-1.1%; the bounds leave room for other draws
PRODUCT_BOUND, LAYER_BOUND = 0.012, 0.015


@pytest.fixture(scope="module")
def kernels():
    if not cpu_info().int8_dots:
        pytest.skip("no AVX512-VNNI on this CPU")
    out = {bits: CpuKernel(INT8_ISA, bits, *TILE) for bits in codegen_int8.INT8_BITS}
    out["mxfp4"] = CpuKernel(INT8_ISA, 4, *TILE, mxfp4=True)
    return out


def emulated_inputs(x: torch.Tensor) -> torch.Tensor:
    """x [m, n] as the kernels see it: per ACT_BLOCK values d = max|x| / 127, round(x * 127 / max|x|) * d (float32
    steps, ties to even), in float64."""
    xu = x.reshape(x.shape[0], -1, codegen_int8.ACT_BLOCK)  # [m, n / block, block]
    amax = xu.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xu * inv).double() * (amax / 127.0).double()).reshape(x.shape)


def relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def test_byte_order_is_a_permutation_of_each_unit():
    for bits in codegen_int8.INT8_BITS:
        order = codegen_int8.byte_order(bits)
        assert sorted(order) == list(range(32))
        assert sorted(order[:16]) == list(range(16))  # the first 4 byte vectors: the first block of 16
    assert codegen_int8.byte_order(8) == list(range(32))  # whole bytes: the inputs' own order


@pytest.mark.parametrize("bits", codegen_int8.INT8_BITS)
def test_affine_codes_match_the_emulation_and_stay_near_exact(kernels, bits):
    kernel, g = kernels[bits], torch.Generator().manual_seed(bits)
    out_features, in_features = 100, 384  # 100 outputs: not a whole tile (padding)
    W = torch.randn(out_features, in_features, generator=g)
    for group in (32, 64, 128):
        qw = hqq.quantize_rtn(W, bits, group)
        packed = pack_for_cpu(qw.codes, qw.scale, qw.zero, bits, group, kernel)
        Wq = ((qw.codes.double().reshape(out_features, -1, group) - qw.zero.half().double().unsqueeze(-1))
              * qw.scale.half().double().unsqueeze(-1)).reshape(out_features, in_features)  # [out, in]
        for rows in (1, 3, 4, 8, 16):
            x = torch.randn(rows, in_features, generator=g)
            y = kernel(x, packed, threads=2)
            assert y.shape == (rows, out_features)
            emulated = emulated_inputs(x) @ Wq.T  # [rows, out]
            assert float((y.double() - emulated).abs().max() / emulated.abs().max()) < 1e-5, (bits, group, rows)
            assert relative(y, x.double() @ Wq.T) < PRODUCT_BOUND, (bits, group, rows)


def test_mxfp4_matches_the_emulation_and_stays_near_exact(kernels):
    kernel, g = kernels["mxfp4"], torch.Generator().manual_seed(7)
    for out_features, in_features in ((100, 384), (33, 64)):
        blocks = torch.randint(0, 256, (out_features, in_features // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(117, 130, (out_features, in_features // 32), generator=g, dtype=torch.uint8)
        packed = pack_mxfp4_for_cpu(blocks, scales, kernel)
        W = dequantize(blocks, scales, torch.float64)  # [out, in]
        for rows in (1, 5, 8, 16):
            x = torch.randn(rows, in_features, generator=g)
            y = kernel(x, packed, threads=2)
            emulated = emulated_inputs(x) @ W.T
            assert float((y.double() - emulated).abs().max() / emulated.abs().max()) < 1e-5, rows
            assert relative(y, x.double() @ W.T) < PRODUCT_BOUND, rows


def test_batch_equals_one_call_per_weight(kernels):
    kernel, g = kernels[4], torch.Generator().manual_seed(3)
    qws = [hqq.quantize_rtn(torch.randn(70, 128, generator=g), 4, 64) for _ in range(3)]
    packed = [pack_for_cpu(q.codes, q.scale, q.zero, 4, 64, kernel) for q in qws]
    rows = [1, 6, 2]
    x = torch.randn(sum(rows), 128, generator=g)
    y = kernel.batch(x, rows, packed, threads=2)  # [9, 70]
    starts = [0, 1, 7, 9]
    for b, p in enumerate(packed):
        torch.testing.assert_close(y[starts[b]:starts[b + 1]], kernel(x[starts[b]:starts[b + 1]], p, threads=1))


def test_layer_of_4bit_experts_is_near_the_float64_experts(kernels):
    """moe_layer (grouping, both projections, SwiGLU, weighted sum in C) on int8 activations against float64
    experts of the dequantized weights, 1..8 tokens."""
    kernel, g = kernels[4], torch.Generator().manual_seed(4)
    E, k, D, F_ = 6, 2, 256, 128

    def weight(out_f, in_f):
        qw = hqq.quantize_rtn(torch.randn(out_f, in_f, generator=g) / in_f ** 0.5, 4, 64)
        W = ((qw.codes.double().reshape(out_f, -1, 64) - qw.zero.half().double().unsqueeze(-1))
             * qw.scale.half().double().unsqueeze(-1)).reshape(out_f, in_f)
        return pack_for_cpu(qw.codes, qw.scale, qw.zero, 4, 64, kernel), W

    gate_up, down = zip(*[weight(2 * F_, D) for _ in range(E)]), zip(*[weight(D, F_) for _ in range(E)])
    (gu_packed, gu_ref), (dn_packed, dn_ref) = gate_up, down
    experts = LayerExperts.of(list(gu_packed), list(dn_packed))
    for T in (1, 4, 8):
        x = torch.randn(T, D, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
        wts = torch.rand(T, k, generator=g)  # [T, k]
        y = moe_layer(kernel, experts, x, ids, wts, threads=2)  # [T, D]
        ref = torch.zeros(T, D, dtype=torch.float64)
        for t in range(T):
            for j in range(k):
                e = int(ids[t, j])
                h = gu_ref[e] @ x[t].double()  # [2F]
                a = torch.nn.functional.silu(h[:F_]) * h[F_:]  # [F]
                ref[t] += float(wts[t, j]) * (dn_ref[e] @ a)
        assert relative(y, ref) < LAYER_BOUND, T


def test_int8_register_tiles_hold_three_accumulator_sets():
    for rows, vectors in tuning.register_tiles(INT8_ISA):
        assert rows + 3 * rows * vectors + vectors <= 32


def test_a_cpu_without_vnni_is_refused_in_one_line(monkeypatch):
    plain = CpuInfo("Old CPU", frozenset({"avx512f", "avx512bw", "avx512vl"}), 32768, 1 << 20, 4)
    monkeypatch.setattr(machine, "cpu_info", lambda: plain)
    with pytest.raises(MoeserveError, match="--cpu-int8 needs a CPU with AVX512-VNNI") as e:
        check_int8_dots()
    assert "\n" not in str(e.value)
