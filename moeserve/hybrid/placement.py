"""Where a hybrid run keeps each MoE layer's routed experts, and the one line that says so.

llama.cpp's vocabulary: `--cpu-moe` puts every MoE layer's routed experts in host RAM, computed on the CPU;
`--n-cpu-moe N` only those of the first N MoE layers (the rest stay resident on the GPU). A GPU cache of S slots
may hold some of the CPU layers' experts, filled by a policy as they are used. Pure data and checks: nothing here
imports torch, so the command line checks its options before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.errors import MoeserveError

# cache policy -> the offload/policies.py priority it ranks experts by. An expert is admitted only when it ranks
# above the one it would evict: LRU admits every miss, `static` (use counts) keeps the most used experts and so
# settles on a static placement by frequency, HOBBIT mixes recency, frequency, precision and layer distance.
CACHE_POLICIES = {"lru": "lru", "hobbit": "hobbit", "static": "lfu"}
EXPERT_BITS = (16, 8, 4, 3, 2)  # 16: the checkpoint's float experts; else the store's low-bit copies
STREAM_FROM = 32  # tokens of a layer call (a prompt) from which the CPU layers' experts are streamed to the GPU


@dataclass(frozen=True)
class HybridPlacement:
    moe_layers: tuple[int, ...]  # every MoE layer of the model
    cpu_layers: tuple[int, ...]  # those whose routed experts live in host RAM (computed on the CPU or cached)
    cache_slots: int = 0  # experts of the CPU layers the model device caches (0: static placement)
    threads: int | None = None  # CPU threads for the experts (None: leave torch's setting)
    mixed: bool = False  # HOBBIT's per-token precision rule (high / low / skip) for CPU experts
    bits: int = 16  # the experts' precision: 16 = float, else the store's low-bit copies
    policy: str = "hobbit"  # cache policy (CACHE_POLICIES)
    stream_from: int = STREAM_FROM  # prompt tokens from which experts are streamed to the GPU (0: never)
    int8: bool = False  # low-bit and MXFP4 CPU experts on int8 activations (the CPU's int8 dots), not exact floats

    @classmethod
    def choose(cls, moe_layers: list[int], cpu_moe: bool = False, n_cpu_moe: int | None = None,
               cache_slots: int = 0, threads: int | None = None, mixed: bool = False, bits: int = 16,
               policy: str = "hobbit", num_experts: int | None = None,
               stream_from: int = STREAM_FROM, int8: bool = False) -> "HybridPlacement":
        """The placement the options ask for; a MoeserveError names the first option that cannot be met."""
        if cpu_moe and n_cpu_moe is not None:
            raise MoeserveError("--cpu-moe and --n-cpu-moe cannot be combined (--cpu-moe puts every MoE layer's "
                                "experts on the CPU, --n-cpu-moe N those of the first N)")
        n = len(moe_layers) if cpu_moe else n_cpu_moe
        if n is None:
            raise MoeserveError("a hybrid placement needs --cpu-moe or --n-cpu-moe N")
        if not 0 <= n <= len(moe_layers):
            raise MoeserveError(f"--n-cpu-moe {n} is outside the model's {len(moe_layers)} MoE layers; give 0 to "
                                f"{len(moe_layers)} (or --cpu-moe for all of them)")
        if cache_slots < 0:
            raise MoeserveError(f"--gpu-cache-experts must be >= 0, got {cache_slots}")
        if threads is not None and threads < 1:
            raise MoeserveError(f"--cpu-threads must be >= 1, got {threads}")
        if bits not in EXPERT_BITS:
            raise MoeserveError(f"--experts-bits {bits} is not one of {', '.join(map(str, EXPERT_BITS))}")
        if stream_from < 0:
            raise MoeserveError(f"--stream-from must be >= 0 tokens (0: never stream), got {stream_from}")
        if policy not in CACHE_POLICIES:
            raise MoeserveError(f"unknown cache policy {policy!r}; choose one of {', '.join(CACHE_POLICIES)}")
        cpu_layers = tuple(moe_layers[:n])
        if num_experts is not None:  # no more slots than experts to hold
            cache_slots = min(cache_slots, len(cpu_layers) * num_experts)
        return cls(tuple(moe_layers), cpu_layers, cache_slots, threads, mixed, bits, policy, stream_from, int8)

    @property
    def low(self) -> bool:
        """The experts run from the store's low-bit copies."""
        return self.bits != 16

    @property
    def needs_low_copies(self) -> bool:
        """The store must hold low-bit copies: low-bit experts, or mixed precision's low choice."""
        return self.low or self.mixed

    def describe(self, device_type: str, dtype_name: str, low_bits: int | None = None, dense_bits: int = 16,
                 cores: str | None = None) -> str:
        """One line: `[placement: hybrid, 24/32 MoE layers' experts on CPU (bf16), 16 GPU cache slots, ...]`;
        dense_bits: the dense part's linear layers (named when they are not in the compute dtype); cores: where the
        CPU threads run when that is worth saying (kernels/cpu/machine.py ExpertCores.describe: `NUMA node 0 of
        2`)."""
        precision = f"{self.bits}-bit" if self.low else dtype_name
        if self.mixed:
            precision += (f", mixed precision: {low_bits}-bit or skipped by gate weight" if not self.low
                          else ", mixed precision: low-weight experts skipped")
        where = "GPU" if device_type == "cuda" else "RAM"
        parts = [f"{len(self.cpu_layers)}/{len(self.moe_layers)} MoE layers' experts on CPU ({precision})"]
        if device_type != "cuda":
            parts.append("no GPU (model on the CPU)")
        if self.cache_slots:
            parts.append(f"{self.cache_slots} {where} cache slots (policy {self.policy})")
        elif device_type == "cuda":
            parts.append("static (no GPU cache)")
        if dense_bits != 16:
            parts.append(f"dense part {dense_bits}-bit")
        if self.threads:
            parts.append(f"{self.threads} CPU threads" + (f" on {cores}" if cores else ""))
        if self.int8:
            parts.append("int8 activations on the CPU")
        if device_type == "cuda" and self.cpu_layers:
            parts.append(f"prompts of {self.stream_from}+ tokens stream experts to the GPU" if self.stream_from
                         else "prompts on the CPU")
        return f"[placement: hybrid, {', '.join(parts)}]"
