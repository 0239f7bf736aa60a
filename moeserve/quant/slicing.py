"""Exact slices of a QuantizedLinear: its output rows, or a run of its input columns, each a QuantizedLinear of its
own whose buffers are parts of the full layer's (tensor parallelism keeps one slice per rank and reads only those
parts from a checkpoint).

Rows are always exact: every output row keeps its own codes, scales, zeros, bias and compensator row (U's; at
integer compensator widths a row of U^T is grouped along the outputs, so a run of rows must keep whole groups there).
A run of input columns is exact when it starts and ends on whole packing units (pack.py) and whole scale groups, and,
for an integer compensator, on whole groups of V; the bias is not part of a column slice (the sum of the slices'
outputs takes it once). Anything else would change the values: MoeserveError names the cut.
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.errors import MoeserveError
from moeserve.kernels.pack import packed_words
from moeserve.quant import milo
from moeserve.quant.hqq import group_range
from moeserve.quant.qlinear import QuantizedLinear

Parts = dict[str, list[tuple[slice, ...]]]  # buffer name -> index tuples whose results, joined on the last dim, are it


def slice_parts(q: QuantizedLinear, rows: range | None = None, cols: range | None = None) -> Parts:
    """The parts of each of q's buffers that hold its rows `rows` or input columns `cols` (one of them; neither:
    all of each buffer)."""
    assert rows is None or cols is None, "a slice takes rows or columns, not both"
    whole = [(slice(None),)]
    if rows is not None:
        part = [(slice(rows.start, rows.stop),)]
        parts = {"qweight": part, "scale": part, "zero": part}
    elif cols is not None:
        groups = [(slice(None), group_range(cols, q.group))]
        parts = {"qweight": [(slice(None), w) for w in packed_words(cols, q.in_features, q.bits)],
                 "scale": groups, "zero": groups}
    else:
        parts = {"qweight": whole, "scale": whole, "zero": whole}
    if q.rank:
        parts.update(milo.compensator_parts(q.compensator_bits, q.out_features, q.in_features, rows, cols))
    return parts


def join(t: torch.Tensor, parts: list[tuple[slice, ...]]) -> torch.Tensor:
    """The parts of t joined along its last dimension (a copy)."""
    return torch.cat([t[index] for index in parts], -1) if len(parts) > 1 else t[parts[0]].clone()


def slice_linear(q: QuantizedLinear, rows: range | None = None, cols: range | None = None
                 ) -> tuple[QuantizedLinear, Parts]:
    """(a QuantizedLinear of q's rows `rows` or input columns `cols` on q's device, the slice_parts it holds). On the
    meta device it has the slice's shapes only, for a loader to fill from those parts. Rows keep their bias; a column
    slice has none."""
    parts = slice_parts(q, rows, cols)
    in_features = q.in_features if cols is None else len(cols)
    out_features = q.out_features if rows is None else len(rows)
    with torch.device(q.qweight.device):
        part = QuantizedLinear(in_features, out_features, q.bits, q.group, q.rank, q.compensator_bits,
                               bias=q.bias is not None and cols is None)
    for name, index in parts.items():
        t, empty = join(getattr(q, name), index), getattr(part, name)
        if t.shape != empty.shape:  # e.g. a compensator row group that a slice of the layer would not keep
            raise MoeserveError(f"its {name} would have shape {tuple(t.shape)}, a {out_features} x {in_features} "
                                f"layer stores {tuple(empty.shape)}")
        setattr(part, name, t)
    if part.bias is not None:
        bias = q.bias if rows is None else q.bias[rows.start:rows.stop]
        part.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return part, parts
