"""`moeserve info`: a checkpoint's architecture, parameters and memory; --explain: each layer's kernel path."""

from __future__ import annotations

import dataclasses
import json

import torch

import moeserve
from moeserve.cli.common import print_table, token_counts
from moeserve.cli.options import EXPLAIN_TOKENS
from moeserve.engine.cuda_graph import graph_safe
from moeserve.errors import MoeserveError
from moeserve.model.paths import EXPERT_PATHS, LINEAR_PATHS, ROUTER_PATHS, explain
from moeserve.plan.footprint import kv_cache_bytes
from moeserve.spec import ModelSpec
from moeserve.units import format_bytes

def run(args) -> int:
    tokens = token_counts(args.tokens)
    if not args.explain and (args.tokens != EXPLAIN_TOKENS or args.device != "auto" or args.dtype != "auto"):
        raise MoeserveError("--tokens, --device and --dtype describe --explain; add --explain")
    spec = ModelSpec.from_dir(args.model)
    if args.explain:
        return _explain(args, tokens)
    counts = spec.parameter_counts()
    memory = {name: counts["total"] * bits / 8 for name, bits in (("float32", 32), ("bfloat16", 16), ("int8", 8),
                                                                   ("int4", 4), ("int3", 3))}
    kv_bytes = {name: kv_cache_bytes(spec, 1, 1, n) for name, n in (("float32", 4), ("bfloat16", 2))}
    if args.json:
        print(json.dumps({"spec": json.loads(spec.to_json()), "parameters": counts, "weight_bytes": memory,
                          "kv_bytes_per_token": kv_bytes}, indent=2))
        return 0
    heads, dim, separate = spec.attention.kv_cache_entry()
    rows = [
        ("family", spec.family),
        ("layers", f"{spec.num_layers} ({sum(spec.moe.layers)} MoE, {spec.num_layers - sum(spec.moe.layers)} dense)"),
        ("hidden / heads / kv heads", f"{spec.hidden_size} / {spec.attention.num_heads} / "
                                      f"{spec.attention.num_kv_heads} (head dim {spec.attention.head_dim})"),
        ("KV cache per token", f"{format_bytes(kv_bytes['bfloat16'])} at bfloat16 ("
                               + (f"{heads} x {dim} keys and values" if separate else f"MLA latent of {dim}")
                               + " a layer)"),
        ("experts", (",".join(map(str, spec.moe.layer_experts)) + " per layer" if spec.moe.layer_experts
                     else str(spec.moe.num_experts)) + f" x FFN {spec.moe.expert_ffn}, top-{spec.moe.top_k}"
                    + (f", {'residual MLP' if spec.moe.residual_mix else 'shared expert'} FFN "
                       f"{spec.moe.shared_expert_ffn}"
                       if spec.moe.shared_expert_ffn else "")),
        ("vocab / context", f"{spec.vocab_size} / {spec.max_position_embeddings}"),
        ("parameters: dense", f"{counts['dense']:,}"),
        ("parameters: experts", f"{counts['experts']:,}"),
        ("parameters: total", f"{counts['total']:,}"),
        ("active per token", f"{counts['active_per_token']:,}"),
    ] + [(f"weights at {k}", format_bytes(v)) for k, v in memory.items()]
    print_table(rows)
    return 0


def _explain(args, tokens: tuple[int, ...]) -> int:
    """Print the execution path of every layer for calls of each token count (model/paths.py)."""
    model = moeserve.load_model(args.model, device=args.device, dtype=args.dtype, progress=True)
    layers = explain(model, tokens)
    where = str(model.device) + (f" ({torch.cuda.get_device_name(model.device)})" if model.device.type == "cuda" else "")
    graphs = {t: graph_safe(model, t) for t in tokens}
    dtype = str(model.dtype).removeprefix("torch.")
    if args.json:
        print(json.dumps({"device": where, "dtype": dtype, "cuda_graph_decode": graphs,
                          "layers": [dataclasses.asdict(p) for p in layers]}, indent=2))
        return 0
    print(f"execution paths on {where}, {dtype}; decode step as a CUDA graph: "
          + ", ".join(f"batch {t} {'yes' if ok else 'no'}" for t, ok in graphs.items()))
    header = ("layers", "tokens", "attention q/k/v", "router", "experts", "dense FFN / shared")
    rows, used = [], set()
    groups: list[list] = []  # consecutive layers with the same paths: [first, last, LayerPaths]
    for p in layers:
        if groups and groups[-1][2].row() == p.row():
            groups[-1][1] = p.layer
        else:
            groups.append([p.layer, p.layer, p])
    for first, last, p in groups:
        for n, t in enumerate(tokens):
            cells = [d[t] if d is not None else "-" for d in (p.attention, p.router, p.experts, p.ffn)]
            used.update(c for c in cells if c != "-")
            name = (str(first) if first == last else f"{first}-{last}") if n == 0 else ""
            rows.append((name, str(t), *cells))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print()
    for table in (LINEAR_PATHS, ROUTER_PATHS, EXPERT_PATHS):
        for name, what in table.items():
            if name in used:
                print(f"{name}: {what}")
                used.discard(name)
    return 0
