"""bench/report.py: MoE block runs over different token counts merge into one table per shape, newest row wins."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import report  # noqa: E402


def block_run(date: str, commit: str, tokens: list[int], ours: float) -> dict:
    row = dict(ours_ms=ours, hf_eager_ms=2.0, hf_grouped_mm_ms=1.0, floor_ms=0.5, floor_bound="bytes",
               ours_over_floor=ours / 0.5, ours_over_hf_grouped_mm=ours)
    lowbit = [dict(experts=e, tokens=t, eager_ms=1.0, cuda_graph_ms=ours, floor_ms=0.1)
              for e in ("3-bit", "bf16") for t in tokens]
    shape = dict(shape="mixtral", num_experts=8, top_k=2, hidden=64, ffn=128, dtype="bfloat16",
                 rows=[{**row, "tokens": t} for t in tokens], lowbit=lowbit)
    return dict(name="moe_block", date=date, device="GPU X", device_type="cuda", torch="t", transformers="tf",
                git=dict(commit=commit), config=dict(tokens=tokens), shapes=[shape])


def test_moe_block_runs_merge_newest_row_per_token_count(tmp_path):
    runs = [block_run("2026-01-01T00:00", "aaaaaaaa1", [1, 16, 1024], 0.9),
            block_run("2026-01-02T00:00", "bbbbbbbb2", [1], 0.3),
            block_run("2025-12-31T00:00", "cccccccc3", [4], 0.7)]  # older, but the only 4-token row
    for i, rec in enumerate(runs):
        (tmp_path / f"moe_block-{i}.json").write_text(json.dumps(rec))
    (merged,) = report.newest_runs(tmp_path)
    (shape,) = merged["shapes"]
    assert [(r["tokens"], r["ours_ms"], r["measured"]) for r in shape["rows"]] == [
        (1, 0.3, "2026-01-02, bbbbbbbb"), (4, 0.7, "2025-12-31, cccccccc"), (16, 0.9, "2026-01-01, aaaaaaaa"),
        (1024, 0.9, "2026-01-01, aaaaaaaa")]
    assert [(r["experts"], r["tokens"], r["cuda_graph_ms"]) for r in shape["lowbit"]] == [
        ("bf16", 1, 0.3), ("bf16", 4, 0.7), ("bf16", 16, 0.9), ("bf16", 1024, 0.9),
        ("3-bit", 1, 0.3), ("3-bit", 4, 0.7), ("3-bit", 16, 0.9), ("3-bit", 1024, 0.9)]
    text = report.report(tmp_path)
    assert text.count("**MoE block, mixtral**") == 1
    assert "| 4 | 0.700 |" in text and "2025-12-31, cccccccc |" in text


def quality_run(date: str, model: str, mixed: bool) -> dict:
    rows = [dict(label="bf16 (reference)", perplexity=4.0, checkpoint_bytes=12_000_000, compensator_bytes=0,
                 quantize_seconds=0.0),
            dict(label="hqq-3", bits=3, method="hqq", perplexity=4.1, checkpoint_bytes=3_000_000, compensator_bytes=0,
                 quantize_seconds=1.0),
            dict(label="milo-3 all=150KB int3", bits=3, method="milo", ranks="all=150KB", compensator_bits=3,
                 perplexity=4.05, checkpoint_bytes=3_150_000, compensator_bytes=150_000, quantize_seconds=9.0,
                 gap_recovered_vs_hqq=0.5, memory_added_vs_hqq=0.05)]
    rec = dict(name="quality", date=date, device="GPU X", device_type="cuda", torch="t", transformers="tf",
               git=dict(commit="abcdef123"), rows=rows,
               config=dict(model=model, group=64, window=512, eval_tokens=173_944, mixed_tokens=4096, mixed_window=256))
    if model != "demo":
        rec["model"] = dict(name=model, architecture="moe-8", scale="4x", parameters=23_888_384, layers=6, experts=8,
                            top_k=2, hidden_size=512, expert_ffn=256)
    if mixed:
        rec["mixed_precision"] = {"4bit": 4.2, "4bit+mixed": 4.3, "mixed_ppl_cost": 4.3 / 4.2 - 1,
                                  "4bit_skipped_share": 0.0, "4bit+mixed_skipped_share": 0.25}
    return rec


def test_quality_runs_of_two_models_render_as_two_tables(tmp_path):
    """A trained model's quality run on the demo's device keeps its own table, titled with its name and shape."""
    for i, rec in enumerate([quality_run("2026-01-01T00:00", "demo", False),
                             quality_run("2026-01-02T00:00", "moe8-4x", True)]):
        (tmp_path / f"quality-{i}.json").write_text(json.dumps(rec))
    text = report.report(tmp_path)
    assert text.count("**Quantization quality, demo model**") == 1
    assert ("**Quantization quality, moe8-4x (moe-8 at scale 4x, 23.9M parameters, 6 layers of 8 experts top-2, "
            "hidden 512, expert FFN 256)**") in text
    assert text.count("| milo | 3 | all=150KB | int3 | 4.0500 | +1.25% | 50% |") == 2
    assert text.count("HOBBIT mixed precision") == 1 and "4.2000 -> 4.3000 (+2.38%), 25.0% of the expert" in text


def test_a_quality_run_with_accuracy_links_its_own_page(tmp_path):
    rec = quality_run("2026-01-03T00:00", "wide", False)
    rec["model"]["name"], rec["rows"][0]["accuracy"] = "wide", 0.5
    (tmp_path / "quality-0.json").write_text(json.dumps(rec))
    text = report.report(tmp_path)
    assert "in [quality/wide.md](quality/wide.md) (GPU X, 2026-01-03" in text and "| milo | 3 |" not in text


def test_committed_performance_page_and_readme_table_are_what_the_results_generate():
    """docs/performance.md and README.md's performance table are `python bench/report.py --write`'s output for the
    committed bench/results: a new result, or a hand edit of either page, fails here until the report is rerun."""
    results = report.ROOT / "bench" / "results"
    runs = report.newest_runs(results)
    assert report.PAGE.read_text() == report.report(results, runs), "rerun `python bench/report.py --write`"
    readme = report.README.read_text()
    assert readme == report.readme_with_headline(readme, runs), "rerun `python bench/report.py --write`"
    headline = "\n".join(report.headline(runs))
    assert headline in readme and headline in report.PAGE.read_text()


def serve_run(date: str, server_args: str | None, tok_per_s: float) -> dict:
    level = dict(clients=64, concurrent=dict(tok_per_s=tok_per_s, ttft_p50_ms=1, ttft_p99_ms=2, itl_p50_ms=1,
                                             itl_p99_ms=2), sequential=dict(tok_per_s=100.0), speedup=tok_per_s / 100)
    return dict(name="serve", date=date, device="GPU X", device_type="cuda", torch="t", transformers="tf",
                git=dict(commit="abcdef123"), levels=[level],
                config=dict(model="/x/demo", server_args=server_args, server="[ready]", prompt_min=16,
                            prompt_max=160, gen=64))


def test_serve_runs_with_another_placement_keep_their_own_table(tmp_path):
    """A newer serve run with --cpu-moe does not hide the plain one; the headline quotes the plain one."""
    for i, rec in enumerate([serve_run("2026-01-01T00:00", None, 900.0),
                             serve_run("2026-01-02T00:00", "--cpu-moe", 300.0)]):
        (tmp_path / f"serve-{i}.json").write_text(json.dumps(rec))
    runs = report.newest_runs(tmp_path)
    assert len(runs) == 2
    (row,) = report.serve_rows(runs)
    assert row[:3] == ("`moeserve serve`, 64 streaming clients, 64 tokens each: demo", "900 tok/s",
                       "the same requests one at a time: 100 tok/s (9.0x)")
