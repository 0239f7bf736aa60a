"""bench/quality.py's generated page: docs/quality/<model>.md (the model and its training curve, the issue's targets
checked, the table, the commands that reproduce it) and docs/quality/<model>.svg (perplexity against bytes, an SVG
written directly: no plotting library needed)."""

from __future__ import annotations

from html import escape
from pathlib import Path

COLORS = {"bf16": "#000000", "rtn": "#999999", "hqq": "#1f77b4", "gptq": "#9467bd", "milo": "#d62728",
          "mxfp4": "#2ca02c", "dense8": "#8c564b", "hobbit": "#ff7f0e"}
WIDTH, HEIGHT, MARGIN = 900, 560, 70
Y_CLIP = 1.30  # rows above 1.3x the bf16 perplexity are drawn on the top edge, their value written beside them


def write_doc(record: dict, docs: Path, result_path: Path) -> list[Path]:
    docs.mkdir(parents=True, exist_ok=True)
    name = record["model"]["name"]
    svg, md = docs / f"{name}.svg", docs / f"{name}.md"
    svg.write_text(plot_svg(record["rows"], f"{name}: held-out perplexity against bytes"))
    md.write_text("\n".join(page(record, svg.name, result_path)) + "\n")
    return [md, svg]


def plot_svg(rows: list[dict], title: str) -> str:
    """Perplexity (y) against model bytes (x, MB), one dot per row coloured by method; the bf16 line dashed."""
    ref = rows[0]["perplexity"]
    xs = [r["bytes"] / 1e6 for r in rows]
    x0, x1 = 0.0, max(xs) * 1.05
    y0 = min(r["perplexity"] for r in rows) * 0.995
    y1 = min(max(r["perplexity"] for r in rows), ref * Y_CLIP) * 1.005

    def px(x: float) -> float:
        return MARGIN + (x - x0) / (x1 - x0) * (WIDTH - 2 * MARGIN)

    def py(y: float) -> float:
        return HEIGHT - MARGIN - (min(y, y1) - y0) / (y1 - y0) * (HEIGHT - 2 * MARGIN)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="11">', f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" font-size="15">{escape(title)}</text>']
    for i in range(6):  # grid and tick labels
        x, y = x0 + i * (x1 - x0) / 5, y0 + i * (y1 - y0) / 5
        out += [f'<line x1="{px(x):.1f}" y1="{MARGIN}" x2="{px(x):.1f}" y2="{HEIGHT - MARGIN}" stroke="#eee"/>',
                f'<text x="{px(x):.1f}" y="{HEIGHT - MARGIN + 16}" text-anchor="middle">{x:.0f}</text>',
                f'<line x1="{MARGIN}" y1="{py(y):.1f}" x2="{WIDTH - MARGIN}" y2="{py(y):.1f}" stroke="#eee"/>',
                f'<text x="{MARGIN - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.3f}</text>']
    out += [f'<line x1="{MARGIN}" y1="{py(ref):.1f}" x2="{WIDTH - MARGIN}" y2="{py(ref):.1f}" stroke="black" '
            f'stroke-dasharray="4 3"/>',
            f'<text x="{WIDTH / 2}" y="{HEIGHT - 20}" text-anchor="middle">model bytes (MB)</text>',
            f'<text x="18" y="{HEIGHT / 2}" text-anchor="middle" transform="rotate(-90 18 {HEIGHT / 2})">'
            f'held-out perplexity</text>']
    for r, x in zip(rows, xs):
        color = COLORS.get(r["method"], "#17becf")
        clipped = r["perplexity"] > y1
        tip = f'{r["label"]}: {r["perplexity"]:.4f}, {x:.1f} MB'
        out.append(f'<circle cx="{px(x):.1f}" cy="{py(r["perplexity"]):.1f}" r="4" fill="{color}" '
                   f'fill-opacity="0.75"><title>{escape(tip)}</title></circle>')
        if clipped:
            out.append(f'<text x="{px(x) + 5:.1f}" y="{py(r["perplexity"]) + 12:.1f}" fill="{color}">'
                       f'{escape(r["label"].split()[0])} {r["perplexity"]:.2f}</text>')
    for i, (method, color) in enumerate(COLORS.items()):  # legend
        y = MARGIN + 14 * i
        out += [f'<circle cx="{WIDTH - MARGIN - 90}" cy="{y}" r="4" fill="{color}"/>',
                f'<text x="{WIDTH - MARGIN - 80}" y="{y + 4}">{method}</text>']
    return "\n".join(out + ["</svg>"]) + "\n"


def curve(history: list[dict], keep: int = 12) -> list[str]:
    """The training run's held-out loss at up to `keep` evaluations, evenly spread, the last one included."""
    if not history:
        return []
    picks = sorted({round(i * (len(history) - 1) / max(keep - 1, 1)) for i in range(min(keep, len(history)))})
    return ["| step | train loss (nats) | held-out bits/token | s |", "|---:|---:|---:|---:|"] + [
        f"| {h['step']} | {h['train_loss']:.4f} | {h['heldout_bits_per_byte']:.4f} | {h.get('seconds', 0):.0f} |"
        for h in (history[i] for i in picks)]


def targets(rows: list[dict]) -> list[str]:
    """The issue's three targets, each with the row that decides it."""
    by = {r["label"]: r for r in rows}
    lines = []
    hqq4 = next((r for r in rows if r["label"].startswith("hqq-4 ")), None)
    if hqq4:
        lines.append(f"- 4-bit HQQ within 1.5% of bf16: {hqq4['label']} {hqq4['ppl_vs_bf16']:+.2%} "
                     f"({'met' if hqq4['ppl_vs_bf16'] <= 0.015 else 'not met'})")
    milo = [r for r in rows if r["method"] == "milo" and r["bits"] == 3 and "gap_recovered_vs_hqq" in r
            and r["memory_added_vs_hqq"] <= 0.05 + 1e-9]
    if milo:
        best = max(milo, key=lambda r: r["gap_recovered_vs_hqq"])
        lines.append(f"- 3-bit MiLo at <= +5% memory recovers >= 60% of HQQ's gap: best {best['label']} "
                     f"{best['gap_recovered_vs_hqq']:.0%} at {best['memory_added_vs_hqq']:+.1%} "
                     f"({'met' if best['gap_recovered_vs_hqq'] >= 0.6 else 'not met'})")
    mixed = next((r for r in rows if "(--mixed-precision)" in r["label"]), None)
    if mixed:
        fewer = 1 - mixed["expert_bytes_read_vs_bf16"]
        ok = mixed["ppl_vs_bf16"] <= 0.01 and fewer >= 0.25
        lines.append(f"- mixed precision at T1/T2 {mixed['t1']}/{mixed['t2']}: {mixed['ppl_vs_bf16']:+.2%} perplexity "
                     f"for {fewer:.0%} fewer expert bytes read ({'met' if ok else 'not met'}: <= 1% for >= 25%)")
    skip = by.get("experts hqq-4 + skip T2=0.9 (--experts-bits 4 --mixed-precision)")
    base = by.get("experts hqq-4 (--experts-bits 4)")
    if skip and base:
        lines.append(f"- `--experts-bits 4 --mixed-precision` against `--experts-bits 4`: "
                     f"{skip['perplexity'] / base['perplexity'] - 1:+.2%} perplexity, "
                     f"{1 - skip['expert_bytes_read_vs_bf16'] / base['expert_bytes_read_vs_bf16']:.0%} fewer expert "
                     f"bytes read")
    return lines


def row_line(r: dict) -> str:
    gap = f"{r['gap_recovered_vs_hqq']:.0%}" if "gap_recovered_vs_hqq" in r else ""
    added = f"{r['memory_added_vs_hqq']:+.1%}" if "memory_added_vs_hqq" in r else ""
    read = f"{r['expert_bytes_read_vs_bf16']:.0%}" if "expert_bytes_read_vs_bf16" in r else ""
    return (f"| {r['label']} | {r['perplexity']:.4f} | {r['ppl_vs_bf16']:+.2%} | {r['accuracy']:.4f} | "
            f"{r['bytes'] / 1e6:.1f} | {r['compensator_bytes'] / 1e3:.0f} | {gap} | {added} | {read} | "
            f"{r['seconds']:.1f} |")


def shown_path(path: Path) -> str:
    """A path relative to the repository when it is inside it."""
    repo = Path(__file__).resolve().parent.parent
    return str(path.resolve().relative_to(repo)) if path.resolve().is_relative_to(repo) else str(path)


def page(record: dict, svg: str, result_path: Path) -> list[str]:
    m, c = record["model"], record["config"]
    git = record["git"].get("commit") or "unknown"
    trained = (f"`{m['architecture']}` trained {m['steps']} steps, {m.get('tokens_seen', 0) / 1e6:.0f}M tokens "
               f"seen of {m.get('train_tokens', 0) / 1e6:.1f}M, in {m.get('seconds', 0) / 60:.1f} min on "
               f"{m.get('device', '?')}" if "architecture" in m else "the built-in demo")
    held = ", ".join(m.get("heldout_texts", [])[:6]) + (" ..." if len(m.get("heldout_texts", [])) > 6 else "")
    name = m["name"]
    model_arg = "" if name == "demo" else f" --model {c.get('model_dir', 'DIR')}"
    return [
        f"# Quantization quality: {name}", "",
        "Generated by `bench/quality.py` (do not edit by hand).", "",
        f"Model: {m['parameters'] / 1e6:.0f}M parameters, {m['layers']} layers of {m['experts']} experts top-"
        f"{m['top_k']}, hidden {m['hidden_size']}, expert FFN {m['expert_ffn']}, vocabulary {m['vocab_size']}; "
        f"{trained}.", "",
        f"Measured on {record['device']}, {record['date']}, torch {record['torch']}, commit {git[:8]}; "
        f"{c['eval_tokens']:,} held-out tokens ({held or 'heldout.txt'}) in windows of {c['window']}, evenly "
        f"spread, fp32 compute; calibration: {c['calibration']} ({c['calibration_tokens']:,} tokens). "
        f"Record: `{shown_path(result_path)}`.",
        "",
        "Reproduce:", "",
        "```",
        *([] if name == "demo" else [
            f"python -m moeserve.train --arch {m.get('architecture', 'wide')} --texts .data/texts --out "
            f"{c.get('model_dir', 'DIR')} --device cuda"]),
        f"python bench/quality.py --part quality{model_arg} --texts .data/texts",
        "```", "",
        "## Targets", "", *targets(record["rows"]), "",
        f"![perplexity against bytes]({svg})", "",
        "## Table", "",
        "Bytes: what the method's checkpoint holds (HOBBIT: the float model and the 4-bit copies its store keeps). "
        "Gap recovered and memory added: against HQQ at the same bits and group. Expert bytes read: per token, "
        "relative to every selected expert read in bf16.", "",
        "| method | perplexity | vs bf16 | next-token accuracy | MB | compensators KB | HQQ gap recovered | "
        "memory added vs HQQ | expert bytes read | s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[row_line(r) for r in record["rows"]], "",
        *([f"Left out when `--minutes` ran out: {', '.join(record['rows_left_out'])}.", ""]
          if record.get("rows_left_out") else []),
        *([f"Failed: {'; '.join(f['label'] + ' (' + f['error'] + ')' for f in record['rows_failed'])}.", ""]
          if record.get("rows_failed") else []),
        f"The whole run took {record.get('seconds', 0) / 60:.1f} min.", "",
        *(["## Training curve", "", *curve(m.get("history", [])), ""] if m.get("history") else []),
    ]
