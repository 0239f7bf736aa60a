"""Tokenizers: HF tokenizer.json through `tokenizers`, and the byte-level tokenizer of the demo model."""

from __future__ import annotations

import json
from pathlib import Path

from moeserve.errors import MoeserveError

BYTE_TOKENIZER_FILE = "byte_tokenizer.json"
HF_TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    """Token i < 256 is byte i; then BOS and EOS. Lossless for any UTF-8 text."""

    def __init__(self, bos_id: int = 256, eos_id: int = 257):
        self.bos_id, self.eos_id = bos_id, eos_id
        self.vocab_size = max(bos_id, eos_id) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's bytes, after a BOS when special tokens are added."""
        return ([self.bos_id] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (none for BOS and EOS)."""
        return bytes([token]) if token < 256 else b""

    def vocab_bytes(self) -> list[bytes]:
        """Each token id's bytes (b"" for BOS and EOS): the vocabulary a grammar library matches text against."""
        return [self.token_bytes(i) for i in range(self.vocab_size)]

    def show(self, texts) -> None:
        """Nothing to do: no special token of this vocabulary has a text (HFTokenizer.show)."""

    def save(self, path: str | Path) -> None:
        Path(path, BYTE_TOKENIZER_FILE).write_text(
            json.dumps({"type": "bytes", "bos_id": self.bos_id, "eos_id": self.eos_id}) + "\n")


class HFTokenizer:
    """A tokenizer.json (any HF fast tokenizer) that encodes as transformers' AutoTokenizer does.

    The special tokens a text gets are those of tokenizer.json's post-processor (none where it has none), never
    the model config's bos_token_id: Qwen configs name a BOS their tokenizer never adds. transformers 5.x takes
    the post-processor alone and drops add_bos_token / add_eos_token from tokenizer_config.json when a
    tokenizer.json is present; its GPT-NeoX tokenizer class (OLMoE's) rebuilds the post-processor from those
    dropped flags, so it adds nothing. Truncation and padding saved in tokenizer.json are off, as in a plain
    `tokenizer(text)` call."""

    def __init__(self, path: Path, adds_special_tokens: bool = True):
        from tokenizers import Tokenizer  # HF checkpoints only: the byte tokenizer and `--help` never load it

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise MoeserveError(f"cannot read tokenizer {path}: {e}") from None
        self._tok.no_truncation()
        self._tok.no_padding()
        self.adds_special_tokens = adds_special_tokens
        self.vocab_size = self._tok.get_vocab_size()
        self.shown: dict[int, str] = {}  # special tokens decoded to their text (show)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's ids, with the special tokens transformers adds when add_special_tokens."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens and self.adds_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ids; special tokens stand for no text, except those shown."""
        if not self.shown or not any(i in self.shown for i in ids):
            return self._tok.decode(ids, skip_special_tokens=True)
        out, run = [], []
        for i in ids:
            if i in self.shown:
                out += [self._tok.decode(run, skip_special_tokens=True), self.shown[i]]
                run = []
            else:
                run.append(i)
        return "".join(out) + self._tok.decode(run, skip_special_tokens=True)

    def show(self, texts) -> None:
        """Decode the special tokens whose texts are `texts` to those texts, and let grammars write them: a chat
        format written with special tokens (harmony's <|channel|>, GLM-4.5's <arg_key>) is read from the answer's
        text."""
        wanted = set(texts)
        self.shown = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()
                      if t.special and t.content in wanted}

    def token_bytes(self, token: int) -> bytes:
        """The text one token decodes to, as UTF-8 (a piece of a character decodes to U+FFFD)."""
        return self.decode([token]).encode("utf-8")

    def vocab_bytes(self) -> list[bytes]:
        """Each token id's exact bytes, pieces of characters included (b"" for special tokens, which stand for no
        text): the vocabulary a grammar library matches text against. Read from the vocabulary as the decoder
        reads it: byte-level BPE (GPT-2's byte-to-character map), or SentencePiece style (U+2581 a space,
        <0xNN> byte fallback)."""
        byte_level = "ByteLevel" in json.dumps(json.loads(self._tok.to_str()).get("decoder"))
        chars = {c: b for b, c in gpt2_byte_chars().items()}
        out = [b""] * self.vocab_size
        for piece, i in self._tok.get_vocab(with_added_tokens=False).items():
            if byte_level:
                out[i] = bytes(chars[c] for c in piece) if all(c in chars for c in piece) else piece.encode()
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out[i] = bytes([int(piece[3:5], 16)])
            else:
                out[i] = piece.replace("\u2581", " ").encode("utf-8")
        for i, added in self._tok.get_added_tokens_decoder().items():
            out[i] = b"" if added.special and i not in self.shown else added.content.encode("utf-8")
        return out


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte-level map: byte -> the printable character byte-level BPE vocabularies write it as."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(shifted)}}


# transformers' tokenizer classes that add no special tokens (see HFTokenizer), named in tokenizer_config.json
# or chosen by config.json's model_type when it names none
NO_SPECIAL_TOKEN_CLASSES = ("GPTNeoXTokenizer", "GPTNeoXTokenizerFast")
NO_SPECIAL_TOKEN_MODEL_TYPES = ("olmoe",)


def has_tokenizer(path: str | Path) -> bool:
    """Whether a checkpoint directory holds a tokenizer load_tokenizer reads."""
    return any((Path(path) / name).is_file() for name in (BYTE_TOKENIZER_FILE, HF_TOKENIZER_FILE))


def load_tokenizer(path: str | Path):
    """The tokenizer stored beside a checkpoint: byte_tokenizer.json or tokenizer.json."""
    path = Path(path)
    if (path / BYTE_TOKENIZER_FILE).is_file():
        return read_byte_tokenizer(path / BYTE_TOKENIZER_FILE)
    if (path / HF_TOKENIZER_FILE).is_file():
        return HFTokenizer(path / HF_TOKENIZER_FILE, applies_post_processor(path))
    raise MoeserveError(f"{str(path)!r} has no tokenizer: looked for {HF_TOKENIZER_FILE} (Hugging Face) and "
                        f"{BYTE_TOKENIZER_FILE} (byte-level) in it")


def applies_post_processor(path: Path) -> bool:
    """Whether transformers' AutoTokenizer applies tokenizer.json's post-processor for the checkpoint at `path`:
    yes, unless its tokenizer class is one of NO_SPECIAL_TOKEN_CLASSES."""
    tokenizer_class = _json_entry(path / "tokenizer_config.json", "tokenizer_class")
    if tokenizer_class is None:
        return _json_entry(path / "config.json", "model_type") not in NO_SPECIAL_TOKEN_MODEL_TYPES
    return tokenizer_class not in NO_SPECIAL_TOKEN_CLASSES


def read_json_object(file: Path) -> dict | None:
    """The JSON object in `file` (a checkpoint's config files): None when the file is absent or holds no object;
    a file that does not parse raises, naming it."""
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoeserveError(f"cannot read {file}: {e}") from None
    return data if isinstance(data, dict) else None


def _json_entry(file: Path, key: str):
    """`key` of the JSON object in `file` (None when the file, or the key, is absent)."""
    return (read_json_object(file) or {}).get(key)


def read_byte_tokenizer(file: Path) -> ByteTokenizer:
    """A byte_tokenizer.json ({"type": "bytes", "bos_id": int, "eos_id": int}); anything else raises."""
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoeserveError(f"cannot read tokenizer {file}: {e}") from None
    ids = [cfg.get(k) for k in ("bos_id", "eos_id")] if isinstance(cfg, dict) else None
    if not ids or cfg.get("type", "bytes") != "bytes" or not all(type(i) is int and i >= 256 for i in ids):
        raise MoeserveError(f'{file} is not a byte tokenizer: it must hold {{"type": "bytes", "bos_id": N, '
                            f'"eos_id": N}} with ids >= 256')
    return ByteTokenizer(*ids)
