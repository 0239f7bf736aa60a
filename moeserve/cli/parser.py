"""The `moeserve` command line: every command's options (torch-free, so --help and argument errors answer at once)."""

from __future__ import annotations

import argparse

from moeserve.cli.options import (DEFAULT_PROMPT, DEMO_DIR, EXPLAIN_TOKENS, TUNE_TOKENS, Parser, dense_bits_arg,
                                  hybrid_args, model_args, offload_group, parallel_args, sampling_args, threads_arg)
from moeserve.cli.serving_args import batch_parser, bench_parser, serve_parser
from moeserve.train.options import DESCRIPTION as TRAIN_DESCRIPTION
from moeserve.train.options import add_train_args


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="moeserve",
        description="Run Mixture-of-Experts language models: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, "
                    "Kimi-K2, GLM-4.5, GPT-OSS, DBRX, Phi-MoE, Granite-MoE, Llama-4 (13 families).",
        epilog="Run `moeserve COMMAND --help` for the options of each command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)

    g = sub.add_parser("generate", help="generate text from prompts (streams it)",
                       description=f"Generate text. With no PROMPT the model continues {DEFAULT_PROMPT!r}, a "
                                   f"Shakespeare opening like the built-in demo's training text; any other --model "
                                   f"gets the same default, so give it a prompt of your own.")
    g.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help=f"one or more prompts, batched together (default {DEFAULT_PROMPT!r} for the demo and for "
                        f"any other --model alike)")
    model_args(g)
    sampling_args(g, max_new_tokens=200)
    g.add_argument("--chat", action="store_true",
                   help="each prompt is a user message: one chat turn through the checkpoint's chat template")
    g.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before each prompt")
    g.add_argument("--no-stream", action="store_true", help="print each result when done instead of streaming")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="decode eagerly on a GPU (default: replay each decode step as a CUDA graph where the "
                        "experts allow it)")
    parallel_args(g)
    offload_group(g)
    hybrid_args(g, store_option=False)

    c = sub.add_parser("chat", help="talk to a model: interactive, multi-turn, streamed",
                       description="An interactive conversation through the checkpoint's chat template (a plain "
                                   "speaker layout for a checkpoint without one, like the demo). Type a message and "
                                   "press Enter; /reset starts over, /exit (or Ctrl-D) ends. Earlier turns are dropped "
                                   "from the oldest when the conversation outgrows --ctx-size.")
    model_args(c)
    sampling_args(c, max_new_tokens=512)
    c.add_argument("--system", default=None, metavar="TEXT", help="a system message that starts the conversation")
    c.add_argument("--ctx-size", type=int, default=None, metavar="N",
                   help="tokens of conversation kept (default: the model's context, at most 4096)")
    c.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on a GPU")
    offload_group(c)
    hybrid_args(c, store_option=False)

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
    model_args(ppl)
    ppl.add_argument("--text", default=None, help="UTF-8 text file (default: the demo's held-out Hamlet)")
    ppl.add_argument("--window", type=int, default=512, help="tokens per window (default 512, capped by the context)")
    ppl.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    ppl.add_argument("--max-tokens", type=int, default=0, help="evaluate only the first N tokens (0 = all)")
    parallel_args(ppl)
    hybrid_args(ppl, store_option=True)

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
    threads_arg(q)

    op = sub.add_parser("offload-prepare", help="build the expert store used by generate --offload",
                        description="Write every routed expert in high precision (as in the checkpoint) and low "
                                    "precision (HQQ) to STORE, one file per layer (memory-mapped when used); a "
                                    "moeserve quantized checkpoint's experts as stored. Rerunning an interrupted build "
                                    "resumes it.")
    op.add_argument("--model", default=str(DEMO_DIR), help="checkpoint directory (default: the demo model)")
    op.add_argument("--out", required=True, help="store directory")
    op.add_argument("--low-bits", type=int, help="bits of the low-precision copies: 2, 3, 4 or 8 (default 4; a "
                                                  "moeserve quantized checkpoint: its own, its experts taken as stored)")
    op.add_argument("--group", type=int, help="quantization group size (default 64; a quantized checkpoint: its own)")

    t = sub.add_parser("trace", help="record expert-routing traces and replay them through cache policies",
                       description="Routing traces for the expert cache (HOBBIT): record one from a model reading a "
                                   "text, replay it under a cache policy, or fit the multi-dimensional policy weights.")
    tsub = t.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    rec = tsub.add_parser("record", help="record the routing of a model reading a text (token by token, layer by layer)")
    model_args(rec)
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
        sp = tsub.add_parser(name, help=helptext, description=f"{helptext}; prints a table (--json: JSON) of "
                                                                f"{outputs[name]}.")
        sp.add_argument("--json", action="store_true", help="print JSON instead of a table")
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

    batch_parser(sub)
    serve_parser(sub)
    bench_parser(sub)
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
    pl.add_argument("--offload", default=None, metavar="STORE",
                    help="with --for decode: an expert store on disk (`moeserve offload-prepare`): placements whose "
                         "CPU experts exceed --cpu-memory are rated with the disk tier, their misses read at the "
                         "store's disk bandwidth (measured once per device and cached)")
    pl.add_argument("--disk-bandwidth", default=None, metavar="SIZE",
                    help="with --for decode: the disk tier's read speed per second, e.g. 3GB (instead of measuring "
                         "--offload STORE's device; alone: rate the disk tier for a store not written yet)")
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
    dense_bits_arg(pl)
    pl.add_argument("--json", action="store_true",
                    help="print JSON instead of a table (a ratio with nothing to divide by, e.g. the link intensity "
                         "of an operator that moves no bytes over the host link, is null)")
    return parser
