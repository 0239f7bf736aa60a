"""Expert/tensor-parallel inference across ranks (DeepSpeed-MoE style): whole-model layouts, communication, MoE layers.

--layouts: a whole model under each layout, one torchrun launch per layout (this script starts them; NCCL on GPUs
with NVLink multicast off for the children: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1), against one GPU (one process) on the same checkpoint:
  layouts      - one process; --ep N; --tp N; --tp 2 --ep N/2 (N >= 4), N = --gpus;
  load         - per rank: seconds from the call to a loaded part, and bytes read of the checkpoint
                 (parallel/accounting.py; one process reads all of it);
  prefill      - one forward pass over -p random tokens (batch 1), tokens/s;
  decode       - greedy decode steps of a continuous batch of 1 / 16 / 64 rows (the engine's step, as `serve`
                 runs it), tokens/s over all rows, with CUDA graphs on and off on GPUs (what was captured is
                 recorded: whole steps, or segments between expert-parallel layers, which run eagerly);
each timing the median of -r repetitions after an untimed one, the slowest rank's. A layout the model cannot take
(heads or experts that do not divide) is recorded with its one-line error.

Without --layouts, per rank, each figure the median of fixed repetitions with the ranks aligned by a barrier before
each one (the same count on every rank: a collective must not be timed adaptively), max over the ranks:
  all_to_all   - one all_to_all_single, equal splits, `rows` rows of D per destination;
  dispatch     - dispatch + combine of an EP layer whose experts return their input (communication and
                 layout only), static and dynamic modes, 1..128 tokens per rank (decode sizes);
  moe_layer    - a whole EP expert layer (real experts, random routing) at EP 1/2/4, latency and tokens/s
                 per rank, for a Mixtral-shaped and a DeepSeek/Qwen-shaped (64 experts) layer;
  bytes_sent   - rows (and bytes) leaving a rank per dispatch, once per rank (ours) vs once per expert, at
                 EP 2/4/8 (top-6/8 for 64 experts), counted on random routing (no timing).

    python bench/parallel.py --layouts --gpus 2 --model DIR            # whole model: 1 GPU vs --ep 2, --tp 2
    python bench/parallel.py --layouts --gpus 4 --random-shape mixtral --random-layers 8 --random-bits 16
    python bench/parallel.py --layouts --quick                          # 2 gloo CPU ranks, tiny random model, seconds
    torchrun --nproc-per-node 4 bench/parallel.py       # GPUs: NCCL, bf16, full shapes
    python bench/parallel.py --world 4                  # CPU: spawns 4 gloo ranks, CPU shapes
    python bench/parallel.py --quick                    # 2 gloo ranks, tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import result_record, sync, write_result  # noqa: E402
from random_checkpoint import (add_random_checkpoint_args, shape_config, write_random_checkpoint,  # noqa: E402
                               write_requested)

from moeserve.engine.batching import ContinuousBatch, Request  # noqa: E402
from moeserve.engine.bench import prompt_pass  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.loader import load_model  # noqa: E402
from moeserve.model.experts import ResidentExperts  # noqa: E402
from moeserve.parallel.accounting import CountingReader, checkpoint_bytes  # noqa: E402
from moeserve.parallel.launch import init_from_env  # noqa: E402
from moeserve.parallel.loading import load_parallel_model  # noqa: E402
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


# ---- whole-model layouts (--layouts) ------------------------------------------------------------------------------

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DECODE_BATCHES, QUICK_DECODE_BATCHES = (1, 16, 64), (1, 4)
LAYOUT_TIMEOUT_S = 3600  # one layout's launch: loading a large checkpoint, graph capture, every batch size


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    ep: int

    @property
    def ranks(self) -> int:
        return self.tp * self.ep


def layouts(gpus: int) -> list[Layout]:
    """One process, then --ep N, --tp N and (N >= 4, even halves) --tp 2 --ep N/2 over N = gpus ranks."""
    out = [Layout("single", 1, 1), Layout(f"ep{gpus}", 1, gpus), Layout(f"tp{gpus}", gpus, 1)]
    if gpus >= 4 and gpus % 2 == 0:
        out.append(Layout(f"tp2ep{gpus // 2}", 2, gpus // 2))
    return out


def slowest_rank(value: float) -> float:
    """The largest of every rank's value (a collective step takes as long as its slowest rank); the value itself in
    one process."""
    return slowest(value) if dist.is_initialized() else value


def decode_rate(model, rows: int, steps: int, cuda_graph: bool, prompt: list[int]) -> dict:
    """`steps` decode steps of a continuous batch of `rows` requests (one-token prompts, greedy, EOS ignored), after
    their prefill and one untimed step (graph capture): tokens/s over all rows, the slowest rank's; what was
    captured."""
    params = SamplingParams(max_new_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    batch = ContinuousBatch(model, None, slots=rows, context=steps + 3, cuda_graph=cuda_graph)
    for i in range(rows):
        batch.add(Request([prompt[i % len(prompt)]], params, lambda *_: None))
    batch.step()  # prefill (and the first token)
    batch.step()  # first decode step: captured where graphs are on
    sync(model.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        batch.step()
    sync(model.device)
    seconds = slowest_rank(time.perf_counter() - t0)
    return {"batch": rows, "cuda_graph": cuda_graph, "steps": steps, "tok_s": rows * steps / seconds,
            "ms_per_step": 1e3 * seconds / steps, "graphed_sizes": batch.decoder.graphed_sizes(),
            "segmented_sizes": batch.decoder.cut_sizes()}


def layout_worker(args) -> None:
    """One rank of a layout's launch (or the one process): load, measure, and rank 0 writes args.part (JSON)."""
    cuda = not args.cpu and torch.cuda.is_available()
    layout = Layout(args.layout, *args.tp_ep)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if layout.ranks == 1:
        device = torch.device("cuda" if cuda else "cpu")
        model = load_model(args.model, device=device)
        rank, read = 0, checkpoint_bytes(args.model)  # one process reads every tensor
    else:
        rank, world, device = init_from_env("cuda" if cuda else "cpu", args.collective_timeout)
        reader = CountingReader(args.model)
        model = load_parallel_model(args.model, rank, world, tp=layout.tp, ep=layout.ep, device=device,
                                    reader=reader, collective_timeout=args.collective_timeout)
        read = reader.total_read
    load = {"rank": rank, "bytes_read": read, "seconds": time.perf_counter() - t0}
    loads = [load]
    if dist.is_initialized():
        loads = [None] * dist.get_world_size()
        dist.all_gather_object(loads, load)
    g = torch.Generator().manual_seed(0)  # the same tokens on every rank: a TP group must share its inputs
    V = model.spec.vocab_size
    tokens = torch.randint(0, V, (1, args.prompt_tokens), generator=g).to(model.device)
    prompt = torch.randint(0, V, (max(args.batches),), generator=g).tolist()
    prefill = [slowest_rank(prompt_pass(model, tokens)) for _ in range(args.repetitions + 1)][1:]
    decode = [decode_rate(model, rows, args.gen_tokens, graph, prompt)
              for rows in args.batches for graph in ((True, False) if cuda else (False,))]
    if rank == 0:
        Path(args.part).write_text(json.dumps({
            "layout": layout.name, "tp": layout.tp, "ep": layout.ep, "ranks": layout.ranks,
            "backend": dist.get_backend() if dist.is_initialized() else None, "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch."), "load": loads,
            "prefill": {"tokens": args.prompt_tokens, "seconds": prefill,
                        "tok_s": args.prompt_tokens / statistics.median(prefill)},
            "decode": decode}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch_layout(layout: Layout, args, part: Path) -> dict:
    """Run one layout's ranks under torchrun (one process: without it; children without NVLink multicast); its
    record, or its error."""
    launcher = [] if layout.ranks == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                             str(layout.ranks)]
    cmd = [sys.executable, *launcher, str(Path(__file__).resolve()), "--layout", layout.name, "--tp-ep",
           str(layout.tp), str(layout.ep),
           "--model", args.model, "--part", str(part), "-p", str(args.prompt_tokens), "-n", str(args.gen_tokens),
           "-r", str(args.repetitions), "--batches", *map(str, args.batches), "--threads", str(args.threads),
           "--collective-timeout", str(args.collective_timeout), *(["--cpu"] if args.cpu else [])]
    env = {**os.environ, **NO_MULTICAST, "OMP_NUM_THREADS": str(args.threads)}
    print(f"[{layout.name}: {layout.ranks} rank(s)]", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAYOUT_TIMEOUT_S)
    if proc.returncode != 0 or not part.exists():
        errors = [line for line in proc.stderr.splitlines() if line.startswith("moeserve: error:")]
        tail = errors[-1] if errors else "\n".join(proc.stderr.strip().splitlines()[-5:])
        print(f"  failed: {tail}", flush=True)
        return {"layout": layout.name, "tp": layout.tp, "ep": layout.ep, "ranks": layout.ranks, "error": tail}
    record = json.loads(part.read_text())
    rates = ", ".join(f"b{d['batch']}{'' if d['cuda_graph'] else ' eager'} {d['tok_s']:,.1f}" for d in record["decode"])
    print(f"  load {max(r['seconds'] for r in record['load']):.2f} s; pp {record['prefill']['tok_s']:,.1f} tok/s; "
          f"decode tok/s {rates}", flush=True)
    return record


def speedups(records: list[dict]) -> list[dict]:
    """Each layout's prefill and decode rates over the single process's, at the same batch and graph setting."""
    base = next((r for r in records if r["layout"] == "single" and "error" not in r), None)
    if base is None:
        return []
    single = {(d["batch"], d["cuda_graph"]): d["tok_s"] for d in base["decode"]}
    return [{"layout": r["layout"], "prefill": r["prefill"]["tok_s"] / base["prefill"]["tok_s"],
             "decode": [{"batch": d["batch"], "cuda_graph": d["cuda_graph"],
                         "over_single": d["tok_s"] / single[d["batch"], d["cuda_graph"]]} for d in r["decode"]]}
            for r in records if r["layout"] != "single" and "error" not in r]


def compare_layouts(args) -> Path:
    """Every layout over args.gpus ranks and one process, on one checkpoint; one result JSON."""
    cuda = not args.cpu and torch.cuda.is_available()
    if args.quick:
        args.cpu, args.batches, args.prompt_tokens, args.gen_tokens, args.repetitions = (
            True, list(QUICK_DECODE_BATCHES), 16, 4, 1)
        cuda = False
    with tempfile.TemporaryDirectory() as work:
        made = write_requested(args, work)
        if args.model is None:  # --quick without a checkpoint: a tiny random Mixtral
            args.model = str(Path(work) / "tiny")
            write_random_checkpoint(shape_config("tiny", 2), Path(args.model), device=torch.device("cpu"))
        records = [launch_layout(layout, args, Path(work) / f"{layout.name}.json") for layout in layouts(args.gpus)]
    config = {"quick": args.quick, "gpus": args.gpus, "model": args.model, "random_checkpoint": made,
              "backend": "nccl" if cuda else "gloo", "batches": args.batches, "prompt_tokens": args.prompt_tokens,
              "gen_tokens": args.gen_tokens, "repetitions": args.repetitions, "threads_per_rank": args.threads,
              "label": (f"{args.gpus} GPUs, NCCL, NVLink multicast off" if cuda else
                        f"CPU only: gloo ranks on {os.cpu_count()} cores, {args.threads} thread(s) each (a smoke "
                        "run: loopback gloo, not GPU figures)")}
    record = result_record("parallel_layouts", config, "cuda" if cuda else "cpu")
    record.update(layouts=records, speedup_over_single=speedups(records))
    return write_result(record, args.out)


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
    whole = ap.add_argument_group("whole-model layouts (--layouts)")
    whole.add_argument("--layouts", action="store_true", help="compare whole-model layouts (see above)")
    whole.add_argument("--gpus", type=int, default=2, help="ranks of the parallel layouts (default 2)")
    whole.add_argument("--model", default=None, help="checkpoint directory (or --random-shape)")
    whole.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU even where GPUs are")
    whole.add_argument("--batches", type=int, nargs="+", default=list(DECODE_BATCHES),
                       help="decode batch sizes (default 1 16 64)")
    whole.add_argument("-p", "--prompt-tokens", type=int, default=512, help="prefill tokens (default 512)")
    whole.add_argument("-n", "--gen-tokens", type=int, default=64, help="timed decode steps (default 64)")
    whole.add_argument("-r", "--repetitions", type=int, default=3, help="prefill repetitions (default 3)")
    whole.add_argument("--collective-timeout", type=float, default=600.0, help="seconds (default 600)")
    whole.add_argument("--seed", type=int, default=0, help="seed of a random checkpoint")
    add_random_checkpoint_args(whole, "bench")
    whole.add_argument("--layout", default=None, help=argparse.SUPPRESS)  # a layout's rank (this script starts them)
    whole.add_argument("--tp-ep", type=int, nargs=2, default=(1, 1), help=argparse.SUPPRESS)
    whole.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layout is not None:
        layout_worker(args)
        return
    if args.layouts:
        if args.model is None and not (args.quick or args.random_shape):
            ap.error("--layouts needs --model DIR, --random-shape or --quick")
        print(f"wrote {compare_layouts(args)}")
        return
    if "RANK" in os.environ:  # under torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return
    world = args.world or 2
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(run, args=(world, args, f"file://{tmp}/rdv"), nprocs=world, join=True)


if __name__ == "__main__":
    main()
