"""A trained model's directory: config.json, bf16 model.safetensors, the byte tokenizer, the held-out text and
training.json (the run's record), written so that the files appear only once all of them are written."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from moeserve.checkpoint import save_safetensors_atomic, to_per_expert
from moeserve.model.transformer import MoETransformer
from moeserve.tokenizer import ByteTokenizer


def save_model(model: MoETransformer, hf_config: dict, tok: ByteTokenizer, heldout_text: str, record: dict,
               out: Path) -> None:
    """Write every file into a temporary directory beside `out`, then rename them into place. HF families get
    per-expert names (what every HF tool reads); moeserve's own (PR-MoE) keeps its fused ones."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        state = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
        if model.spec.family != "prmoe":
            state = to_per_expert(state, model.spec.family)
        save_safetensors_atomic(state, tmp / "model.safetensors")
        tok.save(tmp)
        (tmp / "heldout.txt").write_text(heldout_text, encoding="utf-8", newline="\n")
        (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp and safetensors create owner-only entries
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():  # e.g. moeserve/demo itself: replace our files, keep the others
            for f in sorted(tmp.iterdir()):
                os.replace(f, out / f.name)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def git_commit() -> str | None:
    """HEAD of the checkout this file lives in (with -dirty for local changes), or None."""
    try:
        cwd = Path(__file__).parent
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
