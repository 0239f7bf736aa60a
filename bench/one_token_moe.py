"""One-token MoE layer: the three-launch path (kernels/triton/one_token.py: router + x prepared, gate/up + h prepared,
down + combine; opt-in, MOESERVE_ONE_TOKEN_MOE=1, which the bench sets for it) vs the multi-launch path, and the
quick tune vs the full one.

--part block: the MoE block (router and routed experts, as the model runs it) at 1 token, replayed in a CUDA graph
over rotating inputs, with each path, next to the byte floor: the k experts hit (packed weights, scales, biases), the
router weight, x and the output over the measured copy bandwidth. Shapes: Mixtral-8x7B with 4-bit experts and with
3-bit experts + rank-32 compensators (group 64), GPT-OSS-20B with its MXFP4 experts (biases, clamped SwiGLU, biased
router; D 2880, F 2880, 32 experts, top-4).

--part tune: per Mixtral shape (4-bit, 3-bit + r32) at 1 token, the quick search (MOESERVE_TUNE=quick, at most
autotune.BUDGET_S["quick"] = 20 s) and the full one (--full-budget s), each from the defaults in an empty tuning cache:
wall seconds, the winner's ms and quick / full.

    python bench/one_token_moe.py --part block                 # H200: about a minute
    python bench/one_token_moe.py --part tune --kinds 4        # about 90 s per kind
    python bench/one_token_moe.py --part tune --kinds 3
Writes bench/results/one_token_moe-<part>-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import measure_hbm_bandwidth, result_record, time_cuda_graph, write_result  # noqa: E402
from kernels import random_layer  # noqa: E402
from moe_block import default_device_dtype, our_spec  # noqa: E402

from moeserve.kernels.triton.one_token import ONE_TOKEN_ENV  # noqa: E402
from moeserve.model.moe import MoEBlock  # noqa: E402
from moeserve.quant.mxfp4 import stored_experts  # noqa: E402
from moeserve.quant.qlinear import QuantizedExperts  # noqa: E402
from moeserve.spec import ModelSpec  # noqa: E402

MIXTRAL = dict(E=8, k=2, D=4096, F=14336)
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=1024)
KINDS = {"4": (4, 0), "3": (3, 32)}  # name -> (bits, compensator rank)
INPUTS = 8  # rotating tokens per timing
STD = 0.02


def lowbit_block(bits: int, rank: int, device) -> MoEBlock:
    """A Mixtral-shaped MoEBlock (softmax top-2 router, fp32 weights) with random low-bit experts of group 64."""
    E, k, D, F = MIXTRAL.values()
    with default_device_dtype(device, torch.bfloat16), torch.device("meta"):
        block = MoEBlock(our_spec("mixtral", E, k, D, F), 0).eval()
    block.gate.to_empty(device=device)
    block.gate.weight.data.normal_(0, STD)
    block.experts = QuantizedExperts([random_layer(2 * F, D, bits, device, rank) for _ in range(E)],
                                     [random_layer(D, F, bits, device, rank) for _ in range(E)])
    return block


def gptoss_block(device) -> MoEBlock:
    """A GPT-OSS-20B-shaped MoEBlock: biased router, MXFP4 experts (random codes, scales near 2^-6) with biases."""
    import transformers

    cfg = transformers.GptOssConfig(**GPT_OSS_20B)
    spec = ModelSpec.from_hf_config({**cfg.to_dict(), "architectures": ["GptOssForCausalLM"],
                                     "quantization_config": {"quant_method": "mxfp4"}})
    with default_device_dtype(device, torch.bfloat16), torch.device("meta"):
        block = MoEBlock(spec, 0).eval()
        block.experts = stored_experts(spec, spec.moe.experts_at(0))
    block.to_empty(device=device)
    with torch.no_grad():
        for name, t in [*block.named_parameters(), *block.named_buffers()]:
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, device=device, dtype=torch.uint8) if "blocks" in name else
                        torch.randint(120, 124, t.shape, device=device, dtype=torch.uint8))  # E8M0 2^-7..2^-4
            else:
                t.normal_(0, STD if "weight" in name else 0.5)
    return block


def expert_bytes(block: MoEBlock) -> int:
    """Bytes one routed expert reads: its packed weights, scales (and zeros) and biases."""
    ex = block.experts
    if isinstance(ex, QuantizedExperts):
        layers = (ex.gate_up[0], ex.down[0])
        return sum(t.numel() * t.element_size() for m in layers for t in (m.qweight, m.scale, m.zero)) + sum(
            m.rank * (m.in_features + m.out_features) * 2 for m in layers)
    E = ex.num_experts
    return sum(t.numel() * t.element_size() for _, t in [*ex.named_parameters(), *ex.named_buffers()]) // E


def block_rows(device, bw: float) -> list[dict]:
    rows = []
    builds = [(f"mixtral {bits}-bit" + (f" + r{rank}" if rank else ""), lambda b=bits, r=rank: lowbit_block(b, r, device))
              for bits, rank in KINDS.values()] + [("gpt-oss-20b mxfp4", lambda: gptoss_block(device))]
    for name, build in builds:
        block = build()
        D, k = block.gate.weight.shape[1], block.gate.top_k
        xs = [torch.randn(1, D, device=device, dtype=torch.bfloat16) for _ in range(INPUTS)]
        floor_bytes = k * expert_bytes(block) + block.gate.weight.numel() * block.gate.weight.element_size() + 4 * D
        floor = floor_bytes / bw * 1e3
        times = {}
        with torch.inference_mode():
            for path, env in (("multi_launch", "0"), ("one_token", "1")):
                os.environ[ONE_TOKEN_ENV] = env
                times[path] = time_cuda_graph(block, xs, reps=50)
            os.environ[ONE_TOKEN_ENV] = "1"
            new = block(xs[0])
            os.environ[ONE_TOKEN_ENV] = "0"
            old = block(xs[0])
            os.environ.pop(ONE_TOKEN_ENV)
        err = ((new.float() - old.float()).norm() / old.float().norm()).item()
        rows.append({"block": name, "tokens": 1, **{f"{p}_ms": v for p, v in times.items()}, "floor_ms": floor,
                     "floor_bytes": floor_bytes, "rel_diff": err})
        print(f"  {name:<24} multi-launch {times['multi_launch']:.4f} ms  one-token {times['one_token']:.4f} ms  "
              f"floor {floor:.4f} ms  (rel. diff {err:.1e})", flush=True)
        del block
        torch.cuda.empty_cache()
    return rows


def tune_rows(kinds: list[str], full_budget: float) -> list[dict]:
    """Quick then full search of each kind's experts at 1 token, each from an empty tuning cache (no table)."""
    from moeserve.kernels.triton import autotune, configs
    from moeserve.kernels.triton.lowbit import ops as lowbit_ops

    rows = []
    hidden, cache_env = configs.CONFIG_DIR, os.environ.get("MOESERVE_CACHE")
    for kind in kinds:
        bits, rank = KINDS[kind]
        block = lowbit_block(bits, rank, torch.device("cuda"))
        stacks = block.experts.stacked(torch.bfloat16)
        out = {"experts": f"{bits}-bit" + (f" + r{rank}" if rank else ""), "tokens": 1}
        for mode, budget in (("quick", None), ("full", full_budget)):
            with tempfile.TemporaryDirectory() as cache:
                os.environ["MOESERVE_CACHE"] = cache
                configs.CONFIG_DIR = Path(cache) / "no-shipped-tables"
                autotune.forget()
                res = lowbit_ops.tune_experts(*stacks, 1, MIXTRAL["k"], mode, torch.bfloat16, budget)
            out[mode] = {"seconds": res.seconds, "ms": res.ms, "default_ms": res.default_ms, "timed": res.timed,
                         "complete": res.complete, "config": res.config.as_dict()}
        configs.CONFIG_DIR = hidden
        if cache_env is None:
            os.environ.pop("MOESERVE_CACHE", None)
        else:
            os.environ["MOESERVE_CACHE"] = cache_env
        autotune.forget()
        out["quick_over_full"] = out["quick"]["ms"] / out["full"]["ms"]
        rows.append(out)
        print(f"  {out['experts']:<14} quick {out['quick']['seconds']:.1f} s -> {out['quick']['ms']:.4f} ms   full "
              f"{out['full']['seconds']:.1f} s -> {out['full']['ms']:.4f} ms   quick/full {out['quick_over_full']:.3f}",
              flush=True)
        del block, stacks
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("block", "tune"), default="block")
    ap.add_argument("--kinds", default="4,3", help="--part tune: 4 (4-bit), 3 (3-bit + rank 32)")
    ap.add_argument("--full-budget", type=float, default=60.0, help="--part tune: seconds of the full search")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("one_token_moe.py times CUDA kernels: no GPU here", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    record = result_record(f"one_token_moe-{args.part}", {"part": args.part, "kinds": args.kinds,
                                                          "full_budget": args.full_budget}, device)
    if args.part == "block":
        bw = measure_hbm_bandwidth(device)
        record["copy_bandwidth"] = bw
        record["rows"] = block_rows(device, bw["bytes_per_s"])
    else:
        record["rows"] = tune_rows(args.kinds.split(","), args.full_budget)
    print(f"wrote {write_result(record, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
