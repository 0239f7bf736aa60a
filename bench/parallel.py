"""Expert-parallel communication and MoE layers across ranks (DeepSpeed-MoE style inference).

Measured per rank, each figure the median of fixed repetitions with the ranks aligned by a barrier before
each one (the same count on every rank: a collective must not be timed adaptively), max over the ranks:
  all_to_all   - one all_to_all_single, equal splits, `rows` rows of D per destination;
  dispatch     - dispatch + combine of an EP layer whose experts return their input (communication and
                 layout only), static and dynamic modes, 1..128 tokens per rank (decode sizes);
  moe_layer    - a whole EP expert layer (real experts, random routing) at EP 1/2/4, latency and tokens/s
                 per rank, for a Mixtral-shaped and a DeepSeek/Qwen-shaped (64 experts) layer;
  bytes_sent   - rows (and bytes) leaving a rank per dispatch, once per rank (ours) vs once per expert, at
                 EP 2/4/8 (top-6/8 for 64 experts), counted on random routing (no timing).

    torchrun --nproc-per-node 4 bench/parallel.py       # GPUs: NCCL, bf16, full shapes
    python bench/parallel.py --world 4                  # CPU: spawns 4 gloo ranks, CPU shapes
    python bench/parallel.py --quick                    # 2 gloo ranks, tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import result_record, sync, write_result  # noqa: E402

from moeserve.model.experts import ResidentExperts  # noqa: E402
from moeserve.parallel.dispatch import rows_sent  # noqa: E402
from moeserve.parallel.expert_parallel import ExpertParallelExperts  # noqa: E402
from moeserve.parallel.plan import DispatchPlan  # noqa: E402

# name -> (E, k, D, F): GPU shapes, CPU shapes (same E, k; D, F scaled so weights fit and runs finish), quick
SHAPES = {"mixtral": (8, 2, 4096, 14336), "deepseek_like": (64, 8, 2048, 1408)}
CPU_SHAPES = {"mixtral": (8, 2, 1024, 3584), "deepseek_like": (64, 8, 512, 352)}
QUICK_SHAPES = {"mixtral": (8, 2, 64, 128), "deepseek_like": (64, 8, 32, 16)}
DECODE_TOKENS, QUICK_DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128), (1, 8)
LAYER_TOKENS, QUICK_LAYER_TOKENS = (1, 16, 128), (1, 8)
A2A_ROWS, QUICK_A2A_ROWS = (1, 8, 64, 512), (1, 8)
INPUT_SETS = 4  # rotating inputs


class PassThrough(ResidentExperts):
    """Experts that return their rows: what is left of a layer is its communication and layout work."""

    def run_sorted(self, x_sorted, table):
        return x_sorted


def timed(fn, inputs: list, device: torch.device, group, reps: int, warmup: int = 2) -> float:
    """Median ms of fn(x) over `reps` calls (x rotating), each started after a barrier of `group`."""
    times = []
    for i in range(warmup + reps):
        dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        fn(inputs[i % len(inputs)])
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def slowest(ms: float, group=None) -> float:
    """The slowest rank's figure: a collective step takes as long as its slowest member."""
    figures = [None] * dist.get_world_size(group)
    dist.all_gather_object(figures, ms, group=group)
    return max(figures)


def routing(T: int, E: int, k: int, g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random top-k routing: ids [T, k] (distinct per token), weights [T, k]."""
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]
    return ids.to(device), torch.rand(T, k, generator=g).to(device)


def ep_layer(local, E: int, group, rank: int, size: int, device, static: bool, T: int):
    """An EP layer over `group` with a plan agreed for T tokens (static buffers or dynamic)."""
    plan = DispatchPlan(group, device, threshold=T if static else 0)
    plan.begin(T)
    return ExpertParallelExperts(local, E, group, rank, size, plan=plan)


def bench_all_to_all(rows_list, D, dtype, device, reps) -> list[dict]:
    world, out = dist.get_world_size(), []
    for rows in rows_list:
        sends = [torch.randn(world * rows, D, dtype=dtype, device=device) for _ in range(INPUT_SETS)]
        recv = torch.empty_like(sends[0])
        ms = slowest(timed(lambda s: dist.all_to_all_single(recv, s), sends, device, None, reps))
        nbytes = (world - 1) * rows * D * sends[0].element_size()  # leaving each rank
        out.append({"rows_per_destination": rows, "hidden": D, "ms": ms, "bytes_out_per_rank": nbytes,
                    "gb_per_s_out_per_rank": nbytes / (ms * 1e-3) / 1e9})
    return out


def bench_dispatch(tokens_list, shape, dtype, device, reps) -> list[dict]:
    E, k, D, _ = shape
    world, rank, out = dist.get_world_size(), dist.get_rank(), []
    g = torch.Generator().manual_seed(rank)
    with torch.device("meta"):
        local = PassThrough(E // world, D, 1)
    for T in tokens_list:
        inputs = [(torch.randn(T, D, dtype=dtype, device=device), *routing(T, E, k, g, device))
                  for _ in range(INPUT_SETS)]
        row = {"tokens_per_rank": T}
        for mode in ("static", "dynamic"):
            layer = ep_layer(local, E, dist.group.WORLD, rank, world, device, mode == "static", T)
            row[f"{mode}_ms"] = slowest(timed(lambda a: layer(*a), inputs, device, None, reps))
        row["static_over_dynamic"] = row["static_ms"] / row["dynamic_ms"]
        out.append(row)
    return out


def bench_layer(name, shape, tokens_list, dtype, device, reps) -> list[dict]:
    """EP 1/2/4 (as far as the world goes): the first `ep` ranks run the layer, the others wait."""
    E, k, D, F = shape
    world, rank, out = dist.get_world_size(), dist.get_rank(), []
    for ep in (s for s in (1, 2, 4) if s <= world):
        group = dist.new_group(list(range(ep)))  # collective: every rank creates every group
        if rank < ep:
            g = torch.Generator().manual_seed(1000 + rank)
            local = ResidentExperts(E // ep, D, F).to(device=device, dtype=dtype)
            with torch.no_grad():
                local.gate_up_proj.normal_(0, 0.02)
                local.down_proj.normal_(0, 0.02)
            for T in tokens_list:
                inputs = [(torch.randn(T, D, dtype=dtype, device=device), *routing(T, E, k, g, device))
                          for _ in range(INPUT_SETS)]
                row = {"shape": name, "ep": ep, "tokens_per_rank": T}
                for mode in ("local",) if ep == 1 else ("static", "dynamic"):
                    layer = local if ep == 1 else ep_layer(local, E, group, rank, ep, device, mode == "static", T)
                    with torch.no_grad():
                        row[f"{mode}_ms"] = slowest(timed(lambda a: layer(*a), inputs, device, group, reps), group)
                row["tokens_per_s_per_rank"] = T / (min(v for n, v in row.items() if n.endswith("_ms")) * 1e-3)
                out.append(row)
            del local
        dist.barrier()
    return out


def bytes_sent(shapes: dict, tokens: int = 4096) -> list[dict]:
    """Once per rank vs once per expert, counted from rank 0's view of uniform random routing (the shape's
    top-k, and top-6/8 for 64 experts)."""
    out, g = [], torch.Generator().manual_seed(0)
    for name, (E, k0, D, _) in shapes.items():
        for k in sorted({k0, 6, 8} if E >= 64 else {k0}):
            ids, _ = routing(tokens, E, k, g, "cpu")
            for ep in (2, 4, 8):
                rows = rows_sent(ids, E // ep, ep, rank=0)
                out.append({"shape": name, "top_k": k, "ep": ep, "tokens": tokens, "hidden": D,
                            "rows_once_per_rank": rows["per_rank"], "rows_once_per_expert": rows["per_expert"],
                            "per_expert_over_per_rank": rows["per_expert"] / rows["per_rank"],
                            "bytes_once_per_rank_bf16": rows["per_rank"] * D * 2,
                            "bytes_once_per_expert_bf16": rows["per_expert"] * D * 2})
    return out


def run(rank: int, world: int, args, init_method: str | None) -> None:
    cuda = torch.cuda.is_available() and not args.quick and init_method is None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        shapes = QUICK_SHAPES if args.quick else SHAPES if cuda else CPU_SHAPES
        dtype = torch.bfloat16 if cuda else torch.float32
        reps = 5 if args.quick else 20
        decode = QUICK_DECODE_TOKENS if args.quick else DECODE_TOKENS
        layer_tokens = QUICK_LAYER_TOKENS if args.quick else LAYER_TOKENS
        a2a = bench_all_to_all(QUICK_A2A_ROWS if args.quick else A2A_ROWS, shapes["deepseek_like"][2], dtype,
                               device, reps)
        dispatch = bench_dispatch(decode, shapes["deepseek_like"], dtype, device, reps)
        layers = [r for name, shape in shapes.items()
                  for r in bench_layer(name, shape, layer_tokens, dtype, device, reps)]
        if rank == 0:
            config = {"quick": args.quick, "world": world, "backend": backend, "dtype": str(dtype)[6:],
                      "threads_per_rank": args.threads, "reps": reps, "input_sets": INPUT_SETS,
                      "shapes": {n: dict(zip(("E", "k", "D", "F"), s)) for n, s in shapes.items()},
                      "label": (f"{world} ranks, NCCL on GPUs" if cuda else
                                f"CPU only: {world} gloo ranks on {os.cpu_count()} cores, {args.threads} thread(s) "
                                "each; CPU shapes (D, F scaled down); timings are loopback gloo, not a network")}
            record = result_record("parallel", config, device)
            record.update(all_to_all=a2a, dispatch=dispatch, moe_layer=layers, bytes_sent=bytes_sent(shapes))
            print(f"wrote {write_result(record, args.out)}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 gloo ranks on the CPU, tiny shapes (smoke run)")
    ap.add_argument("--world", type=int, default=None, help="ranks to spawn without torchrun (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank (default 1)")
    ap.add_argument("--out", default=None, help="folder for the result JSON (default bench/results/)")
    args = ap.parse_args()
    if "RANK" in os.environ:  # under torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return
    world = args.world or 2
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(run, args=(world, args, f"file://{tmp}/rdv"), nprocs=world, join=True)


if __name__ == "__main__":
    main()
