"""Hybrid CPU/GPU experts at batch 1: decode (tg128) and 512-token prefill (pp512) tokens/s of a model whose 4-bit
experts do not fit the GPU budget, per placement, beside today's HOBBIT offload and the physical floor.

Shapes (random weights; Mixtral's layers unless said otherwise):
  mixtral  Mixtral-8x7B: 32 layers, D 4096, expert FFN 14336, 8 experts top-2, 12 GiB GPU budget
  qwen3    Qwen3-30B-A3B: 48 layers, D 2048, expert FFN 768, 128 experts top-8, 8 GiB GPU budget
  deepseek DeepSeek-V2-Lite: 27 layers (the first dense, FFN 10944), MLA (16 heads, latent 512 + rope 64, no q
           LoRA), D 2048, expert FFN 1408, 64 experts top-6 beside 2 shared ones (on the GPU), 5.5 GiB GPU budget
  deepseek-v3   DeepSeek-V3 (671B): 61 layers (the first 3 dense, FFN 18432), MLA (128 heads, q LoRA 1536, latent 512
                + rope 64), D 7168, 256 experts of FFN 2048 top-8 (sigmoid, noaux_tc, 8 groups) beside 1 shared; its
                FP8 weights drawn as floats and quantized once to the store's 4-bit HQQ; 128 GiB GPU budget
  qwen3-235b    Qwen3-235B-A22B: 94 layers, D 4096, GQA 64/4 heads of 128 with qk-norm, 128 experts of FFN 1536
                top-8; 64 GiB GPU budget
  gpt-oss-120b  GPT-OSS-120B: 36 layers, D 2880, 64/8 heads of 64, sinks, a 128-token window on even layers, 128
                experts of FFN 2880 top-4 with biases, MXFP4 as shipped on the CPU and the GPU (no re-quantization:
                the low-bit columns hybrid+mixed and hobbit-offload are skipped); 32 GiB GPU budget
Big shapes: `--layers N` runs their first N layers (dense layers in the same share), the GPU budget scaled to keep
the same share of MoE layers resident (budget_at), and reports each rate measured and scaled to full depth (a token's
time per layer as measured, times L), labelled "scaled from N of L layers" in the JSON (`depth`, `<rate>_full_depth`)
and the printed table. A pre-flight check refuses in one line, before anything is drawn, a run whose store (the
distinct layers, pinned, and the CPU kernels' repacks; float copies too with hobbit-offload) does not fit the host's
available RAM, or whose llama.cpp GGUF of the same layers (bench/peer/run.py writes it in the same call, under
$PEER_WORK) does not fit the free disk, and names the --layers (or --distinct-layers) that would. `--quick --shapes
deepseek-v3` etc. run tiny stand-ins of them (stand_in: the structure and depth at D 128, 8 experts).
The llama.cpp side-by-side (bench/peer/) covers mixtral, qwen3, qwen3-235b and gpt-oss-120b (PEER_LAYERS=shape=N for
--layers N); llama.cpp's deepseek2 GGUF (MLA) is not written, so the deepseek shapes have none.
Columns (experts 4-bit HQQ, group 64; CPU threads = --cpu-threads, default the physical cores):
  cpu             every MoE layer's experts on the CPU (--cpu-moe)
  hybrid          static: the first N MoE layers' experts on the CPU, the rest resident on the GPU, N the fewest
                  that fit the budget (--n-cpu-moe N)
  hybrid+cache    every layer on the CPU, the budget as GPU cache slots (--cpu-moe --gpu-cache-experts S; on the device
                  link the cache ranks experts by decayed use counts, kept between steps)
  hybrid+mixed    static, with HOBBIT's precision rule (4-bit experts: the low-weight ones are skipped); its
                  perplexity cost is measured on the demo model (held-out text, 4-bit experts on the CPU;
                  bench/mixed_precision.py, which bench/quality.py also runs on a trained model)
  hobbit-offload  today's offload (bench/offload.py's `hobbit`: bf16 + 4-bit cache, misses copied over PCIe)
Floor per column: max(CPU expert bytes / DRAM read bandwidth, GPU bytes / HBM bandwidth) per decode token, with
the bytes each column read in its timed steps (its measured hit rate); offload: its PCIe bytes / host->device.
Prefill: a prompt of --prefill tokens streams the CPU layers' experts to the GPU (hybrid/stream.py); its floor is
the bytes it copied / the measured host->device bandwidth. Every column with CPU layers keeps the streaming ring
(hybrid/memory.py ring_slots) inside its GPU budget.
Threshold sweep (--sweep): prompts of T tokens through the `cpu` column's model, the experts on the CPU and
streamed, per T: where streaming starts to pay is the measured threshold (STREAM_FROM, `--stream-from`).

Routing: Mixtral replays the demo model's routing of held-out text (bench/offload.py's DemoRouting: both have 8
experts, top-2); the Qwen3 and DeepSeek shapes' 128 and 64 experts cannot replay the demo's 8, so their random
routers pick (near uniform: the cache's worst case; DeepSeek's is its greedy softmax gate). The store holds
--distinct-layers layers of random experts and MoE layer i reads layer i mod that (as bench/offload.py: every
expert read still streams its bytes from DRAM or over PCIe).

    python bench/hybrid.py                    # GPU: every shape, JSON to bench/results/, a table on stdout
    python bench/hybrid.py --shapes deepseek  # GPU: one shape
    python bench/hybrid.py --shapes qwen3-235b --layers 8 --columns cpu,hybrid --sweep ""   # GPU: scaled to 94
    python bench/hybrid.py --quick            # tiny models on the CPU (RAM as the model device; a Mixtral-like
                                              # one and a DeepSeek-like one with MLA), seconds
    OMP_WAIT_POLICY=ACTIVE python bench/hybrid.py   # OpenMP threads spin between regions (default here: PASSIVE)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `moeserve --cpu-moe` runs; before torch loads OpenMP
import torch  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "peer"),
                str(Path(__file__).resolve().parent.parent)]  # bench/, bench/peer/, repo
import make_gguf  # noqa: E402
from common import (add_run_args, measure_dram_read_bandwidth, measure_hbm_bandwidth, result_record,  # noqa: E402
                    run_device, sync, write_result)
from mixed_precision import mixed_precision_cost  # noqa: E402
from offload import (DEMO_DIR, DemoRouting, dense_model, model_spec, random_resident_mxfp4,  # noqa: E402
                     random_store, replay_routing, run_method)

from moeserve.engine.generate import iterate  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.hybrid.memory import ring_slots  # noqa: E402
from moeserve.hybrid.placement import HybridPlacement  # noqa: E402
from moeserve.hybrid.setup import enable_hybrid  # noqa: E402
from moeserve.kernels.cpu.machine import expert_cores, physical_cores  # noqa: E402
from moeserve.offload.host_compute import HostExperts  # noqa: E402
from moeserve.offload.transfer import measure_h2d_bandwidth  # noqa: E402
from moeserve.plan.footprint import (WORKSPACE_SHARE, Precision, dense_bytes, expert_bytes,  # noqa: E402
                                     kv_cache_bytes)
from moeserve.quant.dense import quantize_dense  # noqa: E402

GiB = 1 << 30
SHAPES = {
    "mixtral": (dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                     expert_ffn=14336, num_experts=8, top_k=2), 12 * GiB, "demo"),
    "qwen3": (dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                   expert_ffn=768, num_experts=128, top_k=8), 8 * GiB, "model"),
    # GPU budget: a third of the 26 MoE layers' 4-bit experts resident. bf16 dense part 2.44 GiB (embeddings and
    # head 0.78, MLA, the dense layer, the shared experts) + KV 0.02 GiB (MLA's latent: 576 values per token and
    # layer) + the streaming ring 0.25 GiB (55 experts of 4.6 MiB) + 8.7 layers x 0.29 GiB (64 experts) = 5.2 GiB,
    # over 1 - WORKSPACE_SHARE: 5.5 GiB, which leaves 8 MoE layers resident and 18 on the CPU
    "deepseek": (dict(family="deepseek_v2", vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16,
                      num_kv_heads=16, head_dim=192, rotary_dim=64, expert_ffn=1408, num_experts=64, top_k=6,
                      norm_topk_prob=False, dense_layers=1, dense_ffn=10944, shared_expert_ffn=2 * 1408,
                      rope=dict(interleave=True), router=dict(scoring="softmax", topk_method="greedy"),
                      mla=dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                               v_head_dim=128, softmax_scale=192 ** -0.5)), int(5.5 * GiB), "model"),
    # the big shapes (their real configs' sizes; `--layers N` runs N of their layers and scales to full depth). GPU
    # budgets: deepseek-v3 the H200 itself, 128 GiB (31.9 GiB bf16 dense part incl. MLA and the 3 dense layers, 58
    # MoE layers of 256 4-bit experts at 5.9 GiB a layer: 15 resident); qwen3-235b 64 GiB (14.9 GiB dense, 94
    # layers at 1.27 GiB: 36 resident) and gpt-oss-120b 32 GiB, a consumer card (4.0 GiB dense, 36 layers of MXFP4
    # experts as shipped at 1.58 GiB: 16 resident): the regime --n-cpu-moe is for
    "deepseek-v3": (dict(family="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
                         num_kv_heads=128, head_dim=192, rotary_dim=64, expert_ffn=2048, num_experts=256, top_k=8,
                         dense_layers=3, dense_ffn=18432, shared_expert_ffn=2048, rms_norm_eps=1e-6,
                         rope=dict(interleave=True),
                         router=dict(scoring="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
                                     routed_scaling_factor=2.5, correction_bias=True),
                         mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128, softmax_scale=192 ** -0.5)), 128 * GiB, "model"),
    "qwen3-235b": (dict(family="qwen3_moe", vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64,
                        num_kv_heads=4, head_dim=128, qk_norm="head", expert_ffn=1536, num_experts=128, top_k=8,
                        router_weights_fp32=False, dense_ffn=12288, rms_norm_eps=1e-6, rope=dict(theta=1e6)),
                   64 * GiB, "model"),
    "gpt-oss-120b": (dict(family="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=36, num_heads=64,
                          num_kv_heads=8, head_dim=64, qkv_bias=True, o_bias=True, attention_sinks=True,
                          sliding_window=128, expert_ffn=2880, num_experts=128, top_k=4, router_weights_fp32=False,
                          router_bias=True, expert_bias=True, expert_act=dict(alpha=1.702, limit=7.0),
                          experts_mxfp4=True, rms_norm_eps=1e-5, norm_fp32=True, rope=dict(theta=150000.0)),
                     32 * GiB, "model"),
}

QUICK = {  # --quick: tiny shapes on the CPU, at quick_budget
    "quick": (dict(vocab_size=258, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                   expert_ffn=256, num_experts=8, top_k=2), None, "demo"),
    "quick-mla": (dict(family="deepseek_v2", vocab_size=258, hidden_size=128, num_layers=4, num_heads=4,
                       num_kv_heads=4, head_dim=24, rotary_dim=8, expert_ffn=64, num_experts=8, top_k=2,
                       norm_topk_prob=False, dense_layers=1, dense_ffn=256, shared_expert_ffn=128,
                       rope=dict(interleave=True), router=dict(scoring="softmax", topk_method="greedy"),
                       mla=dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                v_head_dim=16, softmax_scale=24 ** -0.5)), None, "model"),
}
COLUMNS = ("cpu", "hybrid", "hybrid+cache", "hybrid+mixed", "hobbit-offload")
LOW_BIT_COLUMNS = ("hybrid+mixed", "hobbit-offload")  # need low-bit copies (an MXFP4 shape's store has none)
BIG = ("deepseek-v3", "qwen3-235b", "gpt-oss-120b")  # --quick runs their stand_in()
BITS, GROUP = 4, 64
PEER_WORK = Path(os.environ.get("PEER_WORK", "/tmp/peer"))  # where bench/peer/run.py writes its GGUFs
RAM_BASE = 8 * GiB  # host RAM a run takes beside the store: torch, CUDA's host side, the demo model, staging


@dataclasses.dataclass(frozen=True)
class Host:
    """What a run may use of the machine: RAM, free disk where the GGUFs go (bytes), physical cores."""

    ram: int
    disk: int
    cores: int

    @classmethod
    def here(cls, disk_dir: Path = PEER_WORK) -> "Host":
        """This machine: available RAM (/proc/meminfo), free disk in disk_dir (or the nearest folder above it that
        exists), physical cores."""
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        meminfo = Path("/proc/meminfo")
        if meminfo.exists():
            fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
            ram = int(fields.get("MemAvailable", f"{ram // 1024} kB").split()[0]) * 1024
        while not disk_dir.exists():
            disk_dir = disk_dir.parent
        return cls(ram, shutil.disk_usage(disk_dir).free, len(physical_cores()))


H200_HOST = Host(128 * GiB, 64 * GiB, 16)  # the lead's GPU machine: one H200 beside these


def shape_at(shape: dict, layers: int | None) -> dict:
    """The shape with its first `layers` layers (None: all of them); dense-FFN layers in the same share as the full
    depth (rounded), at least one MoE layer."""
    full = shape["num_layers"]
    if layers is None or layers == full:
        return shape
    if not 1 <= layers <= full:
        raise SystemExit(f"hybrid.py: --layers {layers} is outside 1..{full}, the shape's layers")
    out = {**shape, "num_layers": layers}
    if shape.get("dense_layers"):
        out["dense_layers"] = min(round(shape["dense_layers"] * layers / full), layers - 1)
    return out


def budget_at(full_spec, spec, budget: int, kv_tokens: int, dtype_bytes: int, dense_bits: int = 16) -> int:
    """The GPU budget of `spec`, some layers of `full_spec`: the full budget's room for experts (beside the full
    depth's dense part and KV cache) in the same share per MoE layer, beside spec's own dense part and KV cache, so
    the same share of MoE layers stays resident."""
    def fixed(s) -> int:
        return dense_bytes(s, dtype_bytes, dense_bits) + kv_cache_bytes(s, 1, kv_tokens, dtype_bytes)

    room = budget * (1 - WORKSPACE_SHARE) - fixed(full_spec)
    room *= len(spec.moe.layer_indices()) / len(full_spec.moe.layer_indices())
    return int((room + fixed(spec)) / (1 - WORKSPACE_SHARE))


def depth_label(layers: int, full: int) -> str | None:
    """How a run of `layers` of `full` layers reports its figures (None: measured at full depth)."""
    return None if layers == full else f"scaled from {layers} of {full} layers"


SCALED = ("tg_tokens_per_s", "pp_tokens_per_s", "floor_tokens_per_s", "pp_floor_tokens_per_s")


def scale_row(row: dict, layers: int, full: int) -> dict:
    """A row of a run of `layers` of `full` layers with its rates also at full depth (`<rate>_full_depth`): a
    token's time per layer as measured (`tg_ms_per_layer`), times the full depth; the measured rates stay beside
    them."""
    label = depth_label(layers, full)
    if label is None:
        return row
    scaled = {f"{k}_full_depth": row[k] * layers / full for k in SCALED if row.get(k)}
    scaled["tg_ms_per_layer"] = 1e3 / (row["tg_tokens_per_s"] * layers)  # the per-layer figure scaled
    return {**row, **scaled, "depth": label}


def expert_precision_of(spec) -> Precision:
    """The experts' precision in this bench: MXFP4 as shipped (GPT-OSS), else 4-bit HQQ."""
    return Precision.mxfp4(2) if spec.moe.experts_mxfp4 else Precision.hqq(BITS, GROUP)


def gguf_bytes(name: str, layers: int) -> int:
    """The llama.cpp side's GGUF of the shape's first `layers` layers (bench/peer/make_gguf.py), 0 where it has no
    writer for the shape."""
    if name not in make_gguf.SHAPES:
        return 0
    return make_gguf.file_size(*make_gguf.plan(name, layers))


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a run asks of the host: RAM (the store's distinct layers, pinned, the CPU kernels' repacks of them,
    float copies for hobbit-offload, RAM_BASE) and disk (the llama.cpp side's GGUF of the same layers)."""

    ram: int
    disk: int

    def refusal(self, host: Host) -> str | None:
        """What does not fit `host` (None: both fit)."""
        if self.ram > host.ram:
            return f"needs {self.ram / GiB:.1f} GiB of RAM, the host has {host.ram / GiB:.1f} GiB"
        if self.disk > host.disk - GiB:
            return (f"needs {self.disk / GiB:.1f} GiB of disk for the llama.cpp side's GGUF, {host.disk / GiB:.1f} GiB "
                    f"is free (1 GiB kept)")
        return None


def needs(name: str, shape: dict, layers: int, distinct: int, high: bool) -> Needs:
    """What bench/hybrid.py (and bench/peer/run.py in the same call) asks of the host for `layers` of the shape."""
    spec = model_spec(shape_at(shape, layers))
    held = min(distinct, len(spec.moe.layer_indices())) * spec.moe.num_experts
    ram = RAM_BASE + 2 * held * expert_bytes(spec, expert_precision_of(spec))  # the store and the repacks
    if high and not spec.moe.experts_mxfp4:
        ram += held * expert_bytes(spec, Precision.float(2))
    return Needs(ram, gguf_bytes(name, layers))


def preflight(name: str, shape: dict, layers: int, distinct: int, high: bool, host: Host) -> str | None:
    """One line refusing the run when it does not fit `host`, with the layers that would (or the distinct layers,
    when the RAM does not fit at any depth); None when it fits."""
    why = needs(name, shape, layers, distinct, high).refusal(host)
    if why is None:
        return None
    lo, hi = 0, layers - 1  # the most layers that fit is in lo..hi (0: none); needs grow with the layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if needs(name, shape, mid, distinct, high).refusal(host) is None else (lo, mid - 1)
    hints = [f"--layers {lo} fits"] if lo else []
    distinct_fit = [d for d in range(1, distinct) if needs(name, shape, layers, d, high).refusal(host) is None]
    hints += [f"--distinct-layers {max(distinct_fit)} fits"] if distinct_fit else []
    hint = " or ".join(hints) or "nothing fits; fewer columns (hobbit-offload keeps float copies too)"
    return f"hybrid.py: {name} at {layers} layers {why}; {hint}"


def stand_in(shape: dict) -> dict:
    """A big shape's tiny CPU stand-in (--quick): its structure (family, MLA or GQA, dense layers, shared expert,
    router, sinks and window, MXFP4 experts) and depth, with D 128, 4 heads, 8 experts of FFN 64 top-2 and the
    demo's vocabulary."""
    out = {**shape, "vocab_size": 258, "hidden_size": 128, "num_heads": 4, "head_dim": 32, "expert_ffn": 64,
           "num_experts": 8, "top_k": 2, "num_kv_heads": 2 if shape["num_kv_heads"] < shape["num_heads"] else 4}
    if "mla" in shape:
        q_lora = 32 if shape["mla"]["q_lora_rank"] else None
        out.update(head_dim=24, rotary_dim=8, mla=dict(q_lora_rank=q_lora, kv_lora_rank=32, qk_nope_head_dim=16,
                                                       qk_rope_head_dim=8, v_head_dim=16, softmax_scale=24 ** -0.5))
    if "router" in shape:
        out["router"] = {**shape["router"], "n_group": min(shape["router"]["n_group"], 4),
                         "topk_group": min(shape["router"]["topk_group"], 2)}
    out.update({k: 256 if k == "dense_ffn" else 64 for k in ("dense_ffn", "shared_expert_ffn") if shape.get(k)})
    if shape.get("sliding_window"):
        out["sliding_window"] = 8
    return out


def quick_budget(resident: int, kv: int, expert_bytes: int) -> int:
    """A tiny shape's GPU budget: the dense part and the KV cache with their workspace share, then 20 4-bit experts
    (2.5 layers of 8): about a layer's experts resident beside the streaming ring, and room for the experts
    hobbit-offload keeps in flight."""
    return int((resident + kv) / (1 - WORKSPACE_SHARE) + 20 * expert_bytes)


def placement_of(column: str, spec, room: int, expert_bytes: int, threads: int,
                 n_cpu_moe: int | None = None, bits: int = BITS) -> HybridPlacement:
    """The column's placement for `room` bytes of GPU memory left for experts (and the streaming ring); n_cpu_moe:
    the static columns' CPU layers instead of the fewest that fit; bits: the experts' (16: the store's high copies,
    GPT-OSS's MXFP4)."""
    layers = spec.moe.layer_indices()
    room -= ring_slots(expert_bytes, spec.moe.num_experts) * expert_bytes
    if column == "hybrid+cache":
        return HybridPlacement.choose(layers, cpu_moe=True, cache_slots=max(room // expert_bytes, 0), threads=threads,
                                      bits=bits, num_experts=spec.moe.num_experts)
    resident = 0 if column == "cpu" else min(max(room // (spec.moe.num_experts * expert_bytes), 0), len(layers))
    n = len(layers) - resident if column == "cpu" or n_cpu_moe is None else n_cpu_moe
    return HybridPlacement.choose(layers, n_cpu_moe=n, threads=threads, bits=bits,
                                  mixed=column == "hybrid+mixed")


def run(model, spec, prompt_len: int, new_tokens: int, warmup: int, routing_tokens: int | None, device, stats,
        cuda_graph: bool = True, layers: list[int] | None = None):
    """(prefill seconds, decode seconds per step after warm-up, stats delta of the timed steps); layers: the CPU
    layers, which replay the demo's routing (routing_tokens of it)."""
    if routing_tokens:
        replay_routing(model, DemoRouting(routing_tokens), layers)
    prompt = torch.randint(0, spec.vocab_size, (prompt_len,)).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    marks, t0 = [], time.perf_counter()
    for _ in iterate(model, [prompt], params, cuda_graph=cuda_graph):
        sync(device)
        marks.append((time.perf_counter(), {**stats(), "page_faults": minor_faults()}))
    prefill = marks[0][0] - t0
    if new_tokens <= warmup + 1:
        return prefill, None, {}
    (ta, sa), (tb, sb) = marks[warmup], marks[-1]
    steps = len(marks) - 1 - warmup
    per_step = {k: (sb[k] - sa[k]) / steps for k in sb if isinstance(sb[k], (int, float))}
    times = sorted(b[0] - a[0] for a, b in zip(marks[warmup:], marks[warmup + 1:]))  # [steps] seconds
    per_step["step_ms_p10_p50_p90"] = [1e3 * times[int(q * (len(times) - 1))] for q in (0.1, 0.5, 0.9)]
    return prefill, (tb - ta) / steps, per_step


def minor_faults() -> int:
    """Page faults of this process so far (first touches of memory: costly on a VM whose RAM grows on use)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def hybrid_column(column, spec, store, host, device, dtype, room, args, rates, resident_bytes) -> dict:
    expert_bytes = store.expert_bytes(not store.mxfp4)
    placement = placement_of(column, spec, room, expert_bytes, args.cpu_threads, args.n_cpu_moe,
                             16 if store.mxfp4 else BITS)
    model = dense_model(spec, device, dtype)
    if store.mxfp4:  # the store holds the CPU layers' experts; the resident ones are drawn on the GPU
        random_resident_mxfp4(model, [i for i in placement.moe_layers if i not in placement.cpu_layers], device,
                              dtype)
    if args.dense_bits != 16:
        quantize_dense(model, args.dense_bits)
    runtime = enable_hybrid(model, store, placement, host=host, warm=True)  # repacked once per shape, not timed
    demo = args.routing == "demo"
    stats = lambda r=runtime: vars(r.totals())  # noqa: E731
    cpu_layers = list(placement.cpu_layers)
    _, step, per_token = run(model, spec, args.prompt, args.new_tokens + args.warmup, args.warmup,
                             args.prompt + args.new_tokens + args.warmup + 1 if demo else None, device, stats,
                             not args.no_cuda_graph, cpu_layers)
    # the prompt path at the timed length first: compiles, tunes (a first use of a token count) and sizes it
    run(model, spec, args.prefill, 1, 0, args.prefill if demo else None, device, stats, layers=cpu_layers)
    before = runtime.summary().get("bytes_streamed", 0)
    prefill, _, _ = run(model, spec, args.prefill, 1, 0, args.prefill if demo else None, device, stats,
                        layers=cpu_layers)
    streamed = runtime.summary().get("bytes_streamed", 0) - before
    sweep = threshold_sweep(model, spec, runtime, device, args) if column == "cpu" and args.sweep else None
    resident_layers = len(placement.moe_layers) - len(placement.cpu_layers)
    cpu_bytes = per_token["cpu_pairs"] * expert_bytes
    gpu_bytes = resident_bytes + (per_token["gpu_pairs"] + resident_layers * spec.moe.top_k) * expert_bytes
    floor = max(cpu_bytes / rates["dram"], gpu_bytes / rates["hbm"])
    row = {"column": column, "cpu_layers": len(placement.cpu_layers), "cache_slots": placement.cache_slots,
           "tg_tokens_per_s": 1 / step, "pp_tokens_per_s": args.prefill / prefill,
           "cpu_pairs_per_token": per_token["cpu_pairs"], "gpu_pairs_per_token": per_token["gpu_pairs"],
           "skipped_per_token": per_token["skipped"], "cpu_bytes_per_token": cpu_bytes,
           "gpu_bytes_per_token": gpu_bytes, "floor_tokens_per_s": 1 / floor, "of_floor": floor / step,
           "admitted": runtime.summary().get("admitted", 0), "page_faults_per_token": per_token["page_faults"],
           "step_ms_p10_p50_p90": per_token["step_ms_p10_p50_p90"], "pp_bytes_streamed": streamed,
           "pp_floor_tokens_per_s": args.prefill / (streamed / rates["h2d"]) if streamed and rates["h2d"] else None}
    if sweep:
        row["threshold_sweep"] = sweep
    runtime.close()
    del model, runtime
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return row


def threshold_sweep(model, spec, runtime, device, args) -> list[dict]:
    """Prompts of each --sweep T through the model, its CPU layers' experts on the CPU (stream_from 0) and streamed
    (stream_from 1): seconds per prompt and per CPU layer of each."""
    out, placement = [], runtime.placement
    for T in (int(t) for t in args.sweep.split(",")):
        row = {"tokens": T}
        for name, stream_from in (("cpu", 0), ("stream", 1)):
            runtime.placement = dataclasses.replace(placement, stream_from=stream_from)
            run(model, spec, T, 1, 0, T if args.routing == "demo" else None, device, lambda: {})  # warm
            seconds, _, _ = run(model, spec, T, 1, 0, T if args.routing == "demo" else None, device, lambda: {})
            row[f"{name}_s"], row[f"{name}_ms_per_layer"] = seconds, 1e3 * seconds / len(placement.cpu_layers)
        print(f"  sweep T={T}: CPU {row['cpu_ms_per_layer']:.2f} ms/layer, streamed {row['stream_ms_per_layer']:.2f}",
              flush=True)
        out.append(row)
    runtime.placement = placement
    return out


def offload_column(spec, store, device, dtype, budget, args, bandwidth) -> dict:
    """bench/offload.py's `hobbit` method at this budget (decode only; --offload-tokens steps)."""
    opts = SimpleNamespace(prompt=args.prompt, new_tokens=args.offload_tokens + args.warmup, warmup=args.warmup)
    routing = DemoRouting(opts.prompt + opts.new_tokens + 1) if args.routing == "demo" else None
    row = run_method(spec, store, device, dtype, budget, "hobbit", opts, bandwidth, routing, args.dense_bits)
    return {"column": "hobbit-offload", "tg_tokens_per_s": row["tokens_per_s"], "hit_rate": row["hit_rate"],
            "floor_tokens_per_s": row["floor_tokens_per_s"], "of_floor": row["of_floor"],
            "high_slots": row["high_slots"], "low_slots": row["low_slots"]}


def print_table(shape: str, rows: list[dict], prefill: int, precision: str = "4-bit",
                depth: str | None = None) -> None:
    """The shape's rows; depth (a run of fewer layers than the shape has): the figures measured on those layers,
    then tg and pp scaled to full depth, the header saying so."""
    print(f"\n{shape}: batch 1, {precision} experts" + (f"; full-depth columns {depth}" if depth else ""))
    scaled = f" {'tg full':>9s} {f'pp{prefill} full':>12s}" if depth else ""
    print(f"{'column':15s} {'tg tok/s':>9s} {'floor tok/s':>12s} {'of floor':>9s} {f'pp{prefill} tok/s':>12s} "
          f"{'pp floor':>9s} {'CPU layers':>11s} {'slots':>6s}{scaled}")
    for r in rows:
        cells = [f"{r[key]:{fmt}}" if r.get(key) else f"{'-':>{width}s}" for key, fmt, width in (
            ("floor_tokens_per_s", "12.1f", 12), ("of_floor", "9.0%", 9), ("pp_tokens_per_s", "12.1f", 12),
            ("pp_floor_tokens_per_s", "9.1f", 9))]
        full = "".join(f" {r[key]:{fmt}}" if r.get(key) else f" {'-':>{width}s}" for key, fmt, width in (
            ("tg_tokens_per_s_full_depth", "9.2f", 9), ("pp_tokens_per_s_full_depth", "12.1f", 12))) if depth else ""
        print(f"{r['column']:15s} {r['tg_tokens_per_s']:9.2f} {' '.join(cells)} {r.get('cpu_layers', '-'):>11} "
              f"{r.get('cache_slots', r.get('high_slots', '-')):>6}{full}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models on the CPU, seconds")
    ap.add_argument("--shapes", default=None, help=f"comma-separated subset of {','.join(SHAPES)} (default: all; "
                                                  f"with --quick, of {','.join(QUICK)}, or the big shapes' tiny "
                                                  f"stand-ins: {','.join(BIG)})")
    ap.add_argument("--layers", type=int, default=None,
                    help="run the first N layers of each shape and report the figures also scaled to full depth "
                         "(\"scaled from N of L layers\"); default: every layer")
    ap.add_argument("--columns", default=",".join(COLUMNS), help="comma-separated subset of the columns")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before the timed decode")
    ap.add_argument("--new-tokens", type=int, default=128, help="timed decode steps (tg)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill run (pp)")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    ap.add_argument("--offload-tokens", type=int, default=32, help="timed decode steps of hobbit-offload")
    ap.add_argument("--no-cuda-graph", action="store_true",
                    help="decode eagerly (default: the GPU work between the CPU layers as CUDA graphs)")
    ap.add_argument("--cpu-threads", type=int, default=len(expert_cores().cpus),
                    help="threads for the CPU experts (default: the physical cores, of one NUMA node on a multi-socket "
                         "host)")
    ap.add_argument("--distinct-layers", type=int, default=4, help="layers of distinct random experts in the store")
    ap.add_argument("--dense-bits", type=int, default=16, choices=(16, 8),
                    help="the dense part's linear layers: 16 (the compute dtype) or 8 (HQQ copies, --dense-bits 8)")
    ap.add_argument("--n-cpu-moe", type=int, default=None,
                    help="CPU layers of the hybrid and hybrid+mixed columns (default: the fewest that fit the budget; "
                         "e.g. llama.cpp's own fit, or 0: every expert resident, the budget ignored)")
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="held-out demo tokens for the mixed-precision cost")
    ap.add_argument("--sweep", default="8,16,32,64,128",
                    help="prompt lengths of the streaming threshold sweep (cpu column; empty: none)")
    add_run_args(ap)
    args = ap.parse_args(argv)
    table = {**QUICK, **{n: (stand_in(SHAPES[n][0]), None, SHAPES[n][2]) for n in BIG}} if args.quick else SHAPES
    names = args.shapes.split(",") if args.shapes else list(QUICK if args.quick else SHAPES)
    if not set(names) <= set(table):
        ap.error(f"--shapes {args.shapes}: choose from {','.join(table)}")
    shapes = {s: table[s] for s in names}
    high = "hobbit-offload" in args.columns.split(",")
    host = Host.here()
    for name, (shape, _, _) in shapes.items():  # before anything is drawn or written
        refusal = preflight(name, shape, args.layers or shape["num_layers"], args.distinct_layers, high, host)
        if refusal:
            sys.exit(refusal)
    device, dtype = run_device(args)
    if args.quick:
        args.new_tokens, args.warmup, args.prompt, args.prefill, args.offload_tokens = 6, 2, 4, 32, 4
        args.ppl_tokens, args.cpu_threads, args.sweep = 512, args.threads or 1, "4,8"
    torch.set_num_threads(args.cpu_threads)
    rates = {"dram": measure_dram_read_bandwidth(256 << 20 if args.quick else 1 << 30)["bytes_per_s"],
             "hbm": measure_hbm_bandwidth(device, 64 << 20 if args.quick else None)["bytes_per_s"]}
    bandwidth = measure_h2d_bandwidth(device) if device.type == "cuda" else None
    rates["h2d"] = bandwidth
    results = {}
    kv_tokens = args.prefill + args.new_tokens + args.warmup + args.prompt
    for name, (full_shape, full_budget, routing) in shapes.items():
        full = full_shape["num_layers"]
        layers = args.layers or full
        shape = shape_at(full_shape, layers)
        spec = model_spec(shape)
        args.routing = routing
        store = random_store(spec, min(args.distinct_layers, len(spec.moe.layer_indices())), device, dtype, BITS,
                             32 if args.quick else GROUP, high=high)
        low = not store.mxfp4
        resident = dense_bytes(spec, dtype.itemsize, args.dense_bits)
        kv = kv_cache_bytes(spec, 1, kv_tokens, dtype.itemsize)
        budget = (budget_at(model_spec(full_shape), spec, full_budget, kv_tokens, dtype.itemsize, args.dense_bits)
                  if full_budget else quick_budget(resident, kv, store.expert_bytes(low)))
        room = int(budget * (1 - WORKSPACE_SHARE)) - resident - kv
        rows, host = [], HostExperts(store, dtype)  # the CPU's view of the store, shared by the columns
        for column in args.columns.split(","):
            if store.mxfp4 and column in LOW_BIT_COLUMNS:
                print(f"{name} {column}: skipped (MXFP4 experts as shipped have no low-bit copies)", flush=True)
                continue
            if column == "hobbit-offload":
                row = offload_column(spec, store, device, dtype, budget, args, bandwidth)
            else:
                row = hybrid_column(column, spec, store, host, device, dtype, room, args, rates, resident)
            rows.append(scale_row(row, layers, full))
            print(f"{name} {column}: {row['tg_tokens_per_s']:.2f} tok/s", flush=True)
        precision = "MXFP4" if store.mxfp4 else f"{BITS}-bit"
        print_table(name, rows, args.prefill, precision, depth_label(layers, full))
        results[name] = {"shape": shape, "layers": layers, "full_layers": full, "depth": depth_label(layers, full),
                         "budget_bytes": budget, "full_depth_budget_bytes": full_budget, "dense_bytes": resident,
                         "kv_bytes": kv, "expert_precision": precision, "expert_bytes": store.expert_bytes(low),
                         "rows": rows}
        del store, host
        gc.collect()
    ppl = mixed_precision_cost(DEMO_DIR, list((DEMO_DIR / "heldout.txt").read_bytes()[:args.ppl_tokens]), BITS)
    print(f"\nmixed precision on the demo (4-bit experts on the CPU): perplexity {ppl['4bit']:.3f} -> "
          f"{ppl['4bit+mixed']:.3f} ({ppl['mixed_ppl_cost']:+.2%}), {ppl['4bit+mixed_skipped_share']:.1%} skipped")
    record = result_record("hybrid", {"quick": args.quick, "bits": BITS, "group": GROUP, "prompt": args.prompt,
                                      "new_tokens": args.new_tokens, "prefill": args.prefill, "warmup": args.warmup,
                                      "offload_tokens": args.offload_tokens, "cpu_threads": args.cpu_threads,
                                      "distinct_layers": args.distinct_layers, "dtype": str(dtype),
                                      "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
                                      "cuda_graph": not args.no_cuda_graph, "dense_bits": args.dense_bits,
                                      "n_cpu_moe": args.n_cpu_moe, "layers": args.layers}, device)
    record.update({"rates": {"dram_read_bytes_per_s": rates["dram"], "hbm_bytes_per_s": rates["hbm"],
                             "h2d_bytes_per_s": bandwidth}, "shapes": results, "demo_mixed_precision": ppl})
    print(write_result(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
