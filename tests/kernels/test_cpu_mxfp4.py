"""The generated CPU kernels for MXFP4 weights (GPT-OSS's experts as shipped): every ISA here against a float64
dequantize + matmul on random codes and exponents, odd output counts, 1..16 rows."""

import pytest
import torch

from moeserve.kernels.cpu import gemv
from moeserve.kernels.cpu.gemv import CpuKernel, pack_mxfp4_for_cpu
from moeserve.kernels.cpu.machine import cpu_info
from moeserve.quant.mxfp4 import dequantize

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
