"""The generated CPU kernels for MXFP4 weights (GPT-OSS's experts as shipped): every ISA here against a float64
dequantize + matmul on random codes and exponents, odd output counts, 1..16 rows; the native whole-layer call with
GPT-OSS's biases and clamped SwiGLU (MXFP4 and affine codes) against float64 experts; the device link's CPU end on
such a layer."""

import time

import pytest
import torch

from moeserve.kernels.cpu import gemv
from moeserve.kernels.cpu.device_link import SEQ_SHIFT, CpuLinkEnd, ask_word
from moeserve.kernels.cpu.gemv import CpuKernel, pack_for_cpu, pack_mxfp4_for_cpu
from moeserve.kernels.cpu.machine import cpu_info
from moeserve.model.experts import glu
from moeserve.quant import hqq
from moeserve.quant.mxfp4 import dequantize
from moeserve.spec import ClampedSwiGLU

ISAS_HERE = cpu_info().isas  # e.g. avx512, avx2, portable
TILE = {"avx512": (3, 2), "avx2": (2, 2), "portable": (2, 1)}


@pytest.fixture(scope="module")
def kernels():
    return {isa: CpuKernel(isa, 4, *TILE[isa], mxfp4=True) for isa in ISAS_HERE}


def random_mxfp4(out_features: int, in_features: int, g: torch.Generator):
    """(blocks [out, in/32, 16], scales [out, in/32]) uint8: every code, exponents 2^-10 .. 2^2 (real checkpoints'
    range: GPT-OSS-20B's span about 2^-12 .. 2^1)."""
    blocks = torch.randint(0, 256, (out_features, in_features // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 10, 127 + 3, (out_features, in_features // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_mxfp4_kernel_matches_float64(kernels, isa):
    kernel, g = kernels[isa], torch.Generator().manual_seed(1)
    for out_features, in_features in ((100, 384), (33, 64), (257, 96)):  # odd counts: padded tiles
        blocks, scales = random_mxfp4(out_features, in_features, g)
        packed = pack_mxfp4_for_cpu(blocks, scales, kernel)
        W = dequantize(blocks, scales, torch.float64)  # [out, in]: exact
        for rows in range(1, 17):
            x = torch.randn(rows, in_features, generator=g)
            y = kernel(x, packed, threads=2)
            ref = x.double() @ W.T
            assert y.shape == (rows, out_features)
            err = (y.double() - ref).abs().max() / ref.abs().max()
            assert err < 1e-5, (isa, out_features, in_features, rows, float(err))


def test_mxfp4_batch_equals_one_call_per_weight(kernels):
    kernel, g = kernels[ISAS_HERE[0]], torch.Generator().manual_seed(2)
    packed = [pack_mxfp4_for_cpu(*random_mxfp4(80, 128, g), kernel) for _ in range(3)]
    rows = [1, 4, 2]
    x = torch.randn(sum(rows), 128, generator=g)
    y = kernel.batch(x, rows, packed, threads=2)
    starts = [0, 1, 5, 7]
    for b, p in enumerate(packed):
        assert torch.equal(y[starts[b]:starts[b + 1]], kernel(x[starts[b]:starts[b + 1]], p, threads=2))


def test_mxfp4_repack_refuses_other_layouts(kernels):
    kernel = kernels[ISAS_HERE[0]]
    with pytest.raises(ValueError, match="blocks \\[out, in/32, 16\\]"):
        pack_mxfp4_for_cpu(torch.zeros(4, 2, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), kernel)
    with pytest.raises(ValueError, match="mxfp4 kernel"):
        pack_mxfp4_for_cpu(torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8),
                           CpuKernel(ISAS_HERE[0], 4, *TILE[ISAS_HERE[0]]))
    assert gemv.default_kernel(4, mxfp4=True).mxfp4


def float64_layer(x, ids, weights, mask, layer, act):
    """The reference of moe_layer: each kept pair's expert as model/experts.gated_ffn computes it, in float64."""
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            if mask[t, j]:
                gu, dn, bgu, bdn = layer[int(ids[t, j])]
                h = x[t].double() @ gu.T + bgu  # [2F]
                out[t] += weights[t, j].double() * (glu(h[None], act)[0] @ dn.T + bdn)
    return out


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("form", ["mxfp4", "affine"])
def test_moe_layer_with_biases_and_clamped_swiglu_matches_float64(kernels, isa, form):
    """moe_layer over GPT-OSS-like experts (gate_up and down biases, the clamped SwiGLU) in one native call equals
    float64 experts of the same weights, for decode rows, rows past a register tile, and masked pairs; the same
    layer without biases and with silu(gate) * up equals its own reference too."""
    g = torch.Generator().manual_seed(4)
    E, D, F, k = 5, 128, 96, 2
    kernel = kernels[isa] if form == "mxfp4" else CpuKernel(isa, 4, *TILE[isa])
    gate_up, down, layer = [], [], []
    for _ in range(E):
        if form == "mxfp4":
            (gb, gs), (db, ds) = random_mxfp4(2 * F, D, g), random_mxfp4(D, F, g)
            gate_up.append(pack_mxfp4_for_cpu(gb, gs, kernel))
            down.append(pack_mxfp4_for_cpu(db, ds, kernel))
            weights = dequantize(gb, gs, torch.float64), dequantize(db, ds, torch.float64)
        else:
            qs = [hqq.quantize_rtn(torch.randn(n, m, generator=g), 4, 32) for n, m in ((2 * F, D), (D, F))]
            gate_up.append(pack_for_cpu(qs[0].codes, qs[0].scale, qs[0].zero, 4, 32, kernel))
            down.append(pack_for_cpu(qs[1].codes, qs[1].scale, qs[1].zero, 4, 32, kernel))
            weights = tuple(hqq.dequantize(q).double() for q in qs)
        layer.append((*weights, torch.randn(2 * F, generator=g).double(), torch.randn(D, generator=g).double()))
    act = ClampedSwiGLU(alpha=1.702, limit=7.0)
    biased = gemv.LayerExperts.of(gate_up, down, ([b[2] for b in layer], [b[3] for b in layer]), act)
    plain = gemv.LayerExperts.of(gate_up, down)
    unbiased = [(gu, dn, torch.zeros(2 * F, dtype=torch.float64), torch.zeros(D, dtype=torch.float64))
                for gu, dn, _, _ in layer]
    for T in (1, 3, 20):
        x = torch.randn(T, D, generator=g) * 4  # past the clamp limit in places
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
        weights = torch.rand(T, k, generator=g)
        mask = torch.rand(T, k, generator=g) > 0.3
        mask[0] = torch.tensor([True, False])
        for experts, ref_layer, ref_act in ((biased, layer, act), (plain, unbiased, None)):
            y = gemv.moe_layer(kernel, experts, x, ids, weights, mask, threads=2)
            ref = float64_layer(x, ids, weights, mask, ref_layer, ref_act)
            err = (y.double() - ref).abs().max() / ref.abs().max()
            assert err < 1e-5, (isa, form, T, ref_act, float(err))
            pending = gemv.moe_layer(kernel, experts, x, ids, weights, mask, threads=3, start=True)
            assert torch.equal(pending.result(), y)


def test_device_link_answers_an_mxfp4_layer_with_biases(kernels):
    """The device link's CPU end computes a registered MXFP4 layer with its biases and clamped SwiGLU as one
    moe_layer call does, bit for bit; a layer of affine codes is refused by an MXFP4 link."""
    kernel, g = kernels[ISAS_HERE[0]], torch.Generator().manual_seed(5)
    E, D, F, k, rows = 4, 64, 64, 2, 4
    packs = [[pack_mxfp4_for_cpu(*random_mxfp4(n, m, g), kernel) for _ in range(E)] for n, m in ((2 * F, D), (D, F))]
    biases = ([torch.randn(2 * F, generator=g) for _ in range(E)], [torch.randn(D, generator=g) for _ in range(E)])
    experts = gemv.LayerExperts.of(*packs, biases, ClampedSwiGLU(alpha=1.702, limit=7.0))
    end = CpuLinkEnd(kernel, num_layers=2, rows=rows, hidden=D, top_k=k, threads=2, cpu=-1, spin_us=100, pin=False)
    try:
        end.register(1, experts, k)
        b = end.buffers
        for seq, T in enumerate((1, 3), start=1):
            x, ids, wts = torch.randn(T, D, generator=g), torch.randint(0, E, (T, k), generator=g), torch.rand(T, k)
            b.x[:T], b.ids[:T], b.wts[:T] = x, ids, wts
            b.ask[0] = ask_word(seq, 1, T)
            deadline = time.monotonic() + 20
            while int(b.answer[0]) < seq << SEQ_SHIFT:
                assert time.monotonic() < deadline, "the CPU end did not answer"
                time.sleep(1e-4)
            assert torch.equal(b.out[:T], gemv.moe_layer(kernel, experts, x, ids, wts, threads=2))
        affine = CpuKernel(ISAS_HERE[0], 4, *TILE[ISAS_HERE[0]])
        q = hqq.quantize_rtn(torch.randn(2 * F, D), 4, 32)
        packed = pack_for_cpu(q.codes, q.scale, q.zero, 4, 32, affine)
        with pytest.raises(ValueError, match="4-bit experts, the link's kernel reads MXFP4"):
            end.register(0, gemv.LayerExperts.of([packed] * E, [packed] * E), k)
    finally:
        end.close()
