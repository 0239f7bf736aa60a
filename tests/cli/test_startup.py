"""Start-up: a command that compiles nothing never imports torch's compiler stack (torch._dynamo: 1-2 s)."""

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
