"""The shipped demo model: loads in transformers and in moeserve with the same logits, and is trained."""

import json
import math
from pathlib import Path

import torch

import moeserve
from moeserve.cli import DEMO_DIR, main


def test_demo_files_are_shipped_and_small():
    for name in ("config.json", "model.safetensors", "byte_tokenizer.json", "heldout.txt", "training.json"):
        assert (DEMO_DIR / name).is_file(), name
    assert (DEMO_DIR / "model.safetensors").stat().st_size <= 16 * 2**20
    assert 100_000 < (DEMO_DIR / "heldout.txt").stat().st_size < 1_000_000


def test_demo_logits_match_transformers():
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()
    ours = moeserve.load_model(DEMO_DIR, dtype=torch.float32)
    tokens = torch.randint(0, 258, (2, 40))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max() < 1e-4


def test_demo_is_trained(capsys):
    """Held-out Hamlet at well under 2.5 bits per byte (a random model scores 8)."""
    assert main(["eval", "ppl", "--max-tokens", "8192", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    recorded = json.loads(Path(DEMO_DIR, "training.json").read_text())["heldout_bits_per_byte"]
    assert result["bits_per_token"] < 2.5 and math.isfinite(recorded)
