"""The options of the commands that run a model for many requests: serve, bench and batch (torch-free)."""

from __future__ import annotations

import argparse

from moeserve.cli.options import (DEFAULT_BENCH_GEN, DEFAULT_PLAN_PROMPT, DEFAULT_SERVE_CONTEXT, hybrid_args, model_args, offload_group, parallel_args)


def batch_parser(sub) -> None:
    b = sub.add_parser("batch", help="throughput generation for a JSONL file of prompts (resumable)",
                       description="Generate for every {\"id\": ..., \"prompt\": \"...\"} line of INPUT with the "
                                   "CGOPipe pipeline (MoE-Lightning: balanced micro-batches, CPU attention over a host "
                                   "KV cache, layer weights streamed from pinned host memory), appending one JSON line "
                                   "per finished request to OUTPUT. Rerunning skips the ids already in OUTPUT.")
    model_args(b)
    b.add_argument("--input", required=True,
                   help="JSONL prompts: {\"id\": ..., \"prompt\": \"...\"} (id: a string or an integer; default: "
                        "the line number)")
    b.add_argument("--output", required=True, help="JSONL results, appended (id, text, finish_reason, token counts)")
    b.add_argument("--on-bad-line", choices=("skip", "stop"), default="skip",
                   help="an input line that is not UTF-8 or not JSON, has no string prompt, a bad or repeated id, or "
                        "a prompt too long for the model's context is reported by line number and skipped (default) "
                        "or stops the run before the model loads")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    b.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    b.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    b.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    pol = b.add_argument_group("policy", "what runs where (by hand, or --auto for the planner's choice)")
    pol.add_argument("--auto", action="store_true", help="let the planner choose the policy (`moeserve plan`)")
    pol.add_argument("--profile", default=None, metavar="FILE",
                     help="with --auto: hardware profile JSON (default: this machine's, measured once and cached)")
    pol.add_argument("--gpu-memory", default=None, metavar="SIZE",
                     help="GPU memory budget (e.g. 16GiB): the resident weight fraction is fitted to it")
    pol.add_argument("--batch-size", type=int, default=64, help="sequences decoded together, N (default 64)")
    pol.add_argument("--micro-batch", type=int, default=16, help="sequences per micro-batch, n (default 16)")
    pol.add_argument("--cpu-attention", action=argparse.BooleanOptionalAction, default=True,
                     help="attention on the CPU over a host KV cache (default; --no-cpu-attention: on the GPU)")
    pol.add_argument("--cpu-ffn", action="store_true", help="MoE FFN on the CPU from host weights")
    pol.add_argument("--weights-gpu-fraction", type=float, default=None,
                     help="share of the layers resident on the GPU, the rest streamed (default: fit --gpu-memory, "
                          "else 1)")
    pol.add_argument("--kv-gpu-fraction", type=float, default=None,
                     help="share of the micro-batches whose KV cache stays on the GPU (default 0 with CPU "
                          "attention, else 1)")


def origins(text: str) -> tuple[str, ...]:
    """--allowed-origins: a comma list of origins, or `*`."""
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    if not origins:
        raise argparse.ArgumentTypeError("give a comma-separated list of origins, or *")
    return origins


def serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                        description="Serve the model over HTTP in the OpenAI API's conventions: POST /v1/completions "
                                    "and /v1/chat/completions (streaming as server-sent events), GET /v1/models, "
                                    "/health, /metrics; POST /tokenize, /detokenize. Requests join and leave the "
                                    "running batch between decode steps. Needs `pip install 'moeserve[serve]'`.")
    model_args(sv)
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for every interface)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port, printed)")
    sv.add_argument("--parallel", type=int, default=8, metavar="N",
                    help="KV cache slots: requests decoded together (default 8); more wait in a queue")
    sv.add_argument("--ctx-size", type=int, default=None, metavar="C",
                    help=f"tokens per slot, prompt and completion together (default: the model's context, at most "
                         f"{DEFAULT_SERVE_CONTEXT}); KV memory grows with N x C")
    sv.add_argument("--max-queue", type=int, default=64, metavar="Q",
                    help="requests that may wait for a slot; beyond that the server answers 503 (default 64)")
    sv.add_argument("--prefill-chunk", type=int, default=512, metavar="T",
                    help="token slots one prefill pass computes between decode steps (default 512): longer prompts "
                         "are read in chunks, so running streams keep flowing")
    sv.add_argument("--prefix-reuse", action=argparse.BooleanOptionalAction, default=True,
                    help="copy the KV of prompt tokens another slot holds (a shared system prompt, earlier turns, "
                         "the other choices of n > 1) instead of computing it (default: on; --no-prefix-reuse "
                         "computes every prompt whole, a baseline for bench/prefix_cache.py)")
    sv.add_argument("--api-key", default=None, metavar="KEY",
                    help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize (default: none)")
    sv.add_argument("--served-model-name", default=None, metavar="NAME",
                    help="the model's id in the API (default: the name of the --model directory)")
    sv.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                    help="Prometheus metrics at GET /metrics (requests running/waiting, tokens, time to first token, "
                         "inter-token latency, KV slots used; default: on, --no-metrics hides them)")
    sv.add_argument("--allowed-origins", type=origins, default=(), metavar="ORIGINS",
                    help="CORS: origins browsers may call the API from, comma-separated "
                         "(https://a.example,http://localhost:3000), or * for any (default: none, CORS off)")
    sv.add_argument("--no-cuda-graph", action="store_true",
                    help="decode eagerly on a GPU (default: a CUDA graph per padded batch size where the experts "
                         "allow it)")
    parallel_args(sv)
    offload_group(sv)
    hybrid_args(sv, store_option=False)


def bench_parser(sub) -> None:
    bp = sub.add_parser("bench", help="measure prefill and decode tokens/s of any model and placement (llama-bench)",
                        description="Time prompt processing (ppP: one forward pass over P random tokens, batch 1) and "
                                    "text generation (tgN: N greedy decode steps, batch 1) of the model as the "
                                    "placement options place it (resident, a quantized checkpoint, --offload, "
                                    "--cpu-moe/--n-cpu-moe, --gpu-memory's plan, --device cpu, --ep/--tp under "
                                    "torchrun); each test runs once "
                                    "untimed, then -r times. Prints a table: tokens/s mean ± std, peak GPU memory and "
                                    "peak host RSS.")
    model_args(bp)
    bp.add_argument("-p", "--n-prompt", dest="prompt_tokens", type=int, default=None, metavar="P",
                    help=f"prompt tokens of the pp test (default {DEFAULT_PLAN_PROMPT}, or the model's context if "
                         f"shorter)")
    bp.add_argument("-n", "--n-gen", dest="gen_tokens", type=int, default=None, metavar="N",
                    help=f"decode steps of the tg test (default {DEFAULT_BENCH_GEN}, or what the model's context "
                         f"allows)")
    bp.add_argument("-r", "--repetitions", type=int, default=3, metavar="R", help="timed runs per test (default 3)")
    bp.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    bp.add_argument("--json", action="store_true", help="print JSON instead of the table")
    bp.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on a GPU")
    offload_group(bp)
    hybrid_args(bp, store_option=False)
    parallel_args(bp)
