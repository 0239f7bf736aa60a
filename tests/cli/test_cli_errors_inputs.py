"""Bad inputs to the CLI, one table: each gives exit 2 and one `moeserve: error:` line that names the problem,
no traceback, nothing on stdout and no file written. Every check here runs before a model loads."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from moeserve.offload.trace import RoutingTrace

OFFLOAD_STORE = "{tmp}/store"  # never opened: the offload options are checked before the store and the model


def batch(inputs: str = "in", output: str = "{tmp}/out.jsonl") -> list[str]:
    """batch on {tmp}/INPUTS.jsonl (made by the `inputs` fixture)."""
    return ["batch", "--model", "{model}", "--device", "cpu", "--input", f"{{tmp}}/{inputs}.jsonl", "--output", output]


def stop_at(inputs: str) -> list[str]:
    return [*batch(inputs), "--on-bad-line", "stop"]


def trace(action: str, file: str = "trace.npz") -> list[str]:
    return ["trace", action, "--trace", f"{{tmp}}/{file}", "--high-slots", "2"]


BATCH = batch()
SIMULATE = trace("simulate")
FIT = trace("fit")
GENERATE = ["generate", "--model", "{model}"]
PLAN = ["plan", "--model", "{model}", "--profile", "{tmp}/no-profile.json"]  # the context is checked first

CASES = {
    # raw tracebacks before
    "non-UTF-8 prompt": ([*GENERATE, "ok", "\udcff"], "prompt 2 is not valid UTF-8 (byte 0xff"),
    "seed beyond 64 bits": ([*GENERATE, "--seed", "1180591620717411303424", "x"],
                            "seed must be an integer in [0, 2**64)"),
    "negative seed": ([*GENERATE, "--seed", "-1", "x"], "seed must be an integer in [0, 2**64)"),
    "batch seed beyond 64 bits": ([*BATCH, "--seed", str(2 ** 64)], "seed must be an integer"),
    "truncated trace (simulate)": (trace("simulate", "cut.npz"), "cut.npz is not a routing trace"),
    "truncated trace (fit)": (trace("fit", "cut.npz"), "cut.npz is not a routing trace"),
    "inconsistent trace": (trace("simulate", "odd.npz"), "an expert id is outside [0, 4)"),
    "corrupt byte_tokenizer.json": (["generate", "--model", "{tmp}/badtok", "x"], "cannot read tokenizer"),
    "byte_tokenizer.json without ids": (["generate", "--model", "{tmp}/idtok", "x"], "is not a byte tokenizer"),
    "trace record --out under a file": (["trace", "record", "--model", "{model}", "--out", "{tmp}/file/t.npz"],
                                        "cannot write --out {tmp}/file/t.npz: {tmp}/file is not a directory"),
    "trace record --out a directory": (["trace", "record", "--model", "{model}", "--out", "{tmp}"],
                                       "--out {tmp} is a directory"),
    "batch --output under a file": (batch("in", "{tmp}/file/out.jsonl"), "{tmp}/file is not a directory"),
    "batch --output in a missing directory": (batch("in", "{tmp}/none/out.jsonl"), "{tmp}/none does not exist"),
    "batch --output a directory": (batch("in", "{tmp}"), "--output {tmp} is a directory"),
    "batch --output not batch results": (batch("in", "{tmp}/foreign.jsonl"), "foreign.jsonl:1: not a result line"),
    # accepted silently before
    "batch --gpu-memory 12XB": ([*BATCH, "--gpu-memory", "12XB"], "--gpu-memory '12XB' is not a size"),
    "generate --gpu-memory 12XB": ([*GENERATE, "--offload", OFFLOAD_STORE, "--gpu-memory", "12XB", "x"],
                                   "--gpu-memory '12XB' is not a size"),
    "generate --memory 12XB": ([*GENERATE, "--offload", OFFLOAD_STORE, "--memory", "12XB", "x"], "'12XB'"),
    "planner --gpu-memory 12XB": ([*GENERATE, "--gpu-memory", "12XB", "x"], "--gpu-memory '12XB' is not a size"),
    "--high-slots without --offload": ([*GENERATE, "--high-slots", "4", "x"], "--high-slots needs --offload"),
    "--low-slots without --offload": ([*GENERATE, "--low-slots", "4", "x"], "--low-slots needs --offload"),
    "--policy without --offload": ([*GENERATE, "--policy", "foo", "x"], "--policy needs --offload"),
    "--all-high without --offload": ([*GENERATE, "--all-high", "x"], "--all-high needs --offload"),
    "--per-layer-cache without --offload": ([*GENERATE, "--per-layer-cache", "x"], "--per-layer-cache needs --offload"),
    "--t1 without --offload": ([*GENERATE, "--t1", "0.5", "x"], "--t1 needs --offload"),
    "--t2 without --offload": ([*GENERATE, "--t2", "0.95", "x"], "--t2 needs --offload"),
    "--prefetch without --offload": ([*GENERATE, "--prefetch", "0", "x"], "--prefetch needs --offload"),
    "--cooperative without --offload": ([*GENERATE, "--cooperative", "x"], "--cooperative needs --offload"),
    "--no-pin without --offload": ([*GENERATE, "--no-pin", "x"], "--no-pin needs --offload"),
    "--low-slots with --gpu-memory": ([*GENERATE, "--offload", OFFLOAD_STORE, "--gpu-memory", "1GiB",
                                       "--low-slots", "4", "x"], "--low-slots needs --high-slots"),
    "--offload without a budget": ([*GENERATE, "--offload", OFFLOAD_STORE, "x"], "--gpu-memory SIZE or --high-slots"),
    "generate --policy foo": ([*GENERATE, "--offload", OFFLOAD_STORE, "--high-slots", "2", "--policy", "foo", "x"],
                              "unknown policy 'foo'"),
    "trace simulate --policy foo": ([*SIMULATE, "--policy", "foo"], "unknown policy 'foo'"),
    "plan --prompt-len beyond the context": ([*PLAN, "--prompt-len", "5000"], "exceed the model's context of 64"),
    "plan prompt + gen beyond the context": ([*PLAN, "--prompt-len", "40", "--gen-len", "40"],
                                             "--prompt-len 40 + --gen-len 40 = 80 tokens exceed"),
    "plan --gen-len fills the context": ([*PLAN, "--gen-len", "64"], "--gen-len 64 leaves no room for a prompt"),
    "trace record --seq-len beyond the context": (["trace", "record", "--model", "{model}", "--out", "{tmp}/t.npz",
                                                   "--seq-len", "5000"], "--seq-len 5000 exceeds the model's context"),
    "trace simulate --bits-low 0": ([*SIMULATE, "--bits-low", "0"], "--bits-low 0 is not supported"),
    "trace simulate --bits-low 99": ([*SIMULATE, "--bits-low", "99"], "--bits-low 99 is not supported"),
    "trace fit --bits-low 99": ([*FIT, "--bits-low", "99"], "--bits-low 99 is not supported"),
    "batch id object": (stop_at("id-object"),
                        'id-object.jsonl:2: id must be a string or an integer, not {{"a": 1}}'),
    "batch id array": (stop_at("id-array"), "id-array.jsonl:2: id must be"),
    "batch id float": (stop_at("id-float"), "id-float.jsonl:2: id must be"),
    "batch id bool": (stop_at("id-bool"), "id-bool.jsonl:2: id must be"),
    # batch: each line on its own, under --on-bad-line stop
    "batch overlong prompt": (stop_at("long"),
                              "long.jsonl:2: prompt of 101 tokens does not fit the model's context of 64"),
    "batch non-UTF-8 line": (stop_at("latin1"),
                             "latin1.jsonl:2: not UTF-8 (byte 0xe9"),
    # misleading messages before
    "eval ppl --model missing": (["eval", "ppl", "--model", "{tmp}/missing"],
                                 "model path '{tmp}/missing' does not exist"),
    "--tp outside torchrun": ([*GENERATE, "--tp", "3", "x"],
                              "--tp 3 runs one process per rank: launch it under torchrun"),
    "eval --ep outside torchrun": (["eval", "ppl", "--model", "{model}", "--ep", "2"],
                                   "torchrun --nproc-per-node 2 -m moeserve eval ppl --ep 2"),
    "no tokenizer": (["generate", "--model", "{tmp}/notok", "x"], "looked for tokenizer.json"),
    "corrupt tokenizer_config.json": (["generate", "--model", "{tmp}/badcfg", "x"],
                                      "cannot read {tmp}/badcfg/tokenizer_config.json"),
}


@pytest.fixture
def inputs(tmp_path, byte_model_dir, monkeypatch):
    """The files the cases read, made before the command runs (so only the command's own writes are caught)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    (tmp_path / "file").write_text("a regular file, not a directory\n")
    config = (byte_model_dir / "config.json").read_text()
    for name, tokenizer in (("badtok", '{"type": "bytes", "bos'), ("idtok", '{"type": "bytes"}'), ("notok", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config)
        if tokenizer is not None:
            (tmp_path / name / "byte_tokenizer.json").write_text(tokenizer)
    (tmp_path / "badcfg").mkdir()  # an HF tokenizer whose tokenizer_config.json (read for its class) is cut off
    (tmp_path / "badcfg" / "config.json").write_text(config)
    Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(tmp_path / "badcfg" / "tokenizer.json"))
    (tmp_path / "badcfg" / "tokenizer_config.json").write_text('{"tokenizer_class": ')
    ids = np.array([[0, 1], [2, 3], [1, 2], [0, 3]], np.int16)
    trace = RoutingTrace(np.array([0, 0, 1, 1], np.int32), np.array([0, 1, 0, 1], np.int16), ids,
                         np.full((4, 2), 0.5, np.float32), 2, 4)
    trace.save(tmp_path / "trace.npz")
    data = (tmp_path / "trace.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[:len(data) // 2])
    RoutingTrace(trace.sequence, trace.layer, ids * 2, trace.weights, 2, 4).save(tmp_path / "odd.npz")
    good = json.dumps({"id": "a", "prompt": "To be"})
    lines = {"in": good, "long": json.dumps({"prompt": "x" * 100}), "id-object": '{"id": {"a": 1}, "prompt": "p"}',
             "id-array": '{"id": [1], "prompt": "p"}', "id-float": '{"id": 1.5, "prompt": "p"}',
             "id-bool": '{"id": true, "prompt": "p"}'}
    for name, second in lines.items():
        (tmp_path / f"{name}.jsonl").write_text(f"{good}\n{second}\n")
    (tmp_path / "latin1.jsonl").write_bytes(good.encode() + b'\n{"prompt": "caf\xe9"}\n')
    (tmp_path / "foreign.jsonl").write_text("id,text\n")
    return tmp_path


@pytest.mark.parametrize("argv,message", CASES.values(), ids=CASES.keys())
def test_bad_input_is_one_line_before_anything_loads(expect_cli_error, inputs, byte_model_dir, argv, message):
    fill = dict(tmp=inputs, model=byte_model_dir)
    expect_cli_error([a.format(**fill) for a in argv], message.format(**fill))
