"""Execution paths on a CUDA GPU (model/paths.py): what `info --explain` says each layer runs, and that the named path
is the one that runs. Skipped without a GPU."""

import json

import pytest
import torch

import moeserve
from moeserve.cli import DEMO_DIR, main
from moeserve.engine.cuda_graph import graph_safe
from moeserve.model.experts import grouped_mm_available
from moeserve.model.paths import explain
from moeserve.model.router import TopKRouter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_bf16_demo_paths():
    model = moeserve.load_model(DEMO_DIR, device="cuda", dtype=torch.bfloat16)
    D, F = model.spec.hidden_size, model.spec.moe.expert_ffn
    for p in explain(model, (1, 512)):
        assert p.attention == {1: "skinny", 512: "torch"}
        assert p.router == {1: "triton_topk", 512: "torch"}
        assert p.experts[1] == "fused"  # the untuned default covers decode sizes on every GPU
        probe = torch.empty(512, D, device="cuda", dtype=torch.bfloat16)
        assert p.experts[512] in ({"grouped_mm"} if grouped_mm_available(probe, D, F) else {"tiles", "loop"})
    assert graph_safe(model, 1)


def test_quantized_paths_and_the_router_prepares_x(tmp_path, monkeypatch):
    out = tmp_path / "q4"
    assert main(["quantize", "--out", str(out), "--bits", "4", "--method", "rtn", "--ranks", "uniform:0"]) == 0
    model = moeserve.load_model(out, device="cuda", dtype=torch.bfloat16)
    for p in explain(model, (1, 8, 100)):
        assert p.experts == {1: "lowbit_slots", 8: "lowbit_sorted", 100: "loop"}
    assert graph_safe(model, 8) and not graph_safe(model, 100)
    prepared = []
    real = TopKRouter.forward
    monkeypatch.setattr(TopKRouter, "forward", lambda self, x, prep=None: prepared.append(prep is not None)
                        or real(self, x, prep))
    model(torch.tensor([[1]], device="cuda"))  # one token: lowbit_slots, x prepared by the router's launch
    assert prepared and all(prepared)


def test_info_explain_on_the_gpu(capsys):
    assert main(["info", "--explain", "--json", "--device", "cuda", "--tokens", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"].startswith("cuda") and report["cuda_graph_decode"] == {"1": True}
    assert {layer["experts"]["1"] for layer in report["layers"]} == {"fused"}
