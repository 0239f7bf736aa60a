"""Every command and Python example in README.md runs as written (CI runs the two install commands itself).

`DIR` in a command stands for the user's checkpoint directory: here a copy of the demo model. Lines that need
hardware CI lacks (`--device cuda`, or a comment saying "GPU machine") are skipped, and so are installs."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import moeserve

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
NEEDS_WHAT_CI_LACKS = ("pip install", "--device cuda", "GPU machine")


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.M | re.S)


def runnable(block: str) -> str:
    """The block's commands (continuation lines joined), without those CI cannot run."""
    commands = block.replace("\\\n", " ").splitlines()
    return "\n".join(c for c in commands if c.strip() and not any(s in c for s in NEEDS_WHAT_CI_LACKS))


SHELL = [b for b in map(runnable, blocks("bash")) if b]


def test_readme_has_what_this_test_reads():
    assert len(SHELL) >= 4 and blocks("python")


@pytest.mark.parametrize("script", SHELL, ids=[s.split("\n")[0][:60] for s in SHELL])
def test_readme_shell_block_runs_as_written(tmp_path, script):
    demo = tmp_path / "DIR"
    shutil.copytree(moeserve.DEMO_MODEL, demo)
    (tmp_path / "file.txt").write_text((demo / "heldout.txt").read_text()[:4000])
    (tmp_path / "prompts.jsonl").write_text('{"id": "a", "prompt": "KING."}\n{"id": "b", "prompt": "QUEEN."}\n')
    # `moeserve` and `torchrun` as the installed entry points run them, from this checkout: executables (not shell
    # functions), so that `kill` of one started in the background (`moeserve serve ... &`) stops the server itself
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, module in (("moeserve", "moeserve"), ("torchrun", "torch.distributed.run")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + re.sub(r"\bDIR\b", str(demo), script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("code", blocks("python"))
def test_readme_python_runs_outside_the_repo(tmp_path, code):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
