"""`moeserve trace`: record expert-routing traces, replay them through cache policies, fit HOBBIT's weights."""

from __future__ import annotations

import json
from pathlib import Path

from moeserve import runtime
from moeserve.build import build
from moeserve.cli.common import check_output_path, print_table, read_text
from moeserve.config import RunConfig, check_cache_slots
from moeserve.errors import MoeserveError
from moeserve.offload.policies import POLICIES, CachePolicy
from moeserve.offload.simulate import fit_policy_weights, simulate
from moeserve.offload.store import ExpertStore
from moeserve.offload.trace import RoutingTrace, record_trace
from moeserve.quant.hqq import BITS
from moeserve.spec import ModelSpec
from moeserve.tokenizer import load_tokenizer
from moeserve.units import format_bytes


def run(args) -> int:
    return {"record": _trace_record, "simulate": _trace_simulate, "fit": _trace_fit}[args.trace_command](args)


def _trace_record(args) -> int:
    if args.seq_len < 1 or args.max_tokens < 1:
        raise MoeserveError("--seq-len and --max-tokens must be positive")
    check_output_path(args.out, "--out")
    spec, tok = ModelSpec.from_dir(args.model), load_tokenizer(args.model)
    if args.seq_len > spec.max_position_embeddings:
        raise MoeserveError(f"--seq-len {args.seq_len} exceeds the model's context of "
                            f"{spec.max_position_embeddings} tokens")
    _, text = read_text(args.text, args.model, "--text")
    ids = tok.encode(text)[:args.max_tokens]
    model = build(runtime.prepare(RunConfig.from_args(args, "trace record"), spec, 1, args.seq_len)).model
    trace = record_trace(model, [ids[s:s + args.seq_len] for s in range(0, len(ids), args.seq_len)], progress=True)
    trace.save(args.out)
    print(json.dumps({"out": args.out, "events": len(trace), "tokens": len(ids), "layers": trace.num_layers,
                      "experts": trace.num_experts}))
    return 0


def _read_trace(args):
    """The trace of simulate/fit, after the options that need no trace are checked."""
    if args.bits_low not in BITS:
        raise MoeserveError(f"--bits-low {args.bits_low} is not supported; choose one of {', '.join(map(str, BITS))}")
    check_cache_slots(args.high_slots, args.low_slots, args.t1, args.t2)
    if not Path(args.trace).is_file():
        raise MoeserveError(f"trace file {args.trace!r} not found")
    return RoutingTrace.load(args.trace)


def _sim_options(args) -> dict:
    """simulate's cache options, the same for simulate and fit."""
    return dict(mixed=not args.all_high, t1=args.t1, t2=args.t2, bits_low=args.bits_low, per_layer=args.per_layer_cache)


def _trace_fit(args) -> int:
    trace = _read_trace(args)
    weights, penalty = fit_policy_weights(trace, args.high_slots, args.low_slots, progress=True, **_sim_options(args))
    named = dict(zip(("lru", "lfu", "lhu", "fld"), weights))
    if args.json:
        print(json.dumps({"weights": named, "miss_penalty": penalty}))
        return 0
    print_table([("weights", ", ".join(f"{k} {w:g}" for k, w in named.items())),
                 ("miss penalty", f"{penalty:.1f} high-precision expert copies"),
                 ("use them", f"moeserve trace simulate --weights {','.join(f'{w:g}' for w in weights)}")])
    return 0


def _trace_simulate(args) -> int:
    if args.weights is None and args.policy not in POLICIES:
        raise MoeserveError(f"unknown policy {args.policy!r} (--policy); choose one of {', '.join(POLICIES)} "
                            f"or give --weights")
    try:
        weights = tuple(float(w) for w in args.weights.split(",")) if args.weights else None
        CachePolicy.named(args.policy, 1, weights)
    except ValueError as e:
        raise MoeserveError(f"--weights {args.weights!r}: {e}") from None
    trace = _read_trace(args)
    sizes = _store_expert_bytes(args.store, args.bits_low, trace.num_experts) if args.store else {}
    policy = CachePolicy.named(args.policy, trace.num_layers, weights)
    result = simulate(trace, policy, args.high_slots, args.low_slots, **sizes, **_sim_options(args)).as_dict()
    if not args.store:
        del result["bytes_moved"]  # in penalty units without a store's expert sizes: the miss penalty again
    if args.json:
        print(json.dumps({"policy": policy.name, "weights": policy.weights, **result}))
        return 0
    print_table(simulate_rows(policy, result, args.bits_low))
    return 0


def simulate_rows(policy: CachePolicy, result: dict, bits_low: int) -> list[tuple[str, str]]:
    """simulate's result as the rows of a two-column table (what `--json` prints, in words)."""
    weights = ", ".join(f"{k} {w:g}" for k, w in zip(("lru", "lfu", "lhu", "fld"), policy.weights))
    rows = [("policy", f"{policy.name} (weights {weights})"),
            ("requests", f"{result['requests']:,} expert loads asked of the cache"),
            ("hits", f"{result['hits']:,} ({result['hit_rate']:.1%} hit rate)"),
            ("high misses", f"{result['high_misses']:,} copies at full precision"),
            ("low misses", f"{result['low_misses']:,} copies at {bits_low} bits"),
            ("skipped", f"{result['skipped']:,} experts left out by mixed precision"),
            ("miss penalty", f"{result['miss_penalty']:.1f} high-precision expert copies")]
    if "bytes_moved" in result:
        rows.append(("bytes moved", format_bytes(result["bytes_moved"])))
    return rows


def _store_expert_bytes(path: str, bits_low: int, num_experts: int) -> dict[str, int]:
    """simulate's expert_bytes / low_expert_bytes: the real sizes of one expert's copies in an expert store."""
    store = ExpertStore.open(path)
    if store.meta["num_experts"] != num_experts:
        raise MoeserveError(f"--store {path} has {store.meta['num_experts']} experts per layer, the trace "
                            f"{num_experts}: it was built for another model")
    if store.meta["low_bits"] != bits_low:
        raise MoeserveError(f"--store {path} holds {store.meta['low_bits']}-bit low copies; pass --bits-low "
                            f"{store.meta['low_bits']}")
    return {"expert_bytes": store.expert_bytes(low=False), "low_expert_bytes": store.expert_bytes(low=True)}
