"""Hierarchical roofline model of MoE decoding with CPU attention and streamed weights (MoE-Lightning).

Reading of Cao et al. 2024 ("MoE-Lightning", HRM), in our words:
- An operator placed on device d reads its operands from d's own memory (intensity I_d = FLOPs / those
  bytes) and, for data that lives in the other memory, over the CPU->GPU link (I_cross = FLOPs / bytes
  that cross). Its attainable rate is P = min(peak_d, I_d * B_d, I_cross * B_link): three roofs, and
  the lowest names the bound (compute / memory / link).
- Turning points are the intensities where the attainable roof changes: each device's ridge
  peak_d / B_d (memory -> compute) and, for data that crosses the link, peak_GPU / B_link (link ->
  compute), plus I_d * B_d / B_link per operator (link -> memory).
- The balance point is the intensity at which a GPU fed over the link matches the CPU working from its
  own memory: for data in host memory, GPU gives min(peak_GPU, I B_link) and CPU min(peak_CPU, I B_CPU);
  with B_link < B_CPU they meet at I = peak_CPU / B_link. Below it, compute where the data is (CPU
  attention over a host KV cache); above it, ship the data to the GPU (weights of big-batch FFNs).

All functions are pure and broadcast over numpy arrays, so the policy search evaluates every
candidate in one pass and `evaluate` (one policy) runs the very same arithmetic.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import numpy as np

from moeserve.errors import MoeserveError
from moeserve.plan.footprint import checkpoint_precision, expert_bytes, qkv_width
from moeserve.plan.hardware import HardwareProfile
from moeserve.plan.policy import ThroughputPolicy
from moeserve.spec import ModelSpec


OPERATORS = ("pre_attention", "attention", "post_attention")
RESOURCES = ("GPU", "CPU", "CPU-GPU link", "micro-batch chain")


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    gen_len: int
    weight_bytes: float = 2.0  # bytes per weight element (bf16)
    kv_bytes: float = 2.0  # bytes per KV cache element
    act_bytes: float = 2.0  # bytes per activation element

    def __post_init__(self):
        if self.prompt_len < 1 or self.gen_len < 1:
            raise MoeserveError("prompt and generation lengths must be positive")

    @property
    def context(self) -> int:
        """KV positions a sequence holds at the end of generation."""
        return self.prompt_len + self.gen_len

    @property
    def decode_context(self) -> float:
        """Mean KV positions read per decode step (the cache grows from prompt_len to context)."""
        return self.prompt_len + (self.gen_len + 1) / 2


@dataclass(frozen=True)
class Op:
    """One operator of one layer for one micro-batch; every field broadcasts over candidates."""
    flops: np.ndarray
    weights: np.ndarray  # bytes of all the operator's weights in the layer (what is stored / streamed)
    weights_read: np.ndarray  # bytes of weights it reads (routed experts: only those touched)
    kv: np.ndarray  # bytes of KV cache it reads
    act_in: np.ndarray  # bytes of its input activations
    act_out: np.ndarray  # bytes of its output activations

    @property
    def mem(self) -> np.ndarray:
        """Bytes it moves through the memory of the device that runs it."""
        return self.weights_read + self.kv + self.act_in + self.act_out


@dataclass(frozen=True)
class Candidates:
    """Policies as parallel arrays (field names as in ThroughputPolicy), for vectorised evaluation."""
    batch_size: np.ndarray
    micro_batch: np.ndarray
    attention_on_gpu: np.ndarray
    ffn_on_gpu: np.ndarray
    weights_gpu_fraction: np.ndarray
    kv_gpu_fraction: np.ndarray

    @classmethod
    def of(cls, policies: list[ThroughputPolicy]) -> "Candidates":
        return cls(**{f.name: np.array([getattr(p, f.name) for p in policies])
                      for f in dataclasses.fields(cls)})

    def __len__(self) -> int:
        return len(self.batch_size)

    def policy(self, i: int) -> ThroughputPolicy:
        return ThroughputPolicy(**{f.name: getattr(self, f.name)[i].item() for f in dataclasses.fields(self)})

    @property
    def num_micro_batches(self) -> np.ndarray:
        return self.batch_size // self.micro_batch


def value_at(x, i: int = 0) -> float:
    """Candidate i's value of a figure that is an array over candidates or a scalar shared by all."""
    return float(x[i] if np.ndim(x) else x)


def expected_experts(num_experts: int, top_k: int, tokens) -> np.ndarray:
    """Expected distinct experts that `tokens` tokens touch with uniform top-k routing: E (1 - (1 - k/E)^T)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** np.asarray(tokens, dtype=float))


def layer_kinds(spec: ModelSpec) -> Counter:
    """(is_moe, sliding window or None) -> number of layers; layers of one kind cost the same."""
    windows = spec.attention.sliding_windows or (None,) * spec.num_layers
    moe = spec.moe.layers or (True,) * spec.num_layers
    return Counter(zip(moe, windows))


def attention_weights(spec: ModelSpec) -> tuple[int, int]:
    """(before the core, after it): weight elements of one layer's attention projections, biases included, as the
    pipeline runs them: those that make the query and the cache entry (MLA: W_UK too, which absorbs the query into
    the latent space) on the pre-attention side; o_proj (MLA: W_UV too, applied to the core's latent output) after.
    Norms inside attention (qk-norm, MLA's latent norms) and GPT-OSS's sinks are left out (small)."""
    pre = post = 0
    for name, out_features, in_features, bias in spec.attention_projections():
        elements = out_features * in_features + (out_features if bias else 0)
        if name == "o_proj":
            post += elements
        elif name == "kv_b_proj":  # per head W_UK [nope, r] and W_UV [v, r]
            m = spec.attention.mla
            pre += spec.attention.num_heads * m.qk_nope_head_dim * m.kv_lora_rank
            post += spec.attention.num_heads * m.v_head_dim * m.kv_lora_rank
        else:
            pre += elements
    return pre, post


def layer_ops(spec: ModelSpec, wl: Workload, is_moe: bool, window: int | None, n, q, attended,
              kv_len) -> dict[str, Op]:
    """FLOPs and bytes of one decoder layer's operators for a micro-batch of n sequences, q new tokens
    each, every new token attending to `attended` positions on average, kv_len cached positions read
    per sequence. Decode: q = 1, attended = kv_len = context. MLA is counted as it decodes, in the latent space
    (absorbed: model/mla.py), its cache one latent per token. Small terms (norms inside attention, rotary,
    writing the new KV entry, softmax, sinks) are left out."""
    D, H = spec.hidden_size, spec.attention.num_heads
    wb, kb, ab = wl.weight_bytes, wl.kv_bytes, wl.act_bytes
    if window is not None:
        attended, kv_len = np.minimum(attended, window), np.minimum(kv_len, window)
    n = np.asarray(n, dtype=float)
    t = n * q  # tokens in the micro-batch
    heads, dim, separate = spec.attention.kv_cache_entry()
    entry = heads * dim * (2 if separate else 1)  # cache values per token
    core_q, core_out = spec.attention.core()  # per head
    attn_pre, attn_post = attention_weights(spec)
    pre_w = (attn_pre + D) * wb  # query and cache entry projections + input norm
    pre = Op(flops=2 * t * attn_pre + 4 * t * D, weights=pre_w, weights_read=pre_w, kv=0.0,
             act_in=t * D * ab, act_out=t * qkv_width(spec) * ab)
    attn = Op(flops=2 * t * H * attended * (core_q + core_out),  # q.K^T and p.V
              weights=0.0, weights_read=0.0, kv=n * kv_len * entry * kb,
              act_in=t * qkv_width(spec) * ab, act_out=t * H * core_out * ab)
    dense = attn_post + D  # O projection (MLA: and W_UV) + post-attention norm
    if is_moe:
        E = spec.moe.num_experts
        router = D * E + (E if spec.moe.router_bias else 0)
        shared = 3 * D * spec.moe.shared_expert_ffn + (D if spec.moe.shared_expert_gate else 0)
        dense_bytes = (dense + router + shared) * wb
        expert = expert_bytes(spec, checkpoint_precision(spec, wb))  # as shipped: float at wb, or MXFP4 blocks
        total = dense_bytes + E * expert
        read = dense_bytes + expected_experts(E, spec.moe.top_k, t) * expert
        ffn_flops = 2 * t * (router + spec.moe.top_k * 3 * D * spec.moe.expert_ffn + shared)
    else:
        total = read = (dense + 3 * D * spec.moe.dense_ffn) * wb
        ffn_flops = 2 * t * 3 * D * spec.moe.dense_ffn
    post = Op(flops=2 * t * attn_post + ffn_flops + 4 * t * D, weights=total, weights_read=read, kv=0.0,
              act_in=t * H * core_out * ab, act_out=t * D * ab)
    return {"pre_attention": pre, "attention": attn, "post_attention": post}


# ---- placement and time ----------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    gpu_flops: float
    hbm: float
    cpu_flops: float
    dram: float
    link: float
    micro_batch_overhead: float = 0.0  # s per (micro-batch, layer): the executor's fixed cost

    @classmethod
    def of(cls, hw: HardwareProfile) -> "Rates":
        if not hw.has_gpu:
            raise MoeserveError("the hardware profile has no GPU figures (gpu_flops, hbm_bandwidth, h2d_bandwidth); "
                                "plan with --profile FILE from a GPU machine")
        return cls(hw.gpu_flops, hw.hbm_bandwidth, hw.cpu_flops, hw.dram_bandwidth, hw.h2d_bandwidth,
                   hw.micro_batch_overhead)


def placement(c: Candidates) -> dict[str, np.ndarray]:
    """Operator -> runs on the GPU. Pre-attention (QKV) always does: the policy has no switch for it."""
    return {"pre_attention": np.ones_like(c.attention_on_gpu, dtype=bool), "attention": c.attention_on_gpu,
            "post_attention": c.ffn_on_gpu}


def link_bytes(ops: dict[str, Op], c: Candidates, residual) -> dict[str, np.ndarray]:
    """Bytes each operator pulls over the link per micro-batch: its streamed weights (the (1 - f_w) share
    of a GPU operator's weights crosses once per layer, i.e. 1/m of it per micro-batch), its host KV,
    and inputs produced on the other device. `residual`: the hidden state the post-attention adds to."""
    on_gpu = placement(c)
    ag, fg = on_gpu["attention"], on_gpu["post_attention"]
    streamed = (1.0 - c.weights_gpu_fraction) / c.num_micro_batches
    pre, attn, post = (ops[k] for k in OPERATORS)
    return {
        "pre_attention": streamed * pre.weights + np.where(fg, 0.0, pre.act_in),
        "attention": np.where(ag, (1.0 - c.kv_gpu_fraction) * attn.kv, attn.act_in),
        "post_attention": np.where(fg, streamed * post.weights + np.where(ag, 0.0, post.act_in),
                                   np.where(ag, post.act_in, 0.0) + residual),
    }


def op_times(ops: dict[str, Op], c: Candidates, rates: Rates, residual) -> dict[str, dict[str, np.ndarray]]:
    """Per operator: seconds under each roof (compute, memory, link) on its device, per micro-batch."""
    on_gpu, cross = placement(c), link_bytes(ops, c, residual)
    return {name: {"compute": op.flops / np.where(on_gpu[name], rates.gpu_flops, rates.cpu_flops),
                   "memory": op.mem / np.where(on_gpu[name], rates.hbm, rates.dram),
                   "link": cross[name] / rates.link, "on_gpu": on_gpu[name]}
            for name, op in ops.items()}


def layer_time(ops: dict[str, Op], c: Candidates, rates: Rates, residual) -> tuple[np.ndarray, np.ndarray]:
    """(seconds per layer for all m micro-batches, index into RESOURCES of the binding term).

    CGOPipe overlaps GPU compute, CPU compute and link transfers of different micro-batches, so a layer
    takes T = max(m g, m c, m l, g + c): g and c are one micro-batch's GPU and CPU time (each operator
    at the slower of its compute and memory roofs; transfers run on their own engine), l its link time.
    The last term is the dependency chain of one micro-batch (GPU pre-attention -> attention -> post-
    attention), which no overlap hides: with m = 1 CPU and GPU take turns. Assumes perfect overlap,
    pages prefetched a layer ahead and a steady state (pipeline fill ignored). The executor's fixed cost
    per micro-batch (launches, hand-offs: rates.micro_batch_overhead, measured by the hardware profile) is
    added, m times, outside the max: in the H100 runs it did not overlap the link. The profile measured
    2.2 ms there, which brings the eight schedules of bench/results/throughput-*-154458.json to 0.88-1.20
    of the prediction (0.65-0.99 without the term; 1.3 ms, the best fit, would give 0.87-1.01).
    """
    t = op_times(ops, c, rates, residual)
    m = c.num_micro_batches
    busy = {True: 0.0, False: 0.0}
    link = 0.0
    for name in OPERATORS:
        own = np.maximum(t[name]["compute"], t[name]["memory"])
        busy[True] = busy[True] + np.where(t[name]["on_gpu"], own, 0.0)
        busy[False] = busy[False] + np.where(t[name]["on_gpu"], 0.0, own)
        link = link + t[name]["link"]
    terms = np.stack(np.broadcast_arrays(m * busy[True], m * busy[False], m * link, busy[True] + busy[False]))
    return terms.max(axis=0) + m * rates.micro_batch_overhead, terms.argmax(axis=0)


def phase_time(spec: ModelSpec, wl: Workload, c: Candidates, rates: Rates, prefill: bool):
    """(seconds of one decode step, or of the prefill of all N prompts; binding resource of the most
    common layer kind). Embedding and LM head are left out (small next to the layers)."""
    q = wl.prompt_len if prefill else 1
    attended = (wl.prompt_len + 1) / 2 if prefill else wl.decode_context
    kv_len = wl.prompt_len if prefill else wl.decode_context
    total, binding = 0.0, None
    for (is_moe, window), count in layer_kinds(spec).most_common():
        ops = layer_ops(spec, wl, is_moe, window, c.micro_batch, q, attended, kv_len)
        seconds, which = layer_time(ops, c, rates, residual=c.micro_batch * q * spec.hidden_size * wl.act_bytes)
        total = total + count * seconds
        binding = which if binding is None else binding
    return total, binding


def throughput(spec: ModelSpec, wl: Workload, c: Candidates, rates: Rates) -> dict[str, np.ndarray]:
    """Generated tokens per second: N * gen_len / (prefill + gen_len decode steps), per candidate."""
    step, binding = phase_time(spec, wl, c, rates, prefill=False)
    prefill, _ = phase_time(spec, wl, c, rates, prefill=True)
    total = prefill + wl.gen_len * step
    return {"tokens_per_s": c.batch_size * wl.gen_len / total, "decode_tokens_per_s": c.batch_size / step,
            "step_s": step, "prefill_s": prefill, "binding": binding}


# ---- roofs ------------------------------------------------------------------------------------


def turning_points(hw: HardwareProfile) -> dict[str, float]:
    """Intensities (FLOP/byte) where the hierarchical roofline bends, and the CPU/GPU balance point."""
    r = Rates.of(hw)
    return {"gpu_ridge": r.gpu_flops / r.hbm, "cpu_ridge": r.cpu_flops / r.dram,
            "link_to_gpu_compute": r.gpu_flops / r.link, "balance": r.cpu_flops / r.link}


def operator_table(spec: ModelSpec, wl: Workload, hw: HardwareProfile, policy: ThroughputPolicy) -> list[dict]:
    """Decode operators of the most common layer kind under `policy`: per micro-batch FLOPs, bytes,
    intensities, attainable FLOP/s (the lowest of the three roofs) and the bound."""
    c, rates = Candidates.of([policy]), Rates.of(hw)
    (is_moe, window), _ = layer_kinds(spec).most_common(1)[0]
    ops = layer_ops(spec, wl, is_moe, window, c.micro_batch, 1, wl.decode_context, wl.decode_context)
    residual = c.micro_batch * spec.hidden_size * wl.act_bytes
    cross, times = link_bytes(ops, c, residual), op_times(ops, c, rates, residual)
    rows = []
    for name in OPERATORS:
        op, t = ops[name], times[name]
        bounds = {k: value_at(t[k]) for k in ("compute", "memory", "link")}
        bound = max(bounds, key=bounds.get)
        flops, mem, crossing, seconds = value_at(op.flops), value_at(op.mem), value_at(cross[name]), bounds[bound]
        rows.append({"operator": name, "device": "GPU" if value_at(t["on_gpu"]) else "CPU", "flops": flops,
                     "mem_bytes": mem, "link_bytes": crossing, "intensity": flops / mem,
                     "link_intensity": flops / crossing if crossing else float("inf"),
                     "flop_per_s": flops / seconds, "seconds": seconds, "bound": bound})
    return rows


def plot_roofline(rows: list[dict], hw: HardwareProfile, path: str, title: str = "") -> None:
    """Hierarchical roofline (GPU compute and HBM roofs, CPU compute and DRAM roofs, link roof) with each
    operator at (its intensity against the roof that binds it, attainable FLOP/s): it sits on that roof."""
    try:  # matplotlib is optional (the `plot` extra)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MoeserveError("--plot needs matplotlib: pip install matplotlib (or pip install 'moeserve[plot]')") from None
    r, tp = Rates.of(hw), turning_points(hw)
    x = np.logspace(-2, 5, 300)  # FLOP/byte
    fig, ax = plt.subplots(figsize=(7, 5))
    roofs = (("GPU (HBM, compute)", r.hbm, r.gpu_flops, "tab:green", "-"),
             ("CPU (DRAM, compute)", r.dram, r.cpu_flops, "tab:blue", "-"),
             ("CPU->GPU link", r.link, r.gpu_flops, "tab:red", "--"))
    for label, bandwidth, peak, color, style in roofs:
        ax.loglog(x, np.minimum(peak, x * bandwidth), style, color=color, label=label)
    ax.axvline(tp["balance"], color="gray", linestyle=":", label=f"balance point {tp['balance']:.0f} FLOP/B")
    for row in rows:
        x_op = row["link_intensity"] if row["bound"] == "link" else row["intensity"]
        ax.loglog(x_op, row["flop_per_s"], "o", color="black" if row["device"] == "GPU" else "tab:orange")
        ax.annotate(f"{row['operator']} ({row['device']}, {row['bound']})", (x_op, row["flop_per_s"]),
                    fontsize=8, textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("operational intensity (FLOP/byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(title or "hierarchical roofline")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
