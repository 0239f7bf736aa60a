"""`--gpu-memory` planning and `moeserve bench` with the model on a GPU (the demo model); skipped without one.

The plan uses this machine's hardware profile (measured quickly into the test cache on first use)."""

import json
import re

import pytest
import torch

import moeserve
from moeserve.cli import main
from moeserve.plan.footprint import Precision, expert_bytes
from moeserve.plan.placement import PlanRequest, dense_minimum
from moeserve.spec import ModelSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GEN = ["generate", "--device", "cuda", "--greedy", "--max-new-tokens", "16", "--ignore-eos", "KING."]


@pytest.fixture(autouse=True)
def quick_profile(monkeypatch):
    monkeypatch.setenv("MOESERVE_PROFILE_QUICK", "1")


def plan_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("[plan:")]


def test_a_budget_that_holds_the_model_runs_it_resident(capsys):
    assert main(GEN) == 0
    resident = capsys.readouterr().out
    assert main(GEN + ["--gpu-memory", "1GiB"]) == 0
    captured = capsys.readouterr()
    lines = plan_lines(captured.err)
    assert len(lines) == 1 and "every expert on the GPU (bfloat16)" in lines[0]
    assert captured.out == resident


def test_a_small_budget_puts_layers_on_the_cpu_with_the_same_tokens(capsys):
    """fp32, experts and dense part kept float (--experts-bits 16 --dense-bits 16): room for 2.5 of the demo's 6
    layers' experts, so 4 layers' experts on the CPU and the rest of the room as cache slots (3-4: the model's own
    buffers count too); greedy tokens equal the resident model's."""
    spec = ModelSpec.from_dir(moeserve.DEMO_MODEL)
    fp32 = GEN + ["--dtype", "float32"]
    budget = (dense_minimum(spec, PlanRequest(None, 0, 4, "float32", 1, len("KING.") + 16))
              + int(2.5 * 8 * expert_bytes(spec, Precision.float(4)) / 0.95) + 1024)
    assert main(fp32) == 0
    resident = capsys.readouterr().out
    assert main(fp32 + ["--gpu-memory", f"{budget}B", "--experts-bits", "16", "--dense-bits", "16"]) == 0
    captured = capsys.readouterr()
    lines = plan_lines(captured.err)
    assert len(lines) == 1 and re.search(r"4/6 MoE layers' experts on the CPU \(float32\), [34] GPU cache slots",
                                         lines[0]), lines
    assert captured.out == resident and "[hybrid experts:" in captured.err
    assert main(GEN + ["--gpu-memory", "1MiB"]) == 2
    assert "cannot hold the dense part" in capsys.readouterr().err


@pytest.mark.parametrize("placement", [[], ["--cpu-moe", "--experts-bits", "4"], ["--gpu-memory", "1GiB"]])
def test_bench_on_the_gpu(capsys, placement):
    assert main(["bench", "--device", "cuda", "-p", "64", "-n", "8", "-r", "2", "--json", *placement]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cuda"
    assert all(r["tok_s"] > 0 and r["gpu_peak_bytes"] > 0 for r in report["results"])
