"""What the CLI does with unusual but valid inputs: bad batch lines skipped by number, progress where work is
long, exact output paths, valid JSON, one status line per launch, and a --help that does not import torch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moeserve.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def plain_progress(monkeypatch):
    """Progress lines at every update (capsys's stderr is not a terminal, so they are the plain kind)."""
    monkeypatch.setattr("moeserve.progress.PLAIN_INTERVAL_S", 0.0)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_and_its_parser_do_not_import_torch():
    """`moeserve --help` stays fast: torch is imported by the commands that need it, not by the CLI module; nor is
    the web framework of `moeserve serve` (an optional extra)."""
    code = ("import sys, moeserve.cli as c\n"
            "p = c.build_parser()\n"
            "for argv in (['--help'], ['generate', '--help'], ['batch', '--help'], ['serve', '--help']):\n"
            "    try:\n"
            "        p.parse_args(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "heavy = ('torch', 'fastapi', 'starlette', 'uvicorn', 'prometheus_client', 'moeserve.serve')\n"
            "print(sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + '.' for h in heavy))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_batch_decides_each_line_and_reports_progress_off_a_terminal(capsys, tmp_path, byte_model_dir,
                                                                     plain_progress):
    good = [json.dumps({"id": "a", "prompt": "To be"}), json.dumps({"id": 4, "prompt": "Words"})]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join([good[0].encode(), b'{"prompt": "caf\xe9"}',
                                                    json.dumps({"prompt": "x" * 100}).encode(), good[1].encode()]))
    code, _, err = run(capsys, "batch", "--model", byte_model_dir, "--device", "cpu", "--input", tmp_path / "in.jsonl",
                       "--output", tmp_path / "out.jsonl", "--max-new-tokens", 2, "--batch-size", 2,
                       "--micro-batch", 1, "--ignore-eos")
    assert code == 0, err
    assert "in.jsonl:2: not UTF-8 (byte 0xe9 at column 16); skipped" in err
    assert "in.jsonl:3: prompt of 101 tokens does not fit the model's context of 64 tokens; skipped" in err
    assert "[requests: 2/2 req" in err  # plain progress lines: stderr is not a terminal
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(map(str, (r["id"] for r in results))) == ["4", "a"]


def test_generate_several_prompts_shows_progress(capsys, byte_model_dir, plain_progress):
    code, out, err = run(capsys, "generate", "--model", byte_model_dir, "ab", "cde", "--greedy",
                         "--max-new-tokens", 4, "--ignore-eos")
    assert code == 0 and out.count("--- [") == 2
    assert "[generate: 8 tokens, 2 of 2 prompts done" in err


def test_only_rank_0_prints_the_status_lines(capsys, byte_model_dir, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    code, out, err = run(capsys, "generate", "--model", byte_model_dir, "Hi", "--max-new-tokens", 2)
    assert code == 0 and out.startswith("Hi") and "tokens/s" not in err


def test_plan_json_is_valid_json(capsys, tmp_path):
    from checks import H100

    (tmp_path / "h100.json").write_text(json.dumps(H100))
    code, out, _ = run(capsys, "plan", "--for", "batch", "--profile", tmp_path / "h100.json", "--gpu-memory", "16GiB",
                       "--cpu-memory", "100GiB", "--json")

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    report = json.loads(out, parse_constant=no_constants)
    assert code == 0 and None in [op["link_intensity"] for op in report["operators"]]  # nothing over the link


def test_trace_writes_the_given_path_and_reports_real_bytes(capsys, tmp_path, byte_model_dir, plain_progress):
    path = tmp_path / "tracefile"  # no .npz: written as given
    code, out, err = run(capsys, "trace", "record", "--model", byte_model_dir, "--out", path, "--seq-len", 16,
                         "--max-tokens", 64)
    assert code == 0 and json.loads(out)["out"] == str(path) and path.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tracefile"]
    assert "[trace record: 4/4 sequences" in err

    code, out, err = run(capsys, "trace", "fit", "--trace", path, "--high-slots", 2, "--low-slots", 2)
    assert code == 0 and "[trace fit: 35/35 candidates" in err
    assert out.startswith("weights ") and "moeserve trace simulate --weights " in out  # a table by default

    simulate = ["trace", "simulate", "--trace", path, "--high-slots", 2, "--low-slots", 2, "--json"]
    code, out, _ = run(capsys, *simulate)
    result = json.loads(out)
    assert code == 0 and "bytes_moved" not in result and result["miss_penalty"] > 0
    code, table, _ = run(capsys, *simulate[:-1])  # by default the same numbers as a table, one row each
    rows = {line[:12].strip(): line[12:].strip() for line in table.splitlines()}
    assert code == 0 and "{" not in table and "bytes moved" not in rows
    assert rows["requests"].startswith(f"{result['requests']:,} expert loads")
    assert rows["hits"] == f"{result['hits']:,} ({result['hit_rate']:.1%} hit rate)"
    assert rows["miss penalty"] == f"{result['miss_penalty']:.1f} high-precision expert copies"

    store = tmp_path / "store"
    assert run(capsys, "offload-prepare", "--model", byte_model_dir, "--out", store, "--group", 32)[0] == 0
    code, out, _ = run(capsys, *simulate, "--store", store)
    with_store = json.loads(out)
    assert "bytes moved" in run(capsys, *simulate[:-1], "--store", store)[1]
    from moeserve.offload.store import ExpertStore

    high, low = (ExpertStore.open(store).expert_bytes(low=b) for b in (False, True))
    assert with_store["bytes_moved"] == with_store["high_misses"] * high + with_store["low_misses"] * low > 0


def test_batch_policy_line_says_what_runs_where():
    """batch's policy line is words, not a dict: sizes, and where each part runs; without a GPU it says the GPU side
    of the policy runs on the CPU too instead of `ffn_on_gpu: True`."""
    import torch

    from moeserve.cli.batch import policy_line
    from moeserve.plan.policy import ThroughputPolicy

    policy = ThroughputPolicy(64, 16, attention_on_gpu=False, ffn_on_gpu=True, weights_gpu_fraction=0.2,
                              kv_gpu_fraction=0.25)
    assert policy_line(policy, torch.device("cuda", 0)) == (
        "[policy: batch of 64 sequences in 4 micro-batches of 16; attention on the CPU over a host KV cache, MoE FFN "
        "on the GPU; 20% of the layer weights resident on the GPU, the rest streamed from pinned host memory; KV cache "
        "of 1 of 4 micro-batches on the GPU]")
    cpu = policy_line(policy, torch.device("cpu"))
    assert cpu.startswith("[policy: batch of 64 sequences in 4 micro-batches of 16; no GPU (cpu): ")
    assert "computed on the CPU" in cpu and "ffn_on_gpu" not in cpu and "True" not in cpu
    one = ThroughputPolicy(8, 8, True, False, 1.0, 1.0)
    assert policy_line(one, torch.device("cuda")).startswith(
        "[policy: batch of 8 sequences in 1 micro-batch of 8; attention on the GPU, MoE FFN on the CPU; 100% of")


def test_gpu_memory_without_a_gpu_and_offload_say_what_they_do(capsys, tmp_path, byte_model_dir):
    """Without a GPU, --gpu-memory says in one stderr line what it limits (nothing for the planner, the cache's slots
    in RAM with --offload); an --offload run's first line says misses may run low-bit copies and names --all-high."""
    gen = ["generate", "--model", byte_model_dir, "--device", "cpu", "--max-new-tokens", 2, "ab"]
    code, _, err = run(capsys, *gen, "--gpu-memory", "1GiB")
    assert code == 0
    assert "moeserve: note: the run has no GPU, so --gpu-memory 1GiB limits nothing: every part runs on the CPU" in err

    store = tmp_path / "store"
    assert run(capsys, "offload-prepare", "--model", byte_model_dir, "--out", store, "--group", 32)[0] == 0
    code, _, err = run(capsys, *gen, "--offload", store, "--gpu-memory", "32MiB")
    lines = err.splitlines()
    assert code == 0 and lines[0] == ("moeserve: note: the run has no GPU, so --gpu-memory 32MiB limits host RAM for "
                                      "the expert cache's slots (planned after the dense weights and KV cache)")
    assert lines[1].startswith(f"[offload: experts from {store}, cached in ") and " in host RAM, planned " in lines[1]
    assert "a missed expert may run its 4-bit copy or be skipped, which changes the output; --all-high" in lines[1]
    code, _, err = run(capsys, *gen, "--offload", store, "--high-slots", 2, "--all-high")
    assert code == 0 and "no GPU" not in err
    assert "2 high + 0 low slots in host RAM, policy hobbit; --all-high: every expert at full precision" in err


def test_progress_on_a_stderr_that_is_no_terminal_is_whole_lines(capsys, tmp_path, byte_model_dir, plain_progress):
    """quantize, eval ppl and offload-prepare with stderr captured (no terminal): progress comes as whole bracketed
    lines, never a bar's carriage-return redraws or fragments."""
    out = tmp_path / "q"
    for argv in (["quantize", "--model", byte_model_dir, "--out", out, "--bits", 4, "--method", "rtn", "--group", 32],
                 ["eval", "ppl", "--model", byte_model_dir, "--max-tokens", 200, "--window", 64],
                 ["offload-prepare", "--model", byte_model_dir, "--out", tmp_path / "store", "--group", 32]):
        code, _, err = run(capsys, *argv)
        assert code == 0 and "\r" not in err and "%|" not in err and "it/s" not in err
        progress = [line for line in err.splitlines() if not line.startswith("moeserve: note:")]
        assert progress and all(line.startswith("[") and line.endswith("]") for line in progress), err
        assert len(progress) == len(set(progress)), err  # the final count once
