"""`moeserve offload-prepare`: the expert store that --offload and the hybrid placements read."""

from __future__ import annotations

import json
import time

from moeserve.offload.store import ExpertStore

def run(args) -> int:
    t0 = time.perf_counter()
    store = ExpertStore.build(args.model, args.out, low_bits=args.low_bits, group=args.group)
    print(json.dumps({"out": args.out, "layers": len(store.meta["layers"]), "expert_bytes_high": store.expert_bytes(False),
                      "expert_bytes_low": store.expert_bytes(True), "seconds": round(time.perf_counter() - t0, 2)}))
    return 0
