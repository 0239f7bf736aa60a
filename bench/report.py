"""Markdown tables from bench/results/*.json (the newest run per benchmark and device).

    python bench/report.py                 # print the tables
    python bench/report.py --update-readme # rewrite the block between the perf markers in README.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- perf:begin (bench/report.py) -->", "<!-- perf:end -->"


def newest_runs(results_dir: Path) -> list[dict]:
    """The newest non-quick JSON per (benchmark name, device)."""
    runs = {}
    for path in sorted(results_dir.glob("*.json")):
        rec = json.loads(path.read_text())
        if rec.get("config", {}).get("quick"):
            continue
        key = (rec["name"], rec["device"])
        if key not in runs or rec["date"] > runs[key]["date"]:
            runs[key] = rec
    return [runs[k] for k in sorted(runs)]


def _source(rec: dict) -> str:
    return (f"{rec['device']}, {rec['date'][:10]}, torch {rec['torch']}, transformers {rec['transformers']}, "
            f"commit {rec['git']['commit'][:8]}")


def moe_block_tables(rec: dict) -> list[str]:
    lines = []
    for shape in rec["shapes"]:
        lines += [f"**MoE block, {shape['shape']}** (E={shape['num_experts']}, top-{shape['top_k']}, "
                  f"D={shape['hidden']}, F={shape['ffn']}, {shape['dtype']}; {_source(rec)})", "",
                  "| tokens | moeserve ms | HF eager ms | HF grouped_mm ms | floor ms | time moeserve / floor | "
                  "time moeserve / HF grouped_mm |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in shape["rows"]:
            lines.append(f"| {r['tokens']} | {r['ours_ms']:.3f} | {r['hf_eager_ms']:.3f} | {r['hf_grouped_mm_ms']:.3f}"
                         f" | {r['floor_ms']:.3f} ({r['floor_bound']}) | {r['ours_over_floor']:.2f} | "
                         f"{r['ours_over_hf_grouped_mm']:.2f} |")
        lines.append("")
    return lines


def decode_table(rec: dict) -> list[str]:
    lines = [f"**Demo model decode** (prompt 64, 128 new greedy tokens; {_source(rec)})", "",
             "| device | dtype | threads | batch | moeserve tok/s | HF generate tok/s | speed moeserve / HF | "
             "greedy tokens equal to HF |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rec["results"]:
        m = r["greedy_match_prefix"]
        lines.append(f"| {r['device']} | {r['dtype']} | {r['threads']} | {r['batch']} | {r['ours']['decode_tok_s']:.0f}"
                     f" | {r['hf']['decode_tok_s']:.0f} | {r['ours_decode_over_hf_decode_speed']:.2f} | "
                     f"{m['min']}/{m['of']} |")
    return lines + [""]


def report(results_dir: Path) -> str:
    lines = []
    for rec in newest_runs(results_dir):
        lines += {"moe_block": moe_block_tables, "decode": decode_table}.get(rec["name"], lambda r: [])(rec)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--update-readme", action="store_true")
    args = ap.parse_args()
    text = report(Path(args.results))
    if not args.update_readme:
        print(text)
        return
    readme = ROOT / "README.md"
    body = readme.read_text()
    start, end = body.index(BEGIN) + len(BEGIN), body.index(END)
    readme.write_text(body[:start] + "\n" + text + body[end:])


if __name__ == "__main__":
    main()
