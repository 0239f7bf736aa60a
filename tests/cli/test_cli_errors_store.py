"""Errors a user can cause with quantize, offload-prepare and generate --offload: each is exactly one
`moeserve: error:` line, exit 2, no stdout, nothing left behind (the expect_cli_error harness), and comes
before any long work. One table: (case, setup -> argv, part of the message)."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hf_models import save_byte_model
from moeserve.offload.store import META_FILE, ExpertStore
from moeserve.compress import QuantConfig, quantize_checkpoint
from moeserve.quant.manifest import MANIFEST


@dataclass(frozen=True)
class World:
    """Checkpoints and stores the cases read (never change): `byte` is the 2-layer model the cases run."""
    byte: Path
    twin: Path  # same shapes as byte, other weights
    quantized: Path  # byte, quantized by moeserve
    store: Path  # built from byte
    twin_store: Path
    six_store: Path  # a 6-layer model of byte's widths
    wide_store: Path  # a 2-layer model of hidden 64


@pytest.fixture(scope="module")
def world(tmp_path_factory, byte_model_dir) -> World:
    root = tmp_path_factory.mktemp("world")
    twin = save_byte_model(root / "twin", seed=1)
    six = save_byte_model(root / "six", layers=6, seed=2)
    wide = save_byte_model(root / "wide", hidden=64, ffn=64, seed=3)
    stores = {}
    for name, model in (("store", byte_model_dir), ("twin_store", twin), ("six_store", six), ("wide_store", wide)):
        ExpertStore.build(model, root / name, low_bits=4, group=32, progress=False)
        stores[name] = root / name
    quantize_checkpoint(byte_model_dir, root / "q", QuantConfig(bits=8, group=16, method="rtn"), progress=False)
    return World(byte=byte_model_dir, twin=twin, quantized=root / "q", **stores)


def a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("not a directory")
    return tmp / "file"


def store_copy(w: World, tmp: Path, damage=None) -> Path:
    """A copy of byte's store in tmp, with damage(store dir) applied."""
    s = shutil.copytree(w.store, tmp / "store")
    if damage:
        damage(s)
    return s


def truncate_layer(s: Path) -> None:
    f = s / "experts-layer-00001.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def drop_meta_source(s: Path) -> None:
    meta = json.loads((s / META_FILE).read_text())
    del meta["source"]
    (s / META_FILE).write_text(json.dumps(meta))


def without_tensor(w: World, tmp: Path, name: str) -> Path:
    """byte's checkpoint lacking one tensor: read fine until the quantizer reaches it."""
    broken = shutil.copytree(w.byte, tmp / "broken")
    state = load_file(broken / "model.safetensors")
    del state[name]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    return broken


def quantized_copy(w: World, tmp: Path, manifest_text: str) -> Path:
    q = shutil.copytree(w.quantized, tmp / "q")
    (q / MANIFEST).write_text(manifest_text)
    return q


def without_source_sample(w: World, tmp: Path) -> Path:
    """The quantized checkpoint as an older moeserve wrote it: no record of its source's expert rows."""
    manifest = json.loads((w.quantized / MANIFEST).read_text())
    del manifest["source"]["experts_sample"]
    return quantized_copy(w, tmp, json.dumps(manifest))


def unrelated_dir(tmp: Path) -> Path:
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("keep me")
    return tmp / "mine"


def offload(model, store, *more):
    return ["generate", "--model", model, "--offload", store, "--max-new-tokens", "2", "--greedy", *more]


QUANTIZE = ["quantize", "--method", "rtn", "--bits", "8", "--group", "16", "--device", "cpu"]
CASES = [
    ("group 0", lambda w, t: ["quantize", "--out", t / "q", "--group", "0"], "group size must be a positive"),
    ("negative group", lambda w, t: ["quantize", "--out", t / "q", "--group", "-64"], "group size must be a positive"),
    ("empty --out", lambda w, t: [*QUANTIZE, "--model", w.byte, "--out", ""], "output path is empty"),
    ("quantize --out under a file", lambda w, t: [*QUANTIZE, "--model", w.byte, "--out", a_file(t) / "q"],
     "is a file"),
    ("offload-prepare --out under a file",
     lambda w, t: ["offload-prepare", "--model", w.byte, "--out", a_file(t) / "s"], "is a file"),
    ("quantize a quantized checkpoint", lambda w, t: [*QUANTIZE, "--model", w.quantized, "--out", t / "q"],
     "is a moeserve quantized checkpoint"),
    ("offload-prepare of a quantized checkpoint at other bits",
     lambda w, t: ["offload-prepare", "--model", w.quantized, "--out", t / "s", "--low-bits", "4"],
     "quantized checkpoint of 8-bit experts"),
    ("--force over an unrelated directory",
     lambda w, t: [*QUANTIZE, "--model", w.byte, "--out", unrelated_dir(t), "--force"],
     "replaces only a moeserve quantized checkpoint"),
    ("an error met while the progress bar runs",
     lambda w, t: [*QUANTIZE, "--model", without_tensor(w, t, "model.layers.1.self_attn.q_proj.weight"),
                   "--out", t / "q"], "lacks the tensor"),
    ("truncated layer file", lambda w, t: offload(w.byte, store_copy(w, t, truncate_layer), "--high-slots", "2"),
     "truncated"),
    ("deleted layer file", lambda w, t: offload(
        w.byte, store_copy(w, t, lambda s: (s / "experts-layer-00000.safetensors").unlink()), "--high-slots", "2"),
     "experts-layer-00000.safetensors is missing"),
    ("corrupt expert_store.json", lambda w, t: offload(
        w.byte, store_copy(w, t, lambda s: (s / META_FILE).write_text('{"layers": [0, 1], "hid')), "--high-slots", "2"),
     "expert_store.json is unreadable"),
    ("layer file of other shapes", lambda w, t: offload(w.byte, store_copy(w, t, lambda s: shutil.copy(
        w.wide_store / "experts-layer-00000.safetensors", s)), "--high-slots", "2"), "does not hold the experts"),
    ("store without a source fingerprint", lambda w, t: offload(w.byte, store_copy(w, t, drop_meta_source),
                                                                "--high-slots", "2"), "records no source fingerprint"),
    ("store of a model of other shapes", lambda w, t: offload(w.byte, w.wide_store, "--high-slots", "2"),
     "built for another model"),
    ("store of a 6-layer model", lambda w, t: offload(w.byte, w.six_store, "--high-slots", "2"), "6 layers"),
    ("store of another checkpoint of the same shapes", lambda w, t: offload(w.byte, w.twin_store, "--high-slots", "2"),
     "built from another checkpoint"),
    ("--gpu-memory beyond the RAM", lambda w, t: offload(w.byte, w.store, "--device", "cpu", "--gpu-memory",
                                                         "100000GiB"), "of RAM available"),
    ("corrupt moeserve_quant.json", lambda w, t: ["generate", "--model", quantized_copy(w, t, '{"format": "moes'),
                                                  "--max-new-tokens", "2"], "moeserve_quant.json is unreadable"),
    ("quantized checkpoint that does not record its source", lambda w, t: offload(
        without_source_sample(w, t), w.store, "--high-slots", "2"), "does not record which checkpoint"),
    ("store of another checkpoint than a quantized one's source",
     lambda w, t: offload(w.quantized, w.twin_store, "--high-slots", "2"), "built from another checkpoint"),
    ("moeserve_quant.json without its tensors", lambda w, t: [
        "generate", "--model", quantized_copy(w, t, json.dumps({"format": "moeserve-quant-3", "bits": 8})),
        "--max-new-tokens", "2"], "moeserve_quant.json is damaged"),
]


@pytest.mark.parametrize("setup,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_line_error_and_nothing_left_behind(world, tmp_path, monkeypatch, expect_cli_error, setup, message):
    monkeypatch.chdir(tmp_path)  # a relative output (--out "") would land here, watched
    argv = setup(world, tmp_path)
    expect_cli_error(argv, message)
