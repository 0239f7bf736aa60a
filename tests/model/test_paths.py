"""Execution paths (model/paths.py): every component names its path from the tables, runs the path it names, and
`moeserve info --explain` / MOESERVE_LOG=debug report them. GPU paths: tests/model/test_gpu_paths.py."""

import json
import logging

import pytest
import torch

import moeserve
from moeserve.cli import main
from moeserve.kernels.cpu import gemv as cpu_gemv
from moeserve.model.experts import ResidentExperts
from moeserve.model.paths import EXPERT_PATHS, GRAPH_SAFE, LINEAR_PATHS, ROUTER_PATHS, explain


@pytest.fixture(scope="module")
def rtn_dir(byte_model_dir, tmp_path_factory):
    """The byte model quantized to 4 bits (RTN, no compensators)."""
    out = tmp_path_factory.mktemp("rtn") / "q4"
    assert main(["quantize", "--model", str(byte_model_dir), "--out", str(out), "--bits", "4", "--group", "32",
                 "--method", "rtn", "--ranks", "uniform:0", "--device", "cpu"]) == 0
    return out


def test_tables_are_disjoint_where_they_must_be():
    assert GRAPH_SAFE <= set(EXPERT_PATHS)
    assert "loop" not in GRAPH_SAFE and "offload" not in GRAPH_SAFE and "cpu_lowbit" not in GRAPH_SAFE
    assert set(ROUTER_PATHS) == {"triton_topk", "torch"} and set(LINEAR_PATHS) == {"skinny", "torch"}


def test_explain_cpu_resident_and_shared_expert(hf_checkpoints):
    model = moeserve.load_model(hf_checkpoints["qwen2_moe"][1], dtype=torch.float32)
    layers = explain(model, (1, 9))
    assert [p.layer for p in layers] == list(range(model.spec.num_layers))
    assert [p.router is not None for p in layers] == list(model.spec.moe.layers)
    for p in layers:
        assert p.attention == {1: "torch", 9: "torch"}
        assert p.ffn == {1: "torch", 9: "torch"}  # a dense layer's FFN, or the shared expert's projections
        if p.router is not None:
            assert p.router == {1: "torch", 9: "torch"} and p.experts == {1: "loop", 9: "loop"}
        else:
            assert p.experts is None
    assert not all(model.spec.moe.layers), "the tiny Qwen2-MoE has a dense layer to explain"


def test_quantized_cpu_path_is_the_one_that_runs(rtn_dir, monkeypatch):
    """cpu_lowbit is named where the generated kernels read the layout, and then the kernels compute the experts."""
    model = moeserve.load_model(rtn_dir, device="cpu", dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(1, model.spec.hidden_size)
    if cpu_gemv.default_kernel(experts.gate_up[0].bits) is None:
        pytest.skip("no C compiler for the generated CPU kernels here")
    assert experts.kernel_path(x, 1) == "cpu_lowbit"
    calls = []
    real = cpu_gemv.quantized_linear

    def counted(layer, rows):
        y = real(layer, rows)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(cpu_gemv, "quantized_linear", counted)
    model(torch.tensor([[1, 2, 3]]))
    assert calls and all(calls)


def test_resident_loop_is_the_path_on_cpu(monkeypatch):
    ex = ResidentExperts(4, 8, 6)
    with torch.no_grad():
        ex.gate_up_proj.normal_(), ex.down_proj.normal_()
    x = torch.randn(3, 8)
    assert ex.kernel_path(x, 3) == "loop"
    ran = []
    monkeypatch.setattr(ResidentExperts, "expert_ffn", lambda self, e, rows: ran.append(e) or rows)
    ex(x, torch.tensor([[0, 1], [1, 2], [0, 3]]), torch.rand(3, 2))
    assert sorted(ran) == [0, 1, 2, 3]


def test_info_explain_table_and_json(capsys, byte_model_dir):
    assert main(["info", "--explain", "--model", str(byte_model_dir), "--device", "cpu", "--tokens", "1,40"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("execution paths on cpu, float32; decode step as a CUDA graph: batch 1 no, batch 40 no")
    assert out[1].split() == ["layers", "tokens", "attention", "q/k/v", "router", "experts", "dense", "FFN", "/",
                              "shared"]
    assert out[2].split() == ["0-1", "1", "torch", "torch", "loop", "-"]  # the two layers share one row
    assert out[3].split() == ["40", "torch", "torch", "loop", "-"]
    assert any(line.startswith("loop: per-expert loop") for line in out)
    assert main(["info", "--explain", "--json", "--model", str(byte_model_dir), "--tokens", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cuda_graph_decode"] == {"2": False}
    assert [layer["experts"] for layer in report["layers"]] == [{"2": "loop"}] * 2


@pytest.mark.parametrize("argv,message", [
    (["info", "--explain", "--tokens", "1,x"], "--tokens must be positive integers"),
    (["info", "--explain", "--tokens", "0"], "--tokens must be positive integers"),
    (["info", "--tokens", "4"], "add --explain"),
    (["info", "--device", "cpu"], "add --explain"),
])
def test_info_explain_bad_input(expect_cli_error, argv, message):
    expect_cli_error(argv, message)


def test_debug_log_names_each_layers_path_once(caplog, monkeypatch, byte_model_dir):
    monkeypatch.setenv("MOESERVE_LOG", "debug")
    logger = logging.getLogger("moeserve")
    try:
        with caplog.at_level(logging.DEBUG, logger="moeserve"):
            assert main(["generate", "--model", str(byte_model_dir), "--device", "cpu", "--greedy", "ab",
                         "--max-new-tokens", "3", "--ignore-eos"]) == 0
    finally:
        logger.setLevel(logging.NOTSET)
    lines = [r.getMessage() for r in caplog.records if r.name == "moeserve.model.moe"]
    assert lines == [f"layer {i}, {t} tokens on cpu: experts loop" for t in (3, 1) for i in (0, 1)]  # BOS + 2 bytes, then decode
