"""Train the built-in demo model from scratch: a 6M-parameter byte-level Mixtral on Shakespeare.

    python -m moeserve.train.demo --texts DIR --out DIR [--steps N] [--minutes M] [--device cuda] [--quick]

The trainer's `moe-8` architecture (run.py): `--out` receives an HF Mixtral checkpoint (config.json + bf16
model.safetensors with per-expert names), the byte tokenizer, the held-out Hamlet and training.json; the files
appear only once all of them are written.
"""

from __future__ import annotations

import sys

from moeserve.train.arch import architecture
from moeserve.train.run import main as train_main

DEMO_CONFIG = architecture("moe-8").hf_config(512)  # HF MixtralForCausalLM: 6.0M parameters, 12 MB in bf16


def demo_config(seq_len: int, quick: bool = False) -> dict:
    """The config.json to write. Its context is the training window: positions beyond it were never trained
    (the model's perplexity climbs past them), so the config must not promise more."""
    return architecture("moe-8", quick=quick).hf_config(seq_len)


def main(argv: list[str] | None = None) -> int:
    return train_main(["--arch", "moe-8", *(sys.argv[1:] if argv is None else argv)],
                      prog="python -m moeserve.train.demo")


if __name__ == "__main__":
    sys.exit(main())
