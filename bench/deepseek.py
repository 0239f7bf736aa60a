"""DeepSeek shapes on one GPU, random weights, no downloads.

Decode: a DeepSeek-V2-Lite-shaped model (27 layers, hidden 2048, 16 heads of MLA with kv_lora_rank 512 and no q
LoRA, nope/rope/v 128/64/128; layer 0 a dense FFN of 10944, then 64 routed experts of 1408 + 2 shared, top-6; vocab
102400) built once in bf16 and shared in memory by transformers' DeepseekV2ForCausalLM and moeserve (the same
weights): greedy decode tok/s of moeserve (eager, CUDA graph) vs transformers' generate, per batch size; the same
model with random 4-bit experts (group 64) through the CUDA graph; the KV cache bytes per token of moeserve's latent
cache, of transformers' cache after the same prompt, and of a plain K/V cache of the expanded heads. Floor per
step: the weight bytes it reads (all dense weights, the experts a batch of B hits on average) over the measured
copy bandwidth.

MoE block: a DeepSeek-V3-shaped block (hidden 7168, 256 experts of 2048 + 1 shared, top-8, sigmoid noaux_tc routing
over 8 groups keeping 4, correction bias, routed scaling 2.5) at 1/16/64/1024 tokens: moeserve's MoEBlock (eager and
as a CUDA graph) vs transformers' DeepseekV3MoE on the same weights, vs the floor: bytes (distinct experts hit,
shared expert, router, in and out) over the copy bandwidth, or FLOPs over the matmul rate, whichever is larger.

    python bench/deepseek.py            # GPU (bf16): both parts, JSON to bench/results/deepseek-<device>-<date>.json
    python bench/deepseek.py --part block --tokens 1,64
    python bench/deepseek.py --quick    # tiny shapes on the CPU (fp32), seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import (add_run_args, measure_hbm_bandwidth, measure_matmul_flops, result_record, run_device,  # noqa: E402
                    time_cuda_graph, time_fn, write_result)
from decode import decode_figures, hf_generate, ours_generate, paired_runs, random_prompts  # noqa: E402
from lowbit_decode import random_quantized  # noqa: E402
from moe_block import (default_device_dtype, hf_and_ours_blocks, rel_err,  # noqa: E402
                       set_experts_implementation)

from moeserve.engine.cuda_graph import graph_safe  # noqa: E402
from moeserve.model.layers import RotaryEmbedding  # noqa: E402
from moeserve.model.moe import MoEBlock  # noqa: E402
from moeserve.model.transformer import MoETransformer  # noqa: E402
from moeserve.plan.footprint import kv_cache_bytes  # noqa: E402
from moeserve.plan.roofline import expected_experts  # noqa: E402
from moeserve.quant.qlinear import QuantizedExperts  # noqa: E402
from moeserve.spec import ModelSpec  # noqa: E402

V2_LITE = dict(vocab_size=102400, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
               num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
               n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, topk_method="greedy",
               norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=4096, bos_token_id=0,
               eos_token_id=1)
QUICK_V2 = dict(V2_LITE, vocab_size=258, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                max_position_embeddings=128)
V3_BLOCK = dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                topk_group=4, routed_scaling_factor=2.5, n_shared_experts=1, norm_topk_prob=True)
QUICK_V3_BLOCK = dict(V3_BLOCK, hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                      n_group=4, topk_group=2)
TOKENS, QUICK_TOKENS = (1, 16, 64, 1024), (1, 8)
STD = 0.02


def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Matrices ~N(0, STD), vectors 1 (norms), V3's correction bias ~N(0, 0.1): every expert gets chosen sometimes."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.1, generator=gen)
            elif t.ndim >= 2:
                t.normal_(0.0, STD, generator=gen)
            elif t.is_floating_point() and "inv_freq" not in name:
                t.fill_(1.0)


def ours_sharing(hf, spec: ModelSpec, device) -> MoETransformer:
    """moeserve's model over the very tensors of transformers' model (no copy): names are equal but for
    shared_experts, which moeserve calls shared_expert."""
    with torch.device("meta"):
        ours = MoETransformer(spec)
    state = {k.replace(".shared_experts.", ".shared_expert."): v for k, v in hf.state_dict().items()}
    ours.load_state_dict(state, strict=True, assign=True)
    ours.rotary = RotaryEmbedding(spec).to(device)
    return ours.eval()


def cache_bytes(cache) -> int:
    """Bytes of every tensor a transformers cache holds (keys and values of each layer)."""
    return sum(t.numel() * t.element_size() for layer in getattr(cache, "layers", [])
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))


def step_bytes(model, spec: ModelSpec, batch: int) -> float:
    """Weight bytes one decode step of `batch` tokens reads: everything but the routed experts and the embedding,
    one embedding row per token, and the routed experts a batch hits on average (roofline.expected_experts)."""
    hit = float(expected_experts(spec.moe.num_experts, spec.moe.top_k, batch)) / spec.moe.num_experts
    total = 0.0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        n = t.numel() * t.element_size()
        total += n * hit if ".experts." in name else n * batch / spec.vocab_size if "embed_tokens" in name else n
    return total


def decode_part(args, device, dtype, bw: float) -> dict:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    cfg = transformers.DeepseekV2Config(**(QUICK_V2 if args.quick else V2_LITE))
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    gen = torch.Generator(device=device).manual_seed(0)
    with default_device_dtype(device, dtype):
        hf = transformers.DeepseekV2ForCausalLM(cfg).eval()
    randomise(hf, gen)
    ours = ours_sharing(hf, spec, device)
    S, n = args.prompt, args.new_tokens
    quick = " (quick)" if args.quick else ""
    print(f"\n== DeepSeek-V2-Lite shape{quick}: {spec.parameter_counts()['total'] / 1e9:.2f}B parameters, "
          f"{str(dtype).removeprefix('torch.')} on {device}; HF experts implementation "
          f"{getattr(hf.config, '_experts_implementation', None)}", flush=True)
    with torch.inference_mode():
        out = hf(random_prompts(spec.vocab_size, 2, S, 7, device), use_cache=True)
    hf_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    m = spec.attention.mla
    kv = {"moeserve_latent": kv_cache_bytes(spec, 1, 1, 2),
          "transformers_cache": cache_bytes(hf_cache) / (2 * S) / torch.finfo(dtype).bits * 16,
          "expanded_kv": spec.num_layers * spec.attention.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
          * 2,
          "what": "bytes per token over all layers at bf16; expanded_kv: keys and values of every head (plain MHA)"}
    print(f"KV bytes per token (bf16): moeserve {kv['moeserve_latent']:,}, transformers "
          f"{kv['transformers_cache']:,.0f}, expanded heads {kv['expanded_kv']:,}", flush=True)
    rows = []
    pad = spec.pad_token_id if spec.pad_token_id is not None else 0
    for B in args.batch:
        floor = B * bw / step_bytes(ours, spec, B)
        modes = [False, True] if device.type == "cuda" and graph_safe(ours, B) else [False]
        warm = random_prompts(spec.vocab_size, B, S, 99, device)
        for graph in modes:
            ours_generate(ours, warm, 4, graph)
        hf_generate(hf, warm, 4, pad)
        runs, h_tot, h_pre, match, _ = paired_runs(ours, hf, spec.vocab_size, B, S, n, modes, args.repeats, pad, device)
        row = {"batch": B, "prompt": S, "new_tokens": n, "floor_tok_s": floor,
               "eager": decode_figures(runs[False], B, n),
               "hf_decode_tok_s": B * (n - 1) / max(statistics.median(h_tot) - statistics.median(h_pre), 1e-9),
               "greedy_match_prefix_vs_hf": {"min": min(match), "of": n}}
        if True in runs:
            row["cuda_graph"] = decode_figures(runs[True], B, n)
        rows.append(row)
        best = row.get("cuda_graph", row["eager"])["steady_decode_tok_s"]
        print(f"B={B}: moeserve {row['eager']['steady_decode_tok_s']:.0f} tok/s eager, {best:.0f} best | "
              f"transformers {row['hf_decode_tok_s']:.1f} tok/s | floor {floor:.0f} tok/s | greedy match "
              f"{min(match)}/{n}", flush=True)
    lowbit = lowbit_rows(ours, spec, args, device, dtype, bw) if device.type == "cuda" else []
    return {"shape": QUICK_V2 if args.quick else V2_LITE, "kv_bytes_per_token": kv, "bf16": rows, "lowbit": lowbit,
            "hf_experts_implementation": getattr(hf.config, "_experts_implementation", None)}


def lowbit_rows(ours, spec: ModelSpec, args, device, dtype, bw: float, bits: int = 4, group: int = 64) -> list[dict]:
    """The model with random 4-bit experts (the low-bit fused MoE), decoded through the CUDA graph."""
    D, F = spec.hidden_size, spec.moe.expert_ffn
    for layer in ours.model.layers:
        if spec.moe.layers[layer.self_attn.layer_idx]:
            layer.mlp.experts = QuantizedExperts(
                [random_quantized(D, 2 * F, bits, group, 0, device) for _ in range(spec.moe.num_experts)],
                [random_quantized(F, D, bits, group, 0, device) for _ in range(spec.moe.num_experts)])
    torch.cuda.empty_cache()
    rows = []
    for B in args.batch:
        graph = graph_safe(ours, B)
        ours_generate(ours, random_prompts(spec.vocab_size, B, args.prompt, 99, device), 4, graph)
        runs = [ours_generate(ours, random_prompts(spec.vocab_size, B, args.prompt, r, device), args.new_tokens,
                              graph)[1:] for r in range(args.repeats)]
        row = {"batch": B, "bits": bits, "group": group, "cuda_graph": graph,
               "decode": decode_figures(runs, B, args.new_tokens), "floor_tok_s": B * bw / step_bytes(ours, spec, B)}
        rows.append(row)
        print(f"B={B}: moeserve {bits}-bit experts {row['decode']['steady_decode_tok_s']:.0f} tok/s "
              f"({'graph' if graph else 'eager'}) | floor {row['floor_tok_s']:.0f} tok/s", flush=True)
    return rows


def block_floor(T: int, distinct: float, D: int, F: int, E: int, k: int, shared: int, itemsize: int, bw: float,
                flops: float) -> dict:
    nbytes = (distinct * 3 * D * F + 3 * D * shared) * itemsize + E * D * 4 + 2 * T * D * itemsize  # fp32 router
    nflop = 2 * T * (k * 3 * D * F + 3 * D * shared + D * E)
    bytes_ms, flops_ms = nbytes / bw * 1e3, nflop / flops * 1e3
    return {"floor_ms": max(bytes_ms, flops_ms), "floor_bound": "bytes" if bytes_ms >= flops_ms else "flops",
            "bytes": nbytes, "flop": nflop}


@torch.inference_mode()
def block_part(args, device, dtype, bw: float, flops: float) -> dict:
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    shape = QUICK_V3_BLOCK if args.quick else V3_BLOCK
    cfg = transformers.DeepseekV3Config(**shape)
    spec = ModelSpec.from_hf_config({**cfg.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0})
    D, F, E, k = spec.hidden_size, spec.moe.expert_ffn, spec.moe.num_experts, spec.moe.top_k
    gen = torch.Generator(device=device).manual_seed(1)
    hf, ours = hf_and_ours_blocks(lambda: DeepseekV3MoE(cfg), spec, device, dtype)
    randomise(hf, gen)
    state = {name.replace("shared_experts.", "shared_expert."): t for name, t in hf.state_dict().items()}
    ours.load_state_dict(state, strict=True, assign=True)
    print(f"\n== DeepSeek-V3 MoE block{' (quick)' if args.quick else ''}: D={D} E={E} of F={F} + shared "
          f"{spec.moe.shared_expert_ffn}, top-{k}, {spec.moe.router.topk_method} over {spec.moe.router.n_group} groups, "
          f"{str(dtype).removeprefix('torch.')} on {device}", flush=True)
    rows = []
    for T in args.tokens:
        xs = [torch.randn(T, D, device=device, dtype=dtype, generator=gen) for _ in range(4 if args.quick else 8)]
        distinct = statistics.mean(int(ours.gate(x)[0].unique().numel()) for x in xs)
        row = {"tokens": T, "distinct_experts": distinct}
        for impl in ("eager", "grouped_mm"):  # transformers' expert loop and its grouped GEMMs
            set_experts_implementation(hf, impl)
            row[f"hf_{impl}_ms"] = time_fn(lambda x: hf(x[None]), xs, device)
        row.update(ours_vs_hf_rel_err=rel_err(ours(xs[0]), hf(xs[0][None])[0]), ours_ms=time_fn(ours, xs, device),
                   **block_floor(T, distinct, D, F, E, k, spec.moe.shared_expert_ffn, torch.finfo(dtype).bits // 8, bw,
                                 flops))
        if device.type == "cuda" and graph_safe_block(ours, xs[0]):
            row["ours_graph_ms"] = time_cuda_graph(ours, xs)
        best = min(row["ours_ms"], row.get("ours_graph_ms", float("inf")))
        row["best_over_floor"] = best / row["floor_ms"]
        rows.append(row)
        print(f"T={T:5d}: moeserve {row['ours_ms']:.3f} ms eager, {best:.3f} best | transformers "
              f"{row['hf_eager_ms']:.3f} ms eager, {row['hf_grouped_mm_ms']:.3f} ms grouped_mm "
              f"| floor {row['floor_ms']:.3f} ms ({row['floor_bound']}) | {distinct:.0f} experts hit | rel err "
              f"{row['ours_vs_hf_rel_err']:.1e}", flush=True)
    return {"shape": shape, "rows": rows}


def graph_safe_block(block: MoEBlock, x: torch.Tensor) -> bool:
    from moeserve.model.paths import GRAPH_SAFE

    return block.experts.kernel_path(x, x.shape[0]) in GRAPH_SAFE


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, seconds")
    ap.add_argument("--part", choices=("decode", "block", "both"), default="both")
    ap.add_argument("--batch", default="1,16", help="decode batch sizes (default 1,16)")
    ap.add_argument("--tokens", default=None, help=f"MoE block token counts (default {','.join(map(str, TOKENS))})")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps")
    ap.add_argument("--repeats", type=int, default=2)
    add_run_args(ap)
    args = ap.parse_args(argv)
    device, dtype = run_device(args)
    args.batch = [int(b) for b in args.batch.split(",")]
    default_tokens = QUICK_TOKENS if args.quick else TOKENS
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(default_tokens)
    if args.quick:
        args.batch, args.prompt, args.new_tokens, args.repeats = [1], 8, 6, 1
    bw = measure_hbm_bandwidth(device, 64 << 20 if args.quick else None)["bytes_per_s"]
    flops = measure_matmul_flops(device, dtype, 256 if args.quick else None)["flop_per_s"]
    record = result_record("deepseek", {"quick": args.quick, "part": args.part, "batch": args.batch,
                                        "tokens": args.tokens, "prompt": args.prompt, "new_tokens": args.new_tokens,
                                        "repeats": args.repeats, "dtype": str(dtype)}, device)
    record["floor_rates"] = {"copy_bytes_per_s": bw, "matmul_flop_per_s": flops}
    if args.part in ("decode", "both"):
        record["decode"] = decode_part(args, device, dtype, bw)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.part in ("block", "both"):
        record["moe_block"] = block_part(args, device, dtype, bw, flops)
    print(write_result(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
