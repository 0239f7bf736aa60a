"""Perplexity over non-overlapping windows of a token stream (the `eval ppl` command and bench/quality.py)."""

from __future__ import annotations

import math

import torch

from moeserve.progress import Progress


def perplexity(model, ids: list[int], window: int, batch_size: int = 8, progress: bool = True,
               max_windows: int = 0) -> dict:
    """Mean next-token NLL over windows of `window` tokens; each window starts without context.

    max_windows > 0 keeps that many windows, evenly spaced (quick estimates during training)."""
    window = min(window, model.spec.max_position_embeddings)
    windows = [w for w in (ids[s:s + window] for s in range(0, len(ids) - 1, window)) if len(w) > 1]
    if 0 < max_windows < len(windows):
        windows = [windows[round(i * (len(windows) - 1) / (max_windows - 1))] if max_windows > 1 else windows[0]
                   for i in range(max_windows)]
    nll, count = 0.0, 0
    bar = Progress(sum(len(w) - 1 for w in windows), "perplexity", "tokens", progress)
    with torch.inference_mode():
        for b in range(0, len(windows), batch_size):
            batch = windows[b:b + batch_size]
            n = max(len(w) for w in batch)
            tokens = torch.tensor([w + [0] * (n - len(w)) for w in batch], device=model.device)
            lengths = torch.tensor([len(w) for w in batch], device=model.device)
            logits = model(tokens).float()  # [B, S, V] (right padding: causal, so real tokens never see it)
            losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:],
                                                       reduction="none")  # [B, S-1]
            keep = torch.arange(n - 1, device=model.device)[None] < (lengths[:, None] - 1)  # [B, S-1]
            nll += losses[keep].sum().item()
            count += int(keep.sum())
            bar.update(int(keep.sum()), note=f"perplexity {math.exp(nll / count):.3f}")
    bar.close()
    return {"tokens": count, "window": window, "windows": len(windows), "perplexity": math.exp(nll / count),
            "bits_per_token": nll / count / math.log(2)}
