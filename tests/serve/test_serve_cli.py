"""`moeserve serve`'s options: bad ones give one line and exit 2 before the model loads; --help explains every flag
(tests/test_cli_inputs.py checks that it imports neither torch nor the web framework)."""

import importlib.util
import socket

import pytest

from moeserve.cli import main

@pytest.mark.parametrize("argv,message", [
    (["--port", "70000"], "--port 70000 is not a TCP port"),
    (["--port", "eighty"], "invalid int value: 'eighty'"),
    (["--parallel", "0"], "--parallel, --prefill-chunk and --threads must be >= 1"),
    (["--prefill-chunk", "0"], "--parallel, --prefill-chunk and --threads must be >= 1"),
    (["--max-queue", "-1"], "--max-queue >= 0"),
    (["--threads", "0"], "--threads 0 must be >= 1"),
    (["--ctx-size", "1024"], "--ctx-size 1024 must be between 2 and the model's context of 512 tokens"),
    (["--ctx-size", "1"], "--ctx-size 1 must be between 2"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--high-slots", "4"], "--high-slots needs --offload"),
    (["--model", "{tmp}/missing"], "does not exist"),
])
def test_bad_options_give_one_line(expect_cli_error, tmp_path, argv, message):
    expect_cli_error(["serve", *(a.format(tmp=tmp_path) for a in argv)], message)


def test_a_port_in_use_is_named(expect_cli_error):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        expect_cli_error(["serve", "--port", port], f"cannot listen on 127.0.0.1:{port}")


def test_missing_extra_names_the_install(expect_cli_error, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    expect_cli_error(["serve"], "needs fastapi: pip install 'moeserve[serve]'")


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag in ("--host", "--port", "--parallel", "--ctx-size", "--api-key", "--metrics", "--max-queue", "--threads",
                 "--prefill-chunk", "--offload", "--device", "--dtype", "--served-model-name", "--no-cuda-graph",
                 "--no-prefix-reuse"):
        assert flag in out
