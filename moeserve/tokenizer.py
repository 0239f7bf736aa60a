"""Tokenizers: HF tokenizer.json through `tokenizers`, and the byte-level tokenizer of the demo model."""

from __future__ import annotations

import json
from pathlib import Path

from moeserve.errors import MoeserveError

BYTE_TOKENIZER_FILE = "byte_tokenizer.json"


class ByteTokenizer:
    """Token i < 256 is byte i; then BOS and EOS. Lossless for any UTF-8 text."""

    def __init__(self, bos_id: int = 256, eos_id: int = 257):
        self.bos_id, self.eos_id = bos_id, eos_id
        self.vocab_size = max(bos_id, eos_id) + 1

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([self.bos_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, path: str | Path) -> None:
        Path(path, BYTE_TOKENIZER_FILE).write_text(
            json.dumps({"type": "bytes", "bos_id": self.bos_id, "eos_id": self.eos_id}) + "\n")


class HFTokenizer:
    """A tokenizer.json (any HF fast tokenizer) with BOS/EOS from the model config."""

    def __init__(self, path: Path, bos_id: int | None, eos_id: int | None):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise MoeserveError(f"cannot read tokenizer {path}: {e}") from None
        self.bos_id, self.eos_id = bos_id, eos_id
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str | Path, bos_id: int | None = None, eos_id: int | None = None):
    """The tokenizer stored beside a checkpoint: byte_tokenizer.json or tokenizer.json."""
    path = Path(path)
    if (path / BYTE_TOKENIZER_FILE).is_file():
        cfg = json.loads((path / BYTE_TOKENIZER_FILE).read_text())
        return ByteTokenizer(cfg["bos_id"], cfg["eos_id"])
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path / "tokenizer.json", bos_id, eos_id)
    raise MoeserveError(f"{str(path)!r} has no tokenizer.json (or byte_tokenizer.json); pass token ids instead")
