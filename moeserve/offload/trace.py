"""Routing traces: which experts each token picked, layer by layer, with gate weights, in the order a
decoder visits them (token by token, layers 0..L-1). Recorded from real runs, saved as .npz."""

from __future__ import annotations

import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeserve.errors import MoeserveError
from moeserve.progress import Progress


@dataclass
class RoutingTrace:
    sequence: np.ndarray  # [N] int32: which sequence each event belongs to
    layer: np.ndarray  # [N] int16
    expert_ids: np.ndarray  # [N, k] int16
    weights: np.ndarray  # [N, k] float32 gate weights
    num_layers: int
    num_experts: int

    def __len__(self) -> int:
        return len(self.layer)

    def save(self, path: str | Path) -> None:
        """Write exactly `path` (no ".npz" appended), through a temporary file so a cut-short save leaves none."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                np.savez_compressed(f, sequence=self.sequence, layer=self.layer, expert_ids=self.expert_ids,
                                    weights=self.weights, shape=np.array([self.num_layers, self.num_experts]))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> "RoutingTrace":
        """Read a saved trace; a truncated, foreign or inconsistent file raises MoeserveError."""
        try:
            with np.load(path, allow_pickle=False) as f:
                L, E = (int(v) for v in f["shape"])
                trace = cls(f["sequence"], f["layer"], f["expert_ids"], f["weights"], L, E)
        except (OSError, EOFError, KeyError, ValueError, TypeError, zipfile.BadZipFile, zlib.error) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MoeserveError(f"{path} is not a routing trace (cut short or not from `moeserve trace "
                                f"record`: {reason})") from None
        problem = trace.inconsistency()
        if problem:
            raise MoeserveError(f"{path} is not a valid routing trace: {problem}")
        return trace

    def inconsistency(self) -> str | None:
        """What makes the arrays disagree with each other or with the shape, or None."""
        n = self.layer.shape[0] if self.layer.ndim == 1 else -1
        if n < 0 or self.sequence.shape != (n,) or self.expert_ids.ndim != 2 or self.expert_ids.shape[0] != n \
                or self.weights.shape != self.expert_ids.shape:
            return "its arrays have different lengths"
        if n and (self.layer.min() < 0 or self.layer.max() >= self.num_layers):
            return f"a layer index is outside [0, {self.num_layers})"
        if n and (self.expert_ids.min() < 0 or self.expert_ids.max() >= self.num_experts):
            return f"an expert id is outside [0, {self.num_experts})"
        return None

    def split(self, fraction: float) -> tuple["RoutingTrace", "RoutingTrace"]:
        """Two traces cut at a sequence boundary near `fraction` of the events."""
        cut = int(len(self) * fraction)
        while 0 < cut < len(self) and self.sequence[cut] == self.sequence[cut - 1]:
            cut += 1
        part = lambda s: RoutingTrace(self.sequence[s], self.layer[s], self.expert_ids[s], self.weights[s],  # noqa: E731
                                      self.num_layers, self.num_experts)
        return part(slice(0, cut)), part(slice(cut, None))


@torch.no_grad()
def record_trace(model, sequences: list[list[int]], progress: bool = False) -> RoutingTrace:
    """Run each token sequence through `model` (one forward each) and record its routing; progress: show the
    sequences done on stderr."""
    moe_layers = [(i, layer.mlp.experts) for i, layer in enumerate(model.model.layers)
                  if hasattr(layer.mlp, "experts")]
    if not moe_layers:
        raise MoeserveError("the model has no MoE layers to trace")
    captured: dict[int, tuple] = {}
    hooks = [ex.register_forward_pre_hook(lambda _, args, i=i: captured.__setitem__(i, (args[1], args[2])))
             for i, ex in moe_layers]
    seqs, layers, ids, weights = [], [], [], []
    try:
        with Progress(len(sequences), "trace record", "sequences", enabled=progress) as bar:
            for n, tokens in enumerate(sequences):
                captured.clear()
                model(torch.tensor([tokens], device=model.device))
                per_layer = [(i, captured[i][0].cpu().numpy(), captured[i][1].float().cpu().numpy())
                             for i, _ in moe_layers]
                for t in range(len(tokens)):  # token-major order, as decoding visits experts
                    for i, layer_ids, layer_w in per_layer:
                        seqs.append(n)
                        layers.append(i)
                        ids.append(layer_ids[t])
                        weights.append(layer_w[t])
                bar.update()
    finally:
        for h in hooks:
            h.remove()
    return RoutingTrace(np.asarray(seqs, np.int32), np.asarray(layers, np.int16), np.asarray(ids, np.int16),
                        np.asarray(weights, np.float32), model.spec.num_layers, model.spec.moe.num_experts)
