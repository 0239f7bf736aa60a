"""A parallel model from a checkpoint, each rank reading only its own part straight from the safetensors memory
map, so no rank ever holds a full copy: its routed experts (its EP share, or its FFN slice of every expert
under expert slicing), and under TP its slices of the dense weights (attention, dense and shared-expert FFNs,
embedding, head; tensor_parallel.tp_index says which). The model is built and cut to this rank's part on the
meta device first, then filled; replicated tensors (norms, routers, closing biases) are read whole.

A moeserve quantized checkpoint loads alike: a rank reads the packed buffers of its own experts only (all of them
under TP alone, which keeps low-bit experts whole, see tensor_parallel.py), and of each low-bit dense layer the parts
that TP keeps (quant/slicing.py). dense_bits 8 (--dense-bits) quantizes each dense layer from its whole float weight
on every rank, one layer at a time, and keeps this rank's part: HQQ's result depends on the whole matrix, so a slice
quantized on its own would not equal one process's layer.

Errors a user can cause surface on every rank as one line: layout errors are the same on all ranks, and
loading ends with a collective in which the ranks that failed tell the others (see collectives.py).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from moeserve.checkpoint import CheckpointReader, per_expert_names, read_interleaved_part, read_tensor, tensor_experts
from moeserve.errors import MoeserveError
from moeserve.families import lookup
from moeserve.loader import is_routed_expert, meta_model, read_weights, resolve_device, resolve_dtype
from moeserve.model.experts import LoopedExperts, expert_tensors, set_expert_tensor
from moeserve.parallel.accounting import CountingReader, LoadReport, checkpoint_bytes
from moeserve.parallel.collectives import raise_if_any_failed
from moeserve.parallel.expert_parallel import enable_expert_parallel
from moeserve.parallel.groups import RankGrid, check_experts, expert_share, new_groups, split_range
from moeserve.parallel.hierarchical import node_groups
from moeserve.parallel.tensor_parallel import check_tensor_parallel, enable_tensor_parallel, tp_index
from moeserve.parallel.defaults import COLLECTIVE_TIMEOUT_S, STATIC_MAX_TOKENS
from moeserve.plan.layers import LayerPlacement
from moeserve.quant.defaults import DENSE_BITS
from moeserve.quant.dense import DENSE_GROUP, convertible, quantize_linear, replace_module
from moeserve.quant.manifest import FORMAT, is_quantized_expert, read_manifest, stored_to_current
from moeserve.quant.mxfp4 import BLOCK
from moeserve.quant.qlinear import QuantizedExperts, QuantizedLinear
from moeserve.quant.slicing import Parts, join, slice_parts
from moeserve.spec import ModelSpec

log = logging.getLogger(__name__)


def read_expert_shard(reader: CheckpointReader, layer: int, family: str, ffn_size: int, experts: range,
                      ffn: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts `experts` of `layer`, rows `ffn` of their FFN dimension: (gate_up [n, 2f, D], down [n, D, f]),
    from fused (transformers 5) or per-expert (classic HF) tensors; nothing else is read."""
    f = slice(ffn.start, ffn.stop)
    fused = f"model.layers.{layer}.mlp.experts"
    if f"{fused}.gate_up_proj" in reader:  # [E, 2F, D]: gate rows, then up rows
        e = slice(experts.start, experts.stop)
        gate = reader.get_slice(f"{fused}.gate_up_proj", (e, f))
        up = reader.get_slice(f"{fused}.gate_up_proj", (e, slice(ffn_size + ffn.start, ffn_size + ffn.stop)))
        return torch.cat([gate, up], 1), reader.get_slice(f"{fused}.down_proj", (e, slice(None), f))
    names = [per_expert_names(layer, family, j) for j in experts]
    gate_up = torch.stack([torch.cat([reader.get_slice(g, (f,)), reader.get_slice(u, (f,))]) for g, u, _ in names])
    return gate_up, torch.stack([reader.get_slice(d, (slice(None), f)) for _, _, d in names])


def read_interleaved_experts(reader: CheckpointReader, layer: int, experts: range, ffn: range, full_ffn: int,
                             leaf: nn.Module) -> dict[str, torch.Tensor]:
    """Every expert tensor of `leaf` (weights, biases, MXFP4 blocks and scales) for experts `experts`, FFN rows
    `ffn`, of `layer`, from a family that stores them fused and interleaved (GPT-OSS), in moeserve's layout. Down's
    bias, added after the ranks' partial sums are summed, is read by the rank of the first FFN slice; the others
    hold zeros."""
    out = {}
    for name, t in expert_tensors(leaf):
        stored = f"model.layers.{layer}.mlp.experts.{name}"
        if name == "down_proj_bias" and ffn.start > 0:
            out[name] = torch.zeros(t.shape, dtype=torch.float32)
        else:
            out[name] = read_interleaved_part(reader, stored, experts, ffn, full_ffn, BLOCK)
    return out


def set_linear(q: QuantizedLinear, name: str, buffers: dict[str, torch.Tensor], bias: torch.Tensor | None, device,
               dtype) -> None:
    """Put `buffers` (q's buffer name -> tensor, in their stored dtypes) and `bias` (in dtype) into the (meta) low-bit
    layer q, whose stored name is `name`."""
    for buf, t in buffers.items():
        meta = getattr(q, buf)
        if tuple(t.shape) != tuple(meta.shape):
            raise MoeserveError(f"{name}.{buf} has shape {tuple(t.shape)} in the checkpoint, config.json implies "
                                f"{tuple(meta.shape)}")
        setattr(q, buf, t.to(device=device, dtype=meta.dtype))
    if bias is not None:
        q.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)


def stored_parts(reader: CheckpointReader, manifest: dict, name: str, index: list[tuple[slice, ...]]) -> torch.Tensor:
    """The parts `index` of the stored low-bit buffer `name`, joined: only they are read from a checkpoint of the
    current format; an older one's buffer is read whole and converted first (its 3-bit rows lie in another order)."""
    if manifest["format"] == FORMAT:
        return torch.cat([reader.get_slice(name, i) for i in index], -1)
    return join(stored_to_current(manifest, name, reader.get(name)), index)


def fill_quantized_experts(leaf: QuantizedExperts, reader: CheckpointReader, manifest: dict, layer: int,
                           experts: range, device, dtype) -> None:
    """Read the low-bit layers of experts `experts` of `layer` whole into leaf's (meta) ones, leaf's j-th being expert
    experts[j]; nothing of the other experts is read."""
    for j, e in enumerate(experts):
        for proj, linears in (("gate_up", leaf.gate_up), ("down", leaf.down)):
            q, name = linears[j], f"model.layers.{layer}.mlp.experts.{proj}.{e}"
            whole = slice_parts(q)
            bias = None if q.bias is None else reader.get(f"{name}.bias")
            set_linear(q, name, {buf: stored_parts(reader, manifest, f"{name}.{buf}", index)
                                 for buf, index in whole.items()}, bias, device, dtype)


def fill_experts(model, reader: CheckpointReader, manifest: dict | None, experts_of, ffn: range, device,
                 dtype) -> None:
    """Read this rank's experts (experts_of(layer) -> range) into the (meta) expert backends the parallel wrappers
    hold, slices of their FFN rows `ffn` (for interleaved families with all their tensors: biases, MXFP4 blocks and
    scales, such buffers in their stored dtype; low-bit experts whole, from the quantized checkpoint `manifest`
    describes)."""
    spec = model.spec
    for i, layer in enumerate(model.model.layers):
        backend = getattr(layer.mlp, "experts", None)
        if backend is None:
            continue
        experts = experts_of(i)
        leaf = next(m for m in backend.modules() if isinstance(m, LoopedExperts))
        if isinstance(leaf, QuantizedExperts):
            fill_quantized_experts(leaf, reader, manifest, i, experts, device, dtype)
            continue
        if lookup(spec.family).interleaved_experts:
            read = read_interleaved_experts(reader, i, experts, ffn, spec.moe.expert_ffn, leaf)
        else:
            read = dict(zip(("gate_up_proj", "down_proj"),
                            read_expert_shard(reader, i, spec.family, spec.moe.expert_ffn, experts, ffn)))
        for name, t in read.items():
            meta = getattr(leaf, name)
            if tuple(t.shape) != tuple(meta.shape):
                raise MoeserveError(f"layer {i} experts {experts.start}..{experts.stop - 1}: {name} has shape "
                                    f"{tuple(t.shape)} in the checkpoint, config.json implies {tuple(meta.shape)}")
            kept = dtype if isinstance(meta, nn.Parameter) else meta.dtype  # packed buffers keep their dtype
            set_expert_tensor(leaf, name, t.to(device=device, dtype=kept))


def empty_dense_quantized(model, bits: int) -> list[str]:
    """Replace the dense linear layers --dense-bits converts (quant/dense.py) by empty B-bit layers of their shapes on
    the meta device, before TP cuts them; returns their names (fill_low_bit quantizes each from its float weight)."""
    names = convertible(model)
    for name in names:
        linear = model.get_submodule(name)
        with torch.device("meta"):
            q = QuantizedLinear(linear.in_features, linear.out_features, bits, DENSE_GROUP,
                                bias=linear.bias is not None)
        replace_module(model, name, q)
    return names


def own_low_bit(model, dense: list[str], sliced: dict[str, tuple[QuantizedLinear, Parts]]
                ) -> dict[str, tuple[QuantizedLinear, Parts]]:
    """The low-bit dense layers fill_low_bit fills (read_weights, which reads tensors whole or as one slice, does
    not): those TP cut (`sliced`) and the --dense-bits ones (`dense`); by the full layer's name, each with the parts
    of the full layer's buffers it holds."""
    own = dict(sliced)
    for name in dense:
        if name not in own:  # not cut: all of it
            q = model.get_submodule(name)
            own[name] = (q, slice_parts(q))
    return own


def tensor_names(model, modules) -> set[str]:
    """The names in `model` of the buffers and parameters of `modules` (their own, not their children's)."""
    ids = {id(m) for m in modules}
    return {f"{prefix}.{n}" for prefix, m in model.named_modules() if id(m) in ids
            for n, _ in [*m.named_buffers(recurse=False), *m.named_parameters(recurse=False)]}


def fill_low_bit(model, reader: CheckpointReader, manifest: dict | None, own: dict[str, tuple[QuantizedLinear, Parts]],
                 dense: set[str], bits: int, device, dtype) -> None:
    """Fill the layers of `own` (see own_low_bit): each buffer from its parts of the stored low-bit layer, or, for the
    --dense-bits ones, of the layer quantized here from the whole float weight; the bias from its rows of the stored
    one."""
    spec = model.spec
    for name, (q, parts) in own.items():
        experts = tensor_experts(spec, name)
        if name in dense:
            weight = read_tensor(reader, f"{name}.weight", spec.family, experts).to(device)
            full = quantize_linear(weight, None, bits, DENSE_GROUP)
            buffers = {buf: join(getattr(full, buf), index) for buf, index in parts.items()}
        else:
            buffers = {buf: stored_parts(reader, manifest, f"{name}.{buf}", index) for buf, index in parts.items()}
        rows = parts["qweight"][0][:1]  # the rows it keeps (a layer with a bias is never a column slice)
        bias = None if q.bias is None else read_tensor(reader, f"{name}.bias", spec.family, experts, rows)
        set_linear(q, name, buffers, bias, device, dtype)


def load_parallel_model(path, rank: int, world: int, tp: int = 1, ep: int = 1, device="cpu", dtype=None,
                        hierarchical: int = 0, static_max_tokens: int = STATIC_MAX_TOKENS, progress: bool = False,
                        reader: CountingReader | None = None, dense_bits: int = 16,
                        collective_timeout: float = COLLECTIVE_TIMEOUT_S,
                        layers: tuple[LayerPlacement, ...] | None = None):
    """This rank's part of the model: TP slices (tp > 1), EP experts (ep > 1), coordinated when both. dense_bits 8:
    the dense part's linear layers as 8-bit HQQ layers, equal to what loader.load_model makes of them.
    Collective: every rank of the process group calls it. reader: to observe what is read (tests, benches);
    collective_timeout: seconds the TP/EP groups' collectives wait for a peer; layers: the MoE layers' placements
    (RunPlan.layers; default: every one as the checkpoint stores them), whose experts the factory makes before the
    parallel wrappers cut them. Logs (MOESERVE_LOG=info) the rank's LoadReport: bytes read and seconds."""
    start = time.perf_counter()
    device = resolve_device(device)
    if dense_bits not in DENSE_BITS:
        raise MoeserveError(f"--dense-bits {dense_bits} is not one of {', '.join(map(str, DENSE_BITS))}")
    grid = RankGrid(world=world, tp=tp, ep=ep)
    spec = ModelSpec.from_dir(path)
    if ep > 1:
        for i in spec.moe.layer_indices():
            check_experts(spec.moe.experts_at(i), ep)
    if tp > 1:
        check_tensor_parallel(spec, tp)
    (tp_group, tp_ranks), (ep_group, ep_ranks) = new_groups(grid, rank, collective_timeout)
    hierarchy = None
    if hierarchical:
        if ep != world or world % hierarchical:
            raise MoeserveError("a hierarchical all-to-all with G ranks per node needs EP over all ranks and G "
                                "dividing the rank count")
        hierarchy = (hierarchical, *node_groups(world, hierarchical, rank, collective_timeout))
    tp_rank, ep_rank = tp_ranks.index(rank), ep_ranks.index(rank)
    error, model = None, None
    try:
        reader = reader or CountingReader(path)
        manifest = read_manifest(reader.path)  # None for a float checkpoint
        model = meta_model(path, layers)
        dense = empty_dense_quantized(model, dense_bits) if dense_bits != 16 else []
        full = {name: t.shape for name, t in [*model.named_parameters(), *model.named_buffers()]}  # before slicing
        sliced = enable_tensor_parallel(model, tp_group, tp_rank, tp, slice_experts=ep == 1) if tp > 1 else {}
        own = own_low_bit(model, dense, sliced)
        filled = tensor_names(model, [q for q, _ in own.values()])
        dtype = resolve_dtype(dtype, device)
        read_weights(model, reader, device, dtype,
                     lambda name: is_routed_expert(name) or is_quantized_expert(name) or name in filled,
                     lambda name: tp_index(name, full[name], tp_rank, tp, spec.attention.qk_norm == "full"), progress)
        fill_low_bit(model, reader, manifest, own, set(dense), dense_bits, device, dtype)
        if ep > 1:
            enable_expert_parallel(model, ep_group, ep_rank, ep, hierarchy,
                                   (tp_group, tp_rank, tp) if tp > 1 else None, static_max_tokens)
        # as _slice_experts
        ffn = split_range(spec.moe.expert_ffn, tp_rank, tp) if ep == 1 else range(spec.moe.expert_ffn)
        fill_experts(model, reader, manifest, lambda i: expert_share(spec.moe.experts_at(i), ep, ep_rank)[0], ffn,
                     model.device, model.dtype)
    except MoeserveError as e:
        error = e
    else:
        log.info("%s", LoadReport(rank, world, reader.total_read, checkpoint_bytes(path),
                                  time.perf_counter() - start).line())
    raise_if_any_failed(error, device)
    return model
