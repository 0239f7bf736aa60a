"""The wide model's corpus: Python source files (by default the standard library of the Python that runs the
trainer) and the Shakespeare texts, with held-out FILES the model never trains on, and a byte-level BPE tokenizer
fitted on the training files alone.

Held-out files are chosen by a hash of their text (sha256, HELDOUT_PER_MILLE of every thousand), so the split is
the same on every machine that has the same files and needs no list, and a file copied under two paths (a
vendored module) falls on one side only; later copies of a text already read are left out. Hamlet (both
spellings) is held out of the Shakespeare texts as for every model (data.py). Files are read in sorted path order,
as UTF-8 with \\n line endings; files that are not UTF-8, empty, or larger than MAX_FILE_BYTES (generated tables)
are left out of both sides. The BPE is fitted on at most BPE_FIT_CHARS of the training text (documents evenly
spread over it), which keeps fitting under a minute on a large corpus.
"""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from moeserve.errors import MoeserveError
from moeserve.train.data import load_corpus, read_text

HELDOUT_PER_MILLE = 20  # 2% of the code files
MAX_FILE_BYTES = 1 << 20
BPE_FIT_CHARS = 48_000_000
CODE_SUFFIXES = (".py",)
SKIP_DIRS = ("site-packages", "__pycache__", "dist-packages")
BOS, EOS = "<s>", "</s>"  # the BPE tokenizer's special tokens, ids 0 and 1


@dataclass(frozen=True)
class CodeCorpus:
    train: list[str]  # documents, code files then Shakespeare texts, each in sorted name order
    names: list[str]  # their names: "code/<root index>/<relative path>" or "shakespeare/<file>"
    heldout: list[str]  # held-out documents, in the same order
    heldout_names: list[str]

    def heldout_text(self) -> str:
        """The held-out documents as one text (heldout.txt of the model), separated by blank lines."""
        return "\n\n".join(self.heldout)


def default_code_roots() -> list[Path]:
    """The standard library of the running Python (site-packages excluded by SKIP_DIRS)."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def text_digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def is_heldout(digest: bytes) -> bool:
    """The deterministic split: a file is held out when its text's sha256 falls in the first HELDOUT_PER_MILLE of
    1000 buckets."""
    return int.from_bytes(digest[:8], "little") % 1000 < HELDOUT_PER_MILLE


def code_files(root: Path) -> list[Path]:
    """The source files under root, sorted, outside SKIP_DIRS."""
    return sorted(p for p in root.rglob("*") if p.suffix in CODE_SUFFIXES and p.is_file()
                  and not any(part in SKIP_DIRS for part in p.relative_to(root).parts))


def read_source(path: Path) -> str | None:
    """A source file's text, or None when it is left out (see the module docstring)."""
    if path.stat().st_size > MAX_FILE_BYTES:
        return None
    try:
        text = read_text(path)
    except (UnicodeDecodeError, OSError):
        return None
    return text if text.strip() else None


def load_code_corpus(code_roots: list[Path] | None = None, texts: str | Path | None = None,
                     shakespeare: bool = True) -> CodeCorpus:
    """Every code file under code_roots (default: the standard library) and, with shakespeare, the Shakespeare
    texts (data.load_corpus: `texts` or the installed package), split into training and held-out documents."""
    roots = default_code_roots() if code_roots is None else [Path(r) for r in code_roots]
    train, names, heldout, heldout_names = [], [], [], []
    seen: set[bytes] = set()
    for i, root in enumerate(roots):
        if not root.is_dir():
            raise MoeserveError(f"code directory {str(root)!r} does not exist")
        for path in code_files(root):
            text = read_source(path)
            digest = None if text is None else text_digest(text)
            if digest is None or digest in seen:
                continue
            seen.add(digest)
            relative = path.relative_to(root).as_posix()
            docs, doc_names = (heldout, heldout_names) if is_heldout(digest) else (train, names)
            docs.append(text)
            doc_names.append(f"code/{i}/{relative}")
    if shakespeare:
        plays = load_corpus(texts)
        train += plays.train
        names += [f"shakespeare/{n}" for n in plays.names]
        heldout.append(plays.heldout)
        heldout_names.append("shakespeare/hamlet_gut.txt")
    if not train or not heldout:
        raise MoeserveError(f"the code corpus needs training and held-out files; found {len(train)} and "
                            f"{len(heldout)} under {', '.join(map(str, roots))}")
    return CodeCorpus(train, names, heldout, heldout_names)


class BpeTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` (BOS id 0 added before every encoded text, EOS id 1) and the files a
    checkpoint holds it in: tokenizer.json, which moeserve and transformers read, and tokenizer_config.json."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def fit(cls, docs: list[str], vocab_size: int) -> "BpeTokenizer":
        """Fitted on docs (at most BPE_FIT_CHARS of them, evenly spread): any text encodes (byte-level), code's
        whitespace included."""
        step = max(1, math.ceil(sum(map(len, docs)) / BPE_FIT_CHARS))
        docs = docs[::step]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> "BpeTokenizer":
        return cls(Tokenizer.from_file(str(path / "tokenizer.json")))

    def save(self, path: Path) -> None:
        self.tokenizer.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
             "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}, indent=2) + "\n")


def encode_with_bpe(tok, docs: list[str]) -> torch.Tensor:
    """[N] int64: each document as BOS, its tokens, EOS (encoded in parallel by the tokenizers library)."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.int64)
