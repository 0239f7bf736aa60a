"""`moeserve bench`: prefill and decode tokens/s of the model as the placement options place it (llama-bench)."""

from __future__ import annotations

import json
from pathlib import Path

from moeserve.cli.common import is_main_rank, load, prepare
from moeserve.cli.options import DEFAULT_BENCH_GEN, DEFAULT_PLAN_PROMPT
from moeserve.config import RunConfig
from moeserve.engine.bench import check_bench, run_bench, table
from moeserve.progress import Progress
from moeserve.spec import ModelSpec


def run(args) -> int:
    spec = ModelSpec.from_dir(args.model)
    context = spec.max_position_embeddings
    prompt_tokens = min(DEFAULT_PLAN_PROMPT, context) if args.prompt_tokens is None else args.prompt_tokens
    gen_tokens = min(DEFAULT_BENCH_GEN, context - 2) if args.gen_tokens is None else args.gen_tokens
    check_bench(spec, prompt_tokens, gen_tokens, args.repetitions)
    config = RunConfig.from_args(args, "bench")
    run = load(prepare(config, spec, 1, max(prompt_tokens, gen_tokens + 2)))
    model = run.model
    placement = run.placement_name()
    with Progress(2 * (args.repetitions + 1), "bench", "runs", enabled=is_main_rank()) as bar:
        def on_run(test, rep, seconds):
            tokens = prompt_tokens if test.startswith("pp") else gen_tokens
            bar.update(1, note=f"{test} {'warm-up' if rep == 0 else f'{rep}/{args.repetitions}'}: "
                               f"{tokens / seconds:,.1f} tok/s")

        results = run_bench(model, prompt_tokens, gen_tokens, args.repetitions, args.seed, config.cuda_graph, on_run)
    if not is_main_rank():  # every rank ran the same tests (--ep/--tp); rank 0 reports
        return 0
    if args.json:
        print(json.dumps({"model": args.model, "placement": placement, "device": model.device.type,
                          "dtype": str(model.dtype).removeprefix("torch."), "results": [r.as_dict() for r in results],
                          **disk_tier(run)}, indent=2))
    else:
        print(table(results, Path(args.model).name, placement))
    return 0


def disk_tier(run) -> dict:
    """{"disk_tier": the disk tier's counts over every test} for a run reading experts from disk, else {}."""
    st = run.hybrid.summary() if run.hybrid is not None else {}
    return {"disk_tier": {k: v for k, v in st.items() if k.startswith("disk_")}} if "disk_budget" in st else {}
