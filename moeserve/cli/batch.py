"""`moeserve batch`: throughput generation for a JSONL of prompts with the CGOPipe pipeline (resumable)."""

from __future__ import annotations

import sys

from moeserve.cli.common import check_output_path, no_gpu_budget_note
from moeserve.engine.params import SamplingParams
from moeserve.errors import MoeserveError
from moeserve.loader import load_model, resolve_device, resolve_dtype
from moeserve.plan.batch import (BadLines, auto_policy, finished_ids, policy_for_budget, read_requests, run_batch,
                                 tokenize_requests)
from moeserve.plan.layer_weights import host_weight_bytes
from moeserve.plan.pipeline import Pipeline
from moeserve.plan.policy import ThroughputPolicy
from moeserve.spec import ModelSpec
from moeserve.tokenizer import load_tokenizer
from moeserve.units import parse_bytes


def _manual_policy(args):
    """batch's policy from its options (before --gpu-memory fits the resident weights to the budget)."""
    gpu_attention = not args.cpu_attention
    kv = args.kv_gpu_fraction if args.kv_gpu_fraction is not None else float(gpu_attention)
    return ThroughputPolicy(args.batch_size, args.micro_batch, gpu_attention, not args.cpu_ffn,
                            1.0 if args.weights_gpu_fraction is None else args.weights_gpu_fraction, kv)


def policy_line(policy: ThroughputPolicy, device) -> str:
    """The chosen policy in words: batch and micro-batch sizes, where attention, the MoE FFN, the layer weights and
    the KV cache are. Without a GPU the policy's GPU side is the CPU too: the line says that every part runs there."""
    n, m = policy.batch_size, policy.micro_batch
    sizes = f"batch of {n} sequences in {policy.num_micro_batches} micro-batch{'es' * (n // m > 1)} of {m}"
    if device.type != "cuda":
        return (f"[policy: {sizes}; no GPU ({device.type}): attention, the MoE FFN, every layer's weights and the KV "
                f"cache in host memory, computed on the CPU (the pipeline's GPU side runs there too)]")
    kv_mbs = round(policy.kv_gpu_fraction * policy.num_micro_batches)
    attention = ("attention on the GPU" if policy.attention_on_gpu
                 else "attention on the CPU over a host KV cache")
    return (f"[policy: {sizes}; {attention}, MoE FFN on the {'GPU' if policy.ffn_on_gpu else 'CPU'}; "
            f"{policy.weights_gpu_fraction:.0%} of the layer weights resident on the GPU, the rest streamed from "
            f"pinned host memory; KV cache of {kv_mbs} of {policy.num_micro_batches} micro-batches on the GPU]")


def run(args) -> int:
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                            seed=args.seed, ignore_eos=args.ignore_eos)
    budget = None if args.gpu_memory is None else parse_bytes(args.gpu_memory)
    if args.gpu_memory is not None and budget is None:
        raise MoeserveError(f"--gpu-memory {args.gpu_memory!r} is not a size like 16GiB")
    check_output_path(args.output, "--output")
    finished_ids(args.output)  # an output that is not ours fails now, not after the model loads
    bad = BadLines(args.input, args.on_bad_line == "stop", lambda m: print(f"moeserve: warning: {m}", file=sys.stderr))
    spec, tok = ModelSpec.from_dir(args.model), load_tokenizer(args.model)
    requests = tokenize_requests(read_requests(args.input, bad), tok, spec.max_position_embeddings, bad)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if budget is not None and device.type != "cuda":
        print(no_gpu_budget_note(args.gpu_memory, "host memory as if it were the GPU's: the policy's share of the "
                                 "layer weights held whole (the rest copied layer by layer) and its batch"),
              file=sys.stderr)
    policy = None if args.auto else _manual_policy(args)
    model = load_model(args.model, device="cpu", dtype=dtype, progress=True)
    prompt_len = max((len(r.prompt_ids) for r in requests), default=1)
    if args.auto:
        pinned = device.type == "cuda"
        policy = auto_policy(model.spec, prompt_len, args.max_new_tokens, dtype.itemsize, budget, args.profile,
                             host_weight_bytes(model, pinned))
    elif budget is not None and args.weights_gpu_fraction is None:
        policy = policy_for_budget(model.spec, policy, prompt_len, args.max_new_tokens, dtype.itemsize, budget)
    print(policy_line(policy, device), file=sys.stderr)
    pipeline = Pipeline(model, policy, device)
    try:
        st = run_batch(pipeline, tok, requests, params, args.output, progress=True)
    finally:
        pipeline.close()
    print(f"[{st['requests']} requests ({st['skipped']} already done), {st['tokens']} tokens in {st['seconds']:.2f} s, "
          f"{st['tokens'] / max(st['seconds'], 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 0
