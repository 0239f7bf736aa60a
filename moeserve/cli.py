"""The `moeserve` command: generate, info, eval ppl. Errors print one line and exit non-zero."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from moeserve import DEMO_MODEL
from moeserve.errors import MoeserveError
from moeserve.hybrid.placement import STREAM_FROM
from moeserve.parallel.defaults import STATIC_MAX_TOKENS
from moeserve.quant.defaults import DENSE_BITS
from moeserve.train.options import DESCRIPTION as TRAIN_DESCRIPTION
from moeserve.train.options import add_train_args
from moeserve.units import format_bytes, parse_bytes

# Each command imports what it runs inside its own function: modules that load torch stay out of start-up, so
# `moeserve --help` and argument errors answer at once (tests/cli/test_cli_inputs.py checks that torch is not imported).

DEMO_DIR = Path(DEMO_MODEL)  # the package names the demo once
EXPLAIN_TOKENS = "1,8,512"  # info --explain: decode, batch decode, a prefill chunk
DEFAULT_PROMPT = "HAMLET. To be, or not to be"
DEFAULT_PLAN_PROMPT = 512  # tokens: `moeserve plan`'s prompt length unless the model's context is shorter
DEFAULT_BENCH_GEN = 128  # tokens: `moeserve bench`'s decode steps (llama-bench's tg128)
TUNE_TOKENS = (1, 2, 4, 8, 16, 32, 64)  # `moeserve tune`: decode and batch decode
DEFAULT_SERVE_CONTEXT = 4096  # tokens per KV slot of `moeserve serve` unless the model's context is shorter
SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "jinja2")  # what `pip install moeserve[serve]` brings
GPU_MEMORY_HELP = ("GPU memory budget, e.g. 24GiB: the placement planner chooses from the measured hardware profile "
                   "where the experts live (all resident, quantized with --experts-bits, some layers' experts on the "
                   "CPU, cache slots, the dense part at 8 bits) and prints its plan (`moeserve plan` shows every "
                   "candidate); --cpu-moe, --n-cpu-moe N, --experts-bits B, --gpu-cache-experts S and --dense-bits "
                   "fix those parts of it; on a machine without a GPU everything runs on the CPU")


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """'\\n\\n' as a shell passes it (backslash, n) -> two newlines; other backslashes stay as typed."""
    return re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m.group(1)], text)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors like every other moeserve error (exit 2, no usage dump)."""

    def error(self, message: str):
        command = self.prog.removeprefix("moeserve").strip()
        self.exit(2, f"moeserve: error: {command + ': ' if command else ''}{message} (see `{self.prog} --help`)\n")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEMO_DIR),
                   help="checkpoint directory: config.json + *.safetensors (default: the built-in demo model)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (GPU when present; default auto)")
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16 or auto (bf16 on a GPU, fp32 on a CPU; default auto)")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ep", type=int, default=1, metavar="N",
                   help="expert-parallel ranks (run under `torchrun --nproc-per-node N -m moeserve ... --ep N`)")
    p.add_argument("--hierarchical-a2a", type=int, default=0, metavar="G",
                   help="with --ep over all ranks: hierarchical all-to-all with G ranks per node (multi-node runs; "
                        "default off)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks (under torchrun; with --ep, experts are spread over ranks that "
                        "share a TP rank; without, each expert is sliced over the TP ranks)")
    p.add_argument("--static-dispatch-tokens", type=int, default=STATIC_MAX_TOKENS, metavar="T",
                   help=f"with --ep: when no rank has more than T tokens in a forward pass, dispatch with static "
                        f"padded buffers (no host sync per layer; decode) instead of exchanged split sizes "
                        f"(default {STATIC_MAX_TOKENS}; 0 = always dynamic)")


def _offload_args(o) -> list[argparse.Action]:
    """The options that only mean something with --offload; returned so their defaults can be compared."""
    return [
        o.add_argument("--gpu-memory", "--memory", dest="memory", default=None, metavar="SIZE", help=GPU_MEMORY_HELP
                       + "; with --offload, the fast-memory budget (GPU memory, or RAM with --device cpu) from which "
                         "the cache slots are planned after the non-expert weights, KV cache and workspace"),
        o.add_argument("--high-slots", type=int, default=None,
                       help="high-precision cache slots (instead of --gpu-memory)"),
        o.add_argument("--low-slots", type=int, default=0,
                       help="low-precision cache slots (with --high-slots; --gpu-memory plans both kinds)"),
        o.add_argument("--policy", default="hobbit", help="cache policy: lru, lfu, lhu, fld or hobbit (default)"),
        o.add_argument("--all-high", action="store_true", help="no mixed precision: every expert high, none skipped"),
        o.add_argument("--per-layer-cache", action="store_true",
                       help="split the slots evenly over the layers, each evicting only its own experts "
                            "(mixtral-offloading's layout; default: one pool for all layers)"),
        o.add_argument("--t1", type=float, default=0.6, help="high/low threshold (default 0.6)"),
        o.add_argument("--t2", type=float, default=0.9, help="low/skip threshold (default 0.9)"),
        o.add_argument("--prefetch", type=int, default=1, metavar="N",
                       help="prefetch experts predicted for the next N MoE layers (default 1; 0 = off)"),
        o.add_argument("--cooperative", action="store_true",
                       help="compute a missed expert on the CPU when that is faster than copying it to the GPU "
                            "(decided from measured CPU time and host->GPU bandwidth)"),
        o.add_argument("--no-pin", action="store_true",
                       help="do not page-lock the store in RAM (loads are then staged through a small pinned buffer)"),
    ]


def _hybrid_args(p: argparse.ArgumentParser, store_option: bool) -> None:
    """The hybrid placement's options (generate, eval ppl, serve, bench); store_option: add --offload STORE and
    --gpu-memory here (eval ppl: generate has them in its offload group)."""
    h = p.add_argument_group(
        "hybrid CPU/GPU experts", "routed experts in host RAM, computed on the CPU where they lie (llama.cpp's "
        "--cpu-moe / --n-cpu-moe); attention, routers, shared experts and the KV cache stay on --device. The experts "
        "come from --offload STORE (from `moeserve offload-prepare`) or are read from --model into RAM")
    h.add_argument("--cpu-moe", action="store_true", help="every MoE layer's routed experts on the CPU")
    h.add_argument("--n-cpu-moe", type=int, default=None, metavar="N",
                   help="the routed experts of the first N MoE layers on the CPU, the other layers' resident on "
                        "--device")
    h.add_argument("--gpu-cache-experts", type=int, default=None, metavar="S",
                   help="S slots on the GPU caching experts of the CPU layers, filled as experts are used (a missed "
                        "expert runs on the CPU and may be copied in the background; low-bit experts on a GPU: the "
                        "most used ones, counted between CUDA-graph steps; default 0: a static placement; with "
                        "--gpu-memory: the memory the plan leaves)")
    h.add_argument("--cache-policy", default="hobbit", metavar="NAME",
                   help="what --gpu-cache-experts keeps where the host sees each layer call (float experts, "
                        "no GPU): lru, hobbit (default: recency, frequency, precision and layer "
                        "distance) or static (the most used experts: the placement settles)")
    h.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="CPU threads computing the experts, pinned where the OS allows (default: the physical cores)")
    h.add_argument("--experts-bits", type=int, default=None, metavar="B",
                   help="precision of the routed experts: 16 (the checkpoint's float weights, default; with "
                        "--gpu-memory: the plan's) or 8, 4, 3, 2 "
                        "(HQQ copies: fewer bytes for the CPU to read; a STORE must hold B-bit copies, without one "
                        "they are made on the fly)")
    _dense_bits_arg(h)
    h.add_argument("--mixed-precision", action="store_true",
                   help="HOBBIT's per-token rule for the experts: by gate weight each runs at full precision, 4-bit "
                        "(or the store's low bits) or is skipped (T1 0.6, T2 0.9; with --experts-bits B < 16 it only "
                        "skips, chosen on the GPU); default off: exact output")
    h.add_argument("--stream-from", type=int, default=None, metavar="T",
                   help=f"a prompt (layer call) of T or more tokens copies the CPU layers' experts it needs to the GPU "
                        f"and computes them there, where many rows are cheap (default {STREAM_FROM}; 0: prompts run "
                        f"on the CPU too)")
    if store_option:
        h.add_argument("--offload", metavar="STORE", default=None,
                       help="with --cpu-moe/--n-cpu-moe: the expert store to read experts from (default: built in RAM "
                            "from --model)")
        h.add_argument("--gpu-memory", dest="memory", default=None, metavar="SIZE", help=GPU_MEMORY_HELP)


def _dense_bits_arg(p) -> None:
    p.add_argument("--dense-bits", type=int, choices=DENSE_BITS, default=None,
                   help="precision of the dense part's linear layers on the GPU (attention projections, shared "
                        "experts, dense FFNs, an untied LM head; not embeddings, norms or routers): 16 (the compute "
                        "dtype; the default) or 8 (HQQ 8-bit copies, groups of 64: about half the bytes, leaving room "
                        "for more experts); with --gpu-memory, not given: 8 where that puts fewer MoE layers' experts "
                        "on the CPU")


def _offload_group(p: argparse.ArgumentParser) -> None:
    """--offload STORE and the cache options that go with it (generate, serve)."""
    o = p.add_argument_group("expert offloading (HOBBIT)", "keep experts in a store (RAM or disk) and a cache of them "
                             "in fast memory; see `moeserve offload-prepare`")
    o.add_argument("--offload", metavar="STORE", default=None,
                   help="expert store directory from offload-prepare (with --cpu-moe/--n-cpu-moe: the hybrid's store)")
    _offload_args(o)


def _batch_parser(sub) -> None:
    b = sub.add_parser("batch", help="throughput generation for a JSONL file of prompts (resumable)",
                       description="Generate for every {\"id\": ..., \"prompt\": \"...\"} line of INPUT with the "
                                   "CGOPipe pipeline (MoE-Lightning: balanced micro-batches, CPU attention over a host "
                                   "KV cache, layer weights streamed from pinned host memory), appending one JSON line "
                                   "per finished request to OUTPUT. Rerunning skips the ids already in OUTPUT.")
    _model_args(b)
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


def _origins(text: str) -> tuple[str, ...]:
    """--allowed-origins: a comma list of origins, or `*`."""
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    if not origins:
        raise argparse.ArgumentTypeError("give a comma-separated list of origins, or *")
    return origins


def _serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                        description="Serve the model over HTTP in the OpenAI API's conventions: POST /v1/completions "
                                    "and /v1/chat/completions (streaming as server-sent events), GET /v1/models, "
                                    "/health, /metrics; POST /tokenize, /detokenize. Requests join and leave the "
                                    "running batch between decode steps. Needs `pip install 'moeserve[serve]'`.")
    _model_args(sv)
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
    sv.add_argument("--api-key", default=None, metavar="KEY",
                    help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize (default: none)")
    sv.add_argument("--served-model-name", default=None, metavar="NAME",
                    help="the model's id in the API (default: the name of the --model directory)")
    sv.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                    help="Prometheus metrics at GET /metrics (requests running/waiting, tokens, time to first token, "
                         "inter-token latency, KV slots used; default: on, --no-metrics hides them)")
    sv.add_argument("--allowed-origins", type=_origins, default=(), metavar="ORIGINS",
                    help="CORS: origins browsers may call the API from, comma-separated "
                         "(https://a.example,http://localhost:3000), or * for any (default: none, CORS off)")
    sv.add_argument("--threads", type=int, default=None, metavar="N",
                    help="CPU threads the model runs on (default: torch's choice, one per core)")
    sv.add_argument("--no-cuda-graph", action="store_true",
                    help="decode eagerly on a GPU (default: a CUDA graph per padded batch size where the experts "
                         "allow it)")
    _parallel_args(sv)
    _offload_group(sv)
    _hybrid_args(sv, store_option=False)


def _bench_parser(sub) -> None:
    bp = sub.add_parser("bench", help="measure prefill and decode tokens/s of any model and placement (llama-bench)",
                        description="Time prompt processing (ppP: one forward pass over P random tokens, batch 1) and "
                                    "text generation (tgN: N greedy decode steps, batch 1) of the model as the "
                                    "placement options place it (resident, a quantized checkpoint, --offload, "
                                    "--cpu-moe/--n-cpu-moe, --gpu-memory's plan, --device cpu); each test runs once "
                                    "untimed, then -r times. Prints a table: tokens/s mean ± std, peak GPU memory and "
                                    "peak host RSS.")
    _model_args(bp)
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
    _offload_group(bp)
    _hybrid_args(bp, store_option=False)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="moeserve", description="Run Mixture-of-Experts language models (Mixtral, Qwen2/3-MoE, OLMoE).",
        epilog="Run `moeserve COMMAND --help` for the options of each command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)

    g = sub.add_parser("generate", help="generate text from prompts (streams it)",
                       description="Generate text. With no prompt, uses a Shakespeare opening for the demo model.")
    g.add_argument("prompts", nargs="*", metavar="PROMPT", help="one or more prompts (batched together)")
    _model_args(g)
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per prompt (default 200)")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", type=unescape,
                   help="stop when the output contains TEXT (repeatable; TEXT is not printed; the escapes \\n, "
                        "\\t, \\r and \\\\ are read as a newline, tab, carriage return and backslash)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    g.add_argument("--no-stream", action="store_true", help="print each result when done instead of streaming")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="decode eagerly on a GPU (default: replay each decode step as a CUDA graph where the "
                        "experts allow it)")
    _parallel_args(g)
    _offload_group(g)
    _hybrid_args(g, store_option=False)

    i = sub.add_parser("info", help="architecture, parameter counts and memory of a checkpoint",
                       description="Describe a checkpoint without loading its weights.")
    i.add_argument("--model", default=str(DEMO_DIR), help="checkpoint directory (default: the demo model)")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.add_argument("--explain", action="store_true",
                   help="load the model and print which execution path (kernel) each layer takes on this machine for "
                        "calls of --tokens tokens: attention projections, router, experts, dense FFN")
    i.add_argument("--tokens", default=EXPLAIN_TOKENS, metavar="LIST",
                   help="with --explain: comma-separated token counts per call to explain (default 1,8,512: decode, "
                        "batch decode, a prefill chunk)")
    i.add_argument("--device", default="auto", help="with --explain: cpu, cuda, cuda:N or auto (default auto)")
    i.add_argument("--dtype", default="auto", help="with --explain: float32, bfloat16, float16 or auto (default)")

    e = sub.add_parser("eval", help="evaluate a model (perplexity)", description="Evaluate a model.")
    esub = e.add_subparsers(dest="metric", metavar="METRIC", required=True)
    ppl = esub.add_parser("ppl", help="perplexity on a text file",
                          description="Perplexity over non-overlapping windows of a text file "
                                      "(default: the demo model's held-out text).")
    _model_args(ppl)
    ppl.add_argument("--text", default=None, help="UTF-8 text file (default: the demo's held-out Hamlet)")
    ppl.add_argument("--window", type=int, default=512, help="tokens per window (default 512, capped by the context)")
    ppl.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    ppl.add_argument("--max-tokens", type=int, default=0, help="evaluate only the first N tokens (0 = all)")
    _parallel_args(ppl)
    _hybrid_args(ppl, store_option=True)

    q = sub.add_parser(
        "quantize", help="write a low-bit copy of a checkpoint (RTN, HQQ or MiLo)",
        description="Quantize every linear weight (attention, experts, shared/dense FFNs) to BITS with groups of "
                    "GROUP inputs; MiLo adds low-rank compensators whose ranks follow --ranks. No calibration data. "
                    "Writes OUT.partial/ layer by layer and renames it to OUT at the end; rerunning an interrupted "
                    "job resumes it.",
        epilog="rank policies: 'uniform:16', 'dense=512,experts=kurtosis:16', 'experts=frequency:8', "
               "'dense=2MiB,experts=kurtosis:8MiB' (byte budgets). Targets: all, dense, attention, shared, "
               "dense_ffn, experts.")
    q.add_argument("--model", default=str(DEMO_DIR), help="source checkpoint directory (default: the demo model)")
    q.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    q.add_argument("--bits", type=int, default=3, help="weight bits: 2, 3, 4 or 8 (default 3)")
    q.add_argument("--group", type=int, default=64, help="inputs per scale/zero group (default 64)")
    q.add_argument("--method", default="milo", help="rtn, hqq or milo (default milo)")
    q.add_argument("--ranks", default="dense=512,experts=kurtosis:16",
                   help="MiLo rank policy (default 'dense=512,experts=kurtosis:16'; see below)")
    q.add_argument("--compensator-bits", type=int, default=16, help="compensator storage: 3, 8 or 16 (bf16; default)")
    q.add_argument("--skip", action="append", default=[], metavar="KIND",
                   help="leave a tensor kind in full precision: attention, shared_expert, dense_ffn, expert "
                        "(repeatable)")
    q.add_argument("--frequency-text", default=None,
                   help="text to measure expert frequency on for frequency ranks (default: the model's heldout.txt)")
    q.add_argument("--device", default="auto", help="where to run the optimisation: cpu, cuda or auto (default)")
    q.add_argument("--force", action="store_true", help="replace OUT if it exists")

    op = sub.add_parser("offload-prepare", help="build the expert store used by generate --offload",
                        description="Write every routed expert in high precision (as in the checkpoint) and low "
                                    "precision (HQQ) to STORE, one file per layer (memory-mapped when used). "
                                    "Rerunning an interrupted build resumes it.")
    op.add_argument("--model", default=str(DEMO_DIR), help="checkpoint directory (default: the demo model)")
    op.add_argument("--out", required=True, help="store directory")
    op.add_argument("--low-bits", type=int, default=4, help="bits of the low-precision copies: 2, 3, 4 or 8 (default 4)")
    op.add_argument("--group", type=int, default=64, help="quantization group size (default 64)")

    t = sub.add_parser("trace", help="record expert-routing traces and replay them through cache policies",
                       description="Routing traces for the expert cache (HOBBIT): record one from a model reading a "
                                   "text, replay it under a cache policy, or fit the multi-dimensional policy weights.")
    tsub = t.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    rec = tsub.add_parser("record", help="record the routing of a model reading a text (token by token, layer by layer)")
    _model_args(rec)
    rec.add_argument("--text", default=None, help="UTF-8 text (default: the model's heldout.txt)")
    rec.add_argument("--out", required=True, help="trace file to write, exactly this path (an .npz archive)")
    rec.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    rec.add_argument("--max-tokens", type=int, default=16384, help="tokens to record in all (default 16384)")
    outputs = {"simulate": "requests, hits, high_misses, low_misses, skipped, hit_rate and miss_penalty (a high "
                           "miss counts 1, a low miss bits_low/16: copies in units of one high-precision expert); "
                           "with --store also bytes_moved, in bytes at the store's expert sizes",
               "fit": "the weights with the lowest miss_penalty (in units of one high-precision expert copy)"}
    for name, helptext in (("simulate", "replay a trace through a mixed-precision expert cache"),
                           ("fit", "fit the weights of HOBBIT's multi-dimensional policy on a trace")):
        sp = tsub.add_parser(name, help=helptext, description=f"{helptext}; prints JSON: {outputs[name]}.")
        sp.add_argument("--trace", required=True, help="trace file from `moeserve trace record`")
        sp.add_argument("--high-slots", type=int, required=True, help="cache slots for high-precision experts")
        sp.add_argument("--low-slots", type=int, default=0, help="cache slots for low-precision experts (default 0)")
        sp.add_argument("--all-high", action="store_true", help="request every expert in high precision, no skips")
        sp.add_argument("--per-layer-cache", action="store_true", help="an even share of the slots per layer")
        sp.add_argument("--t1", type=float, default=0.6, help="high/low threshold on unimportance (default 0.6)")
        sp.add_argument("--t2", type=float, default=0.9, help="low/skip threshold (default 0.9)")
        sp.add_argument("--bits-low", type=int, default=4,
                        help="low precision bits, for the penalty: 2, 3, 4 or 8 (default 4)")
        if name == "simulate":
            sp.add_argument("--policy", default="hobbit", help="lru, lfu, lhu, fld or hobbit (default hobbit)")
            sp.add_argument("--weights", default=None, help="w_lru,w_lfu,w_lhu,w_fld for a custom priority")
            sp.add_argument("--store", default=None, metavar="STORE",
                            help="expert store from offload-prepare: report bytes_moved at its expert sizes")

    _batch_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    tr = sub.add_parser("train", help="train a standard MoE, PR-MoE or Mixture-of-Students model on Shakespeare",
                        description=TRAIN_DESCRIPTION)
    add_train_args(tr)

    pf = sub.add_parser("profile", help="measure this machine's FLOP/s and bandwidths (cached)",
                        description="Measure matmul FLOP/s, memory bandwidths and the host<->GPU link (a few seconds; "
                                    "GPU figures only with CUDA) for `moeserve plan`. The profile is cached per "
                                    "machine under ~/.cache/moeserve/hardware (MOESERVE_CACHE moves it).")
    pf.add_argument("--refresh", action="store_true", help="measure again instead of reading the cache")
    pf.add_argument("--json", action="store_true", help="print JSON instead of a table")

    tu = sub.add_parser("tune", help="search this GPU's kernel launch configs for a model's MoE shapes (cached)",
                        description="Time the Triton MoE kernels' launch configs at the model's shapes on this GPU "
                                    "(random experts of the checkpoint's kind) and keep the fastest in the user's "
                                    "tuning cache (~/.cache/moeserve/tuning; MOESERVE_CACHE moves it), which every "
                                    "later run reads. Without it a first run tunes each token count it meets by "
                                    "itself, briefly (MOESERVE_TUNE=off|quick|full, default quick). Prints, per "
                                    "experts kind and token count, the call's time before and after.")
    tu.add_argument("--model", default=str(DEMO_DIR), help="checkpoint directory (default: the demo model)")
    tu.add_argument("--tokens", default=",".join(map(str, TUNE_TOKENS)), metavar="LIST",
                    help="comma-separated token counts per call; each is tuned at its power of two at or below "
                         f"(default {','.join(map(str, TUNE_TOKENS))})")
    tu.add_argument("--bits", default=None, metavar="LIST",
                    help="comma-separated expert widths to tune: 16 (bf16), 8, 4, 3, 2 (default: the checkpoint's)")
    tu.add_argument("--rank", type=int, default=None,
                    help="compensator rank of the low-bit experts timed (default: the checkpoint's largest, else 0)")
    tu.add_argument("--quick", action="store_true", help="the short candidate lists a first run uses (default: full)")
    tu.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="search time per experts kind and token count (default 20 quick, 90 full)")
    tu.add_argument("--out", default=None, metavar="FILE",
                    help="also merge the winners into FILE, a table in the shipped format "
                         "(moeserve/kernels/triton/configs/<gpu>.json)")

    pl = sub.add_parser("plan", help="rate where the experts could live for --gpu-memory (decode), or choose a "
                                     "throughput policy for `moeserve batch`",
                        description="--for decode (default): rate every placement of the model in the GPU budget at "
                                    "batch 1 (all experts resident, quantized, some layers' experts on the CPU with "
                                    "GPU cache slots, HOBBIT offload) with its GPU and host bytes and estimated decode "
                                    "and prefill tokens/s, and mark the one `generate|eval ppl|serve|bench "
                                    "--gpu-memory SIZE` runs. --for batch: search batch size, micro-batch, "
                                    "attention/FFN placement and the share of weights and KV cache kept on the GPU "
                                    "for the highest predicted tokens/s of `moeserve batch` (MoE-Lightning). Both "
                                    "need only config.json, no weights.")
    pl.add_argument("--model", default=str(DEMO_DIR), help="checkpoint directory (default: the demo model)")
    pl.add_argument("--for", dest="plan_for", choices=("decode", "batch"), default="decode",
                    help="decode: placements for generate/eval/serve/bench at batch 1 (default); batch: the "
                         "throughput policy of `moeserve batch`")
    pl.add_argument("--gpu-memory", default=None, metavar="SIZE",
                    help="GPU memory budget, e.g. 16GiB (default: 90%% of the profile's GPU memory)")
    pl.add_argument("--cpu-memory", default=None, metavar="SIZE",
                    help="host memory budget, e.g. 100GiB (default: 90%% of the profile's RAM)")
    pl.add_argument("--prompt-len", type=int, default=None,
                    help="prompt tokens per sequence (default 512, or what the model's context leaves after --gen-len)")
    pl.add_argument("--gen-len", type=int, default=128, help="generated tokens per sequence (default 128)")
    pl.add_argument("--max-batch", type=int, default=None,
                    help="with --for batch: largest batch size to consider (default 4096)")
    pl.add_argument("--profile", default=None, metavar="FILE",
                    help="hardware profile JSON (default: this machine's, measured once and cached)")
    pl.add_argument("--plot", default=None, metavar="PNG", help="with --for batch: write the roofline with the "
                    "operators to PNG (needs matplotlib)")
    pl.add_argument("--experts-bits", type=int, default=None, metavar="B",
                    help="with --for decode: rate only placements with B-bit experts (16: the checkpoint's float)")
    _dense_bits_arg(pl)
    pl.add_argument("--json", action="store_true",
                    help="print JSON instead of a table (a ratio with nothing to divide by, e.g. the link intensity "
                         "of an operator that moves no bytes over the host link, is null)")
    return parser


# ---- checks made before anything loads ----------------------------------------------------


def _size(text: str | None, flag: str) -> int | None:
    """A size option ("16GiB") in bytes, None when not given; anything else names the flag."""
    if text is None:
        return None
    size = parse_bytes(text)
    if size is None:
        raise MoeserveError(f"{flag} {text!r} is not a size like 16GiB")
    return size


def _check_output_path(path: str, flag: str) -> None:
    """A file the command will write: not a directory, in an existing writable directory, writable itself."""
    out = Path(path)
    parent = out.parent
    if out.is_dir():
        raise MoeserveError(f"{flag} {path} is a directory; give a file path")
    if not parent.is_dir():
        problem = "is not a directory" if parent.exists() else "does not exist"
        raise MoeserveError(f"cannot write {flag} {path}: {parent} {problem}")
    if not os.access(out if out.exists() else parent, os.W_OK):
        raise MoeserveError(f"cannot write {flag} {path}: permission denied")


def _check_utf8(texts: list[str]) -> None:
    """Prompts from the command line hold undecodable bytes as surrogates (PEP 383); name the first one."""
    for n, text in enumerate(texts, 1):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            char = ord(text[e.start])
            byte = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"character U+{char:04X}"
            raise MoeserveError(f"prompt {n} is not valid UTF-8 ({byte} at position {e.start})") from None


def _check_parallel(args) -> None:
    """--tp/--ep need a torchrun launch of exactly tp x ep ranks (and a float dense part)."""
    if args.tp < 1 or args.ep < 1:
        raise MoeserveError("--tp and --ep must be >= 1")
    if args.tp * args.ep > 1 and _dense_bits(args) != 16:
        raise MoeserveError(f"--dense-bits {args.dense_bits} and --tp/--ep cannot be combined yet")
    if args.tp == 1 and args.ep == 1:
        return
    flags = " ".join(f"--{name} {n}" for name, n in (("tp", args.tp), ("ep", args.ep)) if n > 1)
    command = " ".join(c for c in (args.command, getattr(args, "metric", None)) if c)
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise MoeserveError(f"{flags} runs one process per rank: launch it under torchrun, e.g. `torchrun "
                            f"--nproc-per-node {args.tp * args.ep} -m moeserve {command} {flags} ...`")
    if args.tp * args.ep != int(os.environ["WORLD_SIZE"]):
        raise MoeserveError(f"--tp {args.tp} x --ep {args.ep} must equal the number of ranks "
                            f"({os.environ['WORLD_SIZE']})")


def _offload_only_options() -> list[argparse.Action]:
    """The generate options that need --offload, with their defaults."""
    return _offload_args(argparse.ArgumentParser(add_help=False))


def _check_offload_args(args) -> None:
    """Offload options are rejected without --offload, checked with it, and never silently dropped."""
    from moeserve.offload.policies import POLICIES

    if _hybrid_requested(args):
        return  # --offload names the hybrid's store; _check_hybrid_args checks the rest
    if not args.offload:
        _size(args.memory, "--gpu-memory")  # without --offload: the placement planner's budget
        for option in _offload_only_options():
            if option.dest != "memory" and getattr(args, option.dest) != option.default:
                raise MoeserveError(f"{option.option_strings[0]} needs --offload STORE (an expert store from "
                                    f"`moeserve offload-prepare`)")
        return
    if args.policy not in POLICIES:
        raise MoeserveError(f"unknown policy {args.policy!r} (--policy); choose one of {', '.join(POLICIES)}")
    _size(args.memory, "--gpu-memory")
    if args.high_slots is None:
        if not args.memory:
            raise MoeserveError("--offload needs --gpu-memory SIZE or --high-slots N")
        if args.low_slots:
            raise MoeserveError("--low-slots needs --high-slots: with --gpu-memory the slots of both precisions "
                                "are planned from the budget")
    _check_cache_args(args.high_slots or 0, args.low_slots, args.t1, args.t2)


HYBRID_ONLY = {"gpu_cache_experts": ("--gpu-cache-experts", None), "cache_policy": ("--cache-policy", "hobbit"),
               "cpu_threads": ("--cpu-threads", None), "experts_bits": ("--experts-bits", None),
               "mixed_precision": ("--mixed-precision", False), "stream_from": ("--stream-from", None)}


def _dense_bits(args) -> int:
    """The bits the run loads the dense part's linear layers at: --dense-bits (or the plan's), else 16."""
    bits = getattr(args, "dense_bits", None)
    return 16 if bits is None else bits


def _hybrid_requested(args) -> bool:
    return getattr(args, "cpu_moe", False) or getattr(args, "n_cpu_moe", None) is not None


def _planning(args) -> bool:
    """--gpu-memory without --offload: the placement planner chooses (plan/placement.py)."""
    return getattr(args, "memory", None) is not None and not getattr(args, "offload", None)


def _check_hybrid_args(args, spec) -> None:
    """The hybrid options: none without --cpu-moe/--n-cpu-moe or --gpu-memory, none of offload's with them; with
    them, the placement (args.placement), checked against the model's MoE layers before anything loads (with
    --gpu-memory, _plan_placement chooses it after this)."""
    args.placement = None
    planning = _planning(args)
    if planning and (getattr(args, "tp", 1) > 1 or getattr(args, "ep", 1) > 1):
        raise MoeserveError("--gpu-memory (the placement planner) and --tp/--ep cannot be combined yet")
    if not _hybrid_requested(args):
        for dest, (flag, default) in HYBRID_ONLY.items():
            if getattr(args, dest, default) != default and not planning:
                raise MoeserveError(f"{flag} needs --cpu-moe or --n-cpu-moe N (a hybrid placement) or --gpu-memory "
                                    f"SIZE (a planned one)")
        if args.command == "eval" and args.offload:
            raise MoeserveError("--offload needs --cpu-moe or --n-cpu-moe N here (eval runs a hybrid placement)")
        return
    if getattr(args, "tp", 1) > 1 or getattr(args, "ep", 1) > 1:
        raise MoeserveError("--cpu-moe/--n-cpu-moe and --tp/--ep cannot be combined yet")
    offload_only = [o for o in _offload_only_options() if getattr(args, o.dest, o.default) != o.default
                    and not (planning and o.dest == "memory")]
    if offload_only:
        raise MoeserveError(f"{offload_only[0].option_strings[0]} is an option of --offload's expert cache; with "
                            f"--cpu-moe/--n-cpu-moe the GPU cache is --gpu-cache-experts S")
    args.placement = _hybrid_placement(args, spec, args.cpu_moe, args.n_cpu_moe, args.experts_bits,
                                       args.gpu_cache_experts)


def _hybrid_placement(args, spec, cpu_moe: bool, n_cpu_moe: int | None, bits: int | None, cache_slots: int | None):
    """HybridPlacement.choose with the run's other hybrid options (threads, mixed precision, cache policy)."""
    from moeserve.hybrid.placement import HybridPlacement
    from moeserve.kernels.cpu.machine import physical_cores

    moe_layers = spec.moe_layer_indices()
    return HybridPlacement.choose(
        moe_layers, cpu_moe, n_cpu_moe, cache_slots or 0,
        len(physical_cores()) if args.cpu_threads is None else args.cpu_threads,
        args.mixed_precision, 16 if bits is None else bits, args.cache_policy, spec.num_experts,
        STREAM_FROM if args.stream_from is None else args.stream_from)


def _plan_placement(args, spec, kv_batch: int, kv_tokens: int) -> None:
    """With --gpu-memory and no --offload: plan where the experts live (plan/placement.py) from this machine's
    hardware profile, within the budget and the RAM available now, print the plan in one line and set the run's
    options to it (args.placement, args.device, args.dense_bits); explicit --cpu-moe/--n-cpu-moe, --experts-bits,
    --gpu-cache-experts and --dense-bits narrow the candidates. Nothing is allocated before the plan fits."""
    if not _planning(args):
        return
    from moeserve.loader import resolve_device, resolve_dtype
    from moeserve.offload.budget import available_ram, check_budget
    from moeserve.plan.hardware import load_or_measure
    from moeserve.plan.placement import PlanRequest, moe_layer_count, plan_placement
    from moeserve.quant.manifest import refuse_quantized

    budget = _size(args.memory, "--gpu-memory")
    refuse_quantized(Path(args.model), "--gpu-memory (the placement planner)")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if device.type == "cuda":
        check_budget(budget, device)
    placement = args.placement  # explicit --cpu-moe/--n-cpu-moe, checked
    req = PlanRequest(budget if device.type == "cuda" else None, available_ram(), dtype.itemsize,
                      str(dtype).removeprefix("torch."), kv_batch, kv_tokens, bits=args.experts_bits,
                      cpu_layers=None if placement is None else len(placement.cpu_layers),
                      cache_slots=args.gpu_cache_experts, dense_bits=args.dense_bits)
    plan = plan_placement(spec, load_or_measure(), req)
    chosen = plan.chosen
    args.dense_bits = chosen.dense_bits
    if chosen.hybrid:
        if not chosen.streams and args.stream_from is None:
            args.stream_from = 0  # the budget has no room for the streaming ring: prompts on the CPU too
        every = chosen.cpu_layers == moe_layer_count(spec)
        args.placement = _hybrid_placement(args, spec, every, None if every else chosen.cpu_layers, chosen.bits,
                                           chosen.cache_slots)
    else:
        args.placement = None
        given = [flag for dest, (flag, default) in HYBRID_ONLY.items() if getattr(args, dest, default) != default
                 and dest not in ("experts_bits", "gpu_cache_experts")]  # those two narrowed the plan
        if given:
            raise MoeserveError(f"{given[0]} applies to experts on the CPU, and the plan keeps them all on the "
                                f"{'CPU' if chosen.kind == 'cpu' else 'GPU'} unquantized ({chosen.where()}); give "
                                f"--n-cpu-moe N or leave {given[0]} out")
    if chosen.kind == "cpu":
        args.device = "cpu"
    args.plan_line = plan.describe()
    if _is_main_rank():
        print(args.plan_line, file=sys.stderr, flush=True)


def _is_main_rank() -> bool:
    """Rank 0 of a torchrun launch, or a single process: the one that prints status lines."""
    return os.environ.get("RANK", "0") == "0"


def _tokenizer(model_dir: str):
    """(spec, tokenizer) of a checkpoint, read before its weights so that inputs are checked first."""
    from moeserve.spec import ModelSpec
    from moeserve.tokenizer import load_tokenizer

    return ModelSpec.from_dir(model_dir), load_tokenizer(model_dir)


def _json_ready(value):
    """`value` with every non-finite float (a ratio over zero, an unbounded rate) as None: JSON has no Infinity."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


# ---- commands ------------------------------------------------------------------------------


def _load_model(args):
    """The model as the options place it: one process, torchrun ranks (--tp/--ep) or offloaded experts."""
    import moeserve

    offload = getattr(args, "offload", None)
    if getattr(args, "placement", None) is not None:
        model = _load_hybrid(args, args.placement)
    elif getattr(args, "ep", 1) > 1 or getattr(args, "tp", 1) > 1:
        if offload:
            raise MoeserveError("--ep/--tp and --offload cannot be combined yet")
        model = _load_parallel(args)
    else:
        store, budget = _open_store(args) if offload else (None, None)  # a bad store or budget: before loading
        model = moeserve.load_model(args.model, device=args.device, dtype=args.dtype, progress=True,
                                    routed_experts=offload is None, dense_bits=_dense_bits(args))
        if offload:
            args.cache = _enable_offload(model, store, budget, args)
    return model


def cmd_generate(args) -> int:
    from moeserve.engine.generate import check_request, iterate
    from moeserve.engine.sampling import SamplingParams
    from moeserve.progress import Progress

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
                            ignore_eos=args.ignore_eos)
    _check_parallel(args)
    _check_offload_args(args)
    spec, tok = _tokenizer(args.model)
    _check_hybrid_args(args, spec)
    texts = args.prompts or [DEFAULT_PROMPT]
    _check_utf8(texts)
    prompts = [tok.encode(t) for t in texts]
    check_request(spec, prompts, params, tok)
    _plan_placement(args, spec, len(prompts), min(spec.max_position_embeddings,
                                                  max(map(len, prompts)) + params.max_new_tokens))
    model = _load_model(args)
    if params.seed is None and args.seed is not None:  # chosen by rank 0 for expert-parallel runs
        params = dataclasses.replace(params, seed=args.seed)
    stream = len(texts) == 1 and not args.no_stream

    def on_text(_, delta):
        sys.stdout.write(delta)
        sys.stdout.flush()

    t0 = time.perf_counter()
    steps = iterate(model, prompts, params, tokenizer=tok, on_text=on_text if stream else None,
                    cuda_graph=not args.no_cuda_graph)  # validates
    if stream:
        on_text(0, texts[0])
    with Progress(None, "generate", "tokens", enabled=not stream and _is_main_rank()) as bar:
        for results, _ in steps:  # without streaming, the tokens so far on stderr
            tokens = sum(len(r.token_ids) for r in results)
            done = sum(r.finish_reason is not None for r in results)
            bar.update(tokens - bar.count, note=f"{done} of {len(results)} prompts done")
    seconds = time.perf_counter() - t0
    if stream:
        sys.stdout.write("\n")
    else:
        for n, (text, r) in enumerate(zip(texts, results)):
            print(f"--- [{n}] ({r.finish_reason})\n{text}{r.text}")
    if not _is_main_rank():
        return 0
    cache = getattr(args, "cache", None)
    if cache is not None:
        st = cache.summary()
        print(f"[expert cache: {st['high_slots']} high + {st['low_slots']} low slots, policy {st['policy']}: hit rate "
              f"{st['hit_rate']:.1%}, {st['high_misses']} high / {st['low_misses']} low misses, {st['skipped']} skipped, "
              f"{st['cpu_experts']} on the CPU, {format_bytes(st['bytes_moved'])} moved, {st['prefetched']} prefetched "
              f"({st['prefetch_accuracy']:.0%} used)]", file=sys.stderr)
    hybrid = getattr(args, "hybrid", None)
    if hybrid is not None:
        st = hybrid.summary()
        print(f"[hybrid experts: {st['cpu_pairs']} computed on the CPU, {st['gpu_pairs']} in cache slots "
              f"({st['gpu_share']:.1%}), {st['skipped']} skipped, {st['low_pairs']} low-bit by mixed precision"
              + (f", {st['admitted']} copied into the cache" if 'admitted' in st else "")
              + (f", {st['streamed_pairs']} of the prompt's on the GPU ({st['experts_streamed']} experts streamed, "
                 f"{format_bytes(st['bytes_streamed'])})" if st.get("experts_streamed") else "") + "]", file=sys.stderr)
    n_tokens = sum(len(r.token_ids) for r in results)
    print(f"[{n_tokens} tokens in {seconds:.2f} s, {n_tokens / seconds:.1f} tokens/s, "
          f"{model.device.type}, {str(model.dtype).removeprefix('torch.')}]", file=sys.stderr)
    return 0


def _load_parallel(args):
    """Every rank loads its part of the model (TP slices, EP experts) and serves the same prompts; rank 0 prints."""
    from moeserve.parallel.launch import init_from_env
    from moeserve.parallel.loading import load_parallel_model

    rank, world, device = init_from_env(args.device)
    model = load_parallel_model(args.model, rank, world, tp=args.tp, ep=args.ep, device=device, dtype=args.dtype,
                                hierarchical=args.hierarchical_a2a, progress=rank == 0,
                                static_max_tokens=max(args.static_dispatch_tokens, 0))
    if getattr(args, "seed", 0) is None:  # every rank must sample the same tokens: rank 0 picks the seed
        import torch.distributed as dist

        seed = [int.from_bytes(os.urandom(4), "little")]
        dist.broadcast_object_list(seed, src=0)
        args.seed = seed[0]
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - one copy of the output, from rank 0
    return model


def _hybrid_source(args, spec, placement):
    """(store or None: build one from --model, low bits, group) of a hybrid run: --offload's store checked against
    the model and the placement, or the precision of the store to build; then the host RAM the experts need is
    checked, before anything is allocated."""
    from moeserve.hybrid.memory import check_host_ram, host_bytes, store_precision
    from moeserve.loader import resolve_device, resolve_dtype
    from moeserve.offload.store import ExpertStore
    from moeserve.quant.manifest import refuse_quantized

    dtype = resolve_dtype(args.dtype, resolve_device(args.device))
    store, mapped_bytes = None, None
    if args.offload:
        store = ExpertStore.open(args.offload)
        store.check_model(spec, args.model)
        low_bits, group = store.meta["low_bits"], store.meta["group"]
        if placement.low and low_bits != placement.bits:
            raise MoeserveError(f"--experts-bits {placement.bits}: the store {args.offload} holds {low_bits}-bit "
                                f"copies; give --experts-bits {low_bits} or 16, or build a {placement.bits}-bit store "
                                f"(`moeserve offload-prepare --low-bits {placement.bits}`)")
        mapped_bytes = store.part_shapes(low=False)[0][1].itemsize
    else:
        refuse_quantized(Path(args.model), "--cpu-moe/--n-cpu-moe without --offload STORE")
        low_bits, group = store_precision(spec, placement)
    check_host_ram(host_bytes(spec, placement, dtype.itemsize, low_bits, group, mapped_bytes))
    return store, low_bits, group


def _load_hybrid(args, placement):
    """The model with its CPU layers' experts in host RAM (--offload's store, or read from --model), after the RAM
    they need is checked; prints the placement in one line (unless a plan was printed)."""
    import moeserve
    from moeserve.hybrid.setup import build_store, enable_hybrid, store_layers
    from moeserve.loader import resolve_device, resolve_dtype
    from moeserve.spec import ModelSpec

    spec = ModelSpec.from_dir(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    store, low_bits, _ = _hybrid_source(args, spec, placement)
    stored = set(store_layers(placement))
    model = moeserve.load_model(args.model, device=device, dtype=dtype, progress=True,
                                routed_experts=[i for i in placement.moe_layers if i not in stored],
                                dense_bits=_dense_bits(args))
    if store is None:
        store = build_store(args.model, placement, dtype, device)
    args.hybrid = enable_hybrid(model, store, placement, warm=True)
    if getattr(args, "plan_line", None) is None:  # a planned run printed its plan
        print(placement.describe(device.type, str(dtype).removeprefix("torch."), low_bits, _dense_bits(args)),
              file=sys.stderr, flush=True)
    return model


def _check_cache_args(high: int, low: int, t1: float, t2: float) -> None:
    if high < 0 or low < 0 or not 0 <= t1 <= t2:
        raise MoeserveError("slots must be >= 0 and thresholds 0 <= --t1 <= --t2")


def _open_store(args):
    """(store, memory budget or None): the expert store of --offload checked against --model (layers, shapes,
    source) and --memory against the memory of the device, all before the model loads."""
    from moeserve.loader import resolve_device, resolve_dtype
    from moeserve.offload.budget import check_budget
    from moeserve.offload.store import ExpertStore
    from moeserve.plan.placement import check_dense_budget
    from moeserve.spec import ModelSpec

    spec = ModelSpec.from_dir(args.model)
    store = ExpertStore.open(args.offload)
    store.check_model(spec, args.model)
    if args.high_slots is not None:
        return store, None
    budget = _size(args.memory, "--gpu-memory")  # given: _check_offload_args asks for it or --high-slots
    device = resolve_device(args.device)
    check_budget(budget, device)
    check_dense_budget(spec, budget, resolve_dtype(args.dtype, device).itemsize, *_kv_shape(args, spec),
                       _dense_bits(args))
    return store, budget


def _enable_offload(model, store, budget, args):
    from moeserve.offload.budget import kv_cache_bytes, plan_slots
    from moeserve.offload.experts import enable_offload
    from moeserve.offload.store import layer_experts

    if budget is None:
        high, low = args.high_slots, args.low_slots
    else:
        resident = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                       if not t.is_meta)  # buffers: the packed weights of quantized layers
        kv = kv_cache_bytes(model.spec, *_kv_shape(args, model.spec), model.dtype.itemsize)
        high, low = plan_slots(budget, resident, kv, store.expert_bytes(low=False),
                               0 if args.all_high else store.expert_bytes(low=True), reserve=model.spec.top_k,
                               max_slots=sum(layer_experts(store.meta, i) for i in store.meta["layers"]))
    _check_cache_args(high, low, args.t1, args.t2)
    try:
        return enable_offload(model, store, high_slots=high, low_slots=low, policy=args.policy, mixed=not args.all_high,
                              t1=args.t1, t2=args.t2, prefetch_layers=max(args.prefetch, 0),
                              cooperative=args.cooperative, pin=not args.no_pin, per_layer=args.per_layer_cache)
    except ValueError as e:
        raise MoeserveError(str(e)) from None


def _kv_shape(args, spec) -> tuple[int, int]:
    """(sequences, tokens each) the KV cache of a command will hold, for planning memory around it."""
    if args.command == "serve":
        return args.parallel, args.ctx_size
    if args.command == "bench":
        return 1, max(args.prompt_tokens, args.gen_tokens + 2)
    return max(len(args.prompts), 1), spec.max_position_embeddings


def cmd_serve(args) -> int:
    import importlib.util

    missing = [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise MoeserveError(f"`moeserve serve` needs {', '.join(missing)}: pip install 'moeserve[serve]'")
    if not 0 <= args.port <= 65535:
        raise MoeserveError(f"--port {args.port} is not a TCP port (0 to 65535)")
    if min(args.parallel, args.prefill_chunk, args.max_queue + 1, 1 if args.threads is None else args.threads) < 1:
        raise MoeserveError("--parallel, --prefill-chunk and --threads must be >= 1 and --max-queue >= 0")
    if args.api_key is not None and not args.api_key.strip():
        raise MoeserveError("--api-key must not be empty")
    _check_parallel(args)
    _check_offload_args(args)
    spec, tok = _tokenizer(args.model)
    _check_hybrid_args(args, spec)
    if args.tp * args.ep > 1 and (args.placement is not None or args.offload or _planning(args)):
        raise MoeserveError("--ep/--tp and experts off the GPU (--offload, --cpu-moe, --n-cpu-moe, --gpu-memory) "
                            "cannot be combined yet")
    context = spec.max_position_embeddings
    if args.ctx_size is None:
        args.ctx_size = min(context, DEFAULT_SERVE_CONTEXT)
    elif not 2 <= args.ctx_size <= context:
        raise MoeserveError(f"--ctx-size {args.ctx_size} must be between 2 and the model's context of {context} "
                            f"tokens")
    _plan_placement(args, spec, args.parallel, args.ctx_size)
    if args.placement is not None:
        _hybrid_source(args, spec, args.placement)  # the store and the RAM it needs: checked before listening
    from moeserve.serve.server import run

    return run(args, spec, tok, args.ctx_size, load=lambda: _load_model(args))


def cmd_bench(args) -> int:
    from moeserve.engine.bench import check_bench, run_bench, table
    from moeserve.progress import Progress
    from moeserve.spec import ModelSpec

    spec = ModelSpec.from_dir(args.model)
    context = spec.max_position_embeddings
    if args.prompt_tokens is None:
        args.prompt_tokens = min(DEFAULT_PLAN_PROMPT, context)
    if args.gen_tokens is None:
        args.gen_tokens = min(DEFAULT_BENCH_GEN, context - 2)
    check_bench(spec, args.prompt_tokens, args.gen_tokens, args.repetitions)
    _check_offload_args(args)
    _check_hybrid_args(args, spec)
    _plan_placement(args, spec, *_kv_shape(args, spec))
    model = _load_model(args)
    placement = _placement_name(args, model)
    with Progress(2 * (args.repetitions + 1), "bench", "runs") as bar:
        def on_run(test, rep, seconds):
            tokens = args.prompt_tokens if test.startswith("pp") else args.gen_tokens
            bar.update(1, note=f"{test} {'warm-up' if rep == 0 else f'{rep}/{args.repetitions}'}: "
                               f"{tokens / seconds:,.1f} tok/s")

        results = run_bench(model, args.prompt_tokens, args.gen_tokens, args.repetitions, args.seed,
                            not args.no_cuda_graph, on_run)
    if args.json:
        print(json.dumps({"model": args.model, "placement": placement, "device": model.device.type,
                          "dtype": str(model.dtype).removeprefix("torch."), "results": [r.as_dict() for r in results]},
                         indent=2))
    else:
        print(table(results, Path(args.model).name, placement))
    return 0


def _placement_name(args, model) -> str:
    """A few words on where the run's experts live, for bench's table."""
    dtype = str(model.dtype).removeprefix("torch.")
    if getattr(args, "plan_line", None):
        dense = f", dense part {_dense_bits(args)}-bit" if _dense_bits(args) != 16 else ""
        return args.plan_line.removeprefix("[plan: ").split(";")[0] + f"{dense} ({model.device.type}, {dtype})"
    if args.placement is not None:
        return args.placement.describe(model.device.type, dtype, dense_bits=_dense_bits(args)).removeprefix(
            "[placement: ").removesuffix("]")
    if args.offload:
        return f"offload ({args.memory or f'{args.high_slots}+{args.low_slots} slots'}, {dtype})"
    return f"resident ({model.device.type}, {dtype})"


def cmd_offload_prepare(args) -> int:
    from moeserve.offload.store import ExpertStore

    t0 = time.perf_counter()
    store = ExpertStore.build(args.model, args.out, low_bits=args.low_bits, group=args.group)
    print(json.dumps({"out": args.out, "layers": len(store.meta["layers"]), "expert_bytes_high": store.expert_bytes(False),
                      "expert_bytes_low": store.expert_bytes(True), "seconds": round(time.perf_counter() - t0, 2)}))
    return 0


def cmd_info(args) -> int:
    from moeserve.spec import ModelSpec

    tokens = _token_counts(args.tokens)
    if not args.explain and (args.tokens != EXPLAIN_TOKENS or args.device != "auto" or args.dtype != "auto"):
        raise MoeserveError("--tokens, --device and --dtype describe --explain; add --explain")
    spec = ModelSpec.from_dir(args.model)
    if args.explain:
        return _explain(args, tokens)
    counts = spec.parameter_counts()
    memory = {name: counts["total"] * bits / 8 for name, bits in (("float32", 32), ("bfloat16", 16), ("int8", 8),
                                                                   ("int4", 4), ("int3", 3))}
    kv_bytes = {name: spec.kv_bytes_per_token(n) for name, n in (("float32", 4), ("bfloat16", 2))}
    if args.json:
        print(json.dumps({"spec": json.loads(spec.to_json()), "parameters": counts, "weight_bytes": memory,
                          "kv_bytes_per_token": kv_bytes}, indent=2))
        return 0
    heads, dim, separate = spec.kv_cache_entry()
    rows = [
        ("family", spec.family),
        ("layers", f"{spec.num_layers} ({sum(spec.moe_layers)} MoE, {spec.num_layers - sum(spec.moe_layers)} dense)"),
        ("hidden / heads / kv heads", f"{spec.hidden_size} / {spec.num_heads} / {spec.num_kv_heads} (head dim {spec.head_dim})"),
        ("KV cache per token", f"{format_bytes(kv_bytes['bfloat16'])} at bfloat16 ("
                               + (f"{heads} x {dim} keys and values" if separate else f"MLA latent of {dim}")
                               + " a layer)"),
        ("experts", (",".join(map(str, spec.layer_experts)) + " per layer" if spec.layer_experts
                     else str(spec.num_experts)) + f" x FFN {spec.expert_ffn}, top-{spec.top_k}"
                    + (f", {'residual MLP' if spec.residual_mix else 'shared expert'} FFN {spec.shared_expert_ffn}"
                       if spec.shared_expert_ffn else "")),
        ("vocab / context", f"{spec.vocab_size} / {spec.max_position_embeddings}"),
        ("parameters: dense", f"{counts['dense']:,}"),
        ("parameters: experts", f"{counts['experts']:,}"),
        ("parameters: total", f"{counts['total']:,}"),
        ("active per token", f"{counts['active_per_token']:,}"),
    ] + [(f"weights at {k}", format_bytes(v)) for k, v in memory.items()]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _token_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise MoeserveError(f"--tokens must be positive integers separated by commas, got {text!r}")
    return counts


def _explain(args, tokens: tuple[int, ...]) -> int:
    """Print the execution path of every layer for calls of each token count (model/paths.py)."""
    import torch

    import moeserve
    from moeserve.engine.cuda_graph import graph_safe
    from moeserve.model.paths import EXPERT_PATHS, LINEAR_PATHS, ROUTER_PATHS, explain

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


def _read_text(path: str | None, model: str, flag: str) -> tuple[Path, str]:
    """A UTF-8 text file, by default the model directory's heldout.txt."""
    text_path = Path(path) if path else Path(model) / "heldout.txt"
    if not text_path.is_file():
        raise MoeserveError(f"text file {str(text_path)!r} not found" + ("" if path else f"; pass {flag} FILE"))
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise MoeserveError(f"{text_path} is not UTF-8 text") from None
    if not text.strip():
        raise MoeserveError(f"{text_path} is empty")
    return text_path, text


def cmd_eval_ppl(args) -> int:
    from moeserve.evaluate import perplexity

    if args.window < 2 or args.batch_size < 1 or args.max_tokens < 0:
        raise MoeserveError("--window must be >= 2, --batch-size >= 1 and --max-tokens >= 0")
    _check_parallel(args)
    spec, tok = _tokenizer(args.model)
    _check_hybrid_args(args, spec)
    text_path, text = _read_text(args.text, args.model, "--text")
    ids = tok.encode(text)
    _plan_placement(args, spec, args.batch_size, min(args.window, spec.max_position_embeddings))
    model = _load_model(args)
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    if len(ids) < 2:
        raise MoeserveError(f"{text_path} is too short to evaluate")
    result = perplexity(model, ids, args.window, args.batch_size)
    print(json.dumps({"model": args.model, "text": str(text_path), "tokens": result["tokens"],
                      "window": result["window"], "perplexity": round(result["perplexity"], 4),
                      "bits_per_token": round(result["bits_per_token"], 4),
                      "dtype": str(model.dtype).removeprefix("torch."), "device": model.device.type}))
    return 0


def cmd_quantize(args) -> int:
    from moeserve.loader import resolve_device
    from moeserve.quant.compress import QuantConfig, check_job, frequency_from_text, quantize_checkpoint

    cfg = QuantConfig(bits=args.bits, group=args.group, method=args.method, ranks=args.ranks,
                      compensator_bits=args.compensator_bits, skip=tuple(args.skip))
    check_job(args.model, args.out, cfg, args.force)  # before any loading: settings, source, --out
    device = resolve_device(args.device)
    frequency = None
    if cfg.method == "milo" and "frequency" in cfg.ranks:
        _, text = _read_text(args.frequency_text, args.model, "--frequency-text")
        frequency = frequency_from_text(args.model, text, device)
    manifest = quantize_checkpoint(args.model, args.out, cfg, force=args.force, device=device, frequency=frequency,
                                   note=lambda m: print(f"moeserve: note: {m}", file=sys.stderr))
    ranks = [t["rank"] for t in manifest["tensors"].values()]
    print(json.dumps({"out": args.out, "method": cfg.method, "bits": cfg.bits, "group": cfg.group,
                      "tensors": len(ranks), "mean_rank": round(sum(ranks) / max(len(ranks), 1), 2),
                      "bytes": manifest["bytes"], "source_bytes": manifest["source"]["bytes"],
                      "seconds": manifest["seconds"], "device": device.type}))
    return 0


def cmd_trace(args) -> int:
    return {"record": _trace_record, "simulate": _trace_simulate, "fit": _trace_fit}[args.trace_command](args)


def _trace_record(args) -> int:
    from moeserve.offload.trace import record_trace

    if args.seq_len < 1 or args.max_tokens < 1:
        raise MoeserveError("--seq-len and --max-tokens must be positive")
    _check_output_path(args.out, "--out")
    spec, tok = _tokenizer(args.model)
    if args.seq_len > spec.max_position_embeddings:
        raise MoeserveError(f"--seq-len {args.seq_len} exceeds the model's context of "
                            f"{spec.max_position_embeddings} tokens")
    _, text = _read_text(args.text, args.model, "--text")
    ids = tok.encode(text)[:args.max_tokens]
    model = _load_model(args)
    trace = record_trace(model, [ids[s:s + args.seq_len] for s in range(0, len(ids), args.seq_len)], progress=True)
    trace.save(args.out)
    print(json.dumps({"out": args.out, "events": len(trace), "tokens": len(ids), "layers": trace.num_layers,
                      "experts": trace.num_experts}))
    return 0


def _read_trace(args):
    """The trace of simulate/fit, after the options that need no trace are checked."""
    from moeserve.offload.trace import RoutingTrace
    from moeserve.quant.hqq import BITS

    if args.bits_low not in BITS:
        raise MoeserveError(f"--bits-low {args.bits_low} is not supported; choose one of {', '.join(map(str, BITS))}")
    _check_cache_args(args.high_slots, args.low_slots, args.t1, args.t2)
    if not Path(args.trace).is_file():
        raise MoeserveError(f"trace file {args.trace!r} not found")
    return RoutingTrace.load(args.trace)


def _sim_options(args) -> dict:
    """simulate's cache options, the same for simulate and fit."""
    return dict(mixed=not args.all_high, t1=args.t1, t2=args.t2, bits_low=args.bits_low, per_layer=args.per_layer_cache)


def _trace_fit(args) -> int:
    from moeserve.offload.simulate import fit_policy_weights

    trace = _read_trace(args)
    weights, penalty = fit_policy_weights(trace, args.high_slots, args.low_slots, progress=True, **_sim_options(args))
    print(json.dumps({"weights": dict(zip(("lru", "lfu", "lhu", "fld"), weights)), "miss_penalty": penalty}))
    return 0


def _trace_simulate(args) -> int:
    from moeserve.offload.policies import POLICIES, CachePolicy
    from moeserve.offload.simulate import simulate

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
    print(json.dumps({"policy": policy.name, "weights": policy.weights, **result}))
    return 0


def _store_expert_bytes(path: str, bits_low: int, num_experts: int) -> dict[str, int]:
    """simulate's expert_bytes / low_expert_bytes: the real sizes of one expert's copies in an expert store."""
    from moeserve.offload.store import ExpertStore

    store = ExpertStore.open(path)
    if store.meta["num_experts"] != num_experts:
        raise MoeserveError(f"--store {path} has {store.meta['num_experts']} experts per layer, the trace "
                            f"{num_experts}: it was built for another model")
    if store.meta["low_bits"] != bits_low:
        raise MoeserveError(f"--store {path} holds {store.meta['low_bits']}-bit low copies; pass --bits-low "
                            f"{store.meta['low_bits']}")
    return {"expert_bytes": store.expert_bytes(low=False), "low_expert_bytes": store.expert_bytes(low=True)}


def _print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def cmd_profile(args) -> int:
    from moeserve.plan.hardware import load_or_measure

    profile = load_or_measure(refresh=args.refresh)
    if args.json:
        print(json.dumps(profile.as_dict(), indent=2))
        return 0

    def rate(v, unit):
        return "-" if v is None else f"{v / 1e9:,.1f} G{unit}"

    chunks = lambda d: ", ".join(f"{k} MiB: {v / 1e9:.1f}" for k, v in sorted(d.items())) or "-"  # noqa: E731
    _print_table([
        ("GPU", profile.gpu_name or "none (CUDA not available)"),
        ("GPU bf16 matmul", rate(profile.gpu_flops, "FLOP/s")),
        ("HBM copy (read+write)", rate(profile.hbm_bandwidth, "B/s")),
        ("GPU memory", "-" if profile.gpu_memory_bytes is None else format_bytes(profile.gpu_memory_bytes)),
        ("CPU", f"{profile.cpu_name} ({profile.cpu_cores} cores)"),
        ("CPU fp32 / bf16 matmul", f"{rate(profile.cpu_fp32_flops, 'FLOP/s')} / {rate(profile.cpu_bf16_flops, 'FLOP/s')}"),
        ("DRAM copy (read+write)", rate(profile.dram_bandwidth, "B/s")),
        ("RAM", format_bytes(profile.ram_bytes)),
        ("host->device pinned", rate(profile.h2d_bandwidth, "B/s") + f" (GB/s by chunk: {chunks(profile.h2d_chunk_bandwidth)})"),
        ("device->host pinned", rate(profile.d2h_bandwidth, "B/s") + f" (GB/s by chunk: {chunks(profile.d2h_chunk_bandwidth)})"),
        ("host->device pageable", rate(profile.h2d_pageable_bandwidth, "B/s")),
        ("measured", profile.measured or "-"),
    ])
    return 0


def cmd_tune(args) -> int:
    tokens = _token_counts(args.tokens)
    try:
        bits = [int(b) for b in args.bits.split(",")] if args.bits is not None else None
    except ValueError:
        bits = []
    if bits is not None and (not bits or set(bits) - {16, 8, 4, 3, 2}):
        raise MoeserveError(f"--bits takes comma-separated widths among 16, 8, 4, 3 and 2, got {args.bits!r}")
    if args.rank is not None and args.rank < 0:
        raise MoeserveError(f"--rank must be 0 or more, got {args.rank}")
    if args.budget is not None and args.budget <= 0:
        raise MoeserveError(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.out is not None:
        _check_output_path(args.out, "--out")
    from moeserve.spec import ModelSpec

    ModelSpec.from_dir(args.model)  # a bad checkpoint is named before the GPU check
    import torch

    if not torch.cuda.is_available():
        raise MoeserveError("moeserve tune needs a CUDA GPU (it times the Triton kernels on it)")
    from moeserve.tune import checkpoint_kinds, format_rows, tune_model

    kinds = checkpoint_kinds(args.model, bits, args.rank)
    rows = tune_model(args.model, list(tokens), kinds, "quick" if args.quick else "full", args.budget, args.out)
    print(f"launch configs on {torch.cuda.get_device_name()} (GPU ms of the experts call; default: the stored or "
          "default config before this run):")
    for line in format_rows(rows):
        print(line)
    if args.out is not None:
        print(f"wrote {args.out}")
    return 0


def _budget(text: str | None, flag: str, default: float | None, what: str) -> float:
    if text is None:
        if not default:
            raise MoeserveError(f"the hardware profile does not give the {what}; pass {flag} SIZE")
        return 0.9 * default
    size = parse_bytes(text)
    if size is None:
        raise MoeserveError(f"{flag} {text!r} is not a size like 16GiB")
    return size


def _workload_lengths(prompt_len: int | None, gen_len: int, context: int) -> tuple[int, int]:
    """(prompt, generated) tokens of the planned workload, which the model must be able to run: both positive,
    together within its context. No --prompt-len: 512, or what the context leaves after gen_len."""
    if gen_len < 1 or (prompt_len is not None and prompt_len < 1):
        raise MoeserveError("--prompt-len and --gen-len must be positive")
    if prompt_len is None:
        if gen_len >= context:
            raise MoeserveError(f"--gen-len {gen_len} leaves no room for a prompt in the model's context of "
                                f"{context} tokens")
        return min(DEFAULT_PLAN_PROMPT, context - gen_len), gen_len
    if prompt_len + gen_len > context:
        raise MoeserveError(f"--prompt-len {prompt_len} + --gen-len {gen_len} = {prompt_len + gen_len} tokens exceed "
                            f"the model's context of {context} tokens")
    return prompt_len, gen_len


def cmd_plan(args) -> int:
    if args.plan_for == "decode":
        return _plan_decode(args)
    for flag, value in (("--experts-bits", args.experts_bits), ("--dense-bits", args.dense_bits)):
        if value is not None:
            raise MoeserveError(f"{flag} rates placements: give it with --for decode")
    return _plan_batch(args)


def _plan_decode(args) -> int:
    """`moeserve plan --for decode`: every placement in the budget, rated (plan/placement.py), as a table or JSON."""
    from moeserve.plan.hardware import HardwareProfile, load_or_measure
    from moeserve.plan.placement import PlanRequest, check_dense_budget, rate_placements
    from moeserve.spec import ModelSpec

    for flag, value in (("--max-batch", args.max_batch), ("--plot", args.plot)):
        if value is not None:
            raise MoeserveError(f"{flag} belongs to the throughput plan: give it with --for batch")
    spec = ModelSpec.from_dir(args.model)
    prompt_len, gen_len = _workload_lengths(args.prompt_len, args.gen_len, spec.max_position_embeddings)
    hw = HardwareProfile.load(args.profile) if args.profile else load_or_measure()
    gpu = _budget(args.gpu_memory, "--gpu-memory", hw.gpu_memory_bytes, "GPU memory") if hw.has_gpu else None
    host = _budget(args.cpu_memory, "--cpu-memory", hw.ram_bytes, "host memory")
    dtype_bytes = 2 if gpu is not None else 4  # bf16 on a GPU, fp32 on a CPU (the commands' auto dtype)
    req = PlanRequest(None if gpu is None else int(gpu), int(host), dtype_bytes,
                      "bfloat16" if dtype_bytes == 2 else "float32", 1, prompt_len + gen_len, prompt_len, gen_len,
                      bits=args.experts_bits, dense_bits=args.dense_bits)
    check_dense_budget(spec, req.budget, dtype_bytes, 1, prompt_len + gen_len, req.least_dense_bits)
    plan = rate_placements(spec, hw, req)
    cands, chosen = plan.candidates, plan.chosen
    if args.json:
        print(json.dumps(_json_ready({
            "model": args.model, "device": hw.gpu_name or hw.cpu_name, "gpu_budget": req.budget, "host_budget": req.host_ram,
            "prompt_len": prompt_len, "gen_len": gen_len, "candidates": [c.as_dict() for c in cands],
            "chosen": None if chosen is None else cands.index(chosen), "dense_reason": plan.dense_reason}), indent=2,
            allow_nan=False))
        return 0
    budgets = (f"GPU budget {format_bytes(req.budget)}, " if req.budget is not None else "no GPU, ") + \
        f"host {format_bytes(host)}"
    print(f"{args.model} ({spec.family}, {spec.num_layers} layers, {spec.num_experts} experts top-{spec.top_k}) on "
          f"{hw.gpu_name or 'no GPU'} + {hw.cpu_name}; {budgets}; batch 1, estimated from the hardware profile")
    header = ("", "where the experts live", "dense", "GPU", "host", f"tg{gen_len} t/s", f"pp{prompt_len} t/s", "fits")
    rows = [("*" if c is chosen else "", c.where(), c.dense_precision, format_bytes(c.gpu_bytes),
             format_bytes(c.host_bytes), f"{c.decode_tok_s:,.1f}", f"{c.prefill_tok_s:,.0f}",
             ("yes" if c.fits else f"no: {c.problem}") + (" (needs --offload STORE)" if c.kind == "offload" else ""))
            for c in cands]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(c.rjust(w) if 3 <= i <= 6 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    if chosen is None:
        print("\nno placement fits; give more --gpu-memory or --cpu-memory")
    else:
        print(f"\n*: what generate|eval ppl|serve|bench --gpu-memory SIZE runs"
              + (f" (dense part 8-bit, {plan.dense_reason})" if plan.dense_reason else "")
              + f"; by hand: {' '.join(chosen.flags()) or 'no placement flags'}")
    return 0


def _plan_batch(args) -> int:
    from moeserve.plan.hardware import HardwareProfile, load_or_measure
    from moeserve.plan.roofline import Workload, check_modelled, operator_table, plot_roofline, turning_points
    from moeserve.plan.search import search
    from moeserve.spec import ModelSpec

    spec = ModelSpec.from_dir(args.model)
    check_modelled(spec)
    prompt_len, gen_len = _workload_lengths(args.prompt_len, args.gen_len, spec.max_position_embeddings)
    hw = HardwareProfile.load(args.profile) if args.profile else load_or_measure()
    gpu = _budget(args.gpu_memory, "--gpu-memory", hw.gpu_memory_bytes, "GPU memory")
    host = _budget(args.cpu_memory, "--cpu-memory", hw.ram_bytes, "host memory")
    max_batch = 4096 if args.max_batch is None else args.max_batch
    if max_batch < 1:
        raise MoeserveError("--max-batch must be positive")
    wl = Workload(prompt_len=prompt_len, gen_len=gen_len)
    plan = search(spec, hw, wl, gpu, host, max_batch=max_batch)
    rows = operator_table(spec, wl, hw, plan.policy)
    if args.plot:
        plot_roofline(rows, hw, args.plot, title=f"{Path(args.model).name}: N={plan.policy.batch_size}, "
                                                 f"n={plan.policy.micro_batch}, {plan.tokens_per_s:.0f} tokens/s")
    if args.json:
        report = {"policy": plan.policy.as_dict(), **{k: v for k, v in dataclasses.asdict(plan).items()
                                                      if k != "policy"},
                  "operators": rows, "turning_points": turning_points(hw), "device": hw.gpu_name}
        print(json.dumps(_json_ready(report), indent=2, allow_nan=False))
        return 0
    p = plan.policy
    _print_table([
        ("model", f"{args.model} ({spec.family}, {spec.num_layers} layers)"),
        ("hardware", f"{hw.gpu_name} + {hw.cpu_name}; budgets GPU {format_bytes(gpu)}, host {format_bytes(host)}"),
        ("policy", f"batch N={p.batch_size}, micro-batch n={p.micro_batch}, attention on "
                   f"{'GPU' if p.attention_on_gpu else 'CPU'}, FFN on {'GPU' if p.ffn_on_gpu else 'CPU'}, "
                   f"{p.weights_gpu_fraction:.0%} of weights and {p.kv_gpu_fraction:.0%} of KV on the GPU"),
        ("predicted", f"{plan.tokens_per_s:,.1f} tokens/s ({plan.decode_tokens_per_s:,.1f} in decode; step "
                      f"{plan.step_s * 1e3:.1f} ms, prefill {plan.prefill_s:.2f} s)"),
        ("bottleneck", plan.bottleneck),
        ("GPU memory", f"{format_bytes(sum(plan.gpu_bytes.values()))}: " + ", ".join(
            f"{k} {format_bytes(v)}" for k, v in plan.gpu_bytes.items() if v)),
        ("host memory", f"{format_bytes(sum(plan.host_bytes.values()))}: " + ", ".join(
            f"{k} {format_bytes(v)}" for k, v in plan.host_bytes.items() if v)),
        ("search", f"{plan.evaluated:,} candidates, {plan.feasible:,} fit, {plan.seconds * 1e3:.0f} ms"),
    ])
    print(f"\n{'operator (decode, per micro-batch)':<36}{'device':>7}{'GFLOP':>9}{'MB mem':>9}{'MB link':>9}"
          f"{'FLOP/B':>8}{'TFLOP/s':>9}{'ms':>8}  bound")
    for r in rows:
        print(f"{r['operator']:<36}{r['device']:>7}{r['flops'] / 1e9:>9.2f}{r['mem_bytes'] / 1e6:>9.1f}"
              f"{r['link_bytes'] / 1e6:>9.2f}{r['intensity']:>8.1f}{r['flop_per_s'] / 1e12:>9.2f}"
              f"{r['seconds'] * 1e3:>8.3f}  {r['bound']}")
    if args.plot:
        print(f"\nroofline plot: {args.plot}")
    return 0


def _manual_policy(args):
    """batch's policy from its options (before --gpu-memory fits the resident weights to the budget)."""
    from moeserve.plan.policy import ThroughputPolicy

    gpu_attention = not args.cpu_attention
    kv = args.kv_gpu_fraction if args.kv_gpu_fraction is not None else float(gpu_attention)
    return ThroughputPolicy(args.batch_size, args.micro_batch, gpu_attention, not args.cpu_ffn,
                            1.0 if args.weights_gpu_fraction is None else args.weights_gpu_fraction, kv)


def cmd_batch(args) -> int:
    from moeserve.engine.sampling import SamplingParams
    from moeserve.loader import load_model, resolve_device, resolve_dtype
    from moeserve.plan.batch import (BadLines, auto_policy, finished_ids, policy_for_budget, read_requests,
                                     run_batch, tokenize_requests)
    from moeserve.plan.layer_weights import host_weight_bytes
    from moeserve.plan.pipeline import Pipeline
    from moeserve.plan.roofline import check_modelled

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                            seed=args.seed, ignore_eos=args.ignore_eos)
    budget = _size(args.gpu_memory, "--gpu-memory")
    _check_output_path(args.output, "--output")
    finished_ids(args.output)  # an output that is not ours fails now, not after the model loads
    bad = BadLines(args.input, args.on_bad_line == "stop", lambda m: print(f"moeserve: warning: {m}", file=sys.stderr))
    spec, tok = _tokenizer(args.model)
    check_modelled(spec)
    requests = tokenize_requests(read_requests(args.input, bad), tok, spec.max_position_embeddings, bad)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    policy = None if args.auto else _manual_policy(args)
    model = load_model(args.model, device="cpu", dtype=dtype, progress=True)
    prompt_len = max((len(r.prompt_ids) for r in requests), default=1)
    if args.auto:
        pinned = device.type == "cuda"
        policy = auto_policy(model.spec, prompt_len, args.max_new_tokens, dtype.itemsize, budget, args.profile,
                             host_weight_bytes(model, pinned))
    elif budget is not None and args.weights_gpu_fraction is None:
        policy = policy_for_budget(model.spec, policy, prompt_len, args.max_new_tokens, dtype.itemsize, budget)
    print(f"[policy: {policy.as_dict()}]", file=sys.stderr)
    pipeline = Pipeline(model, policy, device)
    try:
        st = run_batch(pipeline, tok, requests, params, args.output, progress=True)
    finally:
        pipeline.close()
    print(f"[{st['requests']} requests ({st['skipped']} already done), {st['tokens']} tokens in {st['seconds']:.2f} s, "
          f"{st['tokens'] / max(st['seconds'], 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    from moeserve.train.run import run

    run(args)
    return 0


def _cpu_wait_policy(args) -> None:
    """Hybrid runs: torch's OpenMP threads that finish a parallel region sleep rather than spin
    (OMP_WAIT_POLICY=PASSIVE unless the user set it). The experts' native helper threads (kernels/cpu/pool.py), torch's
    own ops and the thread that drives the GPU share the cores, and OpenMP threads spinning process-wide take them from
    the others. Must be set before torch (and its OpenMP runtime) loads, which the commands do after this."""
    if _hybrid_requested(args) or _planning(args):  # a plan may put experts on the CPU
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _configure_logging(level: str) -> None:
    """MOESERVE_LOG=debug|info|warning: log records of moeserve's modules on stderr (debug: each layer's path)."""
    if not level:
        return
    import logging

    if level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise MoeserveError(f"MOESERVE_LOG must be debug, info, warning or error, got {level!r}")
    logging.basicConfig(format="moeserve: %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("moeserve").setLevel(level.upper())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"generate": cmd_generate, "info": cmd_info, "eval": cmd_eval_ppl, "quantize": cmd_quantize,
               "trace": cmd_trace, "batch": cmd_batch, "offload-prepare": cmd_offload_prepare, "profile": cmd_profile,
               "plan": cmd_plan, "serve": cmd_serve, "bench": cmd_bench, "train": cmd_train,
               "tune": cmd_tune}[args.command]
    status = 1
    try:
        _configure_logging(os.environ.get("MOESERVE_LOG", ""))
        _cpu_wait_policy(args)
        status = command(args)
        return status
    except MoeserveError as e:
        sys.stderr.write(f"moeserve: error: {e}\n")  # one write: ranks of a torchrun share the stream
        return 2
    except KeyboardInterrupt:
        print("\nmoeserve: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - resource failures get one line too
        if type(e).__name__ == "OutOfMemoryError":
            print("moeserve: error: out of GPU memory; try --device cpu, a smaller batch or --dtype bfloat16",
                  file=sys.stderr)
            return 2
        raise
    finally:
        if "torch.distributed" in sys.modules:  # only runs under torchrun initialise it
            from moeserve.parallel.launch import shutdown

            shutdown(wait_for_peers=status == 0)


if __name__ == "__main__":
    sys.exit(main())
