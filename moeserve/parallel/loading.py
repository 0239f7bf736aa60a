"""A parallel model from a checkpoint, each rank reading only its own part straight from the safetensors memory
map, so no rank ever holds a full copy: its routed experts (its EP share, or its FFN slice of every expert
under expert slicing), and under TP its slices of the dense weights (attention, dense and shared-expert FFNs,
embedding, head; tensor_parallel.tp_index says which). The model is built and cut to this rank's part on the
meta device first, then filled; replicated tensors (norms, routers, closing biases) are read whole.

Errors a user can cause surface on every rank as one line: layout errors are the same on all ranks, and
loading ends with a collective in which the ranks that failed tell the others (see collectives.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


from moeserve.checkpoint import INTERLEAVED_EXPERTS, CheckpointReader, per_expert_names, read_interleaved_part
from moeserve.errors import MoeserveError
from moeserve.loader import is_routed_expert, meta_model, read_weights, resolve_device, resolve_dtype
from moeserve.model.experts import LoopedExperts, expert_tensors, set_expert_tensor
from moeserve.parallel.collectives import raise_if_any_failed
from moeserve.parallel.expert_parallel import enable_expert_parallel
from moeserve.parallel.groups import RankGrid, check_experts, expert_share, new_groups, split_range
from moeserve.parallel.hierarchical import node_groups
from moeserve.parallel.tensor_parallel import check_tensor_parallel, enable_tensor_parallel, tp_index
from moeserve.parallel.defaults import STATIC_MAX_TOKENS
from moeserve.quant.manifest import refuse_quantized
from moeserve.quant.mxfp4 import BLOCK
from moeserve.spec import ModelSpec


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


def fill_experts(model, reader: CheckpointReader, experts_of, ffn: range, device, dtype) -> None:
    """Read this rank's experts (experts_of(layer) -> range) into the (meta) expert backends the parallel wrappers
    hold, slices of their FFN rows `ffn` (for interleaved families with all their tensors: biases, MXFP4 blocks and
    scales, such buffers in their stored dtype)."""
    spec = model.spec
    for i, layer in enumerate(model.model.layers):
        backend = getattr(layer.mlp, "experts", None)
        if backend is None:
            continue
        experts = experts_of(i)
        leaf = next(m for m in backend.modules() if isinstance(m, LoopedExperts))
        if spec.family in INTERLEAVED_EXPERTS:
            read = read_interleaved_experts(reader, i, experts, ffn, spec.expert_ffn, leaf)
        else:
            read = dict(zip(("gate_up_proj", "down_proj"),
                            read_expert_shard(reader, i, spec.family, spec.expert_ffn, experts, ffn)))
        for name, t in read.items():
            meta = getattr(leaf, name)
            if tuple(t.shape) != tuple(meta.shape):
                raise MoeserveError(f"layer {i} experts {experts.start}..{experts.stop - 1}: {name} has shape "
                                    f"{tuple(t.shape)} in the checkpoint, config.json implies {tuple(meta.shape)}")
            kept = dtype if isinstance(meta, nn.Parameter) else meta.dtype  # packed buffers keep their dtype
            set_expert_tensor(leaf, name, t.to(device=device, dtype=kept))


def load_parallel_model(path, rank: int, world: int, tp: int = 1, ep: int = 1, device="cpu", dtype=None,
                        hierarchical: int = 0, static_max_tokens: int = STATIC_MAX_TOKENS, progress: bool = False,
                        reader: CheckpointReader | None = None):
    """This rank's part of the model: TP slices (tp > 1), EP experts (ep > 1), coordinated when both.
    Collective: every rank of the process group calls it. reader: to observe what is read (tests)."""
    device = resolve_device(device)
    grid = RankGrid(world=world, tp=tp, ep=ep)
    spec = ModelSpec.from_dir(path)
    refuse_quantized(Path(path), "--ep/--tp")  # ranks read float (or MXFP4) tensors shard-wise
    if ep > 1:
        for i in spec.moe_layer_indices():
            check_experts(spec.experts_at(i), ep)
    if tp > 1:
        check_tensor_parallel(spec, tp)
    (tp_group, tp_ranks), (ep_group, ep_ranks) = new_groups(grid, rank)
    hierarchy = None
    if hierarchical:
        if ep != world or world % hierarchical:
            raise MoeserveError("a hierarchical all-to-all with G ranks per node needs EP over all ranks and G "
                                "dividing the rank count")
        hierarchy = (hierarchical, *node_groups(world, hierarchical, rank))
    tp_rank, ep_rank = tp_ranks.index(rank), ep_ranks.index(rank)
    error, model = None, None
    try:
        reader = reader or CheckpointReader(path)
        model = meta_model(path)
        full = {name: p.shape for name, p in model.named_parameters()}  # before slicing: what the checkpoint holds
        if tp > 1:
            enable_tensor_parallel(model, tp_group, tp_rank, tp, slice_experts=ep == 1)
        read_weights(model, reader, device, resolve_dtype(dtype, device), is_routed_expert,
                     lambda name: tp_index(name, full[name], tp_rank, tp, spec.qk_norm == "full"), progress)
        if ep > 1:
            enable_expert_parallel(model, ep_group, ep_rank, ep, hierarchy,
                                   (tp_group, tp_rank, tp) if tp > 1 else None, static_max_tokens)
        ffn = split_range(spec.expert_ffn, tp_rank, tp) if ep == 1 else range(spec.expert_ffn)  # as _slice_experts
        fill_experts(model, reader, lambda i: expert_share(spec.experts_at(i), ep, ep_rank)[0], ffn, model.device,
                     model.dtype)
    except MoeserveError as e:
        error = e
    raise_if_any_failed(error, device)
    return model
