"""The options several commands share (model, ranks, offload, hybrid placement) and the parser class.

Nothing here imports torch: `moeserve --help` and argument errors answer at once. The options map onto
moeserve.config.RunConfig (RunConfig.from_args)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from moeserve.demo import DEMO_MODEL
from moeserve.engine.params import SamplingParams
from moeserve.hybrid.placement import STREAM_FROM
from moeserve.parallel.defaults import COLLECTIVE_TIMEOUT_S, STATIC_MAX_TOKENS
from moeserve.quant.defaults import DENSE_BITS


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


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEMO_DIR),
                   help="checkpoint directory: config.json + *.safetensors (default: the built-in demo model)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (GPU when present; default auto)")
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16 or auto (bf16 on a GPU, fp32 on a CPU; default auto)")
    threads_arg(p)


def threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads of torch's operations (default: one per core this process may use; with other "
                        "work on the machine, fewer than its cores can be faster)")


def parallel_args(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--collective-timeout", type=float, default=COLLECTIVE_TIMEOUT_S, metavar="SECONDS",
                   help=f"under torchrun: how long a rank waits in a collective for a peer before it stops with one "
                        f"line (a peer that died stops it at once on CPUs; default {COLLECTIVE_TIMEOUT_S:g}; it also "
                        f"bounds the wait for the slowest rank's load)")


def offload_args(o) -> None:
    """The options that only mean something with --offload (config.CacheConfig; --gpu-memory is RunConfig's)."""
    o.add_argument("--gpu-memory", "--memory", dest="memory", default=None, metavar="SIZE", help=GPU_MEMORY_HELP
                   + "; with --offload, the fast-memory budget (GPU memory, or RAM with --device cpu) from which "
                     "the cache slots are planned after the non-expert weights, KV cache and workspace")
    o.add_argument("--high-slots", type=int, default=None,
                   help="high-precision cache slots (instead of --gpu-memory)")
    o.add_argument("--low-slots", type=int, default=0,
                   help="low-precision cache slots (with --high-slots; --gpu-memory plans both kinds)")
    o.add_argument("--policy", default="hobbit", help="cache policy: lru, lfu, lhu, fld or hobbit (default)")
    o.add_argument("--all-high", action="store_true", help="no mixed precision: every expert high, none skipped")
    o.add_argument("--per-layer-cache", action="store_true",
                   help="split the slots evenly over the layers, each evicting only its own experts "
                        "(mixtral-offloading's layout; default: one pool for all layers)")
    o.add_argument("--t1", type=float, default=0.6, help="high/low threshold (default 0.6)")
    o.add_argument("--t2", type=float, default=0.9, help="low/skip threshold (default 0.9)")
    o.add_argument("--prefetch", type=int, default=1, metavar="N",
                   help="prefetch experts predicted for the next N MoE layers (default 1; 0 = off)")
    o.add_argument("--cooperative", action="store_true",
                   help="compute a missed expert on the CPU when that is faster than copying it to the GPU "
                        "(decided from measured CPU time and host->GPU bandwidth)")
    o.add_argument("--no-pin", action="store_true",
                   help="do not page-lock the store in RAM (loads are then staged through a small pinned buffer)")


def hybrid_args(p: argparse.ArgumentParser, store_option: bool) -> None:
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
    h.add_argument("--cpu-int8", action="store_true",
                   help="low-bit (2, 4, 8-bit) and MXFP4 CPU experts quantize their inputs to int8 per 32 values and "
                        "multiply on the CPU's AVX512-VNNI int8 dots: faster, about 1%% relative error per expert "
                        "(default: exact float kernels; float and 3-bit experts stay exact)")
    h.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="CPU threads computing the experts, pinned where the OS allows (default: the physical cores; "
                        "of one NUMA node on a multi-socket host)")
    h.add_argument("--experts-bits", type=int, default=None, metavar="B",
                   help="precision of the routed experts: 16 (the checkpoint's float weights, default; with "
                        "--gpu-memory: the plan's) or 8, 4, 3, 2 "
                        "(HQQ copies: fewer bytes for the CPU to read; a STORE must hold B-bit copies, without one "
                        "they are made on the fly)")
    dense_bits_arg(h)
    h.add_argument("--mixed-precision", action="store_true",
                   help="HOBBIT's per-token rule for the experts: by gate weight each runs at full precision, 4-bit "
                        "(or the store's low bits) or is skipped (T1 0.6, T2 0.9; with --experts-bits B < 16 it only "
                        "skips, chosen on the GPU); default off: exact output")
    h.add_argument("--stream-from", type=int, default=None, metavar="T",
                   help=f"a prompt (layer call) of T or more tokens copies the CPU layers' experts it needs to the GPU "
                        f"and computes them there, where many rows are cheap (default {STREAM_FROM}; 0: prompts run "
                        f"on the CPU too)")
    h.add_argument("--cpu-memory", default=None, metavar="SIZE",
                   help="with --offload STORE: host RAM for the CPU layers' experts, e.g. 100GiB; a store larger than "
                        "that stays on disk and a RAM cache of SIZE keeps the recently used experts (read from the "
                        "store on a miss: slower, same output)")
    if store_option:
        h.add_argument("--offload", metavar="STORE", default=None,
                       help="with --cpu-moe/--n-cpu-moe: the expert store to read experts from (default: built in RAM "
                            "from --model)")
        h.add_argument("--gpu-memory", dest="memory", default=None, metavar="SIZE", help=GPU_MEMORY_HELP)


def dense_bits_arg(p) -> None:
    p.add_argument("--dense-bits", type=int, choices=DENSE_BITS, default=None,
                   help="precision of the dense part's linear layers on the GPU (attention projections, shared "
                        "experts, dense FFNs, an untied LM head; not embeddings, norms or routers): 16 (the compute "
                        "dtype; the default) or 8 (HQQ 8-bit copies, groups of 64: about half the bytes, leaving room "
                        "for more experts); with --gpu-memory, not given: 8 where that puts fewer MoE layers' experts "
                        "on the CPU")


def offload_group(p: argparse.ArgumentParser) -> None:
    """--offload STORE and the cache options that go with it (generate, serve)."""
    o = p.add_argument_group("expert offloading (HOBBIT)", "keep experts in a store (RAM or disk) and a cache of them "
                             "in fast memory; see `moeserve offload-prepare`")
    o.add_argument("--offload", metavar="STORE", default=None,
                   help="expert store directory from offload-prepare (with --cpu-moe/--n-cpu-moe: the hybrid's store)")
    offload_args(o)



def sampling_params(args) -> SamplingParams:
    """generate's sampling options (checked: a one-line error names the bad one)."""
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
                          ignore_eos=args.ignore_eos)


def sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The sampling options of generate and chat (sampling_params reads them)."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"tokens to generate per answer (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", type=unescape,
                   help="stop when the output contains TEXT (repeatable; TEXT is not printed; the escapes \\n, "
                        "\\t, \\r and \\\\ are read as a newline, tab, carriage return and backslash)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
