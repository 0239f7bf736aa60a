"""What one CPU layer of a hybrid decode step costs, by the way the device reaches the CPU experts: the device link
(hybrid/link.py: asked and waited on from the device, eager and as one CUDA graph of many layers) against the host
path (routing copied to the host, the native call started on the pool's helpers, the output copied back) and the
CPU experts' own time (the native call alone, inline). Random 4-bit experts of a real shape, random routing.

    python bench/link_latency.py --shape qwen3          # GPU; per-layer milliseconds, JSON to bench/results/
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_run_args, capture_graph, result_record, write_result  # noqa: E402
from hybrid import BITS, GROUP, SHAPES  # noqa: E402
from offload import model_spec, random_store  # noqa: E402

from moeserve.hybrid.experts import routing_to_host  # noqa: E402
from moeserve.hybrid.link import DeviceLink  # noqa: E402
from moeserve.hybrid.runtime import spin_us  # noqa: E402
from moeserve.kernels.cpu import pool  # noqa: E402
from moeserve.kernels.cpu.gemv import default_kernel, moe_layer  # noqa: E402
from moeserve.kernels.cpu.machine import physical_cores  # noqa: E402
from moeserve.offload.host_compute import CpuPairs, HostExperts  # noqa: E402


def per_call(fn, calls: int, repeats: int) -> float:
    """Median milliseconds per call of fn(i) over `repeats` rounds of `calls` calls, the device synchronised."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(calls):
            fn(i)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / calls * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=32, help="layer calls per timed round (distinct layers cycle)")
    ap.add_argument("--distinct-layers", type=int, default=4, help="layers of distinct random experts")
    ap.add_argument("--repeats", type=int, default=7)
    add_run_args(ap)
    args = ap.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.bfloat16
    spec = model_spec(SHAPES[args.shape][0])
    store = random_store(spec, args.distinct_layers, device, dtype, BITS, GROUP)
    host = HostExperts(store, dtype)
    cores = physical_cores()
    pool.configure(cores, spin_us("cuda"))
    L, D, k, E = args.layers, spec.hidden_size, spec.moe.top_k, spec.moe.num_experts
    xs = torch.randn(L, 1, D, device=device, dtype=dtype)  # [L, 1, D]
    ids = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(L)])[:, None]  # [L, 1, k]
    wts = torch.rand(L, 1, k, device=device)  # [L, 1, k]
    for layer in range(args.distinct_layers):
        host.native_layer(layer, torch.empty(1, D))
    kernel = default_kernel(BITS)
    rows = {}

    # the CPU experts alone: the native call inline, every core (host tensors ready)
    xh, ih, wh = xs.float().cpu(), ids.cpu(), wts.cpu()
    rows["cpu_inline_all_cores"] = per_call(
        lambda i: moe_layer(kernel, host.native_layer(i % args.distinct_layers, xh[i]), xh[i], ih[i], wh[i],
                            threads=len(cores)), L, args.repeats)
    rows["cpu_inline_cores_minus_1"] = per_call(
        lambda i: moe_layer(kernel, host.native_layer(i % args.distinct_layers, xh[i]), xh[i], ih[i], wh[i],
                            threads=len(cores) - 1), L, args.repeats)

    # the host path: routing to the host (one wait), started on the helpers, output back
    def host_path(i):
        x_host, idh, wth = routing_to_host(xs[i], ids[i], wts[i])
        job = host.start_layer(i % args.distinct_layers, x_host, CpuPairs(idh, wth, None, True), len(cores) - 1)
        return job.result().to(device, dtype)

    rows["host_path"] = per_call(host_path, L, args.repeats)

    # the device link
    link = DeviceLink(host, args.distinct_layers, k, device, len(cores) - 1, cores[0], spin_us("cuda"), low=True)
    assert link.ping()
    for layer in range(args.distinct_layers):
        assert link.serves(layer, xs[0])

    def linked(i):
        link.ask(i % args.distinct_layers, xs[i], ids[i], wts[i])
        return link.answer(1).to(dtype)

    rows["link_eager"] = per_call(linked, L, args.repeats)
    rows["link_ping_eager"] = per_call(lambda i: link.ping(), 16, args.repeats)
    graph = capture_graph(linked, range(L))
    rows["link_graph"] = per_call(lambda i: graph.replay(), 1, args.repeats) / L
    assert not link.failed() and link.pairs()[1] == 0
    link.close()
    for name, ms in rows.items():
        print(f"{args.shape} {name:26s} {ms:.3f} ms / layer", flush=True)
    record = result_record("link_latency", {"shape": args.shape, "layers": L, "distinct_layers": args.distinct_layers,
                                            "repeats": args.repeats, "bits": BITS, "group": GROUP, "cores": len(cores)},
                           device)
    record["ms_per_layer"] = rows
    print(write_result(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
