"""Static KV cache: one preallocated [L, B, Hkv, S_max, Dh] buffer for keys and one for values.

Batched prompts are left-padded, so every sequence writes the same slot at each step; `valid`
marks the slots that hold real tokens (pads never get attended to).

Two ways to fill it. Dynamic (`begin` / `update` / `commit`): a pass of S tokens writes slots
[length, length + S) and attends over the filled prefix; shapes grow every step (prefill, eager decode).
Static (`reserve_step` / `begin_static` / `update` / `commit`): one decode token per sequence writes
the slot held in the device tensor `index` and attends over all S_max slots, unwritten ones masked, so
every step has the same shapes and reads nothing back to the host: a CUDA graph can capture it.
"""

from __future__ import annotations

import torch

from moeserve.spec import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, batch: int, max_len: int, device, dtype, pin_memory: bool = False):
        """pin_memory: page-lock a host cache, so copies to and from a GPU are asynchronous DMA."""
        shape = (spec.num_layers, batch, spec.num_kv_heads, max_len, spec.head_dim)
        # zeros, not empty: the static path multiplies unwritten (masked) slots by 0, and 0 * NaN = NaN
        self.k = torch.zeros(shape, device=device, dtype=dtype, pin_memory=pin_memory)
        self.v = torch.zeros(shape, device=device, dtype=dtype, pin_memory=pin_memory)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # [B, S_max]
        self.index = torch.zeros(1, dtype=torch.long, device=device)  # [1] slot the next static step writes
        self.length = 0  # slots filled by finished forward passes
        self.max_len = max_len
        self._pending = 0  # slots being written by the forward pass in flight
        self._static = False  # whether the pass in flight writes at `index` (static) or after `length`

    def _reserve(self, S: int) -> None:
        if self.length + S > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {S} > {self.max_len} slots")
        self._pending = S

    def begin(self, valid: torch.Tensor) -> torch.Tensor:
        """Reserve slots for the next forward pass; valid [B, S]. Returns key validity [B, S_total]."""
        S = valid.shape[1]
        self._reserve(S)
        self._static = False
        self.valid[:, self.length:self.length + S] = valid
        return self.valid[:, :self.length + S]

    def reserve_step(self) -> None:
        """Host half of a static decode step (outside any graph): check room, point `index` at the next slot."""
        self._reserve(1)
        self.index.fill_(self.length)  # a kernel taking the value as an argument: no copy, no sync

    def begin_static(self, valid: torch.Tensor) -> torch.Tensor:
        """Device half: mark slot `index` with valid [B, 1]; returns key validity over all slots [B, S_max]."""
        self._static = True
        return self.valid.index_copy_(1, self.index, valid)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this pass's k/v [B, Hkv, S, Dh]; return the keys/values to attend over [B, Hkv, S_total, Dh]
        (static: all S_max slots)."""
        if self._static:
            return self.k[layer].index_copy_(2, self.index, k), self.v[layer].index_copy_(2, self.index, v)
        end = self.length + self._pending
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def static_slot(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """In a static pass, (keys, values [B, Hkv, S_max, Dh], slot index [1]) of a layer, for a kernel that writes
        the slot itself (what update() would write, then returns); None in a dynamic pass."""
        return (self.k[layer], self.v[layer], self.index) if self._static else None

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0
