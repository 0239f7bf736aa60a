"""GPT-OSS-20B-shaped MoE block on one GPU with MXFP4 experts, random weights, no downloads.

The block: hidden 2880, 32 experts of FFN 2880 with biases and the clamped SwiGLU, top-4 of a biased router. Its
expert weights are drawn in bf16, rounded to MXFP4 (E2M1 values, an E8M0 scale per 32) and written back, so that
transformers' bf16 GptOssMLP and moeserve's MoEBlock (experts kept packed: Mxfp4Experts, the Triton kernels that
decode in registers) compute with the same weights. Per token count (default 1 and 16): moeserve eager and as a
CUDA graph, transformers' expert loop and grouped GEMMs (bf16 experts, 4.25x the bytes), and the floor: the bytes
the block must read (MXFP4 blocks + scales + biases of the distinct experts hit, the router, x and out) over the
measured copy bandwidth. `floor_fraction` = floor / moeserve's best time (the target on an H200 is >= 0.6).

    python bench/gptoss.py              # GPU (bf16): JSON to bench/results/gptoss-<device>-<date>.json
    python bench/gptoss.py --tokens 1,16,64
    python bench/gptoss.py --quick      # tiny shapes on the CPU (fp32; experts through the per-expert loop)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import (add_run_args, measure_hbm_bandwidth, result_record, run_device, time_cuda_graph,  # noqa: E402
                    time_fn, write_result)
from moe_block import hf_and_ours_blocks, rel_err, set_experts_implementation  # noqa: E402

from moeserve.checkpoint import from_interleaved  # noqa: E402
from moeserve.model.paths import GRAPH_SAFE  # noqa: E402
from moeserve.quant.mxfp4 import BLOCK, dequantize, quantize  # noqa: E402
from moeserve.spec import ModelSpec  # noqa: E402

GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=1024)
QUICK = dict(GPT_OSS_20B, hidden_size=64, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TOKENS, QUICK_TOKENS = (1, 16), (1, 4)
STD = 0.02


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


def block_floor(T: int, distinct: float, D: int, F: int, E: int, itemsize: int, bw: float) -> dict:
    """Bytes the block must read and write, over the copy bandwidth: the MXFP4 experts hit (half a byte a value,
    a byte per 32 values), their biases, the router (weight and bias) and x and the output."""
    values = 3 * D * F
    expert = values // 2 + values // BLOCK + (2 * F + D) * itemsize
    nbytes = distinct * expert + (E * D + E) * itemsize + 2 * T * D * itemsize
    return {"floor_ms": nbytes / bw * 1e3, "bytes": nbytes, "expert_bytes_mxfp4": expert,
            "expert_bytes_bf16": 3 * D * F * 2 + (2 * F + D) * 2}


@torch.inference_mode()
def block_part(args, device, dtype, bw: float) -> dict:
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    shape = QUICK if args.quick else GPT_OSS_20B
    cfg = transformers.GptOssConfig(**shape)
    hf_cfg = {**cfg.to_dict(), "architectures": ["GptOssForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}
    spec = ModelSpec.from_hf_config(hf_cfg)
    D, F, E, k = spec.hidden_size, spec.expert_ffn, spec.num_experts, spec.top_k
    gen = torch.Generator(device=device).manual_seed(1)
    hf, ours = hf_and_ours_blocks(lambda: GptOssMLP(cfg), spec, device, dtype)
    for p in hf.parameters():
        p.data.normal_(0.0, STD, generator=gen)
    state = {"gate.weight": hf.router.weight.detach(), "gate.bias": hf.router.bias.detach()}
    state.update({f"experts.{n}": t for n, t in mxfp4_rounded(hf.experts).items()})
    ours.load_state_dict(state, strict=True, assign=True)
    print(f"\n== GPT-OSS-20B MoE block{' (quick)' if args.quick else ''}: D={D} E={E} of F={F}, top-{k}, MXFP4 "
          f"experts, {str(dtype).removeprefix('torch.')} on {device}", flush=True)
    rows = []
    for T in args.tokens:
        xs = [torch.randn(T, D, device=device, dtype=dtype, generator=gen) for _ in range(4 if args.quick else 8)]
        distinct = statistics.mean(int(ours.gate(x)[0].unique().numel()) for x in xs)
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
    return {"shape": shape, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, seconds")
    ap.add_argument("--tokens", default=None, help=f"token counts (default {','.join(map(str, TOKENS))})")
    add_run_args(ap)
    args = ap.parse_args(argv)
    device, dtype = run_device(args)
    default_tokens = QUICK_TOKENS if args.quick else TOKENS
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(default_tokens)
    bw = measure_hbm_bandwidth(device, 64 << 20 if args.quick else None)["bytes_per_s"]
    record = result_record("gptoss", {"quick": args.quick, "tokens": args.tokens, "dtype": str(dtype)}, device)
    record["floor_rates"] = {"copy_bytes_per_s": bw}
    record["moe_block"] = block_part(args, device, dtype, bw)
    print(write_result(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
