"""Models by their Hugging Face hub name, read from the local hub cache (no network)."""

import shutil

import pytest

from moeserve.errors import MoeserveError
from moeserve.hub import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_copy(cache, source, repo="acme/tiny-moe", ref="main"):
    """`source` laid out as `hf download repo` leaves it: a snapshot per commit, refs naming commits."""
    root = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(source, root / "snapshots" / COMMIT)
    (root / "refs").mkdir()
    (root / "refs" / ref).write_text(COMMIT)
    return root / "snapshots" / COMMIT


def test_a_hub_name_runs_from_the_local_cache(byte_model_dir, tmp_path, monkeypatch, capsys):
    from moeserve.cli import main

    snapshot = hub_copy(tmp_path / "hub", byte_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model("acme/tiny-moe") == resolve_model(f"acme/tiny-moe@{COMMIT}") == str(snapshot)
    assert main(["generate", "--model", "acme/tiny-moe", "--greedy", "--max-new-tokens", "3", "Hi"]) == 0
    assert main(["generate", "--model", str(byte_model_dir), "--greedy", "--max-new-tokens", "3", "Hi"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == out[1]  # the snapshot is the checkpoint


def test_hub_cache_location_and_a_missing_revision(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    with pytest.raises(MoeserveError, match=r"local Hugging Face cache \(.*home/hub\).*`hf download acme/x --revision v1`"):
        resolve_model("acme/x@v1")
    assert resolve_model(str(tmp_path)) == str(tmp_path)  # a directory is itself
    assert resolve_model("not a name") == "not a name"  # left for the reader's "does not exist"
