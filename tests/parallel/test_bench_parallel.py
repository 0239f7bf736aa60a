"""bench/parallel.py --layouts --quick: the whole-model layout comparison the GPUs run, as a smoke run on 2 gloo CPU
ranks over a tiny random checkpoint; one complete result JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

BENCH = Path(__file__).resolve().parents[2] / "bench" / "parallel.py"


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_layouts_quick_writes_one_result(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--layouts", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = tmp_path.glob("parallel_layouts-quick-*.json")
    r = json.loads(path.read_text())
    assert r["config"]["backend"] == "gloo" and r["device"] and r["date"]
    assert [(x["layout"], x["tp"], x["ep"]) for x in r["layouts"]] == [("single", 1, 1), ("ep2", 1, 2), ("tp2", 2, 1)]
    whole = r["layouts"][0]["load"][0]["bytes_read"]
    for x in r["layouts"]:
        assert "error" not in x, x
        assert len(x["load"]) == x["ranks"] and all(rank["seconds"] > 0 for rank in x["load"])
        assert x["prefill"]["tok_s"] > 0
        assert [(d["batch"], d["cuda_graph"]) for d in x["decode"]] == [(1, False), (4, False)]
        assert all(d["tok_s"] > 0 for d in x["decode"])
    ep_reads = [rank["bytes_read"] for rank in r["layouts"][1]["load"]]
    assert ep_reads[0] == ep_reads[1] < whole  # half the experts each, not the checkpoint
    assert [s["layout"] for s in r["speedup_over_single"]] == ["ep2", "tp2"]
