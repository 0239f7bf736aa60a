"""Compressed checkpoints: quantize -> write -> load gives the in-memory quantized model; resumable; errors."""

import json
import shutil

import pytest
import torch

import moeserve
from moeserve.cli import main
from moeserve.errors import MoeserveError
from moeserve.kernels.pack import units_from_planar
from moeserve import compress
from moeserve.compress import QuantConfig, linear_tensors, quantize_checkpoint, quantize_tensor
from moeserve.quant.manifest import FORMAT, MANIFEST, UNITS_FORMAT
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


def downgrade_manifest(path, found="moeserve-quant-1"):
    """Mark a compressed checkpoint as written by an earlier format (default the first: 3-bit codes in order)."""
    f = path / MANIFEST
    f.write_text(json.dumps({**json.loads(f.read_text()), "format": found}))


def test_format_2_checkpoint_loads_its_3bit_rows_unit_after_unit(hf_checkpoints, tmp_path):
    """Format 2 stored 3-bit weights and INT3 compensator codes unit after unit: made word-planar on load, so the
    model computes exactly what the format-3 checkpoint does (and would not, read as format 3)."""
    from safetensors.torch import load_file, save_file

    _, path = hf_checkpoints["mixtral"]
    cfg = QuantConfig(bits=3, group=16, method="milo", ranks="uniform:4", compensator_bits=3)
    quantize_checkpoint(path, tmp_path / "q3", cfg, progress=False)
    shutil.copytree(tmp_path / "q3", tmp_path / "q2")
    moved = set()  # buffers whose words the rewrite moved (rows of one unit are the same in both layouts)
    for shard in (tmp_path / "q2").glob("*.safetensors"):
        state = load_file(shard)
        for name, t in state.items():
            if name.rsplit(".", 1)[1] in ("qweight", "comp_u_q", "comp_v_q"):
                state[name] = units_from_planar(t)
                if not torch.equal(state[name], t):
                    moved.add(name.rsplit(".", 1)[1])
        save_file(state, shard)
    assert moved == {"qweight", "comp_u_q", "comp_v_q"}
    tokens = torch.randint(3, 97, (2, 9))
    expected = logits(moeserve.load_model(tmp_path / "q3"), tokens)
    assert not torch.allclose(logits(moeserve.load_model(tmp_path / "q2"), tokens), expected)  # read as format 3
    downgrade_manifest(tmp_path / "q2", "moeserve-quant-2")
    assert torch.equal(logits(moeserve.load_model(tmp_path / "q2"), tokens), expected)


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


@pytest.mark.parametrize("first_format", [FORMAT, UNITS_FORMAT])
def test_interrupted_run_resumes_without_redoing_layers(hf_checkpoints, tmp_path, monkeypatch, first_format):
    """A run interrupted by this moeserve resumes; one left by a moeserve of another format starts over."""
    _, path = hf_checkpoints["olmoe"]
    cfg = QuantConfig(bits=3, group=8, method="rtn")
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
    current = FORMAT
    monkeypatch.setattr(compress, "FORMAT", first_format)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(path, tmp_path / "q", cfg, progress=False)
    assert not (tmp_path / "q").exists() and (tmp_path / "q.partial" / "layer-00000.safetensors").is_file()
    monkeypatch.setattr(compress, "FORMAT", current)
    calls["n"] = -10**9  # no more failures; count what the resumed run does
    quantize_checkpoint(path, tmp_path / "q", cfg, progress=False)
    redone = 0 if first_format == current else 1  # layer 0 of another format's job is quantized again
    assert calls["n"] + 10**9 == (spec.num_layers - 1 + redone) * per_layer
    assert not (tmp_path / "q.partial").exists()
    moeserve.load_model(tmp_path / "q")


@pytest.mark.parametrize("kw,message", [
    (dict(bits=5), "bit width"), (dict(group=7), "group size"), (dict(method="gptq"), "method"),
    (dict(group=0), "positive"), (dict(group=-64), "positive"), (dict(compensator_bits=4), "compensator"),
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


def shards(path) -> dict:
    from safetensors.torch import load_file

    return {f.name: load_file(f) for f in sorted(path.glob("*.safetensors"))}


def test_resume_with_another_checkpoint_of_the_same_architecture_redoes_every_layer(byte_model_dir, tmp_path,
                                                                                    monkeypatch):
    """Same config and headers, other weights: the finished shards of the first model are proven foreign by their
    data digests and quantized again, so the output equals a fresh quantization of the second model."""
    from hf_models import save_byte_model

    twin = save_byte_model(tmp_path / "twin", seed=1)
    cfg = QuantConfig(bits=8, group=16, method="rtn")
    per_layer = len([t for t in linear_tensors(moeserve.ModelSpec.from_dir(twin)) if t.layer == 0])
    real, calls = compress.quantize_tensor, {"n": 0}

    def dies_in_layer_1(*args, **kw):
        calls["n"] += 1
        if calls["n"] == per_layer + 1:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(compress, "quantize_tensor", dies_in_layer_1)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(byte_model_dir, tmp_path / "q", cfg, progress=False)
    assert (tmp_path / "q.partial" / "layer-00000.safetensors").is_file()
    calls["n"] = -10**9
    manifest = quantize_checkpoint(twin, tmp_path / "q", cfg, progress=False)
    assert calls["n"] + 10**9 == 2 * per_layer  # both layers quantized from the twin
    monkeypatch.undo()
    fresh = quantize_checkpoint(twin, tmp_path / "fresh", cfg, progress=False)
    a, b = shards(tmp_path / "q"), shards(tmp_path / "fresh")
    assert a.keys() == b.keys() and all(torch.equal(a[f][k], b[f][k]) for f in a for k in a[f])
    assert manifest["source"]["sha256"] == fresh["source"]["sha256"]
    assert manifest["source"]["sha256"] != compress.headers_fingerprint(twin)  # covers the data, not only headers


def test_default_ranks_fit_small_matrices_with_one_note(capsys, tmp_path, monkeypatch):
    """`moeserve quantize` with the default method and ranks (milo, dense=512) on a model of 64-wide matrices:
    ranks are clamped to the matrices with one note line, and the checkpoint loads and generates."""
    from hf_models import save_byte_model
    from moeserve.kernels.cpu import gemv

    model = save_byte_model(tmp_path / "wide", hidden=64, ffn=64)
    assert main(["quantize", "--model", str(model), "--out", str(tmp_path / "q"), "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    notes = [line for line in err.replace("\r", "\n").splitlines() if "moeserve: note:" in line]
    assert len(notes) == 1 and "clamped the rank of 8 tensor(s)" in notes[0] and "512 -> 32" in notes[0], err
    tensors = json.loads((tmp_path / "q" / MANIFEST).read_text())["tensors"]
    assert {n.rsplit(".", 1)[1]: t["rank"] for n, t in tensors.items() if t["kind"] == "attention"} == {
        "q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64}  # 512 asked, min(out, in) given
    assert json.loads(out)["tensors"] == 24
    monkeypatch.setenv("MOESERVE_CPU_KERNELS", "0")  # the PyTorch path: no kernel compile and tuning (seconds)
    gemv.default_kernel.cache_clear()
    try:
        assert main(["generate", "--model", str(tmp_path / "q"), "--max-new-tokens", "4", "--greedy"]) == 0
    finally:
        gemv.default_kernel.cache_clear()
