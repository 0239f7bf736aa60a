"""Start-up: a command that compiles nothing never imports torch's compiler stack (torch._dynamo: 1-2 s)."""

import os
import subprocess
import sys

import pytest

RUN = """
import sys
from moeserve.cli import main
assert main(sys.argv[1:]) == 0
assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
"""


@pytest.mark.parametrize("command", [["eval", "ppl", "--max-tokens", "600"], ["generate", "HAMLET.", "--max-new-tokens", "4"],
                                     ["generate", "HAMLET.", "--max-new-tokens", "4", "--cpu-moe"], ["info"]])
def test_demo_commands_never_import_dynamo(command):
    out = subprocess.run([sys.executable, "-c", RUN, *command], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


ERRORS_BEFORE_TORCH = """
import sys
from moeserve.cli import main
assert main(sys.argv[1:]) == 2
assert "torch" not in sys.modules, "torch was imported before the error"
"""


@pytest.mark.parametrize("command,error", [
    (["generate", "--model", "/nonexistent", "Hi"], "model path '/nonexistent' does not exist"),
    (["generate", "--temperature", "-1", "Hi"], "temperature must be >= 0"),
    (["bench", "--threads", "0"], "--threads 0 must be >= 1"),
    (["serve", "--model", "nobody/nothing@v2"], "`hf download nobody/nothing --revision v2`"),
])
def test_argument_and_model_errors_come_before_torch_loads(command, error, tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", ERRORS_BEFORE_TORCH, *command], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("moeserve: error: ") and error in out.stderr


def test_threads_and_the_wait_policy_are_set_before_torch(monkeypatch):
    """OpenMP threads sleep after a parallel region unless the user chose a wait policy (a spinning team collapses on
    a shared machine: bench/threads.py); --threads N sizes the team."""
    from argparse import Namespace

    from moeserve.cli import cpu_threads

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    cpu_threads(Namespace(threads=3))
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cpu_threads(Namespace())
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_help_names_every_family(capsys):
    from moeserve.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for family in ("Mixtral", "Qwen2-MoE", "Qwen3-MoE", "OLMoE", "DeepSeek-V2/V3", "Kimi-K2", "GLM-4.5", "GPT-OSS",
                   "DBRX", "Phi-MoE", "Granite-MoE", "Llama-4"):
        assert family in text
