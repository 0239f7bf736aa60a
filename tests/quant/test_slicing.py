"""Slices of a QuantizedLinear (quant/slicing.py) hold exactly the full layer's values, at every width and
compensator storage; a slice that would cut a group or a packing unit is refused."""

import pytest
import torch

from moeserve.errors import MoeserveError
from moeserve.quant import hqq, milo
from moeserve.quant.qlinear import QuantizedLinear
from moeserve.quant.slicing import slice_linear


def layer(out_features: int, in_features: int, bits: int, group: int, compensator_bits: int, rank: int = 3):
    """A random low-bit layer with a bias and a rank-r compensator stored at compensator_bits (RTN: no fitting)."""
    g = torch.Generator().manual_seed(bits * 100 + compensator_bits)
    W = torch.randn(out_features, in_features, generator=g)
    U, V = torch.randn(out_features, rank, generator=g), torch.randn(rank, in_features, generator=g)
    return QuantizedLinear.from_quantized(hqq.quantize_rtn(W, bits, group),
                                          milo.compensator_to_buffers(U, V, compensator_bits), rank, compensator_bits,
                                          torch.randn(out_features, generator=g))


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("compensator_bits", [3, 8, 16])
def test_row_and_column_slices_hold_the_full_layers_values(bits, compensator_bits):
    q = layer(128, 192, bits, 32, compensator_bits)
    U, V = q.compensator(torch.float32)
    for rows in (range(0, 64), range(64, 128)):
        part, _ = slice_linear(q, rows=rows)
        assert (part.out_features, part.in_features) == (64, 192)
        assert_same(part.weight(), q.weight()[rows.start:rows.stop])
        assert_same(part.compensator(torch.float32)[0], U[rows.start:rows.stop])
        assert_same(part.compensator(torch.float32)[1], V)
        assert_same(part.bias, q.bias[rows.start:rows.stop])
    for cols in (range(0, 64), range(64, 192)):
        part, _ = slice_linear(q, cols=cols)
        assert part.in_features == len(cols) and part.bias is None  # the bias is added once, after the sum
        assert_same(part.weight(), q.weight()[:, cols.start:cols.stop])
        assert_same(part.compensator(torch.float32)[0], U)
        assert_same(part.compensator(torch.float32)[1], V[:, cols.start:cols.stop])


@pytest.mark.parametrize("compensator_bits", [3, 8])
def test_a_row_stored_whole_keeps_its_scale_and_the_last_run_may_end_in_padding(compensator_bits):
    """80 inputs: one compensator scale per row (64 does not divide 80), packed rows padded to 96 values."""
    q = layer(16, 80, 4, 16, compensator_bits)
    part, _ = slice_linear(q, cols=range(32, 80))
    assert_same(part.weight(), q.weight()[:, 32:])
    assert_same(part.compensator(torch.float32)[1], q.compensator(torch.float32)[1][:, 32:])


@pytest.mark.parametrize("group, compensator_bits, rows, cols, message", [
    (16, 16, None, range(0, 48), "values 0..47 cut a packing unit of 32"),
    (64, 16, None, range(0, 96), "values 0..95 cut a group of 64"),  # the weight's groups
    (32, 8, None, range(32, 96), "values 32..95 cut a group of 64"),  # V's (the weight's of 32 kept)
    (32, 8, range(0, 32), None, "values 0..31 cut a group of 64")])  # U^T's, along the outputs
def test_a_slice_that_cuts_a_unit_or_a_group_is_refused(group, compensator_bits, rows, cols, message):
    with pytest.raises(MoeserveError, match=message):
        slice_linear(layer(128, 192, 4, group, compensator_bits), rows, cols)
