"""`moeserve profile`: this machine's FLOP/s and bandwidths, measured once and cached."""

from __future__ import annotations

import json

from moeserve.cli.common import print_table
from moeserve.plan.hardware import load_or_measure
from moeserve.units import format_bytes

def run(args) -> int:
    profile = load_or_measure(refresh=args.refresh)
    if args.json:
        print(json.dumps(profile.as_dict(), indent=2))
        return 0

    def rate(v, unit):
        return "-" if v is None else f"{v / 1e9:,.1f} G{unit}"

    chunks = lambda d: ", ".join(f"{k} MiB: {v / 1e9:.1f}" for k, v in sorted(d.items())) or "-"  # noqa: E731
    print_table([
        ("GPU", profile.gpu_name or "none (CUDA not available)"),
        ("GPU bf16 matmul", rate(profile.gpu_flops, "FLOP/s")),
        ("HBM copy (read+write)", rate(profile.hbm_bandwidth, "B/s")),
        ("GPU memory", "-" if profile.gpu_memory_bytes is None else format_bytes(profile.gpu_memory_bytes)),
        ("CPU", f"{profile.cpu_name} ({profile.cpu_cores} cores)"),
        ("CPU fp32 / bf16 matmul", f"{rate(profile.cpu_fp32_flops, 'FLOP/s')} / {rate(profile.cpu_bf16_flops, 'FLOP/s')}"),
        ("DRAM copy (read+write)", rate(profile.dram_bandwidth, "B/s")),
        ("RAM", format_bytes(profile.ram_bytes)),
        ("host->device pinned", rate(profile.h2d_bandwidth, "B/s") + f" (GB/s by chunk: {chunks(profile.h2d_chunk_bandwidth)})"),
        ("device->host pinned", rate(profile.d2h_bandwidth, "B/s") + f" (GB/s by chunk: {chunks(profile.d2h_chunk_bandwidth)})"),
        ("host->device pageable", rate(profile.h2d_pageable_bandwidth, "B/s")),
        ("measured", profile.measured or "-"),
    ])
    return 0
