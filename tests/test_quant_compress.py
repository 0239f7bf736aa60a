"""Compressed checkpoints: quantize -> write -> load gives the in-memory quantized model; resumable; errors."""

import json

import pytest
import torch

import moeserve
from moeserve.cli import main
from moeserve.errors import MoeserveError
from moeserve.quant import compress
from moeserve.quant.compress import MANIFEST, QuantConfig, linear_tensors, quantize_checkpoint, quantize_tensor
from moeserve.quant.qlinear import QuantizedExperts, QuantizedLinear


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


def test_8bit_rtn_matches_float_model(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["qwen2_moe"]  # shared expert, dense layer, qkv bias
    quantize_checkpoint(path, tmp_path / "q8", QuantConfig(bits=8, group=8, method="rtn"), progress=False)
    q = moeserve.load_model(tmp_path / "q8")
    f = moeserve.load_model(path)
    assert isinstance(q.model.layers[0].self_attn.q_proj, QuantizedLinear)
    assert isinstance(q.model.layers[0].mlp.experts, QuantizedExperts)
    tokens = torch.randint(3, 97, (2, 11))
    a, b = logits(q, tokens), logits(f, tokens)
    assert ((a - b).norm() / b.norm()) < 0.02
    downgrade_manifest(tmp_path / "q8")  # format 1 differs only at 3 bits: still read
    assert torch.equal(logits(moeserve.load_model(tmp_path / "q8"), tokens), a)


def downgrade_manifest(path):
    """Mark a compressed checkpoint as written by the first format (3-bit codes packed in order)."""
    f = path / MANIFEST
    f.write_text(json.dumps({**json.loads(f.read_text()), "format": "moeserve-quant-1"}))


@pytest.mark.parametrize("method,ranks,cbits", [("hqq", "", 16), ("milo", "dense=16,experts=kurtosis:8", 8),
                                                ("milo", "uniform:8", 3)])
def test_checkpoint_round_trip_equals_in_memory_quantized_model(hf_checkpoints, tmp_path, method, ranks, cbits):
    _, path = hf_checkpoints["mixtral"]
    cfg = QuantConfig(bits=3, group=16, method=method, ranks=ranks or "uniform:0", compensator_bits=cbits)
    manifest = quantize_checkpoint(path, tmp_path / "q", cfg, progress=False)
    assert json.loads((tmp_path / "q" / MANIFEST).read_text())["method"] == method
    loaded = moeserve.load_model(tmp_path / "q")
    # the same quantization done in memory, module by module
    ref = moeserve.load_model(path)
    for name, t in manifest["tensors"].items():
        if t["kind"] == "expert":
            continue
        module = ref.get_submodule(name)
        parent, leaf = name.rsplit(".", 1)
        setattr(ref.get_submodule(parent), leaf, quantize_tensor(module.weight, cfg, t["rank"], module.bias))
    for i, layer in enumerate(ref.model.layers):
        ex = layer.mlp.experts
        stack = f"model.layers.{i}.mlp.experts"
        gate_up = [quantize_tensor(ex.gate_up_proj[e], cfg, manifest["tensors"][f"{stack}.gate_up.{e}"]["rank"], None)
                   for e in range(ex.num_experts)]
        down = [quantize_tensor(ex.down_proj[e], cfg, manifest["tensors"][f"{stack}.down.{e}"]["rank"], None)
                for e in range(ex.num_experts)]
        layer.mlp.experts = QuantizedExperts(gate_up, down)
    tokens = torch.randint(3, 97, (2, 9))
    assert (logits(loaded, tokens) - logits(ref, tokens)).abs().max() < 1e-4
    if method == "milo":
        assert any(t["rank"] > 0 for t in manifest["tensors"].values())
    downgrade_manifest(tmp_path / "q")  # its 3-bit codes would be read in the wrong order: refused, by name
    with pytest.raises(MoeserveError, match="moeserve quantize"):
        moeserve.load_model(tmp_path / "q")


def test_interrupted_run_resumes_without_redoing_layers(hf_checkpoints, tmp_path, monkeypatch):
    _, path = hf_checkpoints["olmoe"]
    cfg = QuantConfig(bits=4, group=8, method="rtn")
    real = compress.quantize_tensor
    spec = moeserve.ModelSpec.from_dir(path)
    per_layer = len([t for t in linear_tensors(spec) if t.layer == 0])
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == per_layer + 3:  # dies inside layer 1
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(compress, "quantize_tensor", flaky)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(path, tmp_path / "q", cfg, progress=False)
    assert not (tmp_path / "q").exists() and (tmp_path / "q.partial" / "layer-00000.safetensors").is_file()
    calls["n"] = -10**9  # no more failures; count what the resumed run does
    quantize_checkpoint(path, tmp_path / "q", cfg, progress=False)
    assert calls["n"] + 10**9 == (spec.num_layers - 1) * per_layer  # layer 0 is not redone
    assert not (tmp_path / "q.partial").exists()
    moeserve.load_model(tmp_path / "q")


@pytest.mark.parametrize("kw,message", [
    (dict(bits=5), "bit width"), (dict(group=7), "group size"), (dict(method="gptq"), "method"),
    (dict(method="milo", ranks="uniform:4096"), "larger than"), (dict(compensator_bits=4), "compensator"),
    (dict(method="milo", ranks="experts=zipf:3"), "signal"),
    (dict(method="milo", ranks="experts=kurtosis:x"), "rank value"), (dict(skip=("mlp",)), "cannot skip"),
])
def test_bad_settings_fail_before_writing(hf_checkpoints, tmp_path, kw, message):
    _, path = hf_checkpoints["mixtral"]
    with pytest.raises(MoeserveError, match=message):
        quantize_checkpoint(path, tmp_path / "q", QuantConfig(**{"group": 16, **kw}), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_cli_quantize_refuses_existing_output_then_runs_with_force(capsys, byte_model_dir, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    argv = ["quantize", "--model", str(byte_model_dir), "--out", str(out), "--bits", "4", "--group", "16",
            "--method", "hqq", "--device", "cpu"]
    assert main(argv) == 2 and "exists" in capsys.readouterr().err
    assert main(argv + ["--force"]) == 0
    assert main(["eval", "ppl", "--model", str(out), "--window", "32"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"] > 1


def test_cli_frequency_ranks_follow_routing_counts(capsys, byte_model_dir, tmp_path):
    out = tmp_path / "qf"
    argv = ["quantize", "--model", str(byte_model_dir), "--out", str(out), "--bits", "3", "--group", "16",
            "--method", "milo", "--ranks", "experts=frequency:4", "--compensator-bits", "3", "--device", "cpu"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["bytes"] < summary["source_bytes"]
    tensors = json.loads((out / MANIFEST).read_text())["tensors"]
    expert_ranks = [t["rank"] for t in tensors.values() if t["kind"] == "expert"]
    assert sum(expert_ranks) == 4 * len(expert_ranks) and len(set(expert_ranks)) > 1
    assert all(t["rank"] == 0 for t in tensors.values() if t["kind"] != "expert")
    assert main(["generate", "--model", str(out), "--max-new-tokens", "5", "--greedy"]) == 0


def test_cli_quantize_missing_frequency_text(capsys, hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["mixtral"]
    argv = ["quantize", "--model", str(path), "--out", str(tmp_path / "q"), "--group", "16",
            "--ranks", "experts=frequency:4"]
    assert main(argv) == 2 and "--frequency-text" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
