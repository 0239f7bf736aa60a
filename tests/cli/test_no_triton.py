"""CPU installs have no Triton (the CPU torch wheel does not bring it): every CPU command must run without it."""

import subprocess
import sys

BLOCKED = "import sys; sys.modules['triton'] = None; from moeserve.cli import main; sys.exit(main(sys.argv[1:]))"


def run_without_triton(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED, *map(str, argv)], capture_output=True, text=True,
                          timeout=600)


def test_triton_is_really_blocked():
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['triton'] = None; import triton"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "triton" in proc.stderr


def test_cpu_commands_run_without_triton(tmp_path, byte_model_dir):
    demo = run_without_triton("generate", "HAMLET.", "--max-new-tokens", 8, "--seed", 0)
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout.startswith("HAMLET.") and "Traceback" not in demo.stderr
    quant = tmp_path / "q"
    steps = [("quantize", "--model", byte_model_dir, "--out", quant, "--bits", 4, "--group", 32, "--method", "hqq"),
             ("generate", "--model", quant, "ab", "--max-new-tokens", 4, "--greedy"),
             ("offload-prepare", "--model", byte_model_dir, "--out", tmp_path / "store", "--group", 32),
             ("generate", "--model", byte_model_dir, "--offload", tmp_path / "store", "--high-slots", 2,
              "--low-slots", 2, "ab", "--max-new-tokens", 4, "--greedy", "--device", "cpu"),
             ("eval", "ppl", "--model", byte_model_dir, "--window", 32, "--max-tokens", 128)]
    for argv in steps:
        proc = run_without_triton(*argv)
        assert proc.returncode == 0, (argv, proc.stderr[-2000:])
