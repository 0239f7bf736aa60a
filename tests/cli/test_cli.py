"""The CLI: each command works, and every bad input gives one line on stderr and a non-zero exit."""

import json
import subprocess
import sys

import pytest

from moeserve.cli import main


def run_cli(capsys, *argv):
    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_prompt_and_continuation(capsys, byte_model_dir):
    code, out, err = run_cli(capsys, "generate", "--model", byte_model_dir, "Hello", "--max-new-tokens", 8,
                             "--seed", 1, "--ignore-eos")
    assert code == 0 and out.startswith("Hello") and "tokens/s" in err


def test_generate_batch_greedy_is_deterministic(capsys, byte_model_dir):
    args = ("generate", "--model", byte_model_dir, "ab", "cde", "--greedy", "--max-new-tokens", 6)
    first = run_cli(capsys, *args)[1]
    assert first == run_cli(capsys, *args)[1] and first.count("--- [") == 2


def test_info_table_and_json(capsys, byte_model_dir):
    code, out, _ = run_cli(capsys, "info", "--model", byte_model_dir)
    assert code == 0 and "mixtral" in out and "parameters: experts" in out
    code, out, _ = run_cli(capsys, "info", "--model", byte_model_dir, "--json")
    info = json.loads(out)
    assert info["parameters"]["total"] == info["parameters"]["dense"] + info["parameters"]["experts"]


def test_eval_ppl_reports_a_plausible_perplexity(capsys, byte_model_dir):
    code, out, _ = run_cli(capsys, "eval", "ppl", "--model", byte_model_dir, "--window", 32)
    result = json.loads(out)
    assert code == 0 and result["tokens"] > 300
    assert 50 < result["perplexity"] < 1000  # random model over a 258-token vocabulary: near-uniform


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "{tmp}/missing", "x"], "does not exist"),
    (["generate", "--model", "{tmp}", "x"], "no config.json"),
    (["generate", "--model", "{model}", "--top-p", "0", "x"], "top_p"),
    (["generate", "--model", "{model}", "--temperature", "-1", "x"], "temperature"),
    (["generate", "--model", "{model}", "--max-new-tokens", "0", "x"], "max_new_tokens"),
    (["generate", "--model", "{model}", "--dtype", "int3", "x"], "unknown dtype"),
    (["generate", "--model", "{model}", "--device", "tpu", "x"], "device"),
    (["generate", "--model", "{model}", "x" * 100], "context"),
    (["eval", "ppl", "--model", "{model}", "--text", "{tmp}/none.txt"], "not found"),
])
def test_bad_input_gives_one_line_error(capsys, tmp_path, byte_model_dir, argv, message):
    argv = [a.format(tmp=tmp_path, model=byte_model_dir) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip() and "loading weights" not in line]
    assert len(lines) == 1 and lines[0].startswith("moeserve: error:") and message in lines[0]
    assert "Traceback" not in err and out == ""


def test_subprocess_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moeserve", "info", "--model", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "does not exist" in proc.stderr


def test_help_everywhere():
    for argv in (["--help"], ["generate", "--help"], ["info", "--help"], ["eval", "ppl", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0


def test_stop_escapes_as_the_shell_passes_them(capsys):
    """`--stop "\\n\\n"` in a shell passes backslash-n twice: it must stop at a blank line, not never."""
    code, out, _ = run_cli(capsys, "generate", "ROMEO.", "--greedy", "--stop", r"\n\n", "--no-stream",
                           "--max-new-tokens", 300)
    header, text = out.split("\n", 1)
    assert code == 0 and header == "--- [0] (stop)" and "\n\n" not in text
