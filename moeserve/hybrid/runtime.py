"""What the hybrid layers of one model share: the CPU worker, the CPU's view of the expert store, the optional
dynamic slot cache (offload/slot_cache.py, misses on the CPU), the streamer of prompts' experts, the precision rule,
and the counts a run reports."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch

from moeserve.errors import MoeserveError
from moeserve.hybrid.link import LINK_ROWS, DeviceLink, link_wanted, start_link
from moeserve.hybrid.placement import CACHE_POLICIES, HybridPlacement
from moeserve.hybrid.memory import read_precisions, ring_slots
from moeserve.hybrid.stream import ExpertStreamer
from moeserve.hybrid.worker import CpuWorker
from moeserve.kernels.cpu import pool
from moeserve.kernels.cpu.machine import expert_cores
from moeserve.offload.disk_cache import DiskCache
from moeserve.offload.host_compute import CpuPairs, HostExperts
from moeserve.offload.policies import CachePolicy
from moeserve.offload.precision import HOBBIT_T1, HOBBIT_T2, LOW, SKIP, choose_precision
from moeserve.offload.slot_cache import CacheSettings, Miss, SlotCache, Tier
from moeserve.offload.store import ExpertStore

# microseconds an idle native helper thread spins before it sleeps: with a GPU, longer than the GPU's part of a layer
# between two CPU layers (the next layer's experts then start at once); on the CPU alone, short (torch's own threads
# compute the attention in between, on the same cores). MOESERVE_SPIN_US overrides both.
SPIN_US = {"cuda": 2000, "cpu": 50}
VICTIM_SAMPLE = 32  # cached experts a background admission compares itself with (CacheState.victim_sample)


def spin_us(device_type: str) -> int:
    value = os.environ.get("MOESERVE_SPIN_US")
    return int(value) if value else SPIN_US.get(device_type, SPIN_US["cpu"])

@dataclass
class HybridStats:
    """(token, expert) pairs by where they ran, summed over every hybrid layer call."""

    gpu_pairs: int = 0  # in a cache slot on the model device
    cpu_pairs: int = 0  # on the CPU, from host RAM
    skipped: int = 0  # mixed precision: below the gate-weight threshold
    low_pairs: int = 0  # mixed precision: on the low-bit copy
    streamed_pairs: int = 0  # a prompt's pairs whose experts were streamed to the model device
    tokens: int = 0  # token rows through the first CPU layer: the tokens the model ran


class HybridRuntime:
    def __init__(self, store: ExpertStore, placement: HybridPlacement, num_layers: int, top_k: int,
                 device: torch.device, dtype: torch.dtype, t1: float = HOBBIT_T1, t2: float = HOBBIT_T2,
                 threaded: bool | None = None, host: HostExperts | None = None, warm: bool = False,
                 stream: bool | None = None, disk_budget: int | None = None):
        """t1, t2: HOBBIT's thresholds (mixed precision); threaded: CPU experts on the worker thread (default:
        when the model is on a GPU, whose work they overlap) or inline; host: the CPU's view of this store, shared
        with other runtimes (its converted and repacked experts too); warm: prepare every CPU expert now (HostExperts
        .warm) rather than at its first token; stream: stream prompts' experts to the model device (default: on a
        GPU, when the placement's stream_from is not 0). With a GPU and every CPU pair on one precision a layer computes
        in one native call (HostExperts.native: the low-bit copies, with mixed precision's skips alone, or MXFP4 high
        copies without mixed precision; cache slots the Triton kernels read) the CPU experts are driven from the
        device (hybrid/link.py) and a cache is kept between steps (before_step, the model's step hook).
        disk_budget: host RAM bytes for the CPU layers' experts of a store on disk larger than that (the disk tier,
        offload/disk_cache.py; page-locked with a GPU): its experts are read from disk on a miss, prompts run on the
        CPU too (no streaming: the streamer reads the store's mapping) and no GPU cache (refused)."""
        self.placement, self.t1, self.t2 = placement, t1, t2
        threaded = device.type == "cuda" if threaded is None else threaded
        self.worker = CpuWorker(placement.threads, inline=not threaded)
        cores = list(expert_cores().cpus)  # one NUMA node's physical cores on a multi-socket host
        threads = placement.threads or len(cores)
        # a layer that is one native call runs on the pool's helpers while this thread enqueues the GPU's work; they
        # leave one core to this thread
        self.helpers = max(threads - 1, 1) if threaded else 0
        pool.configure(cores, spin_us(device.type))
        if disk_budget is not None and placement.cache_slots:
            raise MoeserveError("--cpu-memory (experts read from disk) does not combine with --gpu-cache-experts")
        self.disk = None
        if disk_budget is not None:
            if host is not None:
                raise ValueError("a shared HostExperts reads the store itself: give disk_budget or host, not both")
            self.disk = DiskCache(store, placement.cpu_layers, disk_budget, read_precisions(placement), top_k,
                                  pin=device.type == "cuda")
            stream = False
        self.host = host or HostExperts(store, dtype, self.disk, placement.int8)
        if warm:
            for low in read_precisions(placement):
                self.host.warm(list(placement.cpu_layers), low)
        self.cache = None
        if placement.cache_slots:
            policy = CachePolicy.named(CACHE_POLICIES[placement.policy], num_layers)
            # one tier: a cached copy, at the run's precision, serves every precision a request asks for
            settings = CacheSettings((Tier(placement.cache_slots, low=placement.low),), miss=Miss.CPU,
                                     victim_sample=VICTIM_SAMPLE, layers=tuple(placement.cpu_layers))
            self.cache = SlotCache(store, policy, settings, device, dtype)
        stream = device.type == "cuda" if stream is None else stream
        self.streamer = None
        if stream and placement.stream_from and placement.cpu_layers:
            slots = ring_slots(store.expert_bytes(placement.low), store.meta["num_experts"])
            self.streamer = ExpertStreamer(store, slots, device, dtype, placement.low)
        self.link: DeviceLink | None = None
        one_precision = placement.low or not placement.mixed  # every CPU pair on the run's precision, or skipped
        if threaded and device.type == "cuda" and one_precision and self.host.native(placement.low) \
                and placement.cpu_layers and link_wanted() and (self.cache is None or self.cache.device_serves(
                    torch.empty(LINK_ROWS, store.meta["hidden"], device=device, dtype=dtype), LINK_ROWS)):
            # the CPU thread on the caller's core, computing with helpers on all but the last core (left to the
            # Python thread, which waits for the device meanwhile)
            self.link = start_link(self.host, num_layers, top_k, device, max(threads - 1, 1),
                                   cores[0] if cores else -1, spin_us(device.type), placement.low)
            if self.link is not None and self.cache is not None:
                self.cache.link(LINK_ROWS * top_k)
        # linked calls' skipped pairs, counted on the device (graph replays run no Python)
        self.linked_skipped = torch.zeros((), dtype=torch.int64, device=device) if self.link is not None else None
        self.stats = HybridStats()

    def before_step(self) -> None:
        """The model's step hook: a linked cache's bookkeeping between decode steps (SlotCache.maintain)."""
        if self.link is not None and self.cache is not None:
            self.cache.maintain()

    def start_cpu(self, layer: int, x: torch.Tensor, pairs: CpuPairs):
        """A layer's CPU pairs, started: something whose result() waits for their output [T, D] (float32, or x's
        dtype): the native pool's helpers where the layer is one native call and a GPU's work overlaps it, else the
        worker (inline without a GPU)."""
        pending = self.host.start_layer(layer, x, pairs, self.helpers) if self.helpers else None
        return pending or self.worker.submit(self.host.run_layer, layer, x, pairs)

    def streams(self, tokens: int) -> bool:
        """A layer call of `tokens` tokens computes its missed experts on the model device, streamed there."""
        return self.streamer is not None and tokens >= self.placement.stream_from

    def choose(self, expert_weights: torch.Tensor) -> torch.Tensor | None:
        """expert_weights [T, k] (host) -> [T, k] HIGH / LOW / SKIP by HOBBIT's rule with mixed precision; None
        without it (every pair at the run's precision)."""
        return choose_precision(expert_weights, self.t1, self.t2) if self.placement.mixed else None

    def linked_skips(self, expert_weights: torch.Tensor) -> torch.Tensor | None:
        """expert_weights [T, k] (device) -> [T, k] bool: the pairs mixed precision skips, chosen on the device and
        counted there; None without mixed precision. A low-bit run's other pairs all read the low-bit copy, so over
        the device link the rule only skips."""
        choice = self.choose(expert_weights)  # [T, k] or None
        if choice is None:
            return None
        skip = choice == SKIP  # [T, k]
        self.linked_skipped.add_(skip.sum())
        return skip

    def low_copy(self, choice: torch.Tensor | None) -> torch.Tensor | bool:
        """Which pairs read the store's low-bit copy: all in a low-bit run, else mixed precision's LOW choices."""
        return self.placement.low if choice is None or self.placement.low else choice == LOW

    def count(self, pairs: int, on_gpu: torch.Tensor | None, on_cpu: torch.Tensor | None,
              choice: torch.Tensor | None, streamed: bool = False, tokens: int = 0) -> None:
        """Add one call's pairs to the stats (None masks: every pair on the CPU; streamed: the on_cpu pairs were
        streamed to the model device instead; tokens: the call's rows, for the first CPU layer's calls)."""
        st = self.stats
        st.tokens += tokens
        gpu = 0 if on_gpu is None else int(on_gpu.sum())
        cpu = pairs if on_cpu is None else int(on_cpu.sum())
        st.skipped += pairs - gpu - cpu
        st.gpu_pairs += gpu
        if streamed:
            st.streamed_pairs += cpu
        else:
            st.cpu_pairs += cpu
        if choice is not None:
            st.low_pairs += int((choice == LOW).sum())

    def totals(self) -> HybridStats:
        """The counts so far, the device link's pairs (counted by its CPU end: graph replays run no Python) in
        cpu_pairs; raises if the link's CPU end failed a call (its outputs were wrong)."""
        if self.link is None:
            return replace(self.stats)
        cpu, other, errors = self.link.pairs()
        if errors or self.link.failed():
            raise RuntimeError("the device link's CPU end did not answer every call: outputs are wrong")
        skipped = int(self.linked_skipped)
        return replace(self.stats, cpu_pairs=self.stats.cpu_pairs + cpu,
                       gpu_pairs=self.stats.gpu_pairs + other - skipped, skipped=self.stats.skipped + skipped)

    def summary(self) -> dict:
        totals = self.totals()
        out = {**asdict(totals), "cache_slots": self.placement.cache_slots}
        if self.cache is not None:
            out.update(admitted=self.cache.admitted, bytes_copied=self.cache.bytes_copied)
        if self.disk is not None:
            out.update(self.disk.summary(), disk_bytes_per_token=self.disk.stats.bytes_read / max(totals.tokens, 1))
        if self.streamer is not None:
            out.update(experts_streamed=self.streamer.experts_streamed, bytes_streamed=self.streamer.bytes_copied)
        if self.link is not None:
            out.update(linked_pairs=totals.cpu_pairs - self.stats.cpu_pairs)
            if self.cache is not None:
                out.update(cache_ranking="decayed use counts (device link)")
        out["gpu_share"] = totals.gpu_pairs / max(totals.gpu_pairs + totals.cpu_pairs, 1)
        return out

    def close(self) -> None:
        self.worker.close()
        if self.disk is not None:
            self.disk.close()
        if self.link is not None:
            self.link.close()
            self.link = None
