"""CGOPipe (MoE-Lightning): throughput decoding of a batch larger than GPU memory allows, layer by layer.

The pipeline is a schedule over the model's own layer steps; it decides where weights and KV caches live, when
they are copied and where attention runs, and computes nothing itself. A layer of a micro-batch runs as
DecoderLayer.attention_input (input norm), self_attn.qkv (pre-attention), attention over the KV cache
(self_attn.attend, or on the CPU its core: model/layers.py, model/mla.py), self_attn.project_out and
DecoderLayer.attention_output, then DecoderLayer.mlp_output (the MoE block: router, experts, shared expert), so every
family computes as it does resident (MLA, sinks, sliding windows, Granite's multipliers, MXFP4 experts).

A batch of N requests is split into balanced micro-batches (engine/scheduler.py). Every pass (the prefill,
then each decode step) runs layer-major: for each layer, for each micro-batch, the GPU computes the
pre-attention, attention runs where the policy says, and the GPU computes the post-attention (O projection +
FFN). With CPU attention the KV cache lives in page-locked host memory: the new token's cache entry and the
query of the attention core go to the host, a worker thread appends the entry to the cache and attends
(plan/cpu_attention.py), and the core's output comes back (MLA: the latent query, with W_UK absorbed, is made on
the GPU, the CPU attends over the latents, and W_UV is applied on the GPU). Layers not resident on the GPU are
streamed from pinned host memory into two buffers while the previous layer computes (plan/layer_weights.py).
The same executor runs the baselines:

  cgopipe      attention_on_gpu=False, kv_gpu_fraction=0, several micro-batches
  zero         attention_on_gpu=True,  kv_gpu_fraction=1, one micro-batch (DeepSpeed ZeRO-Inference: weights
               streamed layer by layer, KV on the GPU, no CPU overlap)
  flexgen      attention_on_gpu=True,  kv_gpu_fraction=0 (FlexGen: KV in host memory, swapped in per layer)

Micro-batch m keeps its KV cache on the GPU when m < round(kv_gpu_fraction * micro-batches) and then also
attends there.

Inside a pass the main thread never waits for a copy (a few small ones at its start aside): copies to the
host run on a D2H stream and copies to the GPU on an H2D stream, ordered by CUDA events; only the worker
waits, for the event of the copy it reads. Decode traffic goes through page-locked buffers reused every
step (Staging); prefill KV is written into the host cache by DMA, whole rows at a time; attention masks are
built once per pass on the device that attends. In a decode pass with CPU attention the main thread queues
the pre-attention and the copy of every micro-batch of a layer before it waits for the first attention output,
so the worker attends them back to back while the GPU runs post-attentions.

On a CPU-only machine the CPU plays the GPU too (copies run at once, events are None), so the schedule, its
buffers included, is tested against the plain engine (engine/generate.py) for equal outputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from moeserve.engine.params import SamplingParams
from moeserve.engine.sampling import sample_each
from moeserve.engine.scheduler import balanced_micro_batches
from moeserve.engine.sequence import (Generation, TextStream, check_request, left_padded, record_tokens,
                                      token_limits)
from moeserve.model.kv_cache import KVCache
from moeserve.model.transformer import DecodeState, attention_masks
from moeserve.plan.cpu_attention import cpu_attention
from moeserve.plan.footprint import kv_cache_bytes
from moeserve.plan.layer_weights import LayerWeights, pin_host_weights, pinned_size
from moeserve.plan.policy import ThroughputPolicy

HOST = torch.device("cpu")

SCHEDULES = {  # name -> the policy fields that make the schedule (batch, micro-batch and weights come from the user)
    "cgopipe": dict(attention_on_gpu=False, ffn_on_gpu=True, kv_gpu_fraction=0.0),
    "zero": dict(attention_on_gpu=True, ffn_on_gpu=True, kv_gpu_fraction=1.0),
    "flexgen": dict(attention_on_gpu=True, ffn_on_gpu=True, kv_gpu_fraction=0.0),
}


def staged_parts(spec, cpu_attends: bool) -> list[tuple[int, int]]:
    """(heads, values per head) of what one decode token stages for a host cache, in order: its cache entry (GQA:
    keys, values; MLA: the latent) and, when the CPU attends, the query of the attention core (spec.attention.core)."""
    heads, dim, separate = spec.attention.kv_cache_entry()
    parts = [(heads, dim)] * (2 if separate else 1)
    return parts + [(spec.attention.num_heads, spec.attention.core()[0])] if cpu_attends else parts


class Staging:
    """Page-locked host buffers of one host-KV micro-batch's decode traffic, one per layer, reused every step:
    qkv[i] [n, sum of staged_parts] receives the new token's cache entry and, with CPU attention, the core's query
    (DMA from the GPU; the worker reads it); out[i] [n, H Dc] the CPU attention core's output (the worker writes it;
    DMA to the GPU; None without CPU attention). A pass never reuses a buffer. The next pass refills qkv[i] only
    after this pass has waited for its worker jobs (Pipeline._forward does), and out[i] only after out_read[i], the
    event of the DMA that last read it."""

    def __init__(self, spec, n: int, dtype, pin: bool, cpu_attends: bool):
        L = spec.num_layers
        self.parts, self.cpu_attends = staged_parts(spec, cpu_attends), cpu_attends
        self.separate = spec.attention.mla is None
        self.qkv = torch.empty(L, n, sum(h * d for h, d in self.parts), dtype=dtype, pin_memory=pin)
        out = spec.attention.num_heads * spec.attention.core()[1]
        self.out = torch.empty(L, n, out, dtype=dtype, pin_memory=pin) if cpu_attends else None
        self.out_read: list[torch.cuda.Event | None] = [None] * L

    def unpack(self, i: int):
        """Layer i's staged token -> views k [n, heads, 1, dim], v (None: MLA) and the core's query [n, H, 1, Dq]
        (None without CPU attention)."""
        flat = self.qkv[i]
        n = flat.shape[0]
        views = [t.view(n, 1, h, d).transpose(1, 2)
                 for t, (h, d) in zip(flat.split([h * d for h, d in self.parts], dim=1), self.parts)]
        return views[0], views[1] if self.separate else None, views[-1] if self.cpu_attends else None


def pack(*tensors: torch.Tensor | None) -> torch.Tensor:
    """Decode tensors [n, h, 1, d] (None: left out) -> one contiguous [n, sum h d], in order: one DMA."""
    return torch.cat([t.transpose(1, 2).reshape(t.shape[0], -1) for t in tensors if t is not None], dim=1)


@dataclass
class MicroBatch:
    requests: list[int]  # indices into the batch's prompts
    kv: KVCache  # on the GPU, or in (page-locked) host memory
    kv_on_gpu: bool
    staging: Staging | None  # decode buffers of a host KV cache
    tokens: torch.Tensor  # [n, S] this pass's input tokens (GPU)
    positions: torch.Tensor  # [n, S] (GPU)
    valid: torch.Tensor  # [n, S] real (non-pad, alive) tokens (host)


def host_kv_bytes(spec, policy: ThroughputPolicy, max_len: int, dtype_bytes: int, pinned: bool) -> int:
    """Host memory the pipeline allocates for a batch of `policy` whose caches hold max_len slots: the KV caches
    and Staging of its host-KV micro-batches (pinned: as torch's page-locked allocator rounds them)."""
    L, n, m = spec.num_layers, policy.micro_batch, policy.num_micro_batches
    parts = 2 if spec.attention.kv_cache_entry()[2] else 1
    cpu_attends = not policy.attention_on_gpu
    on_host = m - round(policy.kv_gpu_fraction * m)
    tensors = [kv_cache_bytes(spec, n, max_len, dtype_bytes) // parts] * parts  # k (MLA: latents), v
    tensors.append(L * n * sum(h * d for h, d in staged_parts(spec, cpu_attends)) * dtype_bytes)  # Staging.qkv
    if cpu_attends:
        tensors.append(L * n * spec.attention.num_heads * spec.attention.core()[1] * dtype_bytes)  # Staging.out
    return on_host * sum(pinned_size(t, pinned) for t in tensors)


class Pipeline:
    def __init__(self, model, policy: ThroughputPolicy, device):
        """model: a MoETransformer in host memory (its layers are pinned on CUDA and never moved); its embedding,
        final norm and LM head are copied to `device` (MoETransformer.without_layers), the layers handled by
        LayerWeights."""
        self.host, self.policy, self.spec = model, policy, model.spec
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            pin_host_weights(model.model.layers)
        self.edges = model.without_layers().to(self.device)
        L = self.spec.num_layers
        self.weights = LayerWeights(model.model.layers, round(policy.weights_gpu_fraction * L), self.device,
                                    policy.ffn_on_gpu)
        self.spans = model.spans()
        self.d2h = torch.cuda.Stream(self.device) if self.cuda else None  # staged tokens and prefill KV to the host
        self.h2d = torch.cuda.Stream(self.device) if self.cuda else None  # attention outputs, FlexGen KV to the GPU
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="cpu-attention")

    @property
    def dtype(self) -> torch.dtype:
        return self.edges.dtype

    # ---- generation ----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, tokenizer=None,
                 eos_ids=None) -> Iterator[tuple[list[Generation], torch.Tensor, torch.Tensor]]:
        """Check the batch and allocate its KV caches now (page-locked host memory: seconds for a big batch),
        then yield (generations, new tokens [N], logits [N, V]) per step, as engine.generate.iterate does for
        the same prompts (one batch of at most policy.batch_size)."""
        check_request(self.spec, prompts, params, tokenizer)
        if len(prompts) > self.policy.batch_size:
            raise ValueError(f"{len(prompts)} prompts exceed the policy's batch size {self.policy.batch_size}")
        limits = token_limits(self.spec, prompts, params)
        max_new = max(limits)
        groups = balanced_micro_batches([len(p) for p in prompts], self.policy.micro_batch)
        on_gpu = round(self.policy.kv_gpu_fraction * len(groups))
        mbs = [self._micro_batch(prompts, g, max_new, m < on_gpu) for m, g in enumerate(groups)]
        return self._steps(prompts, mbs, limits, params, tokenizer, eos_ids)

    def _steps(self, prompts, mbs: list[MicroBatch], limits: list[int], params, tokenizer, eos_ids):
        eos = set(self.spec.eos_token_ids if eos_ids is None else eos_ids)
        generators = [torch.Generator().manual_seed(params.seed) if params.seed is not None else None for _ in prompts]
        gens = [Generation(prompt_ids=list(p)) for p in prompts]
        streams = [TextStream(tokenizer.decode, params.stop) if tokenizer else None for _ in prompts]
        alive = torch.ones(len(prompts), dtype=torch.bool)  # host: read and cleared per sequence
        with torch.inference_mode():
            logits = self._forward(mbs)  # [N, V]
            for step in range(max(limits)):
                new = sample_each(logits, params, generators)  # [N]
                record_tokens(gens, streams, new.to(HOST), alive, eos, params, step, limits)
                yield gens, new, logits
                if not alive.any():
                    break
                for mb in mbs:
                    mb.positions = mb.positions[:, -1:] + 1
                    mb.tokens, mb.valid = new[mb.requests][:, None], alive[mb.requests][:, None]
                logits = self._forward([mb for mb in mbs if mb.valid.any()], out=logits)

    def _micro_batch(self, prompts, requests: list[int], max_new: int, kv_on_gpu: bool) -> MicroBatch:
        """Left-pad this micro-batch's prompts to its own longest one (as the plain engine pads a batch)."""
        tokens, valid, positions = left_padded([prompts[r] for r in requests], self.spec)  # [n, S] each
        pin = self.cuda and not kv_on_gpu
        kv = KVCache(self.spec, len(requests), tokens.shape[1] + max_new, self.device if kv_on_gpu else HOST,
                     self.dtype, pin_memory=pin)
        staging = None if kv_on_gpu else Staging(self.spec, len(requests), self.dtype, pin,
                                                 not self.policy.attention_on_gpu)
        return MicroBatch(requests, kv, kv_on_gpu, staging, tokens.to(self.device), positions.to(self.device), valid)

    # ---- one pass over every layer -------------------------------------------------------------------
    def _forward(self, mbs: list[MicroBatch], out: torch.Tensor | None = None) -> torch.Tensor:
        """Run the micro-batches' tokens through all layers, layer-major; the last position's logits go into
        rows mb.requests of out [N, V] (rows of finished micro-batches keep their old values).

        With CPU attention every micro-batch of a layer is queued ahead of the first post-attention; with GPU
        attention one is (the activations and FlexGen KV of two micro-batches live at a time, as the planner's
        memory model counts them)."""
        states = [self.edges.start_state(mb.tokens, mb.positions, self._masks(mb)) for mb in mbs]  # x [n, S, D]
        ahead = len(mbs) if any(self._cpu_attends(mb) for mb in mbs) else 1
        writes: list[Future] = []  # worker jobs appending FlexGen's decode KV to host caches
        for i in range(self.spec.num_layers):
            layer = self.weights.get(i)
            queued: deque = deque()  # (micro-batch index, residual stream, attention output or its Future)
            for m, mb in enumerate(mbs):
                queued.append((m, *self._attention(layer, i, mb, states[m], writes)))
                if len(queued) > ahead:
                    self._post_attention(layer, i, states, *queued.popleft())
            while queued:
                self._post_attention(layer, i, states, *queued.popleft())
            self.weights.release(i)
        for job in writes:
            job.result()  # the host caches and Staging.qkv are free for the next pass
        for mb in mbs:
            mb.kv.commit()
        last = [replace(s, x=s.x[:, -1:], pending=s.pending[:, -1:]) for s in states]
        logits = torch.cat([self.edges.decode_end(s)[:, 0] for s in last])  # [sum n, V]
        if out is None:
            out = logits.new_empty(sum(len(mb.requests) for mb in mbs), logits.shape[-1])
        out[[r for mb in mbs for r in mb.requests]] = logits
        return out

    def _cpu_attends(self, mb: MicroBatch) -> bool:
        """Whether this pass's attention of mb runs on the CPU (a decode pass over a host KV cache)."""
        return not (mb.kv_on_gpu or self.policy.attention_on_gpu or mb.kv.length == 0)

    def _masks(self, mb: MicroBatch) -> dict:
        """Reserve this pass's cache slots; attention masks {Span: [n, 1, S, S_total]} built on the device
        the attention of mb runs on, once per pass."""
        start, S = mb.kv.length, mb.tokens.shape[1]
        key_valid = mb.kv.begin(mb.valid.to(mb.kv.valid.device))  # [n, S_total]
        if not self._cpu_attends(mb):
            key_valid = key_valid.to(self.device)
        q_slots = torch.arange(start, start + S, device=key_valid.device)
        return attention_masks(q_slots, mb.positions.to(key_valid.device), key_valid, self.spans)

    def _attention(self, layer, i: int, mb: MicroBatch, state: DecodeState, writes: list[Future]):
        """Input norm, pre-attention and attention of micro-batch mb at layer i -> (its residual stream [n, S, D],
        the attention output [n, S, H*Dv] on the GPU, or a Future of (the core's output, event it is ready at)
        when the worker attends on the CPU)."""
        attn, mask = layer.self_attn, state.masks[self.spans[i]]
        normed, x = layer.attention_input(state.x, state.pending)
        q, k, v = attn.qkv(normed, state.cos, state.sin, state.q_scale)  # the query; the new cache entry (v: None)
        if mb.kv_on_gpu:
            return x, attn.attend(q, *mb.kv.update(i, k, v), mask)
        if mb.kv.length == 0:  # prefill: attend on the GPU, KV rows to the host cache
            self._prefill_to_host(mb.kv, i, k, v)
            return x, attn.attend(q, k, v, mask)
        if self.policy.attention_on_gpu:  # FlexGen
            copied = self._to_host([mb.staging.qkv[i]], [pack(k, v)])
            keys, values, swapped = self._swap_in(mb.kv, i, k, v, copied)
            writes.append(self.worker.submit(self._host_kv, i, mb, swapped))
            return x, attn.attend(q, keys, values, mask)
        copied = self._to_host([mb.staging.qkv[i]], [pack(k, v, attn.core_query(q))])
        return x, self.worker.submit(self._cpu_attention, i, mb, mask, copied)

    def _post_attention(self, layer, i: int, states: list[DecodeState], m: int, x: torch.Tensor, job) -> None:
        """Micro-batch m's attention output (job) through O-proj into its residual stream x, then the FFN, on the GPU
        or the CPU: states[m] holds the stream and the FFN's output, which the next layer's input norm adds."""
        out = job
        if isinstance(job, Future):
            out, done = job.result()
            self._use([out], done)
            out = layer.self_attn.core_output(out)
        x, normed = layer.attention_output(x, layer.self_attn.project_out(out))
        if self.policy.ffn_on_gpu:
            pending = layer.mlp_output(normed)
        else:
            pending = self.host.model.layers[i].mlp_output(normed.to(HOST)).to(self.device)
        states[m] = replace(states[m], x=x, pending=pending)

    # ---- host KV ---------------------------------------------------------------------------------------
    def _prefill_to_host(self, kv: KVCache, i: int, k, v) -> None:
        """Prefill cache entries k/v [n, heads, S, dim] (v: None for MLA) of layer i into the host cache, one DMA
        per tensor: padded on the GPU to whole rows [n, heads, S_max, dim], which are contiguous in the cache (the
        pad lands on slots the prefill is the first to write, as the zeros they held)."""
        rows = [F.pad(t, (0, 0, 0, kv.max_len - t.shape[2])) for t in (k, v) if t is not None]
        self._to_host([c[i] for c in (kv.k, kv.v) if c is not None], rows)

    def _swap_in(self, kv: KVCache, i: int, k, v, after):
        """FlexGen: layer i's host KV rows to the GPU (whole rows: one DMA per tensor) once event `after` fired
        (a copy to the host queued after the prefill's into this cache), this pass's k/v [n, heads, S, dim] (v:
        None for MLA) written in on the GPU -> keys, values [n, heads, S_total, dim] (values None for MLA), and the
        event the host rows are read at (from then on the worker may append k/v to them)."""
        start, end = kv.length, kv.length + k.shape[2]
        rows, swapped = self._to_device([c[i] for c in (kv.k, kv.v) if c is not None], after)  # [n, h, S_max, d]
        self._use(rows, swapped)
        for r, t in zip(rows, (k, v)):
            r[:, :, start:end] = t
        values = rows[1][:, :, :end] if len(rows) > 1 else None
        return rows[0][:, :, :end], values, swapped

    def _host_kv(self, i: int, mb: MicroBatch, ready):
        """Worker: once event `ready` fired (Staging.qkv[i] of mb filled; None: now), append layer i's new cache
        entry to the host cache -> the core's query [n, H, 1, Dq] (None under FlexGen) and the keys and values to
        attend [n, heads, S_total, dim] (views; values None for MLA)."""
        with torch.inference_mode():
            if ready is not None:
                ready.synchronize()
            k, v, q = mb.staging.unpack(i)
            return (q, *mb.kv.update(i, k, v))

    def _cpu_attention(self, i: int, mb: MicroBatch, mask, copied):
        """Worker: the attention core of mb at layer i on the CPU (the host layer's, plan/cpu_attention.py); its
        output to the GPU through layer i's page-locked buffer -> (output on the GPU, event it is ready at)."""
        with torch.inference_mode():
            result = cpu_attention(self.host.model.layers[i].self_attn, *self._host_kv(i, mb, copied), mask)
            buffer = mb.staging.out[i]  # [n, H*Dc]
            if mb.staging.out_read[i] is not None:
                mb.staging.out_read[i].synchronize()  # the copy that last read it (previous pass) is done
            buffer.copy_(result.reshape(buffer.shape))
            (out,), done = self._to_device([buffer], None)
            mb.staging.out_read[i] = done
            return out.view(result.shape), done

    # ---- copies between the devices ---------------------------------------------------------------------
    def _to_host(self, dst: list[torch.Tensor], src: list[torch.Tensor]):
        """Queue copies of GPU tensors src into page-locked host tensors dst (same shapes, contiguous) on the D2H
        stream, after the compute queued so far -> the event they are done at (on a CPU: copied now, None)."""
        if not self.cuda:
            for d, s in zip(dst, src):
                d.copy_(s)
            return None
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_stream(compute)
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
                s.record_stream(self.d2h)  # made on the compute stream, read here
            return self._record(self.d2h)

    def _to_device(self, src: list[torch.Tensor], after) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Copy page-locked host tensors to new GPU tensors on the H2D stream, once event `after` fired (None:
        now) -> (the tensors, the event they are ready at; on a CPU: copies, None). Consume them with _use."""
        if not self.cuda:
            return [s.clone() for s in src], None
        with torch.cuda.stream(self.h2d):  # allocated on this stream: their memory is free when it runs
            if after is not None:
                self.h2d.wait_event(after)
            out = [s.to(self.device, non_blocking=True) for s in src]
            return out, self._record(self.h2d)

    def _use(self, tensors: list[torch.Tensor], ready) -> None:
        """Let the compute stream read tensors made on a copy stream: wait for their event, and keep their
        memory from reuse until the compute queued from now on is done."""
        if ready is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(ready)
        for t in tensors:
            t.record_stream(compute)

    @staticmethod
    def _record(stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def close(self) -> None:
        self.worker.shutdown()
