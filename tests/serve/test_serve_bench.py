"""bench/serve.py, bench/serve_soak.py and bench/prefix_cache.py --quick: they run against a CPU server and write
complete result JSON; bench/batching.py --quick: the same requests without HTTP."""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_quick(script: str, out: Path, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", "--threads", "1", "--out", str(out),
                           *extra], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = out.glob("*.json")
    return json.loads(result.read_text())


def test_serve_bench_quick(tmp_path):
    """On a random 4-bit checkpoint of a tiny Mixtral shape written for the run, clients over two processes."""
    r = run_quick("serve.py", tmp_path, "--random-shape", "tiny", "--random-layers", "2", "--client-procs", "2")
    assert r["name"] == "serve" and r["config"]["quick"] and "commit" in r["git"]
    made = r["config"]["random_checkpoint"]
    assert made["bits"] == 4 and made["layers"] == 2 and 0 < made["quantized_bytes"] < made["bf16_bytes"]
    assert [level["clients"] for level in r["levels"]] == [1, 4]
    assert [level["concurrent"]["client_procs"] for level in r["levels"]] == [1, 2]
    for level in r["levels"]:
        for run in (level["concurrent"], level["sequential"]):
            assert run["tok_per_s"] > 0 and run["generated_tokens"] == 16 * run["requests"]
            assert run["ttft_p50_ms"] > 0 and run["itl_p99_ms"] >= run["itl_p50_ms"] > 0
            assert run["tokens_per_chunk"] == 1  # ASCII text: each ITL gap is one token's
        assert level["speedup"] > 0 and level["itl_p99_over_single"] > 0


def test_serve_soak_quick(tmp_path):
    r = run_quick("serve_soak.py", tmp_path)
    assert r["passed"] and r["problems"] == [] and r["server_alive"]
    assert sum(r["outcomes"].values()) == 60 and r["responses"] == r["distinct_ids"] > 0
    assert r["rss_kib_start"] > 0 and r["rss_kib_end"] > 0 and not any(r["load_at_end"].values())


def test_batching_bench_quick(tmp_path):
    """The serve bench's requests through a ContinuousBatch in process, on a random tiny 4-bit checkpoint: every
    token counted, every step kept by its shape."""
    r = run_quick("batching.py", tmp_path, "--random-shape", "tiny", "--random-layers", "2")
    assert r["name"] == "batching" and r["config"]["random_checkpoint"]["layers"] == 2
    assert [level["clients"] for level in r["levels"]] == [1, 4]
    for level in r["levels"]:
        assert level["generated_tokens"] == 16 * level["requests"] and level["tok_per_s"] > 0
        assert level["prefill_steps"] >= 1 and level["itl_p99_ms"] >= level["itl_p50_ms"] > 0
        assert max(map(int, level["decode_step_p50_ms"])) == level["clients"]
        assert level["steps"] >= 16 and len(level["slowest"]) == 5


def test_prefix_cache_bench_quick(tmp_path):
    """2 clients x 2 turns on the demo, with prefix reuse and without: every field, cached tokens only with reuse."""
    r = run_quick("prefix_cache.py", tmp_path)
    assert r["name"] == "prefix_cache" and r["config"]["clients"] == 2 and r["device"] and r["date"]
    on, off = r["runs"]["prefix_reuse"], r["runs"]["no_prefix_reuse"]
    for run in (on, off):
        assert run["requests"] == 4 and run["generated_tokens"] == 4 * 8 and run["tok_per_s"] > 0
        assert [t["turn"] for t in run["turns"]] == [1, 2] and run["ttft_p99_ms"] >= run["ttft_p50_ms"] > 0
        assert run["prompt_tokens"] == sum(t["prompt_tokens"] for t in run["turns"])
    assert on["prompt_tokens"] == off["prompt_tokens"] and off["cached_tokens"] == 0 == off["hit_rate"]
    assert 0 < on["cached_tokens"] < on["prompt_tokens"] and on["turns"][1]["cached_tokens"] > 0
    assert set(r["ratios"]) == {"tok_per_s", "ttft_p50", "ttft_p99"} and r["ratios"]["tok_per_s"] > 0
