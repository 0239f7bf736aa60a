"""KV caches: one preallocated [L, rows, Hkv, S_max, Dh] buffer for keys and one for values; for MLA one buffer of
latents [L, rows, 1, S_max, kv_lora_rank + rope] and no values (ModelSpec.attention.kv_cache_entry).

KVCache: a batch of left-padded sequences that advance together (a forward pass of S tokens writes slots
[length, length + S) of every row and attends over the filled prefix; `valid` marks the slots that hold real tokens,
so pads are never attended to): prompt passes, the CGOPipe pipeline, tests.
SlotKVCache: rows that sequences hold independently (continuous batching, the engine's decode steps), with a static
step of fixed shapes that a CUDA graph captures.
"""

from __future__ import annotations

import torch

from moeserve.spec import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, batch: int, max_len: int, device, dtype, pin_memory: bool = False):
        """pin_memory: page-lock a host cache, so copies to and from a GPU are asynchronous DMA."""
        heads, dim, separate = spec.attention.kv_cache_entry()
        shape = (spec.num_layers, batch, heads, max_len, dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype, pin_memory=pin_memory)
        self.v = torch.zeros(shape, device=device, dtype=dtype, pin_memory=pin_memory) if separate else None
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # [B, S_max]
        self.length = 0  # slots filled by finished forward passes
        self.max_len = max_len
        self._pending = 0  # slots being written by the forward pass in flight

    def _reserve(self, S: int) -> None:
        if self.length + S > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {S} > {self.max_len} slots")
        self._pending = S

    def begin(self, valid: torch.Tensor) -> torch.Tensor:
        """Reserve slots for the next forward pass; valid [B, S]. Returns key validity [B, S_total]."""
        S = valid.shape[1]
        self._reserve(S)
        self.valid[:, self.length:self.length + S] = valid
        return self.valid[:, :self.length + S]

    def pass_slots(self, positions: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a pass: (query slots [S], key validity [B, S_total]) for attention_masks."""
        start = self.length
        return torch.arange(start, start + valid.shape[1], device=valid.device), self.begin(valid)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor | None):
        """Write this pass's k/v [B, Hkv, S, Dh] (MLA: latents [B, 1, S, r + rope], v None); return the keys/values
        to attend over [B, Hkv, S_total, Dh] (MLA: latents, None)."""
        end = self.length + self._pending
        self.k[layer, :, :, self.length:end] = k
        if self.v is None:
            return self.k[layer, :, :, :end], None
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def update_in_place(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """update(), for a kernel that reads cache rows in place: (keys, values, rows None: sequence b is row b)."""
        keys, values = self.update(layer, k, v)
        return keys, values, None

    def static_slot(self, layer: int) -> None:
        """No static pass here (SlotKVCache's): attention writes through update()."""
        return None

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0


class SlotKVCache:
    """Per-slot KV cache for continuous batching: `slots` independent rows of `max_len` tokens each, plus one
    spare row that padded batch entries write to. A token at position p of a sequence lives in column p of its
    row, so a row needs no shared clock: sequences of any lengths join and leave between passes.

    A pass covers any subset of rows: `use(rows, span)` names them ([B] row indices, a [B] device tensor) before
    the model runs. Dynamic passes (span = columns to attend over, max position + 1) write only the tokens marked
    valid (pads in a batch of prompt chunks: they take the position of their row's last real token, so their
    query sees what that token sees, and write nothing). Static passes (span None: one token per row, all
    max_len columns, every entry written; padded entries point at the spare row) read nothing back to the host,
    so a CUDA graph can capture them. Masks come from positions alone: key column j is visible to a query at
    position p when j <= p (and within a sliding window), since every column below p holds that row's tokens.
    """

    def __init__(self, spec: ModelSpec, slots: int, max_len: int, device, dtype):
        heads, dim, separate = spec.attention.kv_cache_entry()
        shape = (spec.num_layers, slots + 1, heads, max_len, dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # zeros: masked columns are multiplied by 0
        self.v = torch.zeros(shape, device=device, dtype=dtype) if separate else None  # MLA: latents in k only
        self.slots, self.max_len, self.spare = slots, max_len, slots
        self._rows = torch.zeros(1, dtype=torch.long, device=device)  # [B] rows of the pass
        self._first_row: int | None = None  # rows are first_row, first_row + 1, ...: slice instead of gather
        self._span: int | None = None
        self._write: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def copy_columns(self, src: int, dst: int, start: int, stop: int) -> None:
        """Row dst's columns [start, stop) become row src's (every layer; keys and values, or MLA's latents): the KV of
        tokens both rows hold, copied on the device instead of computed."""
        for cache in (self.k, self.v) if self.v is not None else (self.k,):
            cache[:, dst, :, start:stop] = cache[:, src, :, start:stop]

    def use(self, rows: list[int] | torch.Tensor, span: int | None) -> None:
        """The rows the next passes cover (a list, or a [B] device tensor that a CUDA graph reads) and the columns
        they attend over (None: all, static). Consecutive rows given as a list are sliced, not gathered."""
        self._first_row = None
        if isinstance(rows, list):
            self._first_row = rows[0] if rows == list(range(rows[0], rows[0] + len(rows))) else None
            rows = torch.tensor(rows, device=self.k.device)
        self._rows, self._span = rows, span

    def pass_slots(self, positions: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a dynamic pass of tokens at positions [B, S] (valid [B, S]: written): (query slots [B, S],
        key validity [B, span])."""
        self._write = (positions, valid, None if bool(valid.all()) else valid)
        return positions, torch.ones(positions.shape[0], self._span, dtype=torch.bool, device=positions.device)

    def static_pass_slots(self, positions: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a static step, positions [B, 1]: (query slots [B, 1], key validity [B, max_len])."""
        self._write = (positions, valid, None)
        return positions, torch.ones(positions.shape[0], self.max_len, dtype=torch.bool, device=positions.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor | None):
        """Write this pass's k/v [B, Hkv, S, Dh] (MLA: latents [B, 1, S, r + rope], v None) at (row, position);
        return the rows' keys/values [B, Hkv, span, Dh] (static: all max_len columns; MLA: latents, None)."""
        caches = self._write_new(layer, k, v)
        span = self.max_len if self._span is None else self._span
        if self._first_row is not None:
            end = self._first_row + self._rows.shape[0]
            out = [cache[layer, self._first_row:end, :, :span] for cache in caches]
        else:
            out = [cache[layer, :, :, :span].index_select(0, self._rows) for cache in caches]
        return out[0], out[1] if len(out) > 1 else None

    def update_in_place(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write as update() does, for a kernel that reads the rows in place: (the layer's keys and values of every
        row [slots + 1, Hkv, max_len, Dh], the rows of the pass [B]); nothing is gathered."""
        self._write_new(layer, k, v)
        return self.k[layer], self.v[layer], self._rows

    def _write_new(self, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Write this pass's k/v at (row, position), pads skipped; -> the caches (keys, and values unless MLA)."""
        positions, _, written = self._write
        rows = self._rows[:, None].expand_as(positions)  # [B, S]
        caches = (self.k, self.v) if self.v is not None else (self.k,)
        new = [t.transpose(1, 2) for t in (k, v)[:len(caches)]]  # [B, S, Hkv, Dh] each
        if written is not None:
            rows, positions, new = rows[written], positions[written], [t[written] for t in new]
        for cache, t in zip(caches, new):
            cache[layer][rows, :, positions] = t
        return caches

    def static_slot(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """In a static pass, (keys, values [slots + 1, Hkv, max_len, Dh], each sequence's column [B], its row [B]) of
        a layer, for a kernel that writes the new entries itself (what update() would write) and attends over the
        rows in place; None in a dynamic pass and for MLA's latents."""
        if self._span is not None or self._write is None or self.v is None:
            return None
        return self.k[layer], self.v[layer], self._write[0].reshape(-1), self._rows

    def commit(self) -> None:
        self._write = None
