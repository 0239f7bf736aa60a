"""End-to-end decode of a Mixtral-8x7B-shaped model with random 3-bit (or 4-bit) experts and bf16 MiLo-style
compensators of rank r, resident on one GPU (about 21 GB at 3 bits), through moeserve's decode (eager and
CUDA graph), vs the same shape in bf16 through transformers + accelerate offload (93 GB of bf16 does not
fit an 80 GB GPU: its MoE blocks live on the CPU; bench/offload.py's measurement, a few layers timed and
scaled to 32).

Floor per decode token: the weight bytes one token reads (dense layers, 2 of 8 experts per layer: packed
codes, scales, zeros and compensators; embedding row and LM head) over the measured HBM bandwidth.

    python bench/lowbit_decode.py                # H100: 3-bit, rank 32, batch 1; JSON to bench/results/
    python bench/lowbit_decode.py --bits 4 --rank 0
    python bench/lowbit_decode.py --quick        # tiny model on the CPU (generated CPU kernels), seconds
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_run_args, measure_hbm_bandwidth, result_record, run_device, sync, write_result  # noqa: E402
from offload import MIXTRAL, QUICK, dense_model, hf_accelerate, model_spec  # noqa: E402

from moeserve.engine.generate import iterate  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.quant.qlinear import QuantizedExperts, QuantizedLinear  # noqa: E402

STD = 0.02


def random_quantized(in_f: int, out_f: int, bits: int, group: int, rank: int, device) -> QuantizedLinear:
    """Random codes (any int32 pattern is a valid packing, 3-bit included), scales giving weights of std
    ~STD around a mid-range zero, and a random bf16 compensator of rank `rank`."""
    with torch.device(device):
        q = QuantizedLinear(in_f, out_f, bits, group, rank=rank, compensator_bits=16)
    q.qweight.random_(-2 ** 31, 2 ** 31 - 1)
    q.scale.fill_(STD * 12 ** 0.5 / 2 ** bits).mul_(1 + 0.1 * torch.rand_like(q.scale))
    q.zero.fill_((2 ** bits - 1) / 2)
    if rank:
        q.comp_u.normal_(0, STD / 4)
        q.comp_v.normal_(0, STD / 4)
    return q


def lowbit_model(spec, bits: int, group: int, rank: int, device, dtype):
    """Random bf16 dense weights; every MoE layer's experts as QuantizedExperts (the low-bit fused MoE on CUDA)."""
    model = dense_model(spec, device, dtype)
    D, F = spec.hidden_size, spec.moe.expert_ffn
    for layer in model.model.layers:
        gate_up = [random_quantized(D, 2 * F, bits, group, rank, device) for _ in range(spec.moe.num_experts)]
        down = [random_quantized(F, D, bits, group, rank, device) for _ in range(spec.moe.num_experts)]
        layer.mlp.experts = QuantizedExperts(gate_up, down)
    return model


def bytes_per_token(model, spec, batch: int = 1) -> int:
    """Weight bytes a decode step of `batch` tokens reads: dense layers, the experts its tokens hit per layer (top_k
    of E for one token; E (1 - (1 - k/E)^batch) expected under uniform routing), `batch` embedding rows."""
    hit = spec.moe.num_experts * (1 - (1 - spec.moe.top_k / spec.moe.num_experts) ** batch)
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".experts." in name:
            total += t.nbytes * hit / spec.moe.num_experts
        elif name == "model.embed_tokens.weight":
            total += t.nbytes * batch // spec.vocab_size
        else:
            total += t.nbytes
    return int(total)


def prompts_of(spec, args) -> list[list[int]]:
    """args.batch random prompts of args.prompt tokens."""
    return [torch.randint(0, spec.vocab_size, (args.prompt,)).tolist() for _ in range(args.batch)]


def decode_rate(model, spec, args, cuda_graph: bool, device) -> dict:
    """Tokens/s of the decode steps after the first (the first holds the graph capture), all sequences counted."""
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    marks = []
    for _ in iterate(model, prompts_of(spec, args), params, cuda_graph=cuda_graph):
        sync(device)
        marks.append(time.perf_counter())
    steps = len(marks) - 2
    seconds = marks[-1] - marks[1]
    return {"tokens_per_s": args.batch * steps / seconds, "step_ms": 1e3 * seconds / steps,
            "first_step_ms": 1e3 * (marks[1] - marks[0])}


def kernel_profile(model, spec, args, steps: int = 16, top: int = 25) -> dict:
    """The GPU kernels of decode steps replayed as a CUDA graph (torch.profiler; the profiler sees the kernels inside
    a replay), after the prefill and the capture: per kernel name, microseconds and launches per step, largest
    first, and their sum per step (sum vs the graph's step time says whether the kernels or the gaps between them
    cost)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=steps + 3, temperature=0.0, ignore_eos=True)
    prof = profile(activities=[ProfilerActivity.CUDA])
    for n, _ in enumerate(iterate(model, prompts_of(spec, args), params, cuda_graph=True)):
        if n == 2:  # 0: prefill, 1: the capture
            torch.cuda.synchronize()
            prof.start()
    torch.cuda.synchronize()
    prof.stop()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels) / steps
    rows = [{"kernel": e.key[:120], "us_per_step": e.self_device_time_total / steps, "launches_per_step": e.count / steps}
            for e in kernels[:top]]
    for r in rows:
        print(f"  {r['us_per_step']:8.1f} us  x{r['launches_per_step']:5.1f}  {r['kernel']}")
    print(f"  kernels in all: {total:.0f} us per step, {sum(e.count for e in kernels) / steps:.0f} launches", flush=True)
    return {"steps": steps, "timing": "CUDA graph replay", "kernel_us_per_step": total,
            "launches_per_step": sum(e.count for e in kernels) / steps, "top": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU, seconds")
    ap.add_argument("--bits", type=int, default=3, help="expert bits: 2, 3 or 4 (default 3)")
    ap.add_argument("--rank", type=int, default=32, help="compensator rank per expert projection (0 = none)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (a static batch)")
    ap.add_argument("--hf-layers", type=int, default=2, help="layers of the transformers baseline (0 = skip it)")
    ap.add_argument("--profile", action="store_true", help="also list the GPU kernels of a decode step (CUDA graph replay)")
    add_run_args(ap)
    args = ap.parse_args(argv)
    device, dtype = run_device(args)
    shape, group = (QUICK, 32) if args.quick else (MIXTRAL, 64)
    if args.quick:
        args.new_tokens, args.hf_layers = 6, 0
    spec = model_spec(shape)
    model = lowbit_model(spec, args.bits, group, args.rank, device, dtype)
    per_token = bytes_per_token(model, spec, args.batch) / args.batch
    bw = measure_hbm_bandwidth(device, 64 << 20 if args.quick else None)["bytes_per_s"]
    rows = {"eager": decode_rate(model, spec, args, False, device)}
    if device.type == "cuda":
        rows["cuda_graph"] = decode_rate(model, spec, args, True, device)
    floor = bw / per_token
    for name, r in rows.items():
        r["of_floor"] = r["tokens_per_s"] / floor
        print(f"{name:10s} {r['tokens_per_s']:8.1f} tok/s  ({100 * r['of_floor']:.0f}% of the {floor:.0f} tok/s floor; "
              f"first step {r['first_step_ms']:.0f} ms)", flush=True)
    if device.type == "cuda" and args.profile:
        rows["kernels"] = kernel_profile(model, spec, args)
        rows["kernels"]["graph_step_us"] = 1e6 / rows["cuda_graph"]["tokens_per_s"]
    if device.type == "cuda" and args.hf_layers:
        del model
        torch.cuda.empty_cache()
        try:
            rows["hf_accelerate_bf16"] = hf_accelerate(shape, args.hf_layers, device, torch.bfloat16, args)
            print(f"transformers + accelerate (bf16, MoE on the CPU) {rows['hf_accelerate_bf16']['tokens_per_s']:.3f} "
                  f"tok/s (scaled from {args.hf_layers} layers)")
        except Exception as e:  # noqa: BLE001 - the baseline is optional; say why it is missing
            rows["hf_accelerate_bf16"] = {"error": str(e).splitlines()[0]}
    record = result_record("lowbit_decode", {"shape": shape, "quick": args.quick, "bits": args.bits, "group": group,
                                             "rank": args.rank, "prompt": args.prompt, "new_tokens": args.new_tokens,
                                             "batch": args.batch,
                                             "dtype": str(dtype)}, device)
    record.update({"weight_bytes_per_token": per_token, "hbm_bytes_per_s": bw, "floor_tokens_per_s": floor,
                   "results": rows})
    print(write_result(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
