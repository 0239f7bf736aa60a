"""The disk tier at batch 1: every MoE layer's experts on the CPU (--cpu-moe) from a store on disk 1.5x the host RAM
given to them (--cpu-memory), against the same run with the whole store mapped in RAM: greedy tokens equal, decode
tokens/s, bytes read from disk per decode token (tg_disk_bytes_per_token; disk_bytes_per_token: over every token the
model ran, the prompt's too, as the run's stats line counts them), the RAM cache's hit rate.

Shapes (random weights; the store written layer by layer to --dir, then opened as `--offload STORE` opens it):
  mixtral8  Mixtral-8x7B's layers (D 4096, expert FFN 14336, 8 experts top-2), 8 of its 32 layers, 4-bit HQQ
            experts (group 64): a store of about 6 GiB, a RAM cap of about 4 GiB
  quick     (--quick) 4 layers, D 128, F 256, 8 experts top-2, float32 experts on the CPU: seconds
Routing: the CPU layers replay the trained demo model's routing of held-out text (bench/offload.py DemoRouting; 8
experts, top-2), whose locality is what a cache of 2/3 of the experts can use; `--routing model`: the random routers
(near uniform: the cache's worst case). Reads go through O_DIRECT where the filesystem allows it (the result
records which), so the page cache does not serve them; the mapped reference run's pages come from the page cache.

    python bench/disk_tier.py            # GPU host: mixtral8, JSON to bench/results/
    python bench/disk_tier.py --quick    # CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_run_args, result_record, run_device, sync, write_result  # noqa: E402
from offload import STD, DemoRouting, dense_model, model_spec, replay_routing  # noqa: E402

from moeserve.engine.generate import iterate  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.hybrid.placement import HybridPlacement  # noqa: E402
from moeserve.hybrid.setup import enable_hybrid  # noqa: E402
from moeserve.offload.store import ExpertStore, SourceExperts, layer_tensors, store_meta  # noqa: E402

RAM_SHARE = 1 / 1.5  # the cap: the store is 1.5x the RAM given to its experts
SHAPES = {
    "mixtral8": (dict(vocab_size=32000, hidden_size=4096, num_layers=8, num_heads=32, num_kv_heads=8, head_dim=128,
                      expert_ffn=14336, num_experts=8, top_k=2), 4),
    "quick": (dict(vocab_size=258, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                   expert_ffn=256, num_experts=8, top_k=2), 16),
}
GROUP = 64


def write_store(spec, path: Path, bits: int, device) -> ExpertStore:
    """Random experts of every MoE layer written to `path` one layer at a time (peak RAM: one layer), quantized on
    `device`; a 16-bit run's store holds float copies only, a low-bit run's the low-bit copies only."""
    E, D, F = spec.moe.num_experts, spec.hidden_size, spec.moe.expert_ffn
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def layer(i: int) -> dict:
        g = torch.Generator(device).manual_seed(1000 + i)
        gate_up = torch.randn(E, 2 * F, D, device=device, dtype=dtype, generator=g) * STD
        down = torch.randn(E, D, F, device=device, dtype=dtype, generator=g) * STD
        return layer_tensors(SourceExperts(gate_up, down), bits if bits < 16 else 0, GROUP, high=bits == 16)

    meta = store_meta(spec, spec.moe.layer_indices(), bits if bits < 16 else 0, GROUP)
    ExpertStore(meta, layer).save(path)
    return ExpertStore.open(path)


def decode(model, spec, prompt_len: int, new_tokens: int, warmup: int, device, routing: bool, layers, read):
    """(generated ids, decode seconds per step after `warmup` steps, read() bytes per step over those steps)."""
    if routing:
        replay_routing(model, DemoRouting(prompt_len + new_tokens + 1), layers)
    prompt = torch.randint(0, spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    marks, ids = [], []
    for _, added in iterate(model, [prompt], params, cuda_graph=False):
        sync(device)
        marks.append((time.perf_counter(), read()))
        ids.append(added[0])
    steps = len(marks) - 1 - warmup
    return ids, (marks[-1][0] - marks[warmup][0]) / steps, (marks[-1][1] - marks[warmup][1]) / steps


def run_column(spec, store, placement, device, dtype, args, budget: int | None) -> dict:
    model = dense_model(spec, device, dtype)
    runtime = enable_hybrid(model, store, placement, warm=budget is None, disk_budget=budget)
    stats = runtime.disk.stats if runtime.disk is not None else None
    read = (lambda: stats.bytes_read) if stats is not None else (lambda: 0)  # noqa: E731
    ids, step, read_per_step = decode(model, spec, args.prompt, args.new_tokens + args.warmup, args.warmup, device,
                                      args.routing == "demo", list(placement.cpu_layers), read)
    st = runtime.summary()
    row = {"ids": ids, "tg_tokens_per_s": 1 / step, "tg_disk_bytes_per_token": read_per_step}
    if budget is not None:
        row.update({k: v for k, v in st.items() if k.startswith("disk_")})
        assert row["disk_held_bytes"] <= budget
    runtime.close()
    del model, runtime
    gc.collect()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny shape on the CPU (seconds)")
    ap.add_argument("--dir", default=None, help="where the store is written (default: a temporary folder)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    ap.add_argument("--new-tokens", type=int, default=32, help="timed decode steps (default 32)")
    ap.add_argument("--warmup", type=int, default=4, help="decode steps before timing (default 4)")
    ap.add_argument("--routing", choices=("demo", "model"), default="demo",
                    help="demo: replay the demo model's routing (default); model: the random routers")
    ap.add_argument("--cpu-threads", type=int, default=None, help="CPU threads for the experts")
    add_run_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.new_tokens, args.warmup, args.prompt = min(args.new_tokens, 8), min(args.warmup, 2), min(args.prompt, 8)
    device, dtype = run_device(args)
    shape, bits = SHAPES["quick" if args.quick else "mixtral8"]
    spec = model_spec(shape)
    placement = HybridPlacement.choose(spec.moe.layer_indices(), cpu_moe=True, threads=args.cpu_threads, bits=bits,
                                       num_experts=spec.moe.num_experts)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store = write_store(spec, Path(tmp) / "store", bits, device)
        low = bits < 16
        store_bytes = store.expert_bytes(low) * spec.moe.num_experts * len(store.meta["layers"])  # as on disk
        budget = int(store_bytes * RAM_SHARE)
        ram = run_column(spec, store, placement, device, dtype, args, None)
        disk = run_column(spec, store, placement, device, dtype, args, budget)
    row = {"shape": "quick" if args.quick else "mixtral8", "bits": bits, "store_expert_bytes": store_bytes,
           "cpu_memory": budget, "same_tokens": ram["ids"] == disk["ids"],
           "ram_tg_tokens_per_s": ram["tg_tokens_per_s"], "disk_tg_tokens_per_s": disk["tg_tokens_per_s"],
           "tg_disk_bytes_per_token": disk["tg_disk_bytes_per_token"],
           **{k: v for k, v in disk.items() if k.startswith("disk_")}}
    record = result_record("disk_tier", {"quick": args.quick, "prompt": args.prompt, "new_tokens": args.new_tokens,
                                         "warmup": args.warmup, "routing": args.routing, "group": GROUP,
                                         "ram_share": RAM_SHARE}, device)
    record["results"] = [row]
    print(json.dumps(row, indent=2))
    print(write_result(record, args.out))
    if not row["same_tokens"]:
        print("disk_tier: the disk tier's tokens differ from the all-in-RAM run's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
