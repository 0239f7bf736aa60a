"""The placement planner for runs at batch 1 (generate, eval ppl, serve, bench) within a GPU memory budget: where
the routed experts live and run, chosen from the model's shape and the measured hardware profile.

Candidates, each with the GPU and host bytes it needs (its footprint: plan/footprint.py, the workspace included)
and its estimated decode (tg) and prefill (pp) tokens/s:
  resident  every expert on the GPU, at the checkpoint's float precision or as B-bit HQQ copies
  hybrid    the routed experts of the first N MoE layers in host RAM, computed on the CPU where they lie (hybrid/),
            the other layers' experts resident; the GPU memory left over becomes S cache slots for the CPU layers'
            experts (N the fewest layers that leave the rest room on the GPU)
  offload   HOBBIT (offload/): every expert in a store, missed ones copied into GPU cache slots over the link
  cpu       no GPU: everything in RAM, computed on the CPU (float, or B-bit experts through the hybrid backend)
The dense part (attention, embeddings, norms, routers, shared experts, dense FFNs) and the KV cache are on the GPU
in every GPU candidate, the dense part's linear layers in the compute dtype or, with --dense-bits 8, as 8-bit HQQ
copies (quant/dense.py: about half the bytes); a budget that cannot hold them is refused, naming the minimum.

Estimates, per token at batch 1 (a roofline with fixed host costs, `Costs`):
  decode   max(GPU bytes / HBM bandwidth, CPU expert bytes / (DRAM bandwidth x cpu_dram_share), copied bytes /
           host->GPU bandwidth) + per-layer costs: a CUDA-graph replay when no layer's experts wait on the host
           (every expert resident, or low-bit CPU experts over the device link, each linked layer adding its round
           trip), else eager launches plus the host's work for each layer with CPU or offloaded experts; and each
           (token, expert) pair the CPU computes
  prefill  a prompt of `prompt_len` tokens, the layers' GPU and CPU parts one after the other: each part at the
           slower of its compute (FLOP/s x share) and memory roofs, plus copied bytes over the link
A cache of S slots over N layers of E experts is counted at hit rate S / (N E) (uniform routing: real routing is
skewed, so real caches do better); offload copies its misses at full precision.
Disk tier (a request with disk_bandwidth: `moeserve plan --offload STORE` measures it on the store's device,
plan/disk.py, or --disk-bandwidth gives it): a hybrid or CPU candidate whose CPU layers' experts do not fit the host
RAM runs with them in a store on disk and a RAM cache of what the RAM leaves (offload/disk_cache.py; no GPU cache
slots beside it), at hit rate cache / store bytes (uniform routing, as above); each token's misses are read from
disk before the CPU computes them, so decode adds their bytes / disk_bandwidth, and prefill the misses of the
experts its prompt touches.

Choice: a resident placement at the checkpoint's precision when it fits (the output is unchanged and nothing is
much faster); else, going down the precisions, the fastest fitting candidate of each, where a lower precision
replaces a higher one only when it is at least PRECISION_SPEEDUP times faster (fewer bits cost perplexity: 4-bit
experts are taken over float ones mostly, 3-bit over 4-bit when they make a resident placement of a hybrid one).
Offload needs an expert store from `moeserve offload-prepare`, so it is rated but only run when asked for with
--offload. Explicit flags (--cpu-moe / --n-cpu-moe N, --experts-bits B, --gpu-cache-experts S, --dense-bits) narrow
the candidates to those they describe.

Dense bits: the candidates are rated with the dense part at --dense-bits, 16 when it is not given. Then, without
--dense-bits and with a GPU, when the choice puts experts on the CPU (or nothing fits): the same expert precision
with an 8-bit dense part is taken when that leaves fewer MoE layers' experts on the CPU (llama.cpp keeps its dense
part in Q8_0 by default; decode at batch 1 is set by the experts the CPU computes). --dense-bits 16 keeps the
compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moeserve.errors import MoeserveError
from moeserve.hybrid.memory import ring_slots, store_precision
from moeserve.hybrid.placement import STREAM_FROM, HybridPlacement
from moeserve.plan.footprint import (Footprint, Precision, RunLayout, checkpoint_precision, dense_bytes,
                                     engine_kv_rows, expert_bytes, expert_precision, footprint, gpu_minimum, gpu_room,
                                     hybrid_layout, kv_cache_bytes, offload_layout, plan_slots, resident_layout)
from moeserve.plan.hardware import HardwareProfile
from moeserve.plan.roofline import expected_experts
from moeserve.spec import ModelSpec
from moeserve.units import format_bytes

PLAN_BITS = (16, 4, 3)  # expert precisions rated, highest first: 16 = the checkpoint's float weights, else HQQ
AUTO_DENSE_BITS = 8  # the dense part's precision the planner may choose when --dense-bits is not given
PRECISION_SPEEDUP = 2.0  # how much faster a lower precision must be to be chosen over a higher one
OFFLOAD_LOW_BITS = 4  # the low-bit copies of the offload candidate's store (offload-prepare's default)


@dataclass(frozen=True)
class Costs:
    """What the roofline leaves out: the host's fixed costs and the shares of the peaks our kernels reach.
    The CPU and link figures are fitted to bench/results/hybrid-nvidia-h200-20261126-222643.json (H200 + 16-core
    Xeon, a fresh machine, Mixtral and Qwen3-30B-A3B shapes at 4-bit, CPU layers over the device link: each column's
    decode rate within 12% of the measured one, the Qwen3 cache column left out: its routing repeats); the host-path
    figures to the runs before the link (bench/results/hybrid-nvidia-h200-20261126-115936.json)."""

    graph_layer_s: float = 30e-6  # a decoder layer replayed in a CUDA graph (resident, or CPU layers on the link)
    eager_layer_s: float = 0.2e-3  # a decoder layer launched eagerly (a step with host-path or offloaded experts)
    host_layer_s: float = 3.4e-3  # the host's work for a layer whose experts wait on it (routing copy, hand-off)
    link_layer_s: float = 0.1e-3  # a CPU layer over the device link: the round trip and the CPU call's fixed part
    cpu_call_s: float = 10e-6  # per expert call of the CPU (decode: a (token, expert) pair; prefill: an expert)
    cpu_dram_share: float = 0.9  # of the DRAM bandwidth the CPU expert kernels read at one row
    cpu_flops_share: float = 0.3  # of the CPU's matmul peak reached by the experts of a prompt
    gpu_flops_share: float = 0.5  # of the GPU's matmul peak reached at prefill


@dataclass(frozen=True)
class PlanRequest:
    """What a run asks of the planner. budget None: no GPU (the model runs on the CPU)."""

    budget: int | None  # GPU bytes for the model: weights, KV cache, cache slots, workspace
    host_ram: int  # host bytes the experts (and on a CPU, the whole model) may take
    dtype_bytes: int  # the compute dtype's element size (2: bf16 on a GPU, 4: fp32 on a CPU)
    dtype_name: str = "bfloat16"
    kv_batch: int = 1  # sequences the KV cache holds
    kv_tokens: int = 640  # tokens per sequence it holds
    prompt_len: int = 512  # the estimates' workload: prefill of prompt_len tokens, decode after it
    gen_len: int = 128
    bits: int | None = None  # --experts-bits: only candidates at these bits
    group: int | None = None  # with bits: their quantization group as a quantized checkpoint stores its experts
    cpu_layers: int | None = None  # --cpu-moe / --n-cpu-moe N: only candidates with these CPU layers
    cache_slots: int | None = None  # --gpu-cache-experts S
    dense_bits: int | None = None  # --dense-bits (16 or 8); None: not given (the module docstring's dense rule)
    pass_tokens: int | None = None  # tokens of the run's largest forward pass (the workspace); None: prompt_len
    blas_workspaces: int = 2  # cuBLAS workspaces the GPU holds (footprint.RunLayout): 2 with CUDA graphs, 0 no GPU
    disk_bandwidth: float | None = None  # B/s read from an expert store on disk (the disk tier); None: no store

    @property
    def rated_dense_bits(self) -> int:
        """The dense bits the candidates are rated at."""
        return 16 if self.dense_bits is None else self.dense_bits

    @property
    def least_dense_bits(self) -> int:
        """The fewest dense bits a plan for this request may run at: those given, else AUTO_DENSE_BITS on a GPU."""
        if self.dense_bits is not None:
            return self.dense_bits
        return AUTO_DENSE_BITS if self.budget is not None else 16


@dataclass(frozen=True)
class Candidate:
    kind: str  # resident, hybrid, offload or cpu (the module's docstring)
    bits: int  # experts' precision (16: the compute dtype's float)
    cpu_layers: int  # MoE layers whose experts the CPU computes (offload: those whose experts are copied)
    moe_layers: int
    cache_slots: int
    gpu_bytes: int
    host_bytes: int
    decode_tok_s: float
    prefill_tok_s: float
    dtype_name: str
    problem: str | None = None  # why it cannot run here; None: it fits
    streams: bool = False  # prompts stream the CPU layers' experts to the GPU (the budget holds the ring)
    dense_bits: int = 16  # the dense part's linear layers: 16 = the compute dtype's float, 8 = HQQ copies
    footprint: Footprint = field(default_factory=Footprint, compare=False)  # its bytes per device and part
    disk_cache: int = 0  # the disk tier's RAM cache of the CPU layers' experts (0: they all lie in RAM)
    disk_bytes: float = 0.0  # bytes a decode token reads from disk (the disk tier's misses)

    @property
    def fits(self) -> bool:
        return self.problem is None

    @property
    def hybrid(self) -> bool:
        """Runs through the hybrid backend: low-bit experts or experts on the CPU (not plain or offloaded)."""
        return self.kind != "offload" and (self.bits != 16 or self.cpu_layers > 0)

    @property
    def precision(self) -> str:
        return self.dtype_name if self.bits == 16 else f"{self.bits}-bit"

    @property
    def dense_precision(self) -> str:
        """The dense part's linear layers, in a word: the compute dtype or `8-bit`."""
        return self.dtype_name if self.dense_bits == 16 else f"{self.dense_bits}-bit"

    def where(self) -> str:
        """Where the experts live, in a few words."""
        if self.kind == "resident":
            return f"every expert on the GPU ({self.precision})"
        if self.kind == "cpu":
            return "everything on the CPU " + (f"({self.precision})" if self.bits == 16 else
                                               f"(experts {self.precision})")
        if self.kind == "offload":
            return f"offload: experts in a store, {self.cache_slots} GPU cache slots"
        slots = f", {self.cache_slots} GPU cache slots" if self.cache_slots else ""
        disk = f", read from disk into a {format_bytes(self.disk_cache)} RAM cache" if self.disk_cache else ""
        return f"{self.cpu_layers}/{self.moe_layers} MoE layers' experts on the CPU ({self.precision}){slots}{disk}"

    def flags(self) -> list[str]:
        """The command-line options that ask for this placement by hand."""
        if self.kind == "offload":
            return ["--offload", "STORE", "--gpu-memory", "SIZE"]
        out = ["--device", "cpu"] if self.kind == "cpu" else []
        if self.hybrid:
            out += (["--cpu-moe"] if self.cpu_layers == self.moe_layers and self.cpu_layers
                    else ["--n-cpu-moe", str(self.cpu_layers)])
            out += ["--experts-bits", str(self.bits)] if self.bits != 16 else []
            out += ["--gpu-cache-experts", str(self.cache_slots)] if self.cache_slots else []
            out += ["--stream-from", "0"] if self.kind == "hybrid" and self.cpu_layers and not self.streams else []
            out += ["--offload", "STORE", "--cpu-memory", format_bytes(self.disk_cache).replace(" ", "")] \
                if self.disk_cache else []
        out += ["--dense-bits", str(self.dense_bits)] if self.dense_bits != 16 else []
        return out

    def as_dict(self) -> dict:
        return {"kind": self.kind, "where": self.where(), "bits": self.bits, "cpu_layers": self.cpu_layers,
                "cache_slots": self.cache_slots, "gpu_bytes": self.gpu_bytes, "host_bytes": self.host_bytes,
                "decode_tok_s": self.decode_tok_s, "prefill_tok_s": self.prefill_tok_s, "fits": self.fits,
                "problem": self.problem, "streams": self.streams, "dense_bits": self.dense_bits,
                "flags": self.flags(), "footprint": {"gpu": self.footprint.gpu, "host": self.footprint.host},
                "disk_cache": self.disk_cache, "disk_bytes_per_token": self.disk_bytes}


@dataclass(frozen=True)
class PlacementPlan:
    candidates: list[Candidate]
    chosen: Candidate | None  # None: nothing fits (plan_placement raises instead)
    request: PlanRequest = field(repr=False)
    dense_reason: str | None = None  # why the planner took 8-bit dense (None: --dense-bits given, or it did not)

    def describe(self) -> str:
        """One line: `[plan: 21/32 MoE layers' experts on the CPU (4-bit), ...; dense part 8-bit (...); GPU ...;
        estimated tg 7.1 tok/s, ...]`."""
        c, r = self.chosen, self.request
        memory = (f"GPU {format_bytes(c.gpu_bytes)} of {format_bytes(r.budget)}" if r.budget is not None
                  else "no GPU")
        dense = f"dense part {c.dense_precision}" + (f" ({self.dense_reason})" if self.dense_reason else "")
        return (f"[plan: {c.where()}; {dense}; {memory}, host {format_bytes(c.host_bytes)}; estimated tg "
                f"{c.decode_tok_s:,.1f} tok/s, pp{r.prompt_len} {c.prefill_tok_s:,.0f} tok/s; `moeserve plan` "
                f"lists the others]")


# ---- bytes and FLOPs ----------------------------------------------------------------------------------


def moe_layer_count(spec: ModelSpec) -> int:
    return sum(spec.moe.layers) if spec.moe.layers else spec.num_layers


def dense_layout(spec: ModelSpec, req: PlanRequest, dense_bits: int, budget: int | None = None) -> RunLayout:
    """The request's run without a routed expert on the GPU: the dense part at dense_bits, the engine's KV cache for
    kv_batch x kv_tokens, the request's largest pass (footprint.py)."""
    return _sized(resident_layout(spec, "cuda", req.dtype_bytes, engine_kv_rows(req.kv_batch), req.kv_tokens,
                                  dense_bits, budget=budget, experts=False), req)


def dense_minimum(spec: ModelSpec, req: PlanRequest, dense_bits: int = 16) -> int:
    """The smallest GPU budget any placement runs in: the dense part (at dense_bits), the KV cache and the
    workspace (footprint.py)."""
    return gpu_minimum(spec, dense_layout(spec, req, dense_bits))


def check_dense_budget(spec: ModelSpec, req: PlanRequest, dense_bits: int = 16) -> None:
    """A MoeserveError naming the minimum when the request's budget cannot hold the dense part (at dense_bits), the
    KV cache and the workspace."""
    need = dense_minimum(spec, req, dense_bits)
    if req.budget is not None and req.budget < need:
        at = "" if dense_bits == 16 else f" with {dense_bits}-bit linear layers (--dense-bits {dense_bits})"
        raise MoeserveError(
            f"--gpu-memory {format_bytes(req.budget)} cannot hold the dense part of the model{at}: attention, "
            f"embeddings, norms, routers, shared experts, a KV cache of {req.kv_batch} x {req.kv_tokens} tokens and "
            f"the activations and cuBLAS workspaces need {format_bytes(need)}; give at least that")


@dataclass(frozen=True)
class Work:
    """One token's decode traffic, or one prompt's prefill work, by where it happens."""

    gpu_bytes: float = 0.0
    cpu_bytes: float = 0.0
    link_bytes: float = 0.0  # copied host -> GPU
    gpu_flops: float = 0.0
    cpu_flops: float = 0.0
    cpu_calls: float = 0.0  # expert calls the CPU makes (Costs.cpu_call_s)
    host_layers: int = 0  # layers whose experts wait on the host (CPU or offloaded)
    linked_layers: int = 0  # layers whose CPU experts the GPU asks for over the device link (Costs.link_layer_s)
    disk_bytes: float = 0.0  # read from the store on disk first (the disk tier's misses)


def _dense_work(spec: ModelSpec, dtype_bytes: int, tokens: int, context: float,
                dense_bits: int = 16) -> tuple[float, float]:
    """(bytes read, FLOPs) of the dense part for `tokens` new tokens attending to `context` positions: every dense
    weight (at dense_bits) but the embedding table (a row per token) and the final norm, the KV cache, the LM head on
    the last token only."""
    D = spec.hidden_size
    head = spec.vocab_size * D
    layers = spec.parameter_counts()["dense"] - head * (1 if spec.tie_word_embeddings else 2) - D
    table = 0 if spec.tie_word_embeddings else head  # the embedding table, never quantized
    weights = dense_bytes(spec, dtype_bytes, dense_bits) - (table + D) * dtype_bytes
    kv = kv_cache_bytes(spec, 1, int(context), dtype_bytes)
    attention = 4 * tokens * context * spec.attention.num_heads * spec.attention.head_dim * spec.num_layers
    return weights + kv, 2 * tokens * layers + 2 * head + attention


def _layer_work(spec: ModelSpec, req: PlanRequest, gpu_layers: float, cpu_layers: float, link_layers: float,
                expert: float, host_layers: int, cpu_dense: bool = False, stream: bool = False,
                linked_layers: int = 0) -> tuple[Work, Work]:
    """(decode, prefill) work when `gpu_layers` MoE layers' experts are computed on the GPU, `cpu_layers` on the
    CPU (fractions: a cache's hits count on the GPU) and `link_layers` are copied to the GPU first; expert: bytes
    of one expert; host_layers: layers whose experts wait on the host; linked_layers: layers whose CPU experts the GPU
    asks for over the device link (decode; the step stays one graph); cpu_dense: the dense part runs on the CPU
    too (no GPU); stream: a prompt of the hybrid backend's STREAM_FROM tokens or more streams the CPU layers'
    experts to the GPU (hybrid/stream.py): at prefill they count as copied over the link and computed there."""
    T, k = req.prompt_len, spec.moe.top_k
    touched = float(expected_experts(spec.moe.num_experts, k, T))  # experts of a layer a prompt reads
    flops = 2 * T * k * 3 * spec.hidden_size * spec.moe.expert_ffn  # one layer's experts for the prompt
    dense_b, _ = _dense_work(spec, req.dtype_bytes, 1, req.prompt_len + req.gen_len / 2, req.rated_dense_bits)
    pre_b, pre_f = _dense_work(spec, req.dtype_bytes, T, (T + 1) / 2, req.rated_dense_bits)
    decode = Work(gpu_bytes=gpu_layers * k * expert, cpu_bytes=cpu_layers * k * expert,
                  link_bytes=link_layers * k * expert, cpu_calls=cpu_layers * k, host_layers=host_layers,
                  linked_layers=linked_layers)
    streamed = cpu_layers if stream and T >= STREAM_FROM else 0.0  # CPU layers' prefill on the GPU
    gpu_layers, cpu_layers, link_layers = gpu_layers + streamed, cpu_layers - streamed, link_layers + streamed
    prefill = Work(gpu_bytes=gpu_layers * touched * expert, cpu_bytes=cpu_layers * touched * expert,
                   link_bytes=link_layers * touched * expert, gpu_flops=gpu_layers * flops,
                   cpu_flops=cpu_layers * flops, cpu_calls=cpu_layers * touched, host_layers=host_layers)
    if cpu_dense:
        return (Work(**{**vars(decode), "cpu_bytes": decode.cpu_bytes + dense_b}),
                Work(**{**vars(prefill), "cpu_bytes": prefill.cpu_bytes + pre_b, "cpu_flops": prefill.cpu_flops + pre_f}))
    return (Work(**{**vars(decode), "gpu_bytes": decode.gpu_bytes + dense_b}),
            Work(**{**vars(prefill), "gpu_bytes": prefill.gpu_bytes + pre_b, "gpu_flops": prefill.gpu_flops + pre_f}))


def rates(spec: ModelSpec, hw: HardwareProfile, req: PlanRequest, decode: Work, prefill: Work, graph: bool,
          costs: Costs) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) of the work on this hardware."""
    cpu_bw, cpu_flops = hw.dram_bandwidth * costs.cpu_dram_share, hw.cpu_flops * costs.cpu_flops_share
    link = hw.h2d_bandwidth or float("inf")
    gpu_decode = gpu_prefill = 0.0
    if decode.gpu_bytes:
        gpu_decode = decode.gpu_bytes / hw.hbm_bandwidth
        gpu_prefill = max(prefill.gpu_flops / (hw.gpu_flops * costs.gpu_flops_share),
                          prefill.gpu_bytes / hw.hbm_bandwidth)
    fixed = spec.num_layers * (costs.graph_layer_s if graph else costs.eager_layer_s)
    fixed += decode.host_layers * costs.host_layer_s + decode.linked_layers * costs.link_layer_s
    disk = req.disk_bandwidth or float("inf")
    decode_s = (max(gpu_decode, decode.cpu_bytes / cpu_bw, decode.link_bytes / link) + fixed
                + decode.cpu_calls * costs.cpu_call_s + decode.disk_bytes / disk)
    prefill_s = (gpu_prefill + max(prefill.cpu_flops / cpu_flops, prefill.cpu_bytes / cpu_bw)
                 + prefill.link_bytes / link + fixed + prefill.cpu_calls * costs.cpu_call_s + prefill.disk_bytes / disk)
    return 1 / decode_s, req.prompt_len / prefill_s


# ---- candidates ---------------------------------------------------------------------------------------


def _problem(spec: ModelSpec, req: PlanRequest, layout: RunLayout, need: Footprint) -> str | None:
    """Why a placement with this footprint does not fit the request's memory (None: it fits)."""
    if req.budget is not None and need.gpu_total > req.budget:
        return f"needs {format_bytes(gpu_minimum(spec, layout))} of GPU memory"
    if need.host_total > req.host_ram:
        return f"needs {format_bytes(need.host_total)} of host RAM"
    return None


def _group(spec: ModelSpec, bits: int) -> int:
    """The quantization group of B-bit experts the hybrid backend would build (a MoeserveError for a shape no
    group divides, or bits it does not run)."""
    return store_precision(spec, HybridPlacement.choose([0], cpu_moe=True, bits=bits))[1]


def _bits(spec: ModelSpec, req: PlanRequest) -> list[tuple[int, int]]:
    """(bits, group) of the expert precisions to rate: --experts-bits, or those of PLAN_BITS the shape allows."""
    if req.bits is not None:
        return [(req.bits, _group(spec, req.bits) if req.group is None else req.group)]
    out = []
    for bits in PLAN_BITS:
        try:
            out.append((bits, _group(spec, bits)))
        except MoeserveError:
            continue  # no group divides this shape: float experts only
    return out


def _sized(layout: RunLayout, req: PlanRequest) -> RunLayout:
    """The layout with the request's largest pass (pass_tokens, else a prompt of prompt_len tokens), kv_batch logit
    rows and cuBLAS workspaces."""
    return replace(layout, pass_tokens=req.prompt_len if req.pass_tokens is None else req.pass_tokens,
                   logit_rows=req.kv_batch, blas_workspaces=req.blas_workspaces)


def _hybrid(spec: ModelSpec, req: PlanRequest, device: str, bits: int, group: int, cpu_layers: int, slots: int = 0,
            streams: bool = False) -> RunLayout:
    """The hybrid backend's layout for this split: the first cpu_layers MoE layers' experts in host RAM, slots GPU
    cache slots, the stream ring when prompts stream (footprint.hybrid_layout)."""
    placement = HybridPlacement.choose(spec.moe.layer_indices(), n_cpu_moe=cpu_layers, bits=bits, cache_slots=slots)
    return _sized(hybrid_layout(spec, placement, device, req.dtype_bytes, engine_kv_rows(req.kv_batch),
                                req.kv_tokens, bits if bits != 16 else 0, group, req.rated_dense_bits,
                                streams=streams, budget=req.budget), req)


def _candidate(spec, hw, req, costs, kind, bits, cpu_layers, slots, layout, decode, prefill,
               problem=None, streams=False) -> Candidate:
    tg, pp = rates(spec, hw, req, decode, prefill, graph=kind != "cpu" and not decode.host_layers, costs=costs)
    need = footprint(spec, layout)
    return Candidate(kind, bits, cpu_layers, moe_layer_count(spec), slots, need.gpu_total, need.host_total, tg, pp,
                     req.dtype_name, problem or _problem(spec, req, layout, need), streams, req.rated_dense_bits,
                     need)


def _disk_tier(spec, hw, req, costs, c: Candidate, layout: RunLayout, decode: Work, prefill: Work,
               expert: int) -> Candidate | None:
    """The candidate `c` (no GPU cache slots) with its CPU layers' experts (`expert` bytes each, as they run) in a
    store on disk and a RAM cache of what the host RAM leaves beside the rest of its host bytes (the in-RAM store's
    copies and repacks gone: the cache holds the experts as the CPU kernels read them), when the request has a
    disk bandwidth, c does not fit, and so it fits: the GPU holds it and the cache a token's experts of a layer
    (top_k); else None. Misses (hit rate cache / store, the module docstring) are read from disk: decode and prefill
    add their bytes over disk_bandwidth."""
    if req.disk_bandwidth is None or not c.cpu_layers or c.cache_slots or c.fits:
        return None
    host = {k: v for k, v in c.footprint.host.items() if k != "expert store"}
    store = c.cpu_layers * spec.moe.num_experts * expert
    cache = req.host_ram - sum(host.values())
    if store <= cache or cache < spec.moe.top_k * expert:
        return None
    miss = 1 - cache / store
    decode = replace(decode, disk_bytes=decode.cpu_bytes * miss)
    prefill = replace(prefill, disk_bytes=(prefill.cpu_bytes + prefill.link_bytes) * miss)
    tg, pp = rates(spec, hw, req, decode, prefill, graph=c.kind != "cpu" and not decode.host_layers, costs=costs)
    need = Footprint(c.footprint.gpu, {**host, "disk tier RAM cache": cache})
    if _problem(spec, req, layout, need) is not None:
        return None
    return replace(c, host_bytes=need.host_total, decode_tok_s=tg, prefill_tok_s=pp, problem=None, footprint=need,
                   disk_cache=cache, disk_bytes=decode.disk_bytes)


def _gpu_candidates(spec, hw, req, costs) -> list[Candidate]:
    M, E = moe_layer_count(spec), spec.moe.num_experts
    base = _sized(dense_layout(spec, req, req.rated_dense_bits, req.budget), req)
    room = gpu_room(spec, base)  # bytes left for experts on the GPU
    out = []
    for bits, group in _bits(spec, req):
        run_at = checkpoint_precision(spec, req.dtype_bytes) if bits == 16 else expert_precision(bits, req.dtype_bytes,
                                                                                                 group)
        eb = expert_bytes(spec, run_at)  # a resident expert, a slot's or the ring's copy (MXFP4: packed as shipped)
        ring = ring_slots(eb, E) * eb  # the GPU ring prompts stream the CPU layers' experts through
        if req.cpu_layers is not None:
            splits = [req.cpu_layers]
        else:  # the fewest CPU layers that leave the rest (and the ring) room
            fewest = 0 if room >= M * E * eb else min(max(M - int(max(room - ring, 0) // (E * eb)), 0), M)
            splits = sorted({0, fewest})
        for n in splits:
            streams = n > 0 and room - (M - n) * E * eb >= ring  # else prompts run on the CPU too
            left = room - (M - n) * E * eb - (ring if streams else 0)
            slots = req.cache_slots if req.cache_slots is not None else int(max(left, 0) // eb)
            slots = min(slots, n * E)
            hit = slots / (n * E) if n else 0.0
            linked = bits != 16  # low-bit CPU experts: over the device link, the decode step one graph
            decode, prefill = _layer_work(spec, req, M - n + n * hit, n * (1 - hit), 0, eb,
                                          host_layers=0 if linked else n, stream=streams,
                                          linked_layers=n if linked else 0)
            out.append(_candidate(spec, hw, req, costs, "resident" if n == 0 else "hybrid", bits, n, slots,
                                  _hybrid(spec, req, "cuda", bits, group, n, slots, streams), decode, prefill,
                                  streams=streams))
            if n and req.disk_bandwidth is not None and not out[-1].fits and not req.cache_slots:
                layout = _hybrid(spec, req, "cuda", bits, group, n, 0, streams)  # the disk tier: no GPU cache slots
                decode, prefill = _layer_work(spec, req, M - n, n, 0, eb, host_layers=0 if linked else n,
                                              stream=streams, linked_layers=n if linked else 0)
                c = _candidate(spec, hw, req, costs, "hybrid", bits, n, 0, layout, decode, prefill, streams=streams)
                disk = _disk_tier(spec, hw, req, costs, c, layout, decode, prefill, eb)
                out += [disk] if disk is not None else []
    if req.bits is None and req.cpu_layers is None:
        out.append(_offload_candidate(spec, hw, req, costs, base))
    return out


def _offload_candidate(spec, hw, req, costs, base: RunLayout) -> Candidate:
    """HOBBIT offload at this budget: float and 4-bit slots as `--offload STORE --gpu-memory` plans them."""
    M, E, k = moe_layer_count(spec), spec.moe.num_experts, spec.moe.top_k
    high = Precision.float(req.dtype_bytes)
    try:
        low = Precision.hqq(OFFLOAD_LOW_BITS, _group(spec, OFFLOAD_LOW_BITS))
    except MoeserveError:
        low = None  # no group divides this shape: float copies only
    hb, lb = expert_bytes(spec, high), expert_bytes(spec, low) if low else 0
    problem = None
    try:
        high_slots, low_slots = plan_slots(spec, base, hb, lb, reserve=k, max_slots=M * E)
    except MoeserveError:
        high_slots = low_slots = 0
        problem = f"needs {format_bytes(gpu_minimum(spec, base, k * (hb + lb)))} of GPU memory"
    hit = min((high_slots + low_slots) / (M * E), 1.0)
    decode, prefill = _layer_work(spec, req, M, 0, M * (1 - hit), hb, host_layers=M)
    layout = _sized(offload_layout(spec, req.dtype_bytes, base.kv_rows, req.kv_tokens, high_slots + k,
                                   low_slots + k, low, req.rated_dense_bits, req.budget), req)
    return _candidate(spec, hw, req, costs, "offload", 16, M, high_slots + low_slots, layout, decode, prefill,
                      problem)


def _cpu_candidates(spec, hw, req, costs) -> list[Candidate]:
    """No GPU: the whole model in RAM, its experts at each precision (low-bit ones through --cpu-moe)."""
    M = moe_layer_count(spec)
    out = []
    for bits, group in _bits(spec, req):
        n = req.cpu_layers if req.cpu_layers is not None else (0 if bits == 16 else M)
        eb = expert_bytes(spec, expert_precision(bits, req.dtype_bytes, group))
        layout = (_sized(resident_layout(spec, "cpu", req.dtype_bytes, engine_kv_rows(req.kv_batch), req.kv_tokens,
                                         req.rated_dense_bits), req) if bits == 16 and n == 0
                  else _hybrid(spec, req, "cpu", bits, group, n))
        decode, prefill = _layer_work(spec, req, 0, M, 0, eb, host_layers=0, cpu_dense=True)
        out.append(_candidate(spec, hw, req, costs, "cpu", bits, n, 0, layout, decode, prefill))
        disk = _disk_tier(spec, hw, req, costs, out[-1], layout, decode, prefill, eb)
        out += [disk] if disk is not None else []
    return out


def candidates(spec: ModelSpec, hw: HardwareProfile, req: PlanRequest, costs: Costs = Costs()) -> list[Candidate]:
    """Every placement the request allows, rated (see the module's docstring)."""
    if req.budget is None:
        return _cpu_candidates(spec, hw, req, costs)
    if not hw.has_gpu:
        raise MoeserveError("the hardware profile has no GPU figures (gpu_flops, hbm_bandwidth, h2d_bandwidth); "
                            "plan with --profile FILE from a GPU machine")
    return _gpu_candidates(spec, hw, req, costs)


def choose(cands: list[Candidate]) -> Candidate | None:
    """The checkpoint's precision all resident when it fits; else down the precisions, the fastest fitting candidate
    of each, a lower precision only when PRECISION_SPEEDUP times faster than the choice so far; never offload (it
    needs a store: asked for with --offload)."""
    runnable = [c for c in cands if c.fits and c.kind != "offload"]
    exact = [c for c in runnable if c.bits == 16 and c.cpu_layers == 0]
    if exact:
        return exact[0]
    best = None
    for bits in sorted({c.bits for c in runnable}, reverse=True):
        fastest = max((c for c in runnable if c.bits == bits), key=lambda c: c.decode_tok_s)
        if best is None or fastest.decode_tok_s >= PRECISION_SPEEDUP * best.decode_tok_s:
            best = fastest
    return best


def choose_dense(spec: ModelSpec, hw: HardwareProfile, req: PlanRequest, chosen: Candidate | None,
                 costs: Costs = Costs()) -> tuple[Candidate | None, str | None]:
    """The module docstring's dense rule for `chosen` (the choice at the rated dense bits): (the 8-bit dense candidate
    that replaces it, why) or (None, None). Without --dense-bits, with a GPU, when `chosen` puts experts on the CPU:
    the fitting 8-bit dense candidate of its expert precision with the fewest CPU layers, when that is fewer; when
    `chosen` is None (nothing fits): the choice among the 8-bit dense candidates."""
    if req.dense_bits is not None or req.budget is None or (chosen is not None and chosen.cpu_layers == 0):
        return None, None
    low = candidates(spec, hw, replace(req, dense_bits=AUTO_DENSE_BITS,
                                       bits=req.bits if chosen is None else chosen.bits), costs)
    if chosen is None:
        best = choose(low)
        return best, None if best is None else f"auto: no placement fits with it in {req.dtype_name}"
    fitting = [c for c in low if c.fits and c.kind != "offload"]
    best = min(fitting, key=lambda c: (c.cpu_layers, -c.decode_tok_s), default=None)
    if best is None or best.cpu_layers >= chosen.cpu_layers:
        return None, None
    return best, (f"auto: {chosen.cpu_layers - best.cpu_layers} fewer MoE layers' experts on the CPU than with it in "
                  f"{req.dtype_name}; --dense-bits 16 keeps {req.dtype_name}")


def rate_placements(spec: ModelSpec, hw: HardwareProfile, req: PlanRequest, costs: Costs = Costs()) -> PlacementPlan:
    """Every candidate the request allows, rated at its dense bits, and the choice (None when nothing fits); with the
    dense rule's 8-bit candidate appended where it is chosen (choose_dense)."""
    cands = candidates(spec, hw, req, costs)
    chosen = choose(cands)
    dense, reason = choose_dense(spec, hw, req, chosen, costs)
    if dense is not None:
        cands, chosen = cands + [dense], dense
    return PlacementPlan(cands, chosen, req, reason)


def plan_placement(spec: ModelSpec, hw: HardwareProfile, req: PlanRequest, costs: Costs = Costs()) -> PlacementPlan:
    """The rated candidates and the one to run; a MoeserveError when the budget cannot hold the dense part (at the
    fewest dense bits the request allows) or no candidate fits (naming the memory that is short and by how much)."""
    check_dense_budget(spec, req, req.least_dense_bits)
    plan = rate_placements(spec, hw, req, costs)
    cands, chosen = plan.candidates, plan.chosen
    if chosen is None:
        gpu_ok = [c for c in cands if c.kind != "offload" and (req.budget is None or c.gpu_bytes <= req.budget)]
        if gpu_ok:
            least = min(gpu_ok, key=lambda c: c.host_bytes)
            raise MoeserveError(f"not enough host RAM for the experts: the placement needing least ({least.where()}) "
                                f"needs {format_bytes(least.host_bytes)}, {format_bytes(req.host_ram)} is available; "
                                f"free memory or give more --gpu-memory")
        raise MoeserveError(f"no placement fits --gpu-memory {format_bytes(req.budget)}: "
                            f"{cands[0].where()} {cands[0].problem}; give more or fewer --n-cpu-moe layers' experts "
                            f"on the GPU")
    return plan
