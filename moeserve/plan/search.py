"""Policy search: the throughput policy with the highest predicted tokens/s that fits both memories.

Candidates: batch sizes N in {1, 2, 3, 4, 6, 8, 12, ...} (powers of two and 1.5x them) up to a cap,
micro-batches n of the same form dividing N, attention and MoE FFN each on CPU or GPU, the resident
weight fraction and (with GPU attention) the GPU KV fraction in steps of 0.1. All of them are evaluated
at once with numpy (tens of thousands, well under a second).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from moeserve.errors import MoeserveError
from moeserve.plan.footprint import activation_bytes, kv_cache_bytes
from moeserve.plan.hardware import HardwareProfile
from moeserve.plan.policy import ThroughputPolicy
from moeserve.plan.roofline import (RESOURCES, Candidates, Rates, Workload, layer_kinds, layer_ops,
                                    throughput, value_at)
from moeserve.spec import ModelSpec
from moeserve.units import format_bytes


def batch_sizes(cap: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, ... <= cap: powers of two and 1.5x powers of two."""
    sizes, p = {1}, 1
    while p <= cap:
        sizes.update(s for s in (p, 3 * p // 2) if 1 <= s <= cap)
        p *= 2
    return sorted(sizes)


def candidates(max_batch: int, step: float = 0.1) -> Candidates:
    fractions = np.round(np.arange(0.0, 1.0 + step / 2, step), 6)
    rows = []  # (N, n, attention_on_gpu, ffn_on_gpu, f_w, f_kv)
    sizes = batch_sizes(max_batch)
    for N in sizes:
        for n in (s for s in sizes if N % s == 0):
            for ffn in (False, True):
                rows += [(N, n, False, ffn, fw, 0.0) for fw in fractions]
                rows += [(N, n, True, ffn, fw, fkv) for fw in fractions for fkv in fractions]
    cols = list(zip(*rows))
    return Candidates(*(np.array(col) for col in cols))


# ---- memory ------------------------------------------------------------------------------------


def memory(spec: ModelSpec, wl: Workload, c: Candidates,
           host_weights: float | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(GPU bytes by part, host bytes by part) each candidate needs.

    GPU: embedding + LM head; the resident share f_w of the weights of GPU-placed operators; two buffers
    for the streamed share of the largest layer (one in use, one being filled); the GPU share of the
    KV cache (every layer the whole context, as the pipeline's KVCache allocates it), two staging buffers of
    one layer's host KV per micro-batch; activations of one prefill micro-batch (footprint.activation_bytes of
    n * prompt_len tokens and n logit rows). Host: every layer's weights (the executor keeps the host copies
    of resident layers too; `host_weights`, when known from the loaded model, is the exact pinned figure:
    layer_weights.host_weight_bytes), the host share of the KV cache as the pipeline pins it (a k and a v
    tensor per micro-batch, MLA's one of latents, each rounded up to a power of two by torch's page-locked
    allocator).
    """
    D, wb, ab = spec.hidden_size, wl.weight_bytes, wl.act_bytes
    ag, fg, fw = c.attention_on_gpu, c.ffn_on_gpu, c.weights_gpu_fraction
    gpu_weights = host_only = largest = 0.0
    for (is_moe, window), count in layer_kinds(spec).items():
        ops = layer_ops(spec, wl, is_moe, window, 1, 1, wl.context, wl.context)  # one sequence, full context
        post_w = ops["post_attention"].weights
        on_gpu = ops["pre_attention"].weights + np.where(fg, post_w, 0.0)  # bytes of the GPU-placed weights
        gpu_weights = gpu_weights + count * on_gpu
        host_only = host_only + count * np.where(fg, 0.0, post_w)
        largest = np.maximum(largest, on_gpu)
    kv_per_seq = kv_cache_bytes(spec, 1, wl.context, wl.kv_bytes)  # every layer holds the whole context
    largest_kv = kv_per_seq / spec.num_layers
    kv = c.batch_size * kv_per_seq
    kv_gpu = np.where(ag, c.kv_gpu_fraction, 0.0)
    gpu = {
        "embedding + LM head": spec.vocab_size * D * (1 if spec.tie_word_embeddings else 2) * wb + D * wb,
        "resident weights": fw * gpu_weights,
        "streaming buffers": 2 * (1 - fw) * largest,
        "KV cache": kv_gpu * kv,
        "KV staging": np.where(ag, 2 * (1 - kv_gpu) * c.micro_batch * largest_kv, 0.0),
        "activations": activation_bytes(spec, c.micro_batch * wl.prompt_len, c.micro_batch, ab),
    }
    parts = 2 if spec.attention.kv_cache_entry()[2] else 1  # k and v caches, or MLA's one of latents
    host_kv_part = (1 - kv_gpu) * c.micro_batch * kv_per_seq / parts  # the k (or v) cache of one micro-batch
    pinned = np.where(host_kv_part > 0, 2.0 ** np.ceil(np.log2(np.maximum(host_kv_part, 1.0))), 0.0)
    weights = gpu_weights + host_only if host_weights is None else np.full_like(gpu_weights + host_only, host_weights)
    host = {"weights": weights, "KV cache": parts * c.num_micro_batches * pinned}
    return gpu, host


# ---- search ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    policy: ThroughputPolicy
    tokens_per_s: float  # generated tokens/s, prefill included
    decode_tokens_per_s: float
    step_s: float  # one decode step of all N sequences
    prefill_s: float  # prefill of all N prompts
    bottleneck: str  # resource binding the decode layer time
    gpu_bytes: dict[str, float]
    host_bytes: dict[str, float]
    evaluated: int  # candidates evaluated
    feasible: int  # candidates that fit
    seconds: float  # search time


def _pick(values: dict[str, np.ndarray], i: int) -> dict[str, float]:
    return {k: value_at(v, i) for k, v in values.items()}


def evaluate_all(spec: ModelSpec, hw: HardwareProfile, wl: Workload, c: Candidates, host_weights: float | None = None):
    """(throughput figures, GPU bytes by part, host bytes by part) for every candidate."""
    return (throughput(spec, wl, c, Rates.of(hw)), *memory(spec, wl, c, host_weights))


def search(spec: ModelSpec, hw: HardwareProfile, wl: Workload, gpu_budget: float, host_budget: float,
           max_batch: int = 4096, step: float = 0.1, host_weights: float | None = None) -> Plan:
    """The feasible candidate with the highest predicted throughput. Candidates within 0.1% of the best
    count as tied (the model cannot tell them apart); among those: smallest N, then largest n (fewer
    launches), then least GPU memory."""
    t0 = time.perf_counter()
    c = candidates(max_batch, step)
    perf, gpu, host = evaluate_all(spec, hw, wl, c, host_weights)
    gpu_need, host_need = sum(gpu.values()), sum(host.values())
    fits = (gpu_need <= gpu_budget) & (host_need <= host_budget)
    if not fits.any():
        raise MoeserveError(_shortage(c, gpu, host, gpu_need, host_need, gpu_budget, host_budget))
    tps = perf["tokens_per_s"]
    tied = np.flatnonzero(fits & (tps >= (1 - 1e-3) * tps[fits].max()))
    i = int(tied[np.lexsort((gpu_need[tied], -c.micro_batch[tied], c.batch_size[tied]))[0]])
    return _plan(c, perf, gpu, host, i, evaluated=len(c), feasible=int(fits.sum()), seconds=time.perf_counter() - t0)


def evaluate(spec: ModelSpec, hw: HardwareProfile, wl: Workload, policy: ThroughputPolicy) -> Plan:
    """The model's figures for one given policy (no memory check)."""
    c = Candidates.of([policy])
    return _plan(c, *evaluate_all(spec, hw, wl, c), 0, evaluated=1, feasible=1, seconds=0.0)


def _plan(c: Candidates, perf: dict, gpu: dict, host: dict, i: int, **search_stats) -> Plan:
    return Plan(policy=c.policy(i), tokens_per_s=value_at(perf["tokens_per_s"], i),
                decode_tokens_per_s=value_at(perf["decode_tokens_per_s"], i), step_s=value_at(perf["step_s"], i),
                prefill_s=value_at(perf["prefill_s"], i), bottleneck=RESOURCES[int(value_at(perf["binding"], i))],
                gpu_bytes=_pick(gpu, i), host_bytes=_pick(host, i), **search_stats)


def _shortage(c, gpu, host, gpu_need, host_need, gpu_budget, host_budget) -> str:
    """Which memory is short, by how much, for the candidate closest to fitting, with its parts."""
    gpu_short, host_short = np.maximum(gpu_need - gpu_budget, 0), np.maximum(host_need - host_budget, 0)
    i = int(np.argmin(gpu_short + host_short))
    p = c.policy(i)
    where = (f"N={p.batch_size}, n={p.micro_batch}, attention on {'GPU' if p.attention_on_gpu else 'CPU'}, "
             f"FFN on {'GPU' if p.ffn_on_gpu else 'CPU'}, {p.weights_gpu_fraction:.0%} of weights on GPU")
    parts = []
    for name, short, need, budget, split in (("GPU", gpu_short, gpu_need, gpu_budget, gpu),
                                             ("host", host_short, host_need, host_budget, host)):
        if short[i] > 0:
            terms = " + ".join(f"{k} {format_bytes(v)}" for k, v in _pick(split, i).items() if v > 0)
            parts.append(f"{name} memory short by {format_bytes(short[i])}: {terms} = {format_bytes(need[i])} "
                         f"> {format_bytes(budget)} budget")
    return "; ".join(parts) + f" (closest policy: {where})"
