"""`moeserve generate`: text from prompts, streamed when there is one."""

from __future__ import annotations

import dataclasses
import sys
import time

from moeserve.cli.common import check_utf8, is_main_rank, load, prepare
from moeserve.cli.options import DEFAULT_PROMPT, sampling_params
from moeserve.config import RunConfig
from moeserve.engine.generate import iterate
from moeserve.engine.sequence import check_request
from moeserve.errors import MoeserveError
from moeserve.progress import Progress
from moeserve.serve.chat_template import ChatTemplate
from moeserve.spec import ModelSpec
from moeserve.tokenizer import load_tokenizer
from moeserve.units import format_bytes


def run(args) -> int:
    params = sampling_params(args)
    config = RunConfig.from_args(args, "generate")  # validated by cli.main
    spec, tok = ModelSpec.from_dir(config.model), load_tokenizer(config.model)
    texts = args.prompts or [DEFAULT_PROMPT]
    check_utf8(texts)
    if args.system is not None and not args.chat:
        raise MoeserveError("--system needs --chat (a system message is part of a chat)")
    prompts = chat_turns(config.model, tok, texts, args.system) if args.chat else [tok.encode(t) for t in texts]
    shown = [""] * len(texts) if args.chat else texts  # a chat prints the answer alone; plain text continues
    check_request(spec, prompts, params, tok)
    kv_tokens = min(spec.max_position_embeddings, max(map(len, prompts)) + params.max_new_tokens)
    run = load(prepare(config, spec, len(prompts), kv_tokens))
    model = run.model
    if params.seed is None and run.seed is not None:  # chosen by rank 0 for expert-parallel runs
        params = dataclasses.replace(params, seed=run.seed)
    stream = len(texts) == 1 and not args.no_stream

    def on_text(_, delta):
        sys.stdout.write(delta)
        sys.stdout.flush()

    t0 = time.perf_counter()
    steps = iterate(model, prompts, params, tokenizer=tok, on_text=on_text if stream else None,
                    cuda_graph=config.cuda_graph)  # validates
    if stream:
        on_text(0, shown[0])
    with Progress(None, "generate", "tokens", enabled=not stream and is_main_rank()) as bar:
        for results, _ in steps:  # without streaming, the tokens so far on stderr
            tokens = sum(len(r.token_ids) for r in results)
            done = sum(r.finish_reason is not None for r in results)
            bar.update(tokens - bar.count, note=f"{done} of {len(results)} prompts done")
    seconds = time.perf_counter() - t0
    if stream:
        sys.stdout.write("\n")
    else:
        for n, (text, r) in enumerate(zip(shown, results)):
            print(f"--- [{n}] ({r.finish_reason})\n{text}{r.text}")
    if not is_main_rank():
        return 0
    for line in expert_lines(run):
        print(line, file=sys.stderr)
    n_tokens = sum(len(r.token_ids) for r in results)
    print(f"[{n_tokens} tokens in {seconds:.2f} s, {n_tokens / seconds:.1f} tokens/s, "
          f"{model.device.type}, {str(model.dtype).removeprefix('torch.')}]", file=sys.stderr)
    return 0


def expert_lines(run) -> list[str]:
    """What the expert cache or the hybrid runtime did, one line each."""
    lines = []
    if run.cache is not None:
        st = run.cache.summary()
        lines.append(f"[expert cache: {st['high_slots']} high + {st['low_slots']} low slots, policy {st['policy']}: "
                     f"hit rate {st['hit_rate']:.1%}, {st['high_misses']} high / {st['low_misses']} low misses, "
                     f"{st['skipped']} skipped, {st['cpu_experts']} on the CPU, {format_bytes(st['bytes_moved'])} "
                     f"moved, {st['prefetched']} prefetched ({st['prefetch_accuracy']:.0%} used)]")
    if run.hybrid is not None:
        st = run.hybrid.summary()
        lines.append(
            f"[hybrid experts: {st['cpu_pairs']} computed on the CPU, {st['gpu_pairs']} in cache slots "
            f"({st['gpu_share']:.1%}), {st['skipped']} skipped, {st['low_pairs']} low-bit by mixed precision"
            + (f", {st['admitted']} copied into the cache" if 'admitted' in st else "")
            + (f", {st['streamed_pairs']} of the prompt's on the GPU ({st['experts_streamed']} experts streamed, "
               f"{format_bytes(st['bytes_streamed'])})" if st.get("experts_streamed") else "") + "]")
        if "disk_budget" in st:
            lines.append(f"[disk tier: {format_bytes(st['disk_budget'])} RAM cache ({st['disk_slots']} experts), hit "
                         f"rate {st['disk_hit_rate']:.1%}, {format_bytes(st['disk_bytes_read'])} read from disk, "
                         f"{format_bytes(st['disk_bytes_per_token'])} per token"
                         f"{'' if st['disk_direct'] else ' (through the page cache)'}]")
    return lines


def chat_turns(model: str, tok, texts: list[str], system: str | None) -> list[list[int]]:
    """Each text as a user message (after `system`, if given), rendered by the checkpoint's chat template."""
    template = ChatTemplate.from_dir(model)
    start = [{"role": "system", "content": system}] if system else []
    return [template.encode([*start, {"role": "user", "content": t}], tok) for t in texts]
