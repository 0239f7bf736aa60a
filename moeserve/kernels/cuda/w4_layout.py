"""The 4-bit MMA kernels' weight layout (w4_moe.cu), built once from the packed experts (pure functions).

A weight [N, K] is cut into 16-row tiles and 64-input chunks. Lane (g, c) of a warp (g = lane / 4, c = lane % 4)
holds the A fragments of rows g and g + 8 of a tile for the chunk's inputs 16c .. 16c + 15 (the kernel reads x in
the same permuted order: MMA step s, k index 2c + j (j < 2) or 2c + 8 + j - 2, is input 16c + 4s + j), as four
words, word s for MMA step s. Register i of a step (a0..a3 of m16n8k16: row g / g + 8, low / high k half) is the
nibble pair at bits 4i and 16 + 4i, so one shift and one LOP3 decode it. Scales and zeros: per tile and group, per
g, (s[g], s[g + 8], z[g], z[g + 8]) fp16."""

from __future__ import annotations

import torch

from moeserve.kernels.pack import unpack

CHUNK = 64  # inputs per chunk: four m16n8k16 steps
TILE = 16  # weight rows per tile


def supported(bits: int, group: int, n: int, k: int) -> bool:
    """Widths and shapes the layout takes: 4 bits, groups of whole chunks, whole tiles and chunks."""
    return bits == 4 and group % CHUNK == 0 and n % (2 * TILE) == 0 and k % group == 0 and k % CHUNK == 0


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[E, 2F, ...] (gate rows, then up rows) -> tiles alternating gate / up: [E, 2F, ...], tile 2i = gate rows
    16i .. 16i + 15, tile 2i + 1 = the same up rows."""
    E, two_f = t.shape[:2]
    return t.reshape(E, 2, two_f // 2 // TILE, TILE, *t.shape[2:]).transpose(1, 2).reshape(t.shape)


def shuffle_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [E, N, K] (0..15) -> the kernel's words [E, N / 16, K / 64, 32, 4] int32."""
    E, N, K = codes.shape
    q = codes.to(torch.int64).reshape(E, N // TILE, 2, 8, K // CHUNK, 4, 4, 2, 2)  # e, tile, h, g, chunk, c, s, kh, jl
    q = q.permute(0, 1, 4, 3, 5, 6, 8, 7, 2)  # e, tile, chunk, g, c, s, jl, kh, h: nibble n = 4 jl + 2 kh + h
    q = q.reshape(E, N // TILE, K // CHUNK, 32, 4, 8)
    words = (q << (4 * torch.arange(8, device=codes.device))).sum(-1)  # [E, tiles, chunks, 32, 4]
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def shuffle_scales(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """scale, zero [E, N, G] fp16 -> [E, N / 16, G, 8, 4] fp16: (s[g], s[g + 8], z[g], z[g + 8]) per tile row g."""
    E, N, G = scale.shape
    sz = torch.stack([scale, zero], -1).reshape(E, N // TILE, 2, 8, G, 2)  # e, tile, h, g, group, s/z
    return sz.permute(0, 1, 4, 3, 5, 2).reshape(E, N // TILE, G, 8, 4).contiguous()


def mma_layout(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int,
               gate_up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed 4-bit experts (pack.py rows: qweight [E, N, K / 8], scale/zero [E, N, G]) -> (words, scales) in the
    kernel's layout; gate_up: gate and up tiles interleaved."""
    codes = unpack(qweight, 4, in_features)  # [E, N, K] uint8
    if gate_up:
        codes, scale, zero = (interleave_gate_up(t) for t in (codes, scale, zero))
    return shuffle_codes(codes), shuffle_scales(scale, zero)


def reference_tile_product(words: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
    """What the kernel computes for one expert, from its layout alone, in float64: words [tiles, chunks, 32, 4],
    scales [tiles, G, 8, 4] fp16, x [M, K] -> [M, tiles * 16]: decodes each lane's registers as the kernel does
    and places them by the m16n8k16 fragment map (the layout's test)."""
    tiles, chunks = words.shape[:2]
    M, K = x.shape
    w = torch.zeros(tiles * TILE, K, dtype=torch.float64)
    lane = torch.arange(32)
    g, c = lane // 4, lane % 4
    wd = words.to(torch.int64) & 0xFFFFFFFF
    for s in range(4):
        for i in range(4):  # register a_i: row g + 8 (i & 1), k half i >> 1
            for half in range(2):  # low / high 16 bits: j = 2 (i >> 1) + half
                nib = (wd[..., s] >> (4 * i + 16 * half)) & 0xF  # [tiles, chunks, 32]
                row = g + 8 * (i & 1)  # [32]
                col = 16 * c + 4 * s + 2 * (i >> 1) + half  # [32] input within the chunk
                for t in range(tiles):
                    for ch in range(chunks):
                        w[t * TILE + row, ch * CHUNK + col] = nib[t, ch].to(torch.float64)
    sz = scales.to(torch.float64).reshape(tiles, -1, 8, 2, 2)  # tile, group, g, s/z, h
    s = sz[..., 0, :].permute(0, 3, 2, 1).reshape(tiles * TILE, -1)  # [N, G] row h*8+g
    z = sz[..., 1, :].permute(0, 3, 2, 1).reshape(tiles * TILE, -1)
    deq = (w.reshape(tiles * TILE, -1, group) - z[..., None]) * s[..., None]  # [N, G, group]
    return x.to(torch.float64) @ deq.reshape(tiles * TILE, K).T
