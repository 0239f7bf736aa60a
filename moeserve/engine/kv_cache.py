"""Static KV cache: one preallocated [L, B, Hkv, S_max, Dh] buffer for keys and one for values.

Batched prompts are left-padded, so every sequence writes the same slot at each step; `valid`
marks the slots that hold real tokens (pads never get attended to).
"""

from __future__ import annotations

import torch

from moeserve.spec import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, batch: int, max_len: int, device, dtype):
        shape = (spec.num_layers, batch, spec.num_kv_heads, max_len, spec.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # [B, S_max]
        self.length = 0  # slots filled by finished forward passes
        self.max_len = max_len
        self._pending = 0  # slots being written by the forward pass in flight

    def begin(self, valid: torch.Tensor) -> torch.Tensor:
        """Reserve slots for the next forward pass; valid [B, S]. Returns key validity [B, S_total]."""
        S = valid.shape[1]
        if self.length + S > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {S} > {self.max_len} slots")
        self.valid[:, self.length:self.length + S] = valid
        self._pending = S
        return self.valid[:, :self.length + S]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this pass's k/v [B, Hkv, S, Dh]; return all keys/values so far [B, Hkv, S_total, Dh]."""
        end = self.length + self._pending
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0
