"""Markdown tables from bench/results/*.json (the newest run per benchmark and device): docs/performance.md, and its
headline table in README.md (between the README's two PERFORMANCE markers).

    python bench/report.py          # print the page
    python bench/report.py --write  # write docs/performance.md and README.md's table (what is committed)
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def newest_runs(results_dir: Path) -> list[dict]:
    """The newest non-quick JSON per (benchmark name, device; for CPU runs also the core count)."""
    runs = {}
    for path in sorted(results_dir.glob("*.json")):
        rec = json.loads(path.read_text())
        if "name" not in rec or rec.get("config", {}).get("quick"):  # hardware profiles are not benchmark runs
            continue
        key = (rec["name"], rec["device"], rec.get("cpu_count") if rec.get("device_type") == "cpu" else None,
               _variant(rec))
        merge = {"kernels": _with_newest_rows,  # runs may time a subset of the rows (--rows)
                 "moe_block": _with_newest_block_rows,  # runs may time a subset of the token counts
                 "lowbit_decode": _with_baseline,  # runs may skip transformers (--hf-layers 0)
                 "hybrid": _with_newest_shapes}.get(rec["name"])  # runs may measure a subset of the shapes
        if merge is not None:  # the merge keeps the newer run's fields whatever the file order
            runs[key] = merge(runs.get(key), rec)
        elif key not in runs or rec["date"] > runs[key]["date"]:
            runs[key] = rec
    return [runs[k] for k in sorted(runs)]


def _variant(rec: dict) -> str:
    """What keeps runs of one benchmark on one device apart: a run over fewer token counts does not hide a full
    one, nor a 3-bit run a 4-bit one, nor a quality run of one model another model's (MoE block runs merge)."""
    if rec["name"] == "moe_block":
        return ""
    if rec["name"] == "serve":  # a server placement (--cpu-moe, --offload ...) does not hide the plain one
        return json.dumps([serve_model(rec["config"]), rec["config"].get("server_args") or ""])
    if rec["name"] == "batching":
        return json.dumps([serve_model(rec["config"]), rec["config"]["prefill_tokens"]])
    keys = ("tokens", "bits", "model") if rec["name"] == "quality" else ("tokens", "bits", "batch")
    return json.dumps([rec.get("config", {}).get(k) for k in keys])


def _with_newest_rows(old: dict | None, new: dict) -> dict:
    """The newer of two low-bit linear runs, its rows completed by the other's (N, K, bits, rows) it lacks; each
    row keeps the commit it was measured at."""
    for rec in (old, new):
        for r in rec["rows"] if rec else []:
            r.setdefault("commit", rec["git"]["commit"][:8])
    if old is None:
        return new
    newer, older = (new, old) if new["date"] > old["date"] else (old, new)
    have = {(r["N"], r["K"], r["bits"], r["rows"]) for r in newer["rows"]}
    rows = newer["rows"] + [r for r in older["rows"] if (r["N"], r["K"], r["bits"], r["rows"]) not in have]
    return {**newer, "rows": sorted(rows, key=lambda r: (-r["N"], r["K"], -r["bits"], r["rows"]))}


def _with_newest_shapes(old: dict | None, new: dict) -> dict:
    """The newer of two hybrid runs, its shapes completed by the other's it lacks and each shape's columns by the
    other's rows of columns it lacks; each shape keeps the date and commit it was measured at, and a row from the
    other run names its commit."""
    for rec in (old, new):
        for shape in (rec["shapes"] if rec else {}).values():
            shape.setdefault("measured", _measured(rec))
            for row in shape["rows"]:
                row.setdefault("commit", rec["git"]["commit"][:8])
    if new["config"].get("dense_bits", 16) == 8:  # another column than bf16's (`old` merged runs already labelled)
        for shape in new["shapes"].values():
            for row in shape["rows"]:
                row["column"] += "+dense8"
    if old is None:
        return new
    newer, older = (new, old) if new["date"] > old["date"] else (old, new)
    shapes = {**older["shapes"], **newer["shapes"]}
    for name, shape in newer["shapes"].items():
        if name in older["shapes"]:
            have = {row["column"] for row in shape["rows"]}
            extra = [row for row in older["shapes"][name]["rows"] if row["column"] not in have]
            shapes[name] = {**shape, "rows": shape["rows"] + extra}
    return {**newer, "shapes": shapes}


_EXPERTS = ("bf16", "4-bit", "3-bit")  # the order of a block's low-bit rows


def _measured(rec: dict) -> str:
    return f"{rec['date'][:10]}, {rec['git']['commit'][:8]}"


def _with_newest_block_rows(old: dict | None, new: dict) -> dict:
    """The newer of two MoE block runs, each shape's rows completed by the other's token counts (and low-bit
    (experts, tokens) rows) it lacks; each row keeps the date and commit it was measured at."""
    for rec in (old, new):
        for shape in rec["shapes"] if rec else []:
            for r in shape["rows"] + shape.get("lowbit", []):
                r.setdefault("measured", _measured(rec))
    if old is None:
        return new
    newer, older = (new, old) if new["date"] > old["date"] else (old, new)
    shapes = {s["shape"]: s for s in older["shapes"]}
    for shape in newer["shapes"]:
        prev = shapes.get(shape["shape"], {})
        have = {r["tokens"] for r in shape["rows"]}
        rows = shape["rows"] + [r for r in prev.get("rows", []) if r["tokens"] not in have]
        have_lb = {(r["experts"], r["tokens"]) for r in shape.get("lowbit", [])}
        lowbit = shape.get("lowbit", []) + [r for r in prev.get("lowbit", [])
                                            if (r["experts"], r["tokens"]) not in have_lb]
        shapes[shape["shape"]] = {**shape, "rows": sorted(rows, key=lambda r: r["tokens"]),
                                  "lowbit": sorted(lowbit, key=lambda r: (_EXPERTS.index(r["experts"]), r["tokens"]))}
    return {**newer, "shapes": list(shapes.values())}


def _with_baseline(old: dict | None, new: dict, name: str = "hf_accelerate_bf16") -> dict:
    """The newer of two decode runs, with the other's baseline result `name` where it has none (marked with the
    commit and date it was measured at)."""
    if old is None:
        return new
    newer, older = (new, old) if new["date"] > old["date"] else (old, new)
    if name in newer["results"] or name not in older["results"]:
        return newer
    carried = older["results"][name]
    when = carried.get("measured", f"{older['date'][:10]}, commit {older['git']['commit'][:8]}")
    return {**newer, "results": {**newer["results"], name: {**carried, "measured": when}}}


def _source(rec: dict) -> str:
    cores = f" ({rec['cpu_count']} cores)" if rec.get("device_type") == "cpu" else ""
    return (f"{rec['device']}{cores}, {rec['date'][:10]}, torch {rec['torch']}, transformers {rec['transformers']}, "
            f"commit {rec['git']['commit'][:8]}")


def moe_block_tables(rec: dict) -> list[str]:
    """Per shape: the block against transformers, then the block as a CUDA graph with bf16 / 4-bit / 3-bit experts;
    each row from the newest run that measured it (`measured`: date, commit)."""
    lines = []
    for shape in rec["shapes"]:
        dates = sorted(r.get("measured", _measured(rec))[:10] for r in shape["rows"] + shape.get("lowbit", []))
        lines += [f"**MoE block, {shape['shape']}** (E={shape['num_experts']}, top-{shape['top_k']}, "
                  f"D={shape['hidden']}, F={shape['ffn']}, {shape['dtype']}; {rec['device']}, "
                  f"{dates[0]}{f' to {dates[-1]}' if dates[-1] != dates[0] else ''}, torch {rec['torch']}, "
                  f"transformers {rec['transformers']}; each row from the newest run that measured it; "
                  "`python bench/moe_block.py`)", "",
                  "| tokens | moeserve ms | HF eager ms | HF grouped_mm ms | floor ms | time moeserve / floor | "
                  "time moeserve / HF grouped_mm | measured |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in shape["rows"]:
            lines.append(f"| {r['tokens']} | {r['ours_ms']:.3f} | {r['hf_eager_ms']:.3f} | {r['hf_grouped_mm_ms']:.3f}"
                         f" | {r['floor_ms']:.3f} ({r['floor_bound']}) | {r['ours_over_floor']:.2f} | "
                         f"{r['ours_over_hf_grouped_mm']:.2f} | {r.get('measured', _measured(rec))} |")
        lines.append("")
        if shape.get("lowbit"):
            lines += ["| experts | tokens | eager ms | CUDA graph ms | byte floor ms | graph / floor | measured |",
                      "|---|---:|---:|---:|---:|---:|---|"]
            lines += [f"| {r['experts']} | {r['tokens']} | {r['eager_ms']:.3f} | {r['cuda_graph_ms']:.3f} | "
                      f"{r['floor_ms']:.3f} | {r['cuda_graph_ms'] / r['floor_ms']:.2f} | "
                      f"{r.get('measured', _measured(rec))} |" for r in shape["lowbit"]]
            lines.append("")
    return lines


def decode_table(rec: dict) -> list[str]:
    lines = [f"**Demo model decode** (prompt 64, 128 new greedy tokens; {_source(rec)})", "",
             "| device | dtype | threads | batch | moeserve tok/s | moeserve CUDA graph tok/s (steady) | "
             "HF generate tok/s | speed moeserve / HF | greedy tokens equal to HF |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rec["results"]:
        m, graph = r["greedy_match_prefix"], r.get("ours_graph")
        best = graph["steady_decode_tok_s"] if graph else r["ours"]["decode_tok_s"]
        lines.append(f"| {r['device']} | {r['dtype']} | {r['threads']} | {r['batch']} | {r['ours']['decode_tok_s']:.0f}"
                     f" | {f'{best:.0f}' if graph else '-'} | {r['hf']['decode_tok_s']:.0f} | "
                     f"{best / r['hf']['decode_tok_s']:.2f} | {m['min']}/{m['of']} |")
    return lines + [""]


def quality_model(rec: dict) -> str:
    """The model a quality run measured: the demo, or a trained model's name, architecture and shape."""
    m = rec.get("model")
    if rec["config"].get("model") == "demo" or not m:
        return "demo model"
    trained = f"{m['architecture']} at scale {m['scale']}, " if "architecture" in m else ""
    return (f"{m['name']} ({trained}{m['parameters'] / 1e6:.1f}M parameters, {m['layers']} layers of {m['experts']} "
            f"experts top-{m['top_k']}, hidden {m['hidden_size']}, expert FFN {m['expert_ffn']})")


def mixed_precision_line(rec: dict) -> list[str]:
    """HOBBIT's mixed-precision cost on the run's model, when the run measured it."""
    mp, c = rec.get("mixed_precision"), rec["config"]
    if not mp:
        return []
    return [f"HOBBIT mixed precision on this model (4-bit experts on the CPU, the first {c['mixed_tokens']:,} "
            f"held-out bytes, windows of {c['mixed_window']}): perplexity {mp['4bit']:.4f} -> {mp['4bit+mixed']:.4f} "
            f"({mp['mixed_ppl_cost']:+.2%}), {mp['4bit+mixed_skipped_share']:.1%} of the expert pairs skipped.", ""]


def quality_row(r: dict, ref: float) -> str:
    """One method's row of a quality table; `ref` is the float model's perplexity."""
    milo = r.get("method") == "milo"
    comp = {16: "bf16", 8: "int8", 3: "int3"}[r.get("compensator_bits", 16)] if milo else ""
    gap = f"{100 * r['gap_recovered_vs_hqq']:.0f}%" if "gap_recovered_vs_hqq" in r else ""
    added = f"{100 * r['memory_added_vs_hqq']:+.1f}%" if "memory_added_vs_hqq" in r else ""
    return (f"| {r.get('method', 'bf16')} | {r.get('bits', 16)} | {r.get('ranks', '') if milo else ''} | {comp} | "
            f"{r['perplexity']:.4f} | {100 * (r['perplexity'] / ref - 1):+.2f}% | {gap} | "
            f"{r['checkpoint_bytes'] / 1e6:.2f} | {r['compensator_bytes'] / 1e3:.0f} | {added} | "
            f"{r['quantize_seconds']:.1f} |")


def quality_table(rec: dict) -> list[str]:
    """Perplexity, bytes and time of each method on the run's model, then its mixed-precision cost."""
    c, ref = rec["config"], rec["rows"][0]["perplexity"]
    return [f"**Quantization quality, {quality_model(rec)}** (group {c['group']}, held-out Hamlet "
            f"{c['eval_tokens']:,} tokens, windows of {c['window']}, fp32 compute; {_source(rec)})", "",
            "| method | bits | ranks | compensator | perplexity | vs bf16 | HQQ gap recovered (same bits) | "
            "checkpoint MB | compensators KB | memory added vs HQQ | quantize s |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"] + [
        quality_row(r, ref) for r in rec["rows"]] + [""] + mixed_precision_line(rec)


def quality_speed_table(rec: dict) -> list[str]:
    """Seconds to quantize one Mixtral-size expert matrix, and what that makes for all of Mixtral-8x7B's experts."""
    speed = rec["expert_matrix_speed"]
    return [f"**Quantization speed, one {speed['shape'][0]} x {speed['shape'][1]} expert matrix, 3-bit group 64** "
            f"({_source(rec)})", "",
            "| HQQ s | MiLo rank 32, 20 rounds s | MiLo with early stop s (rounds) | "
            "Mixtral-8x7B experts, MiLo 20 rounds | same, early stop | same, HQQ |",
            "|---:|---:|---:|---:|---:|---:|",
            f"| {speed['hqq_s']:.3f} | {speed['milo_s']:.2f} | {speed['milo_default_s']:.2f} "
            f"({speed['milo_default_rounds']}) | {speed['mixtral_8x7b_milo_minutes_estimate']:.1f} min | "
            f"{speed['mixtral_8x7b_milo_default_minutes_estimate']:.1f} min | "
            f"{speed['mixtral_8x7b_hqq_minutes_estimate']:.1f} min |", ""]


def quality_tables(rec: dict) -> list[str]:
    """A quality run's tables: its model's methods (a run of today's bench, whose rows score next-token accuracy,
    writes its own page, docs/quality/<model>.md: a link to it), and the expert-matrix speed when the run timed
    it."""
    lines = quality_table(rec) if rec.get("rows") else []
    if rec.get("rows") and "accuracy" in rec["rows"][0]:
        page = f"quality/{rec['model']['name']}.md"
        lines = [f"**Quantization quality, {quality_model(rec)}**: every method's perplexity, accuracy and bytes in "
                 f"[{page}]({page}) ({_source(rec)})", ""]
    return lines + (quality_speed_table(rec) if rec.get("expert_matrix_speed") else [])


def cpu_kernel_tables(rec: dict) -> list[str]:
    c = rec["config"]
    dram = rec["floor_rates"]["dram_read"]["bytes_per_s"] / 1e9
    lines = [f"**CPU low-bit GEMV/GEMM, generated kernels** ({rec['threads']} threads, ISA {c['isa']}, tile "
             f"{c['tile_rows']}x{c['tile_vectors']}, group 64, DRAM read {dram:.1f} GB/s; {_source(rec)})", "",
             "| out x in | bits | rows | moeserve ms | weight GB/s | % of DRAM read | torch fp32 ms | torch bf16 ms | "
             "unpack+matmul ms | speed vs bf16 | speed vs fp32 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rec["gemv"]:
        lines.append(f"| {r['out']} x {r['in']} | {r['bits']} | {r['rows']} | {r['ours_ms']:.3f} | {r['ours_gb_s']:.1f} "
                     f"| {100 * r['dram_share']:.0f}% | {r['torch_fp32_ms']:.3f} | {r['torch_bf16_ms']:.3f} | "
                     f"{r['unpack_matmul_ms']:.2f} | {r['speed_vs_bf16']:.2f} | {r['speed_vs_fp32']:.2f} |")
    lines += ["", f"**End to end on the CPU** ({rec['threads']} threads; {_source(rec)}): one Mixtral-shaped MoE "
              "expert layer (8 x 4096 -> 14336, top-2, 1 token) and demo-model greedy decode", "",
              "| what | " + " | ".join(r["experts"] for r in rec["moe_layer"]) + " |",
              "|---|" + "---:|" * len(rec["moe_layer"]),
              "| MoE layer ms per token | " + " | ".join(f"{r['ms']:.2f}" for r in rec["moe_layer"]) + " |",
              "", "| demo decode | " + " | ".join(r["weights"] for r in rec["demo_decode"]) + " |",
              "|---|" + "---:|" * len(rec["demo_decode"]),
              "| tokens/s | " + " | ".join(f"{r['tokens_per_s']:.0f}" for r in rec["demo_decode"]) + " |", ""]
    return lines


def _schedule(cfg: dict) -> str:
    """A fused-MoE projection config's schedule: decode, row tiles, or row tiles through TMA descriptors."""
    if cfg.get("schedule") != "tiles":
        return "decode"
    return "tiles (TMA)" if cfg.get("TMA") else "tiles"


def _tuned(results_dir: Path, device: str) -> str:
    """When `bench/tune_fused_moe.py` last ran on `device`, from its result records."""
    dates = sorted(rec["date"][:10] for rec in map(json.loads, (p.read_text() for p in
                   results_dir.glob("tune_fused_moe-*.json"))) if rec.get("device") == device)
    return f"tuner run of {dates[-1]}" if dates else "tuner run not recorded"


def fused_moe_tables(config_dir: Path, results_dir: Path) -> list[str]:
    """Kernel-only times from the tuner's per-GPU config files (moeserve/kernels/triton/configs)."""
    lines = []
    for path in sorted(config_dir.glob("*.json")):
        table = json.loads(path.read_text())
        if not table.get("timings"):  # a table written by `moeserve tune` records configs, not kernel timings
            continue
        lines += [f"**Triton fused MoE kernels alone** (the two launches, bf16, routing excluded; the grouped_mm "
                  "path: two torch._grouped_mm calls with the SwiGLU between, fused from 256 tokens on, torch's "
                  "two elementwise kernels below; "
                  f"{table['device']}, {_tuned(results_dir, table['device'])}; `python bench/tune_fused_moe.py`, "
                  f"{path.relative_to(ROOT)}; the low-bit MoE's configs: `python bench/tune_lowbit_moe.py`)", "",
                  "| shape | tokens | schedule (gate_up, down) | fused ms | grouped_mm path ms | floor ms | fused / floor |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for key, by_tokens in table.get("timings", {}).items():
            for t, r in by_tokens.items():
                cfg = table.get("fused_moe", {}).get(key, {}).get(t, {})
                schedule = ", ".join(_schedule(cfg[p]) for p in ("gate_up", "down") if p in cfg)
                lines.append(f"| {key} | {t} | {schedule} | {r['fused_ms']:.3f} | {r['grouped_mm_ms']:.3f} | "
                             f"{r['floor_ms']:.3f} | {r['fused_ms'] / r['floor_ms']:.2f} |")
        lines.append("")
    return lines


def kernel_tables(rec: dict) -> list[str]:
    lines = [f"**Triton low-bit linear** (group 64, {rec['config']['dtype']} activations; GPU ms = CUDA-graph replay "
             f"of the best swept config, as decode runs it; the newest run of each row, at the commit shown; "
             f"{_source(rec)})", "",
             "| N x K | bits | rows | GPU ms | with launch ms | floor ms | % of HBM | bf16 cuBLAS GPU ms | vs bf16 | commit |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rec["rows"]:
        gpu = r.get("best_graph_ms", r.get("dispatch_graph_ms", r["ours_ms"]))
        bf16 = r.get("bf16_graph_ms", r["bf16_ms"])
        lines.append(f"| {r['N']} x {r['K']} | {r['bits']} | {r['rows']} | {gpu:.4f} | {r['ours_ms']:.4f} | "
                     f"{r['floor_ms']:.4f} | {100 * r['floor_ms'] / gpu:.0f}% | {bf16:.4f} | {bf16 / gpu:.2f}x | "
                     f"{r.get('commit', '')} |")
    return lines + [""]


def offload_table(rec: dict) -> list[str]:
    c = rec["config"]
    lines = [f"**Offloaded decode, Mixtral-8x7B shape** (batch 1, bf16 + {c['low_bits']}-bit experts in pinned host "
             f"memory, routing replayed from the demo model: `{c['routing']}`; host->GPU "
             f"{rec['h2d_bytes_per_s'] / 1e9:.1f} GB/s; {_source(rec)})", "",
             "| GPU budget | method | tokens/s | vs naive | hit rate | GB moved / token | floor tokens/s | "
             "share of floor |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    rows = [r for r in rec["results"] if "budget_bytes" in r]
    naive = {r["budget_bytes"]: r["tokens_per_s"] for r in rows if r["method"] == "naive"}
    for r in rows:
        lines.append(f"| {r['budget_bytes'] / 2 ** 30:.0f} GiB | {r['method']} | {r['tokens_per_s']:.2f} | "
                     f"{r['tokens_per_s'] / naive[r['budget_bytes']]:.2f} | {r['hit_rate']:.0%} | "
                     f"{r['bytes_per_token'] / 1e9:.1f} | {r['floor_tokens_per_s']:.2f} | {r['of_floor']:.0%} |")
    for r in rec["results"]:
        if r["method"] == "hf-accelerate" and "tokens_per_s" in r:
            lines.append(f"| any | transformers + accelerate (MoE blocks on the CPU; {r['measured_layers']} layers "
                         f"timed, scaled to 32) | {r['tokens_per_s']:.3f} | "
                         f"{r['tokens_per_s'] / next(iter(naive.values())):.2f} | | | | |")
    return lines + [""]


def throughput_table(rec: dict) -> list[str]:
    c = rec["config"]
    lines = [f"**Batch throughput, Mixtral-8x7B shape** (random bf16 weights in pinned host memory, prompt {c['prompt']}, "
             f"KV sized for {c['gen']} new tokens, {c['timed_steps']} decode steps timed, N <= {c['max_batch']}; "
             f"{_source(rec)})", "",
             "| GPU budget | schedule | N / n | CPU attention | weights on GPU | decode tok/s | predicted tok/s | "
             "measured / predicted |", "|---:|---|---|---|---:|---:|---:|---:|"]
    for r in (r for r in rec["results"] if "schedule" in r):  # the others are cgopipe/baseline ratio rows
        p = r["policy"]
        lines.append(f"| {r['budget_bytes'] / 2 ** 30:.0f} GiB | {r['schedule']} | {p['batch_size']} / {p['micro_batch']} | "
                     f"{'yes' if not p['attention_on_gpu'] else 'no'} | {p['weights_gpu_fraction']:.0%} | "
                     f"{r['decode_tokens_per_s']:.1f} | {r['predicted_decode_tokens_per_s']:.1f} | "
                     f"{r['measured_over_predicted']:.2f} |")
    return lines + [""]


def _lowbit_experts(c: dict) -> str:
    return f"{c['bits']}-bit experts" + (f" + rank-{c['rank']} compensators" if c["rank"] else "")


def lowbit_decode_table(rec: dict) -> list[str]:
    c = rec["config"]
    lines = [f"**Decode, Mixtral-8x7B shape, {_lowbit_experts(c)}, batch {c.get('batch', 1)}** "
             f"(random weights, resident; floor {rec['floor_tokens_per_s']:.0f} tok/s = HBM bandwidth / "
             f"{rec['weight_bytes_per_token'] / 1e9:.1f} GB read per token; {_source(rec)})", "",
             "| run | tokens/s | share of floor |", "|---|---:|---:|"]
    for name, r in rec["results"].items():
        if "tokens_per_s" in r:
            when = f" (measured {r['measured']})" if "measured" in r else ""
            share = r["tokens_per_s"] / rec["floor_tokens_per_s"]
            lines.append(f"| {name}{when} | {r['tokens_per_s']:.2f} | {share:.0%} |")
    return lines + [""]


def mma_moe_table(rec: dict) -> list[str]:
    c = rec["config"]
    lines = [f"**4-bit MoE experts by token count, {c['shape']}** (MMA kernels beside the Triton low-bit tiles and the "
             f"bf16 fused MoE; floor = packed bytes of the experts hit / copy bandwidth; {_source(rec)})", "",
             "| tokens | MMA ms | Triton ms | bf16 ms | floor ms | MMA share of floor | Triton share |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rec["rows"]:
        lines.append(f"| {r['tokens']} | {r['mma_ms']:.3f} | {r['triton_ms']:.3f} | {r['bf16_ms']:.3f} | "
                     f"{r['floor_ms']:.3f} | {r['mma_floor_share']:.0%} | {r['triton_floor_share']:.0%} |")
    return lines + [""]


def parallel_tables(rec: dict) -> list[str]:
    c = rec["config"]
    shapes = "; ".join(f"{n} E={v['E']} k={v['k']} D={v['D']} F={v['F']}" for n, v in c["shapes"].items())
    lines = [f"**Expert-parallel MoE layer** ({c['label']}; {c['backend']}, {c['dtype']}; {shapes}; {_source(rec)}; "
             "`python bench/parallel.py`)", "",
             "| shape | EP | tokens per rank | ms (static dispatch; EP 1: local) | ms (dynamic dispatch) | "
             "tokens/s per rank |", "|---|---:|---:|---:|---:|---:|"]
    for r in rec["moe_layer"]:
        static = r.get("static_ms", r.get("local_ms"))
        dynamic = f"{r['dynamic_ms']:.2f}" if "dynamic_ms" in r else "-"
        lines.append(f"| {r['shape']} | {r['ep']} | {r['tokens_per_rank']} | {static:.2f} | {dynamic} | "
                     f"{r['tokens_per_s_per_rank']:.0f} |")
    lines += ["", "| rows leaving a rank per dispatch | top-k | EP | tokens | once per rank | once per expert | "
              "per expert / per rank |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['top_k']} | {r['ep']} | {r['tokens']} | {r['rows_once_per_rank']} | "
              f"{r['rows_once_per_expert']} | {r['per_expert_over_per_rank']:.2f} |" for r in rec["bytes_sent"]]
    return lines + [""]


def serve_model(c: dict) -> str:
    """What a serve run served: the checkpoint folder's name, or the random checkpoint's shape."""
    made = c.get("random_checkpoint")
    if made:
        return (f"random {made['shape']}-shaped checkpoint, {made['layers']} layers, HQQ {made['bits']}-bit "
                f"(byte vocabulary)")
    return Path(c["model"]).name


def serve_table(rec: dict) -> list[str]:
    c = rec["config"]
    lines = [f"**Serving {serve_model(c)}, `moeserve serve`** (streaming HTTP clients at once vs the same requests "
             f"one after another; prompts {c['prompt_min']}-{c['prompt_max']} bytes, {c['gen']} greedy tokens each; server "
             f"`{c['server']}`" + (f" started with `{c['server_args']}`" if c.get("server_args") else "")
             + f", threads {c.get('threads') or 'default'}; {_source(rec)})", "",
             "| clients | tok/s | sequential tok/s | speedup | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "p99 ITL / 1-client ITL |", "|---:|---:|---:|---:|---|---|---:|"]
    for r in rec["levels"]:
        run, ratio = r["concurrent"], r.get("itl_p99_over_single")
        lines.append(f"| {r['clients']} | {run['tok_per_s']:,.0f} | {r['sequential']['tok_per_s']:,.0f} | "
                     f"{r['speedup']:.2f}x | {run['ttft_p50_ms']:.0f} / {run['ttft_p99_ms']:.0f} | "
                     f"{run['itl_p50_ms']:.1f} / {run['itl_p99_ms']:.1f} | {'' if ratio is None else f'{ratio:.1f}'} |")
    return lines + [""]


def batching_table(rec: dict) -> list[str]:
    c = rec["config"]
    lines = [f"**Continuous batching of {serve_model(c)} without HTTP** (bench/batching.py: the serve bench's requests "
             f"through a ContinuousBatch in one process; prefill passes of up to {c['prefill_tokens']} token slots; "
             f"{_source(rec)})", "",
             "| clients | tok/s | ITL p50 / p99 ms | decode step ms at the full batch | steps with a prefill pass: "
             "count, p50 / max ms |", "|---:|---:|---|---:|---|"]
    for r in rec["levels"]:
        full = r["decode_step_p50_ms"].get(str(r["clients"]))
        prefill = (f"{r['prefill_steps']}, {r['prefill_step_p50_ms']:.1f} / {r['prefill_step_max_ms']:.1f}"
                   if r["prefill_steps"] else "0")
        lines.append(f"| {r['clients']} | {r['tok_per_s']:,.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
                     f"{'' if full is None else f'{full:.2f}'} | {prefill} |")
    return lines + [""]


def serve_soak_table(rec: dict) -> list[str]:
    c, kib = rec["config"], 1024
    return [f"**Serving soak** ({c['requests']} requests from {c['clients']} clients, {c['parallel']} slots, queue "
            f"{c['max_queue']}; {_source(rec)}): {'passed' if rec['passed'] else 'FAILED'}; {rec['responses']} "
            f"answers, {rec['distinct_ids']} distinct ids, {rec['retried_503']} retries after 503, server RSS "
            f"{rec['rss_kib_start'] / kib:.0f} MiB after warm-up, {rec['rss_kib_end'] / kib:.0f} MiB at the end, "
            f"{rec['seconds']:.0f} s", ""]


def hybrid_tables(rec: dict) -> list[str]:
    r, mp = rec["rates"], rec["demo_mixed_precision"]
    link = f"{r['h2d_bytes_per_s'] / 1e9:.0f} GB/s" if r.get("h2d_bytes_per_s") else "the link"
    lines = [f"**Hybrid CPU/GPU experts** (batch 1, 4-bit experts; tg: decode tok/s, pp512: prefill tok/s, the CPU "
             f"layers' experts streamed to the GPU; floor = max(CPU expert bytes / DRAM read "
             f"{r['dram_read_bytes_per_s'] / 1e9:.0f} GB/s, GPU bytes / HBM {r['hbm_bytes_per_s'] / 1e12:.1f} TB/s) at "
             f"the run's hit rate, pp floor = streamed bytes / host->GPU {link}; mixed precision costs "
             f"{mp['mixed_ppl_cost']:+.2%} perplexity on the demo; {_source(rec)})", ""]
    for name, shape in rec["shapes"].items():
        lines += [f"{name} ({shape['shape']['num_layers']} layers, {shape['shape']['num_experts']} experts, top-"
                  f"{shape['shape']['top_k']}), GPU budget {shape['budget_bytes'] / 2 ** 30:.3g} GiB (measured "
                  f"{shape['measured']}):", "",
                  "| column | CPU layers | GPU cache slots | tg tok/s | floor tok/s | share of floor | pp512 tok/s | "
                  "pp floor (link) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for row in shape["rows"]:
            pp, ppf = row.get("pp_tokens_per_s"), row.get("pp_floor_tokens_per_s")
            earlier = row.get("commit") and row["commit"] not in shape["measured"]
            column = f"{row['column']} (at {row['commit']})" if earlier else row["column"]
            lines.append(f"| {column} | {row.get('cpu_layers', '')} | {row.get('cache_slots', '')} | "
                         f"{row['tg_tokens_per_s']:.2f} | {row['floor_tokens_per_s']:.1f} | {row['of_floor']:.0%} | "
                         f"{'-' if pp is None else f'{pp:.1f}'} | {'-' if ppf is None else f'{ppf:.0f}'} |")
        lines.append("")
    return lines


TABLES = {"moe_block": moe_block_tables, "decode": decode_table, "quality": quality_tables,
          "cpu_kernels": cpu_kernel_tables, "kernels": kernel_tables, "offload": offload_table,
          "throughput": throughput_table, "lowbit_decode": lowbit_decode_table, "parallel": parallel_tables,
          "serve": serve_table, "batching": batching_table, "serve_soak": serve_soak_table, "hybrid": hybrid_tables,
          "mma_moe": mma_moe_table}


def _when(rec: dict) -> str:
    cores = f" ({rec['cpu_count']} cores)" if rec.get("device_type") == "cpu" else ""
    return f"{rec['device']}{cores}, {rec['date'][:10]}"


def headline(runs: list[dict]) -> list[str]:
    """A few figures from the tables below: demo decode on a GPU and a CPU, the Mixtral-shaped MoE block, low-bit
    decode of a Mixtral-8x7B shape (each from the newest run of its benchmark)."""
    def newest(name: str, device_type: str | None = None) -> dict | None:
        recs = [r for r in runs if r["name"] == name and device_type in (None, r.get("device_type"))]
        return max(recs, key=lambda r: r["date"]) if recs else None

    rows = []
    for device_type in ("cuda", "cpu"):
        rec = newest("decode", device_type)
        for r in rec["results"] if rec else []:
            if r["batch"] == 1:
                graph = r.get("ours_graph")
                ours = graph["steady_decode_tok_s"] if graph else r["ours"]["decode_tok_s"]
                how = "CUDA graph" if graph else f"{r['threads']} threads"
                rows.append((f"demo model decode, batch 1, {r['dtype']}, {how}", f"{ours:,.0f} tok/s",
                             f"transformers generate {r['hf']['decode_tok_s']:,.0f} tok/s", _when(rec)))
    rec = newest("moe_block")
    for shape in rec["shapes"] if rec else []:
        if shape["shape"] != "mixtral":
            continue
        for r in shape["rows"]:
            if r["tokens"] in (1, 1024):
                rows.append((f"MoE block, Mixtral shape, {r['tokens']} token{'s' * (r['tokens'] > 1)}, bf16",
                             f"{r['ours_ms']:.3f} ms", f"transformers grouped_mm {r['hf_grouped_mm_ms']:.3f} ms, "
                             f"floor {r['floor_ms']:.3f}",
                             f"{rec['device']}, {r.get('measured', _measured(rec))[:10]}"))
        for r in shape.get("lowbit", []):
            if r["tokens"] == 1 and r["experts"] != "bf16":
                rows.append((f"MoE block, Mixtral shape, 1 token, {r['experts']} experts, CUDA graph",
                             f"{r['cuda_graph_ms']:.3f} ms", f"byte floor {r['floor_ms']:.3f} ms",
                             f"{rec['device']}, {r.get('measured', _measured(rec))[:10]}"))
    for rec in sorted((r for r in runs if r["name"] == "lowbit_decode"), key=lambda r: -r["config"]["bits"]):
        best = rec["results"].get("cuda_graph")
        if best and "tokens_per_s" in best:
            c = rec["config"]
            rows.append((f"decode, Mixtral-8x7B shape, {_lowbit_experts(c)}, batch {c.get('batch', 1)}, CUDA graph",
                         f"{best['tokens_per_s']:.0f} tok/s",
                         f"floor {rec['floor_tokens_per_s']:.0f} tok/s "
                         f"({best['tokens_per_s'] / rec['floor_tokens_per_s']:.0%})", _when(rec)))
    rec = newest("deepseek")
    for r in rec["decode"]["bf16"] if rec else []:
        if r["batch"] == 1 and "cuda_graph" in r:
            kv = rec["decode"]["kv_bytes_per_token"]["moeserve_latent"]
            rows.append((f"decode, DeepSeek-V2-Lite shape, bf16, batch 1, CUDA graph (KV {kv / 1e3:.0f} KB/token, MLA "
                         f"latents)", f"{r['cuda_graph']['steady_decode_tok_s']:.0f} tok/s",
                         f"transformers {r['hf_decode_tok_s']:.0f} tok/s", _when(rec)))
    rows += serve_rows([r for r in runs if r["name"] == "serve"])
    for rec in (r for r in runs if r["name"] == "hybrid"):
        rows += hybrid_rows(rec)
    rec = newest("gpt_oss_20b_peer")
    rows += [peer_row(rec)] if rec else []
    return headline_table(rows)


def headline_table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    return ["| what | moeserve | reference | device, date |", "|---|---:|---|---|"] + [
        f"| {' | '.join(r)} |" for r in rows] + [""]


def serve_rows(runs: list[dict]) -> list[tuple[str, str, str, str]]:
    """`moeserve serve` on a GPU with its default placement, at the most clients of each model's newest run."""
    rows = []
    for rec in runs:
        c = rec["config"]
        if rec.get("device_type") != "cuda" or c.get("server_args"):
            continue
        top = max(rec["levels"], key=lambda r: r["clients"])
        rows.append((f"`moeserve serve`, {top['clients']} streaming clients, {c['gen']} tokens each: "
                     f"{serve_model(c)}", f"{top['concurrent']['tok_per_s']:,.0f} tok/s",
                     f"the same requests one at a time: {top['sequential']['tok_per_s']:,.0f} tok/s "
                     f"({top['speedup']:.1f}x)", _when(rec)))
    return rows


def hybrid_rows(rec: dict) -> list[tuple[str, str, str, str]]:
    """Per shape of a hybrid run: tg / pp512 with the CPU layers' experts computed there (and with mixed precision),
    against every expert on the CPU and HOBBIT's offload, each from the shape's newest rows."""
    rows = []
    for name, shape in rec["shapes"].items():
        by = {row["column"]: row for row in shape["rows"]}
        if "hybrid" not in by:
            continue
        at = by["hybrid"]["commit"]  # a figure measured at another commit names it

        def tg(row: dict) -> str:
            return f"{row['tg_tokens_per_s']:.1f}" + ("" if row["commit"] == at else f" (at {row['commit']})")

        ours = [by[c] for c in ("hybrid", "hybrid+mixed") if c in by and by[c]["commit"] == at]
        rate = ", ".join(f"{r['tg_tokens_per_s']:.1f}" + (f" / {r['pp_tokens_per_s']:,.0f}"
                                                          if r.get("pp_tokens_per_s") else "") for r in ours)
        refs = [f"floor {by['hybrid']['floor_tokens_per_s']:.0f}"]
        refs += [f"every expert on the CPU {tg(by['cpu'])}"] if "cpu" in by else []
        refs += [f"HOBBIT offload {tg(by['hobbit-offload'])}"] if "hobbit-offload" in by else []
        s = shape["shape"]
        rows.append((f"tg / pp512, {name} shape, 4-bit experts, {shape['budget_bytes'] / 2 ** 30:.3g} GiB GPU: "
                     f"{by['hybrid']['cpu_layers']} of {s['num_layers']} layers' experts on the CPU"
                     + (" / with `--mixed-precision`" if len(ours) > 1 else ""), f"{rate} tok/s", "; ".join(refs),
                     f"{rec['device']} + {rec['cpu']}, {shape['measured'][:10]}"))
    return rows


def _peer_setting(key: str) -> str:
    """A peer run's setting as the flag both programs take: n_cpu_moe_10 -> `--n-cpu-moe 10`."""
    n = re.fullmatch(r"n_cpu_moe_(\d+)", key)
    return f"`--n-cpu-moe {n.group(1)}`" if n else {"all_experts_on_cpu": "`--cpu-moe`"}.get(key, key)


def peer_row(rec: dict) -> tuple[str, str, str, str]:
    """A same-machine run against llama.cpp: each configuration's tg / pp512, and llama.cpp's with the ratios."""
    names = [_peer_setting(k) for k in rec["rates"]]
    ours = ", ".join(f"{r['moeserve']['tg128'][0]:.1f} / {r['moeserve']['pp512'][0]:,.0f}"
                     for r in rec["rates"].values())
    theirs = ", ".join(f"{r['llama_cpp']['tg128'][0]:.1f} / {r['llama_cpp']['pp512'][0]:,.0f} "
                       f"({rec['ratios'][k]['tg128']:.2f}x / {rec['ratios'][k]['pp512']:.2f}x)"
                       for k, r in rec["rates"].items())
    return (f"tg / pp512, {rec['shape'].split(':')[0]}, {' / '.join(names)}", f"{ours} tok/s",
            f"llama.cpp {rec['llama_cpp_commit']} (same machine, same calls) {theirs}",
            f"{rec['device']} + {rec['cpu'].split(' (')[0]}, {rec['date'][:10]}")


HEADER = """# Performance

Generated by `python bench/report.py --write` from `bench/results/*.json`: the newest run of each benchmark per
device (a run that measured only some rows keeps the other rows of the run before it, each marked with its date and
commit); README.md's performance table is the headline below, written by the same command. Do not edit by hand;
rerun the benchmark and the report.

Every figure is measured side by side in one run on the device named: moeserve, the peer (transformers, torch,
cuBLAS) and the floor. The floor is the larger of the bytes that must move over the measured bandwidth of the
memory they live in and the FLOPs over the measured matmul rate. Time ratios: lower is better; speed ratios:
higher is better. Absolute times hold for the device named only.

## Headline
"""


PAGE = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
README_BEGIN = "<!-- PERFORMANCE: the headline of docs/performance.md, written by `python bench/report.py --write` -->"
README_END = "<!-- PERFORMANCE: end -->"


def report(results_dir: Path, runs: list[dict] | None = None) -> str:
    """docs/performance.md: the headline, then every benchmark's tables (runs: newest_runs(results_dir), if read)."""
    runs = newest_runs(results_dir) if runs is None else runs
    lines = [HEADER] + headline(runs) + ["## Tables", ""]
    lines += fused_moe_tables(ROOT / "moeserve" / "kernels" / "triton" / "configs", results_dir)
    for rec in runs:
        lines += TABLES.get(rec["name"], lambda r: [])(rec)
    return "\n".join(lines).rstrip() + "\n"


def readme_with_headline(readme: str, runs: list[dict]) -> str:
    """README.md with the text between its PERFORMANCE markers replaced by the headline table."""
    begin, end = readme.find(README_BEGIN), readme.find(README_END)
    if begin < 0 or end < begin:
        raise SystemExit(f"README.md lacks the lines {README_BEGIN!r} ... {README_END!r}")
    return readme[:begin + len(README_BEGIN)] + "\n" + "\n".join(headline(runs)) + readme[end:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--write", action="store_true",
                    help=f"write {PAGE.relative_to(ROOT)} and the headline table in {README.name} instead of "
                         "printing the page")
    args = ap.parse_args()
    runs = newest_runs(Path(args.results))
    text = report(Path(args.results), runs)
    if not args.write:
        print(text, end="")
        return
    PAGE.write_text(text)
    README.write_text(readme_with_headline(README.read_text(), runs))


if __name__ == "__main__":
    main()
