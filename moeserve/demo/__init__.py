"""The built-in demo checkpoint: this directory (config.json, model.safetensors, the byte tokenizer, heldout.txt)."""

from pathlib import Path

DEMO_MODEL = str(Path(__file__).parent)  # the demo checkpoint's directory, wherever the package is installed
