"""`moeserve quantize`: a low-bit copy of a checkpoint (RTN, HQQ or MiLo)."""

from __future__ import annotations

import json
import sys

from moeserve.cli.common import read_text
from moeserve.loader import resolve_device
from moeserve.compress import QuantConfig, check_job, frequency_from_text, quantize_checkpoint

def run(args) -> int:
    cfg = QuantConfig(bits=args.bits, group=args.group, method=args.method, ranks=args.ranks,
                      compensator_bits=args.compensator_bits, skip=tuple(args.skip))
    check_job(args.model, args.out, cfg, args.force)  # before any loading: settings, source, --out
    device = resolve_device(args.device)
    frequency = None
    if cfg.method == "milo" and "frequency" in cfg.ranks:
        _, text = read_text(args.frequency_text, args.model, "--frequency-text")
        frequency = frequency_from_text(args.model, text, device)
    manifest = quantize_checkpoint(args.model, args.out, cfg, force=args.force, device=device, frequency=frequency,
                                   note=lambda m: print(f"moeserve: note: {m}", file=sys.stderr))
    ranks = [t["rank"] for t in manifest["tensors"].values()]
    print(json.dumps({"out": args.out, "method": cfg.method, "bits": cfg.bits, "group": cfg.group,
                      "tensors": len(ranks), "mean_rank": round(sum(ranks) / max(len(ranks), 1), 2),
                      "bytes": manifest["bytes"], "source_bytes": manifest["source"]["bytes"],
                      "seconds": manifest["seconds"], "device": device.type}))
    return 0
