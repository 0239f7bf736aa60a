import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, torch.get_num_threads()))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU interpreter at tiny sizes
os.environ["MOESERVE_CACHE"] = tempfile.mkdtemp(prefix="moeserve-test-cache-")  # compiled kernels: built fresh
os.environ.setdefault("MOESERVE_TUNE", "off")  # GPU tests at many shapes: defaults, no search per shape (own tests)



@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """family -> (HF fp32 model, directory it was saved to with save_pretrained)."""
    from hf_models import FAMILIES, build_hf_model

    out = {}
    for i, fam in enumerate(FAMILIES):
        model = build_hf_model(fam, seed=100 + i)
        path = tmp_path_factory.mktemp(fam)
        model.save_pretrained(path)
        out[fam] = (model, path)
    return out


@pytest.fixture(scope="session")
def byte_model_dir(tmp_path_factory):
    """A tiny random Mixtral with the demo's byte vocabulary, tokenizer and a held-out text (2 layers, hidden 32)."""
    from hf_models import save_byte_model

    return save_byte_model(tmp_path_factory.mktemp("byte"))


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and modification time: what a failed command must leave alone."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def progress_line(line: str) -> bool:
    """A tqdm bar or a bracketed status line ("[policy: ...]") that may precede an error."""
    return "it/s]" in line or "s/it]" in line or "|" in line and "%" in line or line.startswith("[")


@pytest.fixture
def expect_cli_error(capsys, tmp_path):
    """expect_cli_error(argv, message[, watch]): the command exits 2 with exactly one stderr line that starts
    `moeserve: error:` and contains message (case-insensitive), prints nothing on stdout, raises nothing, and
    leaves the tree under watch (default tmp_path) exactly as it was."""
    from moeserve.cli import main

    def check(argv, message: str, watch: Path | None = None) -> str:
        watch = Path(watch or tmp_path)
        before = tree_state(watch)
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        out, err = capsys.readouterr()
        lines = [ln for part in err.splitlines() for ln in part.split("\r") if ln.strip() and not progress_line(ln)]
        assert code == 2, f"exit {code}; stderr: {err!r}"
        assert len(lines) == 1 and lines[0].startswith("moeserve: error:"), f"stderr: {err!r}"
        assert message.lower() in lines[0].lower(), f"{message!r} not in {lines[0]!r}"
        assert out == "", f"stdout: {out!r}"
        assert tree_state(watch) == before, "the command changed files it should have left alone"
        return lines[0]

    return check
