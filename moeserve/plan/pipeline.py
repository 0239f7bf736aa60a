"""CGOPipe (MoE-Lightning): throughput decoding of a batch larger than GPU memory allows, layer by layer.

A batch of N requests is split into balanced micro-batches (engine/scheduler.py). Every pass (the prefill,
then each decode step) runs layer-major: for each layer, for each micro-batch, the GPU computes the
pre-attention (norm + QKV), attention runs where the policy says, and the GPU computes the post-attention
(O projection + FFN). With CPU attention the KV cache lives in host memory: q/k/v go to the CPU, a worker
thread attends micro-batch i+1 while the GPU runs the post-attention of micro-batch i, and the output comes
back on a copy stream. Layers not resident on the GPU are streamed from pinned host memory into two
buffers while the previous layer computes (plan/layer_weights.py). The same executor runs the baselines:

  cgopipe      attention_on_gpu=False, kv_gpu_fraction=0, several micro-batches
  zero         attention_on_gpu=True,  kv_gpu_fraction=1, one micro-batch (DeepSpeed ZeRO-Inference: weights
               streamed layer by layer, KV on the GPU, no CPU overlap)
  flexgen      attention_on_gpu=True,  kv_gpu_fraction=0 (FlexGen: KV in host memory, swapped in per layer)

Micro-batch m keeps its KV cache on the GPU when m < round(kv_gpu_fraction * micro-batches) and then also
attends there. On a CPU-only machine the CPU plays the GPU too (streams and events become no-ops), so the
schedule is tested against the plain engine (engine/generate.py) for equal outputs.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moeserve.engine.generate import Generation, TextStream, check_request, left_padded, record_tokens
from moeserve.engine.kv_cache import KVCache
from moeserve.engine.sampling import SamplingParams, sample_next
from moeserve.engine.scheduler import balanced_micro_batches
from moeserve.model.transformer import attention_masks
from moeserve.plan.cpu_attention import gqa_attention
from moeserve.plan.layer_weights import LayerWeights, pin_host_weights
from moeserve.plan.policy import Policy

HOST = torch.device("cpu")

SCHEDULES = {  # name -> the policy fields that make the schedule (batch, micro-batch and weights come from the user)
    "cgopipe": dict(attention_on_gpu=False, ffn_on_gpu=True, kv_gpu_fraction=0.0),
    "zero": dict(attention_on_gpu=True, ffn_on_gpu=True, kv_gpu_fraction=1.0),
    "flexgen": dict(attention_on_gpu=True, ffn_on_gpu=True, kv_gpu_fraction=0.0),
}


@dataclass
class MicroBatch:
    requests: list[int]  # indices into the batch's prompts
    kv: KVCache  # on the GPU or in host memory
    kv_on_gpu: bool
    tokens: torch.Tensor  # [n, S] this pass's input tokens
    positions: torch.Tensor  # [n, S]
    valid: torch.Tensor  # [n, S] real (non-pad, alive) tokens


class Pipeline:
    def __init__(self, model, policy: Policy, device):
        """model: a MoETransformer in host memory (its layers are pinned on CUDA and never moved); the
        embedding, final norm and LM head are copied to `device`, the layers handled by LayerWeights."""
        self.host, self.policy, self.spec = model, policy, model.spec
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            pin_host_weights(model.model.layers)
        self.embed = copy.deepcopy(model.model.embed_tokens).to(self.device)
        self.norm = copy.deepcopy(model.model.norm).to(self.device)
        self.lm_head = copy.deepcopy(model.lm_head).to(self.device)
        self.rotary = copy.deepcopy(model.rotary).to(self.device)
        L = self.spec.num_layers
        self.weights = LayerWeights(model.model.layers, self.spec, round(policy.weights_gpu_fraction * L),
                                    self.device, policy.ffn_on_gpu)
        self.windows = [layer.sliding_window for layer in model.model.layers]
        self.io = torch.cuda.Stream(self.device) if self.cuda else None  # q/k/v out, attention output back
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="cpu-attention")

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    # ---- generation ----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, tokenizer=None,
                 eos_ids=None) -> Iterator[tuple[list[Generation], torch.Tensor, torch.Tensor]]:
        """Check the batch now, then yield (generations, new tokens [N], logits [N, V]) per step, as
        engine.generate.iterate does for the same prompts (one batch of at most policy.batch_size)."""
        check_request(self.spec, prompts, params, tokenizer)
        if len(prompts) > self.policy.batch_size:
            raise ValueError(f"{len(prompts)} prompts exceed the policy's batch size {self.policy.batch_size}")
        return self._steps(prompts, params, tokenizer, eos_ids)

    def _steps(self, prompts, params, tokenizer, eos_ids):
        spec, device = self.spec, self.device
        eos = set(spec.eos_token_ids if eos_ids is None else eos_ids)
        longest = max(len(p) for p in prompts)
        max_new = min(params.max_new_tokens, spec.max_position_embeddings - longest)
        groups = balanced_micro_batches([len(p) for p in prompts], self.policy.micro_batch)
        on_gpu = round(self.policy.kv_gpu_fraction * len(groups))
        mbs = [self._micro_batch(prompts, g, max_new, m < on_gpu) for m, g in enumerate(groups)]
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        gens = [Generation(prompt_ids=list(p)) for p in prompts]
        streams = [TextStream(tokenizer.decode, params.stop) if tokenizer else None for _ in prompts]
        alive = torch.ones(len(prompts), dtype=torch.bool, device=device)
        with torch.inference_mode():
            logits = self._forward(mbs)  # [N, V]
            for step in range(max_new):
                new = sample_next(logits, params, generator)  # [N]
                record_tokens(gens, streams, new, alive, eos, params, step == max_new - 1)
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
        longest = tokens.shape[1]
        kv_device = self.device if kv_on_gpu else HOST
        kv = KVCache(self.spec, len(requests), longest + max_new, kv_device, self.dtype)
        if self.cuda and not kv_on_gpu:
            kv.k, kv.v = kv.k.pin_memory(), kv.v.pin_memory()
        return MicroBatch(requests, kv, kv_on_gpu, tokens.to(self.device), positions.to(self.device),
                          valid.to(self.device))

    # ---- one pass over every layer -------------------------------------------------------------------
    def _forward(self, mbs: list[MicroBatch], out: torch.Tensor | None = None) -> torch.Tensor:
        """Run the micro-batches' tokens through all layers, layer-major; the last position's logits go into
        rows mb.requests of out [N, V] (rows of finished micro-batches keep their old values)."""
        x, rope, masks = [], [], []
        for mb in mbs:
            x.append(self.embed(mb.tokens))  # [n, S, D]
            rope.append(self.rotary(mb.positions, self.dtype))
            start, S = mb.kv.length, mb.tokens.shape[1]
            key_valid = mb.kv.begin(mb.valid.to(mb.kv.k.device))  # [n, S_total]
            q_slots = torch.arange(start, start + S, device=key_valid.device)
            masks.append(attention_masks(q_slots, key_valid, self.windows))  # window -> [n, 1, S, S_total]
        for i in range(self.spec.num_layers):
            layer = self.weights.get(i)
            pending = None
            for m, mb in enumerate(mbs):
                q, k, v = layer.self_attn.qkv(layer.input_layernorm(x[m]), *rope[m])
                job = self._attention(layer, i, mb, q, k, v, masks[m][self.windows[i]])
                if pending is not None:
                    self._post_attention(layer, i, x, *pending)
                pending = m, job
            self._post_attention(layer, i, x, *pending)
            self.weights.release(i)
        for mb in mbs:
            mb.kv.commit()
        logits = torch.cat([self.lm_head(self.norm(h[:, -1])) for h in x])  # [sum n, V]
        if out is None:
            out = logits.new_empty(sum(len(mb.requests) for mb in mbs), logits.shape[-1])
        out[[r for mb in mbs for r in mb.requests]] = logits
        return out

    def _attention(self, layer, i: int, mb: MicroBatch, q, k, v, mask):
        """Attention of micro-batch mb at layer i -> its output [n, S, H*Dh] on the GPU, or a Future of it
        (CPU attention, running in the worker while the main thread queues GPU work)."""
        prefill = mb.kv.length == 0
        if mb.kv_on_gpu:
            k_all, v_all = mb.kv.update(i, k, v)
            return layer.self_attn.attend(q, k_all, v_all, mask)
        if prefill or self.policy.attention_on_gpu:  # KV written to host memory, attention on the GPU
            k_all, v_all = mb.kv.update(i, k.to(HOST), v.to(HOST))  # [n, Hkv, S_total, Dh]
            if not prefill:  # FlexGen: swap this layer's KV in (whole contiguous pinned rows: one DMA each)
                end = k_all.shape[2]
                k, v = (t[i].to(self.device, non_blocking=True)[:, :, :end] for t in (mb.kv.k, mb.kv.v))
            return layer.self_attn.attend(q, k, v, mask.to(self.device))
        ready = torch.cuda.Event() if self.cuda else None
        if ready is not None:
            ready.record()
        return self.worker.submit(self._cpu_attention, i, mb.kv, q, k, v, mask, ready)

    def _cpu_attention(self, i: int, kv: KVCache, q, k, v, mask, ready):
        """Worker thread: q/k/v to host, append k/v to the host cache, GQA attention on the CPU, output back to
        the GPU on the copy stream -> (output [n, 1, H*Dh], event it is ready at)."""
        with torch.inference_mode():
            q, k, v = self._to_host([q, k, v], ready)
            k_all, v_all = kv.update(i, k, v)  # [n, Hkv, S_total, Dh]
            out = gqa_attention(q, k_all, v_all, mask)  # [n, 1, H*Dh]
            if not self.cuda:
                return out, None
            with torch.cuda.stream(self.io):
                out = out.pin_memory().to(self.device, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.io)
            return out, done

    def _to_host(self, tensors: list[torch.Tensor], ready) -> list[torch.Tensor]:
        if not self.cuda:
            return tensors
        with torch.cuda.device(self.device), torch.cuda.stream(self.io):
            self.io.wait_event(ready)
            out = [t.to(HOST, non_blocking=True) for t in tensors]
            for t in tensors:
                t.record_stream(self.io)
        self.io.synchronize()
        return out

    def _post_attention(self, layer, i: int, x: list[torch.Tensor], m: int, job) -> None:
        """x[m] += O-proj(attention output); x[m] += FFN(norm(x[m])), the FFN on the GPU or the CPU."""
        out = job
        if isinstance(job, Future):
            out, done = job.result()
            if done is not None:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(done)
                out.record_stream(stream)
        h = x[m] + layer.self_attn.o_proj(out)
        y = layer.post_attention_layernorm(h)
        if self.policy.ffn_on_gpu:
            x[m] = h + layer.mlp(y)
        else:
            x[m] = h + self.host.model.layers[i].mlp(y.to(HOST)).to(self.device)

    def close(self) -> None:
        self.worker.shutdown()
