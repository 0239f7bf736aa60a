"""bench/quality.py on a tiny `--arch wide --quick` model the trainer makes in seconds: the in-memory rows give the
bytes and logits of the checkpoints `moeserve quantize` writes, every kind of row runs and lands in the record and
the generated page, and the full row list of a wide model."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import moeserve
from moeserve.compress import QuantConfig, quantize_checkpoint
from moeserve.spec import ModelSpec
from moeserve.train.arch import WIDE
from moeserve.train.run import main as train_main

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import quality  # noqa: E402
import quant_eval  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer wide-architecture model trained 30 steps on 150 generated Python files (no Shakespeare)."""
    root = tmp_path_factory.mktemp("quality")
    rng = random.Random(0)
    words = "def return self value None for in if else import class yield lambda with as try".split()
    for n in range(150):
        (root / "code").mkdir(exist_ok=True)
        (root / "code" / f"mod{n}.py").write_text("\n".join(
            f"def f{i}(x):\n    return {' '.join(rng.choice(words) for _ in range(8))}\n" for i in range(20)))
    out = root / "tiny-wide"
    assert train_main(["--arch", "wide", "--quick", "--code", str(root / "code"), "--no-shakespeare", "--out",
                       str(out), "--device", "cpu"]) == 0
    return out


def checkpoint_tensor_bytes(path: Path) -> int:
    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            total += sum(st.get_tensor(k).numel() * st.get_tensor(k).element_size() for k in st.keys())
    return total


def test_in_memory_rows_equal_the_quantized_checkpoint(tiny_model, tmp_path):
    """MiLo with INT3 compensators by kurtosis (the HQQ, rank and compensator paths at once)."""
    method = quant_eval.Method("milo-3 g32 kurtosis int3", "milo", 3, 32, "all=kurtosis:6KB", 3)
    w = quant_eval.Weights(moeserve.load_model(tiny_model, device="cpu", dtype=torch.float32))
    cal = quant_eval.calibrate(w, [method], None, 4)
    total, comp = quant_eval.APPLY[method.kind](w, method, cal)
    out = tmp_path / "q"
    quantize_checkpoint(tiny_model, out, QuantConfig(bits=3, group=32, method="milo", ranks=method.ranks,
                                                     compensator_bits=3), progress=False)
    assert total == checkpoint_tensor_bytes(out) and comp > 0
    loaded = moeserve.load_model(out, device="cpu", dtype=torch.float32)
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = w.model(tokens), loaded(tokens)
    assert (ours - theirs).abs().max() < 1e-3 * theirs.abs().max()
    w.restore()
    fresh = moeserve.load_model(tiny_model, device="cpu", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(w.model.parameters(), fresh.parameters()))


def test_hobbit_rule_reads_fewer_expert_bytes_and_all_high_is_the_float_model(tiny_model):
    w = quant_eval.Weights(moeserve.load_model(tiny_model, device="cpu", dtype=torch.float32))
    windows = torch.randint(0, 320, (4, 33), generator=torch.Generator().manual_seed(1))
    hobbit = quant_eval.Hobbit(w)
    ref = quant_eval.score(w.model, windows, 2)
    high = quant_eval.run_method(w, quant_eval.Method("all high", "hobbit", 16), None, hobbit, windows, 2)
    assert high["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-6) and high["high_share"] == 1
    low = quant_eval.run_method(w, quant_eval.Method("all low", "hobbit", 16, t1=0.0, t2=1.0), None, hobbit,
                                windows, 2)
    assert low["high_share"] == pytest.approx(0.5) and low["low_share"] == pytest.approx(0.5)  # top-1 stays high
    assert 0.5 < low["expert_bytes_read_vs_bf16"] < 0.7 and low["perplexity"] != ref["perplexity"]
    assert w.model.model.layers[0].mlp.experts is hobbit.float[0]  # the float experts are back


def test_quality_quick_on_a_trained_model(tiny_model, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "bench/quality.py", "--quick", "--model", str(tiny_model), "--out",
                           str(tmp_path / "out"), "--docs", str(tmp_path / "docs")], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = (tmp_path / "out").glob("quality-quick-*.json")
    rec = json.loads(path.read_text())
    assert "partial" not in rec  # the per-row rewrites (partial) end in the whole record
    rows = {r["label"]: r for r in rec["rows"]}
    assert {r["method"] for r in rec["rows"]} == {"bf16", "hqq", "rtn", "gptq", "milo", "mxfp4", "dense8", "hobbit"}
    assert rec["config"]["calibration"].endswith(" training files")
    assert all(r["perplexity"] > 1 and 0 <= r["accuracy"] <= 1 and r["bytes"] > 0 for r in rec["rows"])
    ref = rows["bf16"]
    assert ref["bytes"] == 2 * ModelSpec.from_dir(tiny_model).parameter_counts()["total"]
    assert rows["hqq-3 g32"]["bytes"] < rows["experts mxfp4"]["bytes"] < rows["dense 8-bit (--dense-bits 8)"][
        "bytes"] < ref["bytes"]
    milo = rows["milo-3 g32 frequency +5% int3"]
    assert 0 < milo["memory_added_vs_hqq"] <= 0.05 and "gap_recovered_vs_hqq" in milo
    mixed = rows["hobbit T1=0.6 T2=0.9 (--mixed-precision)"]
    assert mixed["high_share"] + mixed["low_share"] + mixed["skipped_share"] == pytest.approx(1)
    page = (tmp_path / "docs" / "tiny-wide.md").read_text()
    assert "## Targets" in page and "| hqq-3 g32 |" in page and "tiny-wide.svg" in page
    assert (tmp_path / "docs" / "tiny-wide.svg").read_text().startswith("<svg")


def test_rows_of_the_wide_model():
    spec = ModelSpec.from_hf_config(WIDE.with_bpe().hf_config(1024))
    total = 2 * spec.parameter_counts()["total"]
    labels = [m.label for m in quality.table_methods(spec, total, quick=False)]
    assert labels[:3] == ["bf16", "rtn-8 g64", "hqq-8 g64"] and "hqq-2 g128" in labels
    gptq = sorted(x for x in labels if x.startswith("gptq"))
    assert gptq == ["gptq-3 g128", "gptq-3 g64", "gptq-4 g128", "gptq-4 g64"]
    assert labels.index("gptq-3 g64") < labels.index("milo-2 g64 uniform +10% int8")  # the 3-bit comparison first
    milo = [x for x in labels if x.startswith("milo")]
    assert len(milo) == 19 and "milo-3 g64 kurtosis +3% int3" in milo and "milo-2 g64 uniform +10% int8" in milo
    assert "hobbit T1=0.6 T2=0.9 (--mixed-precision)" in labels and "experts mxfp4" in labels
    assert len(labels) == 1 + 16 + 4 + 19 + 2 + 9
    hqq3 = quality.grid_bytes(spec, total, 3, 64)
    assert 0.22 * total < hqq3 < 0.25 * total  # 3 bits + two fp16 per 64 of 16 bits, the embeddings kept
