"""The offloaded expert backend: experts come from a SlotCache (fast memory, Miss.COPY or, cooperative, Miss.CHOOSE)
filled from an ExpertStore (slow memory), each selected expert in high or low precision or skipped (HOBBIT)."""

from __future__ import annotations

from collections import Counter

import torch

from moeserve.model.experts import ExpertBackend
from moeserve.offload.host_compute import CpuPairs
from moeserve.offload.precision import LOW, SKIP
from moeserve.offload.slot_cache import SlotCache
from moeserve.offload.store import layer_experts


class OffloadedExperts(ExpertBackend):
    """Serves each token's experts through the cache, in token order (as the simulator replays them),
    then computes them: GPU experts over their slots in one routed pass, CPU ones on the host meanwhile."""

    def __init__(self, layer: int, num_experts: int, top_k: int, cache: SlotCache,
                 next_layers: list[int] = (), next_gates: torch.Tensor | None = None):
        super().__init__()
        self.layer, self.num_experts, self.top_k, self.cache = layer, num_experts, top_k, cache
        self.slots = cache.slots  # virtual ids: high, then low
        self.next_layers = list(next_layers)
        self.next_gates = next_gates  # [sum of their E, D]: the routers of the next n MoE layers, stacked
        self.next_counts = [layer_experts(cache.store.meta, j) for j in self.next_layers]

    def predict_next(self, x: torch.Tensor) -> list[tuple[int, int]]:
        """Experts the next layers' routers would pick for this layer's gate input (one stacked matmul)."""
        if not self.next_layers:
            return []
        logits = (x @ self.next_gates.T).split(self.next_counts, dim=-1)  # n x [T, E of that layer]
        picks = [part.topk(self.top_k, dim=-1).indices.tolist() for part in logits]  # n x [T, k]
        return list(dict.fromkeys((self.next_layers[j], e) for t in range(x.shape[0])
                                  for j in range(len(picks)) for e in picks[j][t]))

    def kernel_path(self, x: torch.Tensor, num_tokens: int, expert_weights: torch.Tensor | None = None) -> str:
        return "offload"

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        prec = cache.precision(expert_weights)  # [T, k]
        ids_l, w_l, p_l = expert_ids.tolist(), expert_weights.float().tolist(), prec.tolist()
        rows = Counter(e for ids in ids_l for e in ids)  # tokens per expert, for the CPU cost
        out = torch.zeros_like(x)  # [T, D]
        planned: list[tuple] = []  # (token, k-slot, expert, gate weight, source)
        cpu_busy = 0.0

        def flush():
            nonlocal planned, cpu_busy
            self._compute(x, expert_weights, planned, out)
            planned, cpu_busy = [], 0.0
            cache.chunk_done()

        for t, (ids, w, p) in enumerate(zip(ids_l, w_l, p_l)):
            cache.log(self.layer, ids, w)
            needed = {(self.layer, e) for e in ids}
            for j, (e, pj) in enumerate(zip(ids, p)):
                if pj == SKIP:
                    cache.stats.skipped += 1
                    continue
                source = cache.serve(self.layer, e, pj, needed, rows[e], cpu_busy, flush)
                if source[0] == "cpu":
                    cpu_busy += cache.cpu.cost(source[1] == LOW, rows[e])
                planned.append((t, j, e, w[j], source))
        flush()
        cache.settle_prefetches(self.layer)
        if self.next_layers:
            cache.prefetch(self.predict_next(x), needed={(self.layer, e) for e in expert_ids.flatten().tolist()})
        return out

    def _compute(self, x, expert_weights, planned, out) -> None:
        """Add the planned (token, k-slot) contributions to out [T, D]: the CPU's rows as one layer call
        (HostExperts.run_layer), the slots' in one routed pass (SlotExperts)."""
        on_cpu = [p for p in planned if p[4][0] == "cpu"]
        on_gpu = [p for p in planned if p[4][0] == "gpu"]
        if on_cpu:  # read the rows before queueing GPU work behind the copies
            x_host = x.cpu()  # [T, D]
            ids, mask, low = (torch.zeros(expert_weights.shape, dtype=dt) for dt in (torch.long, torch.bool, torch.bool))
            for t, j, e, _, (_, tier) in on_cpu:
                ids[t, j], mask[t, j], low[t, j] = e, True, tier == LOW
            work = CpuPairs(ids, expert_weights.cpu(), mask, low)  # [T, k] each
        if on_gpu:
            virtual = torch.full(expert_weights.shape, self.slots.none, dtype=torch.long)  # [T, k]
            for t, j, _, _, (_, tier, slot) in on_gpu:
                virtual[t, j] = self.slots.virtual(tier, slot)
            out += self.slots.compute(x, expert_weights, virtual)
        if on_cpu:
            out += self.cache.cpu.run_layer(self.layer, x_host, work).to(x.device)

