"""The decoder stack: forward(tokens, positions, kv) -> logits, for every supported family."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from moeserve.model.kv_cache import KVCache, SlotKVCache
from moeserve.model.layers import MLP, Attention, RotaryEmbedding, decoder_norm, temperature_scale
from moeserve.model.mla import MLAttention
from moeserve.model.moe import MoEBlock
from moeserve.spec import ModelSpec


@dataclass(frozen=True)
class Span:
    """Which keys a layer's queries see besides the causal rule: the last `window` positions (a sliding window), or
    those of the query's own chunk of `chunk` positions (Llama-4's chunked attention); None: no such limit."""

    window: int | None = None
    chunk: int | None = None


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.input_layernorm = decoder_norm(spec, spec.hidden_size)
        self.self_attn = MLAttention(spec, layer_idx) if spec.attention.mla is not None else Attention(spec, layer_idx)
        self.post_attention_layernorm = decoder_norm(spec, spec.hidden_size)
        self.mlp = (MoEBlock(spec, layer_idx) if spec.moe.layers[layer_idx]
                    else MLP(spec.hidden_size, spec.moe.dense_ffn))
        window = spec.attention.sliding_windows[layer_idx] if spec.attention.sliding_windows else None
        chunk = spec.attention.chunks[layer_idx] if spec.attention.chunks else None
        self.span = Span(window, chunk)  # which keys its queries see: the key of its mask (attention_masks)
        self.residual_multiplier = spec.residual_multiplier  # Granite: on both branches before their adds

    def forward(self, x, cos, sin, mask, kv, q_scale=None):
        x, out = self.step(x, None, cos, sin, mask, kv, q_scale)
        return x + out

    def step(self, x, pending, cos, sin, mask, kv, q_scale=None):
        """The layer on the residual stream x + pending (pending: the previous layer's MLP output, or None) ->
        (its residual stream before the MLP output, the MLP output): each residual add goes into the launch of the
        RMSNorm after it (RMSNorm.added), this layer's input norm or the next one's. q_scale [B, S]: the queries'
        attention temperature (Llama-4's NoPE layers) or None."""
        x, normed = self.pre_mlp(x, pending, cos, sin, mask, kv, q_scale)
        return x, self.mlp_output(normed)

    def pre_mlp(self, x, pending, cos, sin, mask, kv, q_scale=None):
        """step() up to the MLP: (the residual stream after attention, the MLP's normed input)."""
        normed, x = self.attention_input(x, pending)
        return self.attention_output(x, self.self_attn(normed, cos, sin, mask, kv, q_scale))

    # step() in pieces around self_attn, for a pipeline that places the KV cache and attention itself
    # (plan/pipeline.py: self_attn.qkv, .attend or its core, .project_out between these)
    def attention_input(self, x, pending) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x [B, S, D] plus pending (or None) -> (attention's normed input, the stream)."""
        if pending is None:
            return self.input_layernorm(x), x
        return self.input_layernorm.added(x, pending)

    def attention_output(self, x, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream x [B, S, D] and attention's output attn [B, S, D] (after o_proj) -> (the stream with attn
        added, the MLP's normed input)."""
        normed, x = self.post_attention_layernorm.added(x, self.residual(attn))
        return x, normed

    def mlp_output(self, normed: torch.Tensor) -> torch.Tensor:
        """The MLP on its normed input [B, S, D] -> its branch as it joins the stream [B, S, D]."""
        return self.residual(self.mlp(normed))

    def residual(self, out: torch.Tensor) -> torch.Tensor:
        """A residual branch's output [B, S, D] as it joins the stream (times residual_multiplier)."""
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


@dataclass
class DecodeState:
    """A static decode step between its pieces (MoETransformer.decode_begin / decode_layers / decode_end): the
    residual stream [B, 1, D], the last MLP output not yet added to it (or None), the step's rotary tables,
    additive masks (one per Span) and the queries' attention temperature [B, S] (None: the family has none)."""

    x: torch.Tensor
    pending: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    masks: dict
    q_scale: torch.Tensor | None = None


class Backbone(nn.Module):
    """Named `model` inside MoETransformer so parameter names equal HF's (`model.layers.0...`)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                         _weight=embedding_init(spec.vocab_size, spec.hidden_size))  # [V, D]
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = decoder_norm(spec, spec.hidden_size)


def embedding_init(rows: int, dim: int) -> torch.Tensor:
    """nn.Embedding's own N(0, 1) init, left out on the meta device (a model built to be read into): torch's init of
    a meta embedding goes through its reference ops, which import the whole compiler stack (1-2 s of start-up)."""
    weight = torch.empty(rows, dim)
    return weight if weight.is_meta else weight.normal_()


def attention_masks(q_slots, q_positions, key_valid, spans):
    """Boolean masks [B, 1, S, S_total] per distinct Span.

    q_slots [S] (or [B, S], per sequence) are the cache slots of the new tokens, q_positions [B, S] their
    positions, key_valid [B, S_total] marks real tokens. A sequence's tokens fill consecutive slots, so a key
    diff = slot distance before a query at position p is at position p - diff: in p's chunk of C positions when
    diff <= p mod C. A query always sees itself, so a pad row never has an empty (NaN) softmax.
    """
    k_slots = torch.arange(key_valid.shape[1], device=key_valid.device)  # [S_total]
    diff = q_slots[..., :, None] - k_slots  # [S, S_total] or [B, S, S_total]
    diff = diff if diff.dim() == 3 else diff[None]
    masks = {}
    for span in set(spans):
        allowed = diff >= 0
        if span.window is not None:
            allowed = allowed & (diff < span.window)
        if span.chunk is not None:
            allowed = allowed & (diff <= (q_positions % span.chunk)[..., None])  # [B, S, S_total]
        masks[span] = ((allowed & key_valid[:, None, :]) | (diff == 0))[:, None]
    return masks


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA's additive one (0 where True, -inf elsewhere), made once for all layers: given the
    boolean mask, SDPA converts it the same way in every layer (three launches a layer at one token)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class MoETransformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        self.rotary = RotaryEmbedding(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=spec.lm_head_bias)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # called by the engine before each decode step, outside any CUDA graph: backends whose state the host keeps
        # between steps (the hybrid backend's GPU expert cache under the device link) register here
        self.step_hooks: list[Callable[[], None]] = []

    def before_step(self) -> None:
        """Run the step hooks (the engine calls this before every decode step, eager or replayed)."""
        for hook in self.step_hooks:
            hook()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                kv: KVCache | SlotKVCache | None = None, valid: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, V] (or [B, 1, V] with last_only).

        positions [B, S] default to 0..S-1 after what `kv` holds; valid [B, S] marks non-pad tokens. kv: a KVCache
        (sequences share its slots) or a SlotKVCache (positions required: they are the slots).
        """
        B, S = tokens.shape
        if valid is None:
            valid = torch.ones(B, S, dtype=torch.bool, device=tokens.device)
        if positions is None:
            start = kv.length if kv is not None else 0
            positions = torch.arange(start, start + S, device=tokens.device).expand(B, S)
        if kv is None:
            q_slots, key_valid = torch.arange(S, device=tokens.device), valid  # [S], [B, S]
        else:
            q_slots, key_valid = kv.pass_slots(positions, valid)  # [S] or [B, S], [B, S_total]
        masks = attention_masks(q_slots, positions, key_valid, self.spans())
        x, pending = self._layers(tokens, positions, masks, kv)
        if kv is not None:
            kv.commit()
        if last_only:
            x, pending = x[:, -1:], pending[:, -1:]
        return self.logits(self.model.norm.added(x, pending)[0])

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                    kv: SlotKVCache) -> torch.Tensor:
        """One token per sequence, tokens/positions/valid [B, 1] -> logits [B, 1, V], written in the rows kv.use()
        named, at each sequence's position.

        The static twin of forward() for decode: it attends over all kv.max_len columns (unwritten ones masked),
        so every step has the same shapes and nothing is read back to the host: a CUDA graph can capture it.
        The host bookkeeping stays outside: kv.use() before, kv.commit() after.
        """
        state = self.decode_begin(tokens, positions, valid, kv)
        return self.decode_end(self.decode_layers(state, 0, len(self.model.layers), kv))

    # decode_step in pieces, for decoders that run the host's part of some layers between captured segments
    def decode_begin(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                     kv: SlotKVCache) -> DecodeState:
        """Embed tokens [B, 1]; the step's masks and rotary tables."""
        q_slots, key_valid = kv.static_pass_slots(positions, valid)
        masks = attention_masks(q_slots, positions, key_valid, self.spans())
        masks = {span: additive_mask(m, self.dtype) for span, m in masks.items()}
        return self.start_state(tokens, positions, masks)

    def decode_layers(self, state: DecodeState, start: int, stop: int,
                      kv: KVCache | SlotKVCache | None) -> DecodeState:
        """Layers [start, stop) of the step (forward's pass too)."""
        x, pending = state.x, state.pending
        for layer in self.model.layers[start:stop]:
            x, pending = layer.step(x, pending, state.cos, state.sin, state.masks[layer.span], kv, state.q_scale)
        return replace(state, x=x, pending=pending)

    def decode_to_mlp(self, state: DecodeState, layer: int, kv: SlotKVCache):
        """Layer `layer` up to its MLP -> (the state with its residual stream, the MLP's normed input [B, 1, D]):
        the MLP's output becomes the next piece's pending."""
        block = self.model.layers[layer]
        x, normed = block.pre_mlp(state.x, state.pending, state.cos, state.sin, state.masks[block.span], kv,
                                  state.q_scale)
        return replace(state, x=x, pending=None), normed

    def decode_end(self, state: DecodeState) -> torch.Tensor:
        """The final norm and the LM head -> logits [B, 1, V]."""
        pending = state.pending if state.pending is not None else torch.zeros_like(state.x)
        return self.logits(self.model.norm.added(state.x, pending)[0])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The final hidden states [.., D] (normed) -> logits [.., V]: the head, divided by Granite's logits_scaling."""
        out = self.lm_head(h)
        return out if self.spec.logits_scaling == 1.0 else out / self.spec.logits_scaling

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] -> [B, S, D] (times Granite's embedding_multiplier)."""
        x = self.model.embed_tokens(tokens)
        return x if self.spec.embedding_multiplier == 1.0 else x * self.spec.embedding_multiplier

    def without_layers(self) -> MoETransformer:
        """A copy of the model without its decoder layers and step hooks (embedding, final norm, LM head, rotary
        tables; nothing of the layers is copied): what a pipeline that places the layers itself computes with around
        them (start_state, decode_end)."""
        return copy.deepcopy(self, {id(self.model.layers): nn.ModuleList(), id(self.step_hooks): []})

    def spans(self) -> list[Span]:
        """Each layer's Span: the keys of its masks."""
        return [layer.span for layer in self.model.layers]

    def _layers(self, tokens, positions, masks, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """Embed tokens [B, S] and run every decoder layer -> the hidden states [B, S, D] before the final norm as
        (residual stream, last MLP output): the norm adds them in its launch."""
        state = self.decode_layers(self.start_state(tokens, positions, masks), 0, len(self.model.layers), kv)
        return state.x, state.pending if state.pending is not None else torch.zeros_like(state.x)

    def start_state(self, tokens, positions, masks) -> DecodeState:
        """tokens [B, S] at positions [B, S] embedded, with the pass's rotary tables, masks ({Span: [B, 1, S,
        S_total]}) and attention temperature: the state before the first layer."""
        x = self.embed(tokens)  # [B, S, D]
        cos, sin = self.rotary(positions, x.dtype)
        t = self.spec.attention.temperature
        return DecodeState(x, None, cos, sin, masks, temperature_scale(t, positions) if t is not None else None)
