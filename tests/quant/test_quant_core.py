"""Quantization building blocks against plain float64 references: packing, RTN/HQQ, MiLo, compensators,
rank policies and QuantizedLinear."""

import pytest
import torch

from moeserve.errors import MoeserveError
from moeserve.kernels.pack import pack, planar_from_units, units_from_planar, unpack
from moeserve.quant import hqq, milo
from moeserve.quant.qlinear import QuantizedLinear
from moeserve.quant.ranks import TensorInfo, assign_ranks, parse_rank_policy, weight_kurtosis


def heavy_tailed(out, inp, seed=None):
    """A weight like a trained one: Gaussian bulk, a few large outliers."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    W = torch.randn(out, inp, generator=g) * 0.02
    mask = torch.rand(out, inp, generator=g) < 2e-3
    return torch.where(mask, W * 15, W)


# ---- packing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_round_trip_every_value(bits):
    n = 32 * 9
    codes = torch.randint(0, 1 << bits, (3, 4, n), dtype=torch.uint8)
    codes[0, 0, :1 << bits] = torch.arange(1 << bits)  # every code value appears
    codes[0, 1] = (1 << bits) - 1  # all bits set (sign bit of the int32 words)
    words = pack(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, 4, n * bits // 32)  # zero wasted bits
    assert torch.equal(unpack(words, bits, n), codes)


def test_3bit_layout_is_the_documented_one():
    """Values i and i + 5 of a word 16 bits apart (the GPU kernels decode them as one pair); values 30 and 31 spread
    over bits 15 and 31 of the unit's three words; rows word-planar (word k of unit u at k * units + u)."""
    units = 3
    codes = torch.randint(0, 8, (2, 32 * units), dtype=torch.uint8)
    for row, packed in zip(codes, pack(codes, 3)):
        for u in range(units):
            unit = row[32 * u:32 * (u + 1)]
            words = [int(packed[k * units + u]) & 0xFFFFFFFF for k in range(3)]
            for k in range(3):
                for j in range(5):
                    assert (words[k] >> (3 * j)) & 7 == unit[10 * k + j]
                    assert (words[k] >> (16 + 3 * j)) & 7 == unit[10 * k + 5 + j]
                assert (words[k] >> 15) & 1 == (int(unit[30]) >> k) & 1
                assert words[k] >> 31 == (int(unit[31]) >> k) & 1


def test_3bit_planar_rows_convert_from_the_unit_order():
    """LAYOUT 2 stored each unit's three words together: planar_from_units is the permutation between the two."""
    codes = torch.randint(0, 8, (4, 5, 32 * 7), dtype=torch.uint8)
    planar = pack(codes, 3)
    by_unit = units_from_planar(planar)
    assert not torch.equal(by_unit, planar) and torch.equal(planar_from_units(by_unit), planar)
    assert torch.equal(by_unit.reshape(4, 5, 7, 3)[:, :, 2, 1], planar.reshape(4, 5, 3, 7)[:, :, 1, 2])


@pytest.mark.parametrize("bits,n,message", [(5, 32, "widths"), (3, 48, "multiple of 32"), (4, 20, "multiple of 32")])
def test_pack_rejects_bad_input(bits, n, message):
    with pytest.raises(MoeserveError, match=message):
        pack(torch.zeros(2, n, dtype=torch.uint8), bits)


def test_pack_rejects_out_of_range_codes():
    with pytest.raises(MoeserveError, match="out of range"):
        pack(torch.full((1, 32), 8, dtype=torch.uint8), 3)


# ---- RTN / HQQ -------------------------------------------------------------------------------


def reference_dequant(qw):
    """Float64, one group at a time: the definition W ~ (q - z) * s."""
    out, n = qw.shape
    W = torch.empty(out, n, dtype=torch.float64)
    for g in range(n // qw.group):
        cols = slice(g * qw.group, (g + 1) * qw.group)
        W[:, cols] = (qw.codes[:, cols].double() - qw.zero[:, g:g + 1].double()) * qw.scale[:, g:g + 1].double()
    return W


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_rtn_error_within_half_a_step_and_dequant_matches_reference(bits):
    W = heavy_tailed(48, 128)
    qw = hqq.quantize_rtn(W, bits, 32)
    assert int(qw.codes.max()) < 1 << bits
    deq = hqq.dequantize(qw)
    assert torch.allclose(deq.double(), reference_dequant(qw), atol=1e-6)
    step = qw.scale.float().repeat_interleave(32, 1)
    assert ((W - deq).abs() <= step * 0.5 + 1e-4 * step + 1e-7).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_hqq_never_worse_than_rtn(bits):
    W = heavy_tailed(64, 256)
    rtn = (W - hqq.dequantize(hqq.quantize_rtn(W, bits, 64))).abs()
    opt = (W - hqq.dequantize(hqq.quantize_hqq(W, bits, 64))).abs()
    # HQQ's metric, per group and in total; and it should actually help at low bit widths
    assert (opt.reshape(64, -1, 64).mean(-1) <= rtn.reshape(64, -1, 64).mean(-1) + 1e-7).all()
    if bits <= 3:
        assert opt.mean() < 0.98 * rtn.mean()


def test_quantizer_rejects_bad_settings():
    W = torch.randn(8, 96)
    with pytest.raises(MoeserveError, match="bit width"):
        hqq.quantize_hqq(W, 5, 32)
    with pytest.raises(MoeserveError, match="does not divide"):
        hqq.quantize_rtn(W, 3, 64)


def test_constant_groups_survive():
    W = torch.full((4, 64), 0.37)
    W[1] = 0.0
    assert torch.allclose(hqq.dequantize(hqq.quantize_hqq(W, 3, 32)), W, atol=1e-3)


# ---- MiLo ------------------------------------------------------------------------------------


def quantize3(M):
    return hqq.quantize_hqq(M, 3, 64)


def test_milo_error_non_increasing_and_below_hqq():
    W = heavy_tailed(192, 256, seed=1)
    result = milo.milo(W, 16, quantize3, seed=0)
    e = result.errors
    assert 3 <= len(e) <= 20
    assert all(b <= a * (1 + 1e-6) for a, b in zip(e, e[1:]))
    final = (W - hqq.dequantize(result.q_state) - result.U @ result.V).norm()
    assert abs(float(final) - e[-1]) <= 1e-4 * e[-1]  # the reported error is the real one
    assert e[-1] < 0.9 * float((W - hqq.dequantize(quantize3(W))).norm())


def test_randomized_svd_close_to_exact_on_low_rank_plus_noise():
    g = torch.Generator().manual_seed(torch.seed())
    R = torch.randn(1500, 12, generator=g) @ torch.randn(12, 1100, generator=g) + 0.01 * torch.randn(1500, 1100,
                                                                                                     generator=g)
    U, V = milo.low_rank(R, 12, torch.Generator().manual_seed(0))  # 1100 > EXACT_SVD_MAX_DIM: randomised
    S = torch.linalg.svdvals(R)
    best = S[12:].pow(2).sum().sqrt()
    assert (R - U @ V).norm() <= 1.01 * best


def test_milo_rank_out_of_range():
    with pytest.raises(MoeserveError, match="rank"):
        milo.milo(torch.randn(16, 64), 17, quantize3)


@pytest.mark.parametrize("bits,max_rel", [(16, 0.01), (8, 0.02), (3, 0.45)])
def test_compensator_storage_round_trip(bits, max_rel):
    U, V = torch.randn(96, 12), torch.randn(12, 128)
    bufs = milo.compensator_to_buffers(U, V, bits)
    U2, V2 = milo.compensator_from_buffers(bufs, bits, 96, 128, 12)
    assert U2.shape == U.shape and V2.shape == V.shape
    for a, b in ((U, U2), (V, V2)):
        assert (a - b).norm() / a.norm() < max_rel
    assert milo.compensator_bytes((96, 128), 12, bits) == sum(t.numel() * t.element_size() for t in bufs.values())
    if bits == 3:  # integer codes with an absmax scale: the largest entry of each group is exact
        assert torch.allclose(V2.abs().amax(1), V.abs().amax(1), rtol=2e-3)


@pytest.mark.parametrize("bits", [16, 8, 3])
def test_padded_compensator_adds_exact_zero_components_and_slices_back(bits):
    """An expert store pads compensators to one rank: the extra components dequantize to exactly zero, the product
    (x V^T) U^T matches the float64 one of the stored rank, and the slice gives the stored buffers back."""
    U, V = torch.randn(96, 5), torch.randn(5, 128)
    bufs = milo.compensator_to_buffers(U, V, bits)
    padded = milo.padded_compensator(bufs, bits, 5, 8)
    assert {n: t.shape for n, t in padded.items()} == {n: t.shape for n, t in milo.compensator_buffers(96, 128, 8,
                                                                                                        bits).items()}
    U5, V5 = milo.compensator_from_buffers(bufs, bits, 96, 128, 5)
    U8, V8 = milo.compensator_from_buffers(padded, bits, 96, 128, 8)
    assert torch.equal(U8[:, :5], U5) and torch.equal(V8[:5], V5)
    assert not U8[:, 5:].any() and not V8[5:].any()
    x = torch.randn(3, 128)
    want = (x.double() @ V5.double().T) @ U5.double().T  # [3, 96]
    assert torch.allclose((x @ V8.T) @ U8.T, want.float(), rtol=1e-4, atol=1e-4)
    back = milo.compensator_slice(padded, 5)
    assert all(torch.equal(back[n], bufs[n]) for n in bufs)
    with pytest.raises(MoeserveError, match="rank-5 compensator to rank 4"):
        milo.padded_compensator(bufs, bits, 5, 4)


def test_int3_compensator_costs_less_than_int8_and_bf16():
    sizes = [milo.compensator_bytes((4096, 14336), 32, b) for b in (3, 8, 16)]
    assert sizes[0] < sizes[1] < sizes[2]
    assert sizes[0] < 0.25 * sizes[2]


# ---- QuantizedLinear -------------------------------------------------------------------------


@pytest.mark.parametrize("bits,cbits", [(3, 16), (4, 8), (2, 3), (8, 16)])
def test_quantized_linear_forward_matches_float64_reference(bits, cbits):
    W = heavy_tailed(40, 96)  # 96 inputs: rows padded to 128 codes for packing
    bias = torch.randn(40)
    q, bufs, _ = milo.fit(W, 4, lambda M: hqq.quantize_hqq(M, bits, 32), cbits, iters=3)
    layer = QuantizedLinear.from_quantized(q, bufs, 4, cbits, bias)
    x = torch.randn(5, 7, 96)
    U, V = milo.compensator_from_buffers(bufs, cbits, 40, 96, 4)
    ref = x.double() @ reference_dequant(q).T + (x.double() @ V.double().T) @ U.double().T + bias.double()
    torch.testing.assert_close(layer(x).double(), ref, atol=1e-4, rtol=1e-4)
    assert (layer(x) - x @ W.T - bias).norm() < (x @ W.T).norm()  # it approximates W


# ---- rank policies ---------------------------------------------------------------------------


def model_tensors():
    ts = [TensorInfo(f"l{i}.{p}", "attention", i, None, (256, 256)) for i in range(2) for p in "qkvo"]
    ts += [TensorInfo(f"l{i}.e{e}.{m}", "expert", i, e, (512, 256) if m == "gu" else (256, 256))
           for i in range(2) for e in range(4) for m in ("gu", "d")]
    return ts


def test_rank_policies_give_the_promised_ranks():
    ts = model_tensors()
    experts = [t for t in ts if t.kind == "expert"]
    dense = [t for t in ts if t.kind == "attention"]
    r = assign_ranks(ts, parse_rank_policy("uniform:8"))
    assert set(r.values()) == {8}
    r = assign_ranks(ts, parse_rank_policy("dense=32,experts=4"))
    assert all(r[t.name] == 32 for t in dense) and all(r[t.name] == 4 for t in experts)
    kurt = {t.name: float(k) for t, k in zip(ts, torch.rand(len(ts)) * 10 + 1)}
    r = assign_ranks(ts, parse_rank_policy("dense=32,experts=kurtosis:16"), kurtosis=kurt)
    assert sum(r[t.name] for t in experts) == 16 * len(experts)  # mean rank exactly 16
    by_k = sorted(experts, key=lambda t: kurt[t.name])
    assert all(r[a.name] <= r[b.name] for a, b in zip(by_k, by_k[1:]))  # monotone in kurtosis
    freq = {(t.layer, t.expert): n for t, n in zip(experts, torch.randint(1, 1000, (len(experts),)).tolist())}
    r = assign_ranks(ts, parse_rank_policy("experts=frequency:8"), frequency=freq)
    assert sum(r[t.name] for t in experts) == 8 * len(experts) and all(r[t.name] == 0 for t in dense)
    r = assign_ranks(ts, parse_rank_policy("uniform:8,experts=2"))  # later rules override
    assert all(r[t.name] == 2 for t in experts) and all(r[t.name] == 8 for t in dense)


@pytest.mark.parametrize("policy,bits", [("experts=kurtosis:300KB", 16), ("dense=100KiB", 3), ("all=1MB", 8)])
def test_memory_budget_is_respected_and_used(policy, bits):
    ts = model_tensors()
    kurt = {t.name: float(k) for t, k in zip(ts, torch.rand(len(ts)) * 10 + 1)}
    rule = parse_rank_policy(policy)[0]
    r = assign_ranks(ts, [rule], kurtosis=kurt, compensator_bits=bits)
    members = [t for t in ts if t.kind in rule.kinds]
    used = sum(milo.compensator_bytes(t.shape, r[t.name], bits) for t in members)
    assert 0 < used <= rule.budget_bytes
    one_more = min(milo.compensator_bytes(t.shape, 1, bits) for t in members)
    assert used > rule.budget_bytes - 2 * len(members) * one_more  # the budget is mostly spent


@pytest.mark.parametrize("text,message", [("zipf:3", "signal"), ("heads=3", "target"), ("kurtosis:abc", "rank value"),
                                          ("dense=frequency:3", "experts only"), ("", "empty")])
def test_bad_rank_policies(text, message):
    with pytest.raises(MoeserveError, match=message):
        parse_rank_policy(text)


def test_kurtosis_of_gaussian_is_three_and_outliers_raise_it():
    W = torch.randn(512, 512)
    assert abs(weight_kurtosis(W) - 3) < 0.1
    assert weight_kurtosis(heavy_tailed(512, 512)) > 10
