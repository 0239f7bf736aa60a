"""`moeserve bench` (engine/bench.py): the passes it times, its statistics, its table and JSON for resident and
hybrid placements on the CPU, and its one-line errors."""

import json
import statistics

import pytest

import moeserve
from moeserve.cli import main
from moeserve.engine.bench import BenchResult, decode_steps, prompt_pass, run_bench, table


@pytest.fixture(scope="module")
def model(byte_model_dir):
    return moeserve.load_model(byte_model_dir, device="cpu")


def test_each_test_runs_the_passes_it_names(model, monkeypatch):
    """pp: one forward pass over the P tokens; tg: a one-token prompt's prefill, then N one-token decode passes."""
    import torch

    shapes = []
    forward = type(model).forward

    def counting(self, tokens, *args, **kwargs):
        shapes.append(tuple(tokens.shape))
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    assert prompt_pass(model, torch.randint(0, 258, (1, 20))) > 0
    assert shapes == [(1, 20)]
    shapes.clear()
    assert decode_steps(model, 7, 5, cuda_graph=False) > 0
    assert shapes == [(1, 1)] * 6


def test_results_and_statistics(model):
    seen = []
    results = run_bench(model, 16, 4, 3, seed=1, cuda_graph=False, on_run=lambda *a: seen.append(a[:2]))
    assert seen == [("pp16", r) for r in range(4)] + [("tg4", r) for r in range(4)]  # a warm-up, then 3 timed
    pp, tg = results
    assert (pp.test, pp.tokens, tg.test, tg.tokens) == ("pp16", 16, "tg4", 4)
    for r in results:
        rates = [r.tokens / s for s in r.seconds]
        assert len(r.seconds) == 3 and min(r.seconds) > 0
        assert r.mean == pytest.approx(statistics.fmean(rates)) and r.std == pytest.approx(statistics.stdev(rates))
        assert r.gpu_peak_bytes is None and r.host_peak_bytes > 1 << 20
    one = BenchResult("tg8", 8, (0.5,), None, 1 << 30)
    assert (one.mean, one.std) == (16.0, 0.0)
    text = table([one], "demo", "resident (cpu, float32)")
    lines = text.splitlines()
    assert lines[0].startswith("| model") and "16.00 ± 0.00" in lines[2] and "1.0 GiB" in lines[2]
    assert len({len(ln) for ln in lines}) == 1  # aligned columns


def test_cli_bench_table_and_json(capsys, byte_model_dir):
    base = ["bench", "--model", str(byte_model_dir), "--device", "cpu", "-p", "16", "-n", "4", "-r", "2"]
    assert main(base) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[0].startswith("| model") and "pp16" in out[2]
    assert "resident (cpu, float32)" in out[2] and "tg4" in out[3] and "±" in out[3]
    assert main(base + ["--cpu-moe", "--experts-bits", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["placement"].startswith("hybrid, 2/2 MoE layers' experts on CPU (4-bit)")
    assert [r["test"] for r in report["results"]] == ["pp16", "tg4"]
    assert all(len(r["seconds"]) == 2 and r["tok_s"] > 0 for r in report["results"])


@pytest.mark.parametrize("argv, message", [
    (["-p", "0"], "-p, -n and -r must be >= 1"),
    (["-r", "0"], "-p, -n and -r must be >= 1"),
    (["-p", "65"], "do not fit the model's context of 64 tokens (-p at most 64, -n at most 62)"),
    (["-n", "63"], "-n at most 62"),
    (["--n-cpu-moe", "3"], "--n-cpu-moe 3 is outside the model's 2 MoE layers"),
    (["--high-slots", "2"], "--high-slots needs --offload"),
])
def test_cli_bench_errors(expect_cli_error, byte_model_dir, argv, message):
    expect_cli_error(["bench", "--model", byte_model_dir, "--device", "cpu", *argv], message)
