"""bench/llama_server_adapter.py's flag mapping (a pure function): llama.cpp's server test harness starts it with
llama-server's flags, and it must start `moeserve serve` with the options they mean."""

import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "bench")]
from llama_server_adapter import CHATML, MODEL_CONTEXT, AdapterError, checkpoint_for, map_flags  # noqa: E402

HARNESS = ["--host", "127.0.0.1", "--port", "8081", "--temp", "0.8", "--seed", "42", "--hf-repo", "ggml-org/models",
           "--hf-file", "tinyllamas/stories260K.gguf", "--batch-size", "2048", "--no-slots", "--alias",
           "tinyllama-2-tool-call", "--ctx-size", "1024", "--parallel", "2", "--n-predict", "1024", "--jinja",
           "--chat-template-file", "llama.jinja"]


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_harness_flags_map_to_serve_options():
    launch = map_flags(HARNESS, read_file=lambda p: f"template of {p}")
    args = launch.serve_args
    assert (option(args, "--host"), option(args, "--port")) == ("127.0.0.1", "8081")
    assert option(args, "--served-model-name") == "tinyllama-2-tool-call"
    assert (option(args, "--parallel"), option(args, "--ctx-size")) == ("2", "512")  # llama's -c is all slots'
    assert (option(args, "--device"), option(args, "--dtype"), option(args, "--threads")) == ("cpu", "float32", "1")
    assert launch.template == "template of llama.jinja"
    assert launch.models == ["ggml-org/models", "tinyllamas/stories260K.gguf"]


def test_context_is_capped_and_named_templates_and_keys_map():
    launch = map_flags(["-c", "8192", "-np", "1", "--chat-template", "chatml", "--api-key", "k", "-t", "3",
                        "--metrics"])
    assert option(launch.serve_args, "--ctx-size") == str(MODEL_CONTEXT)
    assert option(launch.serve_args, "--api-key") == "k" and option(launch.serve_args, "--threads") == "3"
    assert "--metrics" in launch.serve_args and launch.template == CHATML
    assert option(map_flags([]).serve_args, "--ctx-size") == str(MODEL_CONTEXT) and map_flags([]).template is None


@pytest.mark.parametrize("argv,named", [(["--lora", "x.gguf"], "--lora"), (["--port"], "--port"),
                                        (["--chat-template", "llama3"], "llama3")])
def test_unknown_flags_stop_with_one_line_naming_them(argv, named):
    with pytest.raises(AdapterError, match=named) as e:
        map_flags(argv)
    assert "\n" not in str(e.value)


def test_one_checkpoint_directory_per_template(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        (base / name).write_text(name)
    work = tmp_path / "work"
    a, b = checkpoint_for("A", base, work), checkpoint_for("B", base, work)
    assert a != b and checkpoint_for("A", base, work) == a
    assert (a / "chat_template.jinja").read_text() == "A" and (a / "config.json").read_text() == "config.json"
    assert (a / "config.json").is_symlink()
