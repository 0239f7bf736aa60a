"""GPT-OSS-20B-shaped MoE block on one GPU with MXFP4 experts, random weights, no downloads.

The block: hidden 2880, 32 experts of FFN 2880 with biases and the clamped SwiGLU, top-4 of a biased router. Its
expert weights are drawn in bf16, rounded to MXFP4 (E2M1 values, an E8M0 scale per 32) and written back, so that
transformers' bf16 GptOssMLP and moeserve's MoEBlock (experts kept packed: Mxfp4Experts, the Triton kernels that
decode in registers) compute with the same weights. Per token count (default 1 and 16): moeserve eager and as a
CUDA graph, transformers' expert loop and grouped GEMMs (bf16 experts, 4.25x the bytes), and the floor: the bytes
the block must read (MXFP4 blocks + scales + biases of the distinct experts hit, the router, x and out) over the
measured copy bandwidth. `floor_fraction` = floor / moeserve's best time (the target on an H200 is >= 0.6).

--sweep times the MXFP4 kernels' launch configs instead (a few dozen Mxfp4Configs, about two minutes on an H200): per
token count (default 1, 16, 64) each candidate runs the experts alone (mxfp4_experts on the block's routed rows, a
CUDA graph over rotating inputs), with its time, its share of the experts' floor (the MXFP4 bytes of the experts hit,
x in and y out, over the copy bandwidth) and its error against the per-expert loop; then the whole block runs with
the fastest one (share of the block's floor as above). Off the GPU, --quick --sweep with TRITON_INTERPRET=1 runs a
two-candidate smoke of it in Triton's interpreter.

    python bench/gptoss.py              # GPU (bf16): JSON to bench/results/gptoss-<device>-<date>.json
    python bench/gptoss.py --tokens 1,16,64
    python bench/gptoss.py --sweep      # GPU: the kernels' launch configs per token count, then the block
    python bench/gptoss.py --quick      # tiny shapes on the CPU (fp32; experts through the per-expert loop)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import (add_run_args, measure_hbm_bandwidth, result_record, run_device, time_cuda_graph,  # noqa: E402
                    time_fn, write_result)
from moe_block import hf_and_ours_blocks, rel_err, set_experts_implementation  # noqa: E402

from moeserve.checkpoint import from_interleaved  # noqa: E402
from moeserve.kernels.routing import build_routing_table  # noqa: E402
from moeserve.model.experts import LoopedExperts  # noqa: E402
from moeserve.model.paths import GRAPH_SAFE  # noqa: E402
from moeserve.quant.mxfp4 import BLOCK, dequantize, quantize  # noqa: E402
from moeserve.spec import ModelSpec  # noqa: E402

GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=1024)
QUICK = dict(GPT_OSS_20B, hidden_size=64, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TOKENS, QUICK_TOKENS = (1, 16), (1, 4)
SWEEP_TOKENS = (1, 16, 64)
STD = 0.02
# --sweep candidates (each compiles for sm_90a with Triton 3.6 and 3.9 without spilling registers; 64-row tensor-core
# tiles fail to compile on 3.6). CUDA cores: BLOCK_N, BLOCK_K, num_warps, num_stages; all at one token; up to 16
# tokens GEMV_ROWS_SWEEP with 2 rows of x at once and its first two with 4
GEMV_SWEEP = [(32, 256, 4, 3), (64, 256, 4, 3), (32, 512, 4, 3), (64, 256, 8, 3), (32, 256, 4, 2), (32, 256, 4, 4),
              (32, 128, 4, 4), (64, 512, 8, 2)]
GEMV_ROWS_SWEEP = [(32, 256, 4, 3), (64, 256, 8, 3), (32, 256, 4, 2)]
# tensor cores: BLOCK_N, BLOCK_K, BLOCK_M, num_warps, num_stages; the first five up to 16 tokens, all above
DOT_SWEEP = [(64, 128, 16, 4, 3), (128, 128, 16, 8, 3), (64, 128, 16, 4, 4), (32, 128, 16, 4, 3), (64, 64, 16, 4, 4),
             (128, 128, 32, 8, 3), (64, 128, 32, 4, 3), (128, 128, 32, 8, 4)]
BAD_REL_ERR = 3e-2  # a candidate further than this from the per-expert loop is reported as wrong, never as best


def mxfp4_rounded(hf_experts) -> dict:
    """Round transformers' expert weights to MXFP4 in place (so both sides hold the same values) and return
    moeserve's packed tensors: gate_up/down blocks and scales in moeserve's layout, the biases."""
    ours = {}
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(hf_experts, name)  # [E, in, out]
        blocks, scales = quantize(p.detach().float().transpose(1, 2))  # rows = outputs, as checkpoints ship them
        with torch.no_grad():
            p.copy_(dequantize(blocks, scales, p.dtype).transpose(1, 2))
        ours[f"{name}_blocks"] = from_interleaved(f"{name}_blocks", blocks)
        ours[f"{name}_scales"] = from_interleaved(f"{name}_scales", scales)
        ours[f"{name}_bias"] = from_interleaved(f"{name}_bias", getattr(hf_experts, f"{name}_bias").detach())
    return ours


def mxfp4_expert_bytes(D: int, F: int, itemsize: int) -> int:
    """One expert's bytes as stored: half a byte a value, a scale byte per 32 values, its biases."""
    values = 3 * D * F
    return values // 2 + values // BLOCK + (2 * F + D) * itemsize


def block_floor(T: int, distinct: float, D: int, F: int, E: int, itemsize: int, bw: float) -> dict:
    """Bytes the block must read and write, over the copy bandwidth: the MXFP4 experts hit (half a byte a value,
    a byte per 32 values), their biases, the router (weight and bias) and x and the output."""
    expert = mxfp4_expert_bytes(D, F, itemsize)
    nbytes = distinct * expert + (E * D + E) * itemsize + 2 * T * D * itemsize
    return {"floor_ms": nbytes / bw * 1e3, "bytes": nbytes, "expert_bytes_mxfp4": expert,
            "expert_bytes_bf16": 3 * D * F * 2 + (2 * F + D) * 2}


@torch.inference_mode()
def build_blocks(args, device, dtype):
    """(transformers' GptOssMLP, moeserve's MoEBlock on the same MXFP4-rounded weights, its spec, a generator)."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    shape = QUICK if args.quick else GPT_OSS_20B
    cfg = transformers.GptOssConfig(**shape)
    hf_cfg = {**cfg.to_dict(), "architectures": ["GptOssForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}
    spec = ModelSpec.from_hf_config(hf_cfg)
    gen = torch.Generator(device=device).manual_seed(1)
    hf, ours = hf_and_ours_blocks(lambda: GptOssMLP(cfg), spec, device, dtype)
    for p in hf.parameters():
        p.data.normal_(0.0, STD, generator=gen)
    state = {"gate.weight": hf.router.weight.detach(), "gate.bias": hf.router.bias.detach()}
    state.update({f"experts.{n}": t for n, t in mxfp4_rounded(hf.experts).items()})
    ours.load_state_dict(state, strict=True, assign=True)
    print(f"\n== GPT-OSS-20B MoE block{' (quick)' if args.quick else ''}: D={spec.hidden_size} "
          f"E={spec.moe.num_experts} of F={spec.moe.expert_ffn}, top-{spec.moe.top_k}, MXFP4 experts, "
          f"{str(dtype).removeprefix('torch.')} on {device}",
          flush=True)
    return hf, ours, spec, gen


def token_inputs(T: int, D: int, args, device, dtype, gen) -> list[torch.Tensor]:
    """Rotating inputs [T, D] of one token count."""
    return [torch.randn(T, D, device=device, dtype=dtype, generator=gen) for _ in range(4 if args.quick else 8)]


def distinct_experts(ours, xs: list[torch.Tensor]) -> float:
    """Experts the router hits per input, on average."""
    return statistics.mean(int(ours.gate(x)[0].unique().numel()) for x in xs)


@torch.inference_mode()
def block_part(args, blocks, device, dtype, bw: float) -> dict:
    hf, ours, spec, gen = blocks
    D, F, E = spec.hidden_size, spec.moe.expert_ffn, spec.moe.num_experts
    rows = []
    for T in args.tokens:
        xs = token_inputs(T, D, args, device, dtype, gen)
        distinct = distinct_experts(ours, xs)
        row = {"tokens": T, "distinct_experts": distinct, "path": ours.experts.kernel_path(xs[0], T)}
        for impl in ("eager", "grouped_mm"):
            set_experts_implementation(hf, impl)
            row[f"hf_{impl}_ms"] = time_fn(lambda x: hf(x[None])[0], xs, device)
        row.update(ours_vs_hf_rel_err=rel_err(ours(xs[0]), hf(xs[0][None])[0][0]), ours_ms=time_fn(ours, xs, device),
                   **block_floor(T, distinct, D, F, E, torch.finfo(dtype).bits // 8, bw))
        if device.type == "cuda" and row["path"] in GRAPH_SAFE:
            row["ours_graph_ms"] = time_cuda_graph(ours, xs)
        best = min(row["ours_ms"], row.get("ours_graph_ms", float("inf")))
        row["floor_fraction"] = row["floor_ms"] / best
        row["speedup_vs_hf_best"] = min(row["hf_eager_ms"], row["hf_grouped_mm_ms"]) / best
        rows.append(row)
        print(f"T={T:4d} ({row['path']}): moeserve {row['ours_ms']:.3f} ms eager, {best:.3f} best | transformers "
              f"(dense experts) {row['hf_eager_ms']:.3f} ms eager, {row['hf_grouped_mm_ms']:.3f} ms grouped_mm | floor "
              f"{row['floor_ms']:.3f} ms ({row['floor_fraction']:.0%} of it) | {distinct:.1f} experts hit | rel err "
              f"{row['ours_vs_hf_rel_err']:.1e}", flush=True)
    return {"shape": QUICK if args.quick else GPT_OSS_20B, "rows": rows}


# ---- --sweep: the MXFP4 kernels' launch configs ----------------------------------------------------------------


def sweep_configs(T: int, quick: bool):
    """The Mxfp4Configs --sweep times at T tokens: CUDA-core programs (one row of x at once at one token, the fp32
    sums once; 2 and 4 rows up to 16 tokens) and, above one token, tensor-core tiles. --quick: two, for the
    interpreter."""
    from moeserve.kernels.triton.mxfp4 import Mxfp4Config, default_config

    if quick:
        return [default_config(T, torch.float32), Mxfp4Config(BLOCK_N=32, BLOCK_K=64, BLOCK_M=2, num_stages=2)]
    gemv = [Mxfp4Config(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st) for n, k, w, st in GEMV_SWEEP]
    rows = [Mxfp4Config(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st, BLOCK_M=m)
            for m in (2, 4) for n, k, w, st in GEMV_ROWS_SWEEP[:3 if m == 2 else 2]]
    dot = [Mxfp4Config(BLOCK_N=n, BLOCK_K=k, BLOCK_M=m, num_warps=w, num_stages=st) for n, k, m, w, st in DOT_SWEEP]
    if T == 1:
        return gemv + [dataclasses.replace(gemv[0], HALF=False)]
    if T <= 16:
        return rows + dot[:5]
    return dot


def experts_floor_ms(rows: int, distinct: float, D: int, F: int, itemsize: int, bw: float) -> float:
    """The experts alone: the MXFP4 bytes of the experts hit (blocks, scales, biases), x's rows in, float32 y out."""
    return (distinct * mxfp4_expert_bytes(D, F, itemsize) + rows * D * (itemsize + 4)) / bw * 1e3


def routed(ours, xs: list[torch.Tensor]) -> list[tuple[torch.Tensor, object]]:
    """(x, its routing table) of each input, as the block's experts get them."""
    out = []
    for x in xs:
        ids, weights, _ = ours.gate(x)
        out.append((x, build_routing_table(ids, weights, ours.experts.num_experts)))
    return out


def time_experts(fn, items, device) -> float:
    """Milliseconds per call of fn over rotating items: a CUDA graph on a GPU, a few interpreted calls off it."""
    if device.type == "cuda":
        return time_cuda_graph(fn, items)
    return time_fn(fn, items, device, reps=2, warmup=1)


def time_candidate(cfg, items, weights, act, ref: torch.Tensor, device) -> dict:
    """One config: its time over items, its error on items[0] against the per-expert loop (ref), or the error that
    stopped it (a tile too big for this GPU, say)."""
    from moeserve.kernels.triton.mxfp4 import mxfp4_experts

    gate_up, down = weights

    def run(item):  # the tokens, gathered by the kernels as in the block
        return mxfp4_experts(item[0], gate_up, down, item[1], act, cfg, token_ids=item[1].token_ids)

    row = {"config": dataclasses.asdict(cfg), "path": "dot" if cfg.use_dot(items[0][0].dtype) else "gemv"}
    try:
        row["rel_err"] = rel_err(run(items[0]), ref)
        row["ms"] = time_experts(run, items, device)
    except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run here is reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


@torch.inference_mode()
def sweep_part(args, blocks, device, dtype, bw: float) -> dict:
    """Per token count: every candidate config on the experts alone, then the block with the fastest good one."""
    from moeserve.kernels.triton.mxfp4 import Mxfp4Config, Mxfp4Weights

    _, ours, spec, gen = blocks
    D, F, E = spec.hidden_size, spec.moe.expert_ffn, spec.moe.num_experts
    ex = ours.experts
    weights = (Mxfp4Weights(ex.gate_up_proj_blocks, ex.gate_up_proj_scales, ex.gate_up_proj_bias),
               Mxfp4Weights(ex.down_proj_blocks, ex.down_proj_scales, ex.down_proj_bias))
    itemsize = torch.finfo(dtype).bits // 8
    out = []
    for T in args.tokens:
        xs = token_inputs(T, D, args, device, dtype, gen)
        items = routed(ours, xs)
        distinct = distinct_experts(ours, xs)
        floor = experts_floor_ms(T * spec.moe.top_k, distinct, D, F, itemsize, bw)
        x0, table0 = items[0]
        ref = LoopedExperts.run_sorted(ex, x0[table0.token_ids], table0).float()
        rows = []
        for cfg in sweep_configs(T, args.quick):
            row = time_candidate(cfg, items, weights, ex.act, ref, device)
            if "ms" in row:
                row["experts_floor_fraction"] = floor / row["ms"]
            rows.append(row)
            print(f"T={T:3d} {row['path']:4s} {cfg}: " + (f"{row['ms']:.4f} ms ({row['experts_floor_fraction']:.0%} "
                  f"of the experts' floor), rel err {row['rel_err']:.1e}" if "ms" in row else row["error"]),
                  flush=True)
        good = [r for r in rows if "ms" in r and r["rel_err"] < BAD_REL_ERR]
        entry = {"tokens": T, "distinct_experts": distinct, "experts_floor_ms": floor, "candidates": rows}
        if good:
            best = min(good, key=lambda r: r["ms"])
            ex.kernel_config = Mxfp4Config(**best["config"])
            block_ms = time_cuda_graph(ours, xs) if device.type == "cuda" else time_fn(ours, xs, device, reps=2)
            ex.kernel_config = None
            block = block_floor(T, distinct, D, F, E, itemsize, bw)
            entry.update(best=best["config"], best_ms=best["ms"], block_graph_ms=block_ms,
                         block_floor_ms=block["floor_ms"], block_floor_fraction=block["floor_ms"] / block_ms)
            print(f"T={T:3d} best {Mxfp4Config(**best['config'])}: experts {best['ms']:.4f} ms, "
                  f"block {block_ms:.4f} ms = {entry['block_floor_fraction']:.0%} of its floor "
                  f"{block['floor_ms']:.4f} ms", flush=True)
        out.append(entry)
    return {"shape": QUICK if args.quick else GPT_OSS_20B, "tokens": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, seconds")
    ap.add_argument("--tokens", default=None, help=f"token counts (default {','.join(map(str, TOKENS))}; "
                                                   f"--sweep: {','.join(map(str, SWEEP_TOKENS))})")
    ap.add_argument("--sweep", action="store_true", help="time the MXFP4 kernels' launch configs (GPU), then the block")
    add_run_args(ap)
    args = ap.parse_args(argv)
    device, dtype = run_device(args)
    if args.sweep and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--sweep times Triton kernels: it needs a CUDA GPU (or --quick with TRITON_INTERPRET=1, a smoke run)")
    default_tokens = QUICK_TOKENS if args.quick else SWEEP_TOKENS if args.sweep else TOKENS
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(default_tokens)
    bw = measure_hbm_bandwidth(device, 64 << 20 if args.quick else None)["bytes_per_s"]
    record = result_record("gptoss", {"quick": args.quick, "tokens": args.tokens, "dtype": str(dtype),
                                      "sweep": args.sweep}, device)
    record["floor_rates"] = {"copy_bytes_per_s": bw}
    blocks = build_blocks(args, device, dtype)
    if args.sweep:
        record["sweep"] = sweep_part(args, blocks, device, dtype, bw)
    else:
        record["moe_block"] = block_part(args, blocks, device, dtype, bw)
    print(write_result(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
