"""Tiny random PR-MoE checkpoints (moeserve's PRMoEForCausalLM format) for the tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from moeserve.model.transformer import MoETransformer
from moeserve.spec import ModelSpec
from moeserve.tokenizer import ByteTokenizer
from moeserve.train.arch import ArchConfig


def tiny_arch(experts=(2, 4, 8), top_k: int = 1, residual: bool = True) -> ArchConfig:
    return ArchConfig(experts=tuple(experts), top_k=top_k, residual=residual, hidden_size=32, num_heads=4,
                      num_kv_heads=2, head_dim=8, expert_ffn=24)


def save_prmoe_model(path: Path, arch: ArchConfig | None = None, seed: int = 0, context: int = 64) -> Path:
    """Random weights (N(0, 0.1), norms near 1, so every layer matters) with the byte tokenizer and a held-out
    text: a directory `moeserve` loads like any checkpoint."""
    arch = arch or tiny_arch()
    config = arch.hf_config(context)
    model = MoETransformer(ModelSpec.from_hf_config(config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.ndim == 1 and p.shape[0] != 2 else 0.0))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    ByteTokenizer().save(path)
    (path / "heldout.txt").write_text("Words, words, words. " * 20)
    return path
