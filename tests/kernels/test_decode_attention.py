"""The decode attention kernels against a float64 reference: grouped heads, cache rows read in place, additive and
boolean masks with holes (sliding windows, left pads, whole blocks hidden), splits merged. On the CPU in Triton's
interpreter at small sizes; on a GPU, compiled, in bf16 too."""

import pytest
import torch

pytest.importorskip("triton")

from checks import DEVICE  # noqa: E402
from moeserve.kernels.triton.decode_attention import decode_attention, split_count  # noqa: E402


def reference(q, keys, values, rows, keep, scale):
    """float64: q [B, H, 1, Dh], caches [R, Hkv, S_max, Dh], keep [B, S] bool -> [B, 1, H * Dh]."""
    B, H, _, Dh = q.shape
    G = H // keys.shape[1]
    S = keep.shape[1]
    k = keys[rows][:, :, :S].double().repeat_interleave(G, dim=1)  # [B, H, S, Dh]
    v = values[rows][:, :, :S].double().repeat_interleave(G, dim=1)
    s = (q.double() @ k.transpose(-1, -2)) * scale  # [B, H, 1, S]
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, 1, H * Dh)


def keep_mask(B: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """[B, S] attended columns: a random length per sequence, a sliding window on one, left pads on another, and a
    hole of more than a block on a third."""
    keep = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        n = int(torch.randint(1, S + 1, (1,), generator=gen))
        keep[b, :n] = True
        if b % 4 == 1:
            keep[b, : max(n - 40, 0)] = False  # sliding window of 40
        elif b % 4 == 2:
            keep[b, : n // 3] = False  # left pads
        elif b % 4 == 3 and n > 150:
            keep[b, 10:140] = False  # whole blocks hidden
    return keep


@pytest.mark.parametrize("H,Hkv,Dh,S", [(8, 2, 32, 300), (4, 4, 16, 70), (16, 2, 64, 1100)])
@pytest.mark.parametrize("additive", [True, False], ids=["additive", "bool"])
def test_decode_attention_matches_float64(H, Hkv, Dh, S, additive):
    gen = torch.Generator().manual_seed(H * S + Dh)
    B, R, S_max = 5, 7, S + 13
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q = torch.randn(B, H, 1, Dh, generator=gen)
    keys, values = torch.randn(2, R, Hkv, S_max, Dh, generator=gen)
    rows = torch.randperm(R, generator=gen)[:B]
    keep = keep_mask(B, S, gen)
    mask = keep if not additive else torch.zeros(B, S).masked_fill(~keep, float("-inf"))
    scale = 0.7 / Dh ** 0.5
    ref = reference(q, keys, values, rows, keep, scale)
    got = decode_attention(*(t.to(DEVICE, dtype) for t in (q, keys, values)), rows.to(DEVICE),
                           mask[:, None, None, :].to(DEVICE, mask.dtype if not additive else dtype), scale)
    assert got.shape == (B, 1, H * Dh) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double().cpu(), ref, atol=tol, rtol=tol)


def test_rows_none_reads_row_b_and_a_broadcast_mask():
    """No rows (a batch cache: sequence b is row b) and one mask row for every sequence."""
    gen = torch.Generator().manual_seed(3)
    B, H, Hkv, Dh, S = 3, 4, 2, 16, 90
    q = torch.randn(B, H, 1, Dh, generator=gen)
    keys, values = torch.randn(2, B, Hkv, S, Dh, generator=gen)
    keep = torch.ones(1, S, dtype=torch.bool)
    keep[0, 50:] = False
    got = decode_attention(q.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), None, keep[:, None, None].to(DEVICE))
    ref = reference(q, keys, values, torch.arange(B), keep.expand(B, S), Dh ** -0.5)
    torch.testing.assert_close(got.double().cpu(), ref, atol=1e-5, rtol=1e-5)


def test_split_count_fills_the_gpu_on_long_caches_only():
    assert split_count(1, 8, 4096) == 16 and split_count(64, 8, 4096) == 1
    assert split_count(1, 8, 300) == 1 and split_count(2, 8, 600) == 2
