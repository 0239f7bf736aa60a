"""RunConfig: what a run asks for (the model, where its parts live, how many ranks), typed and frozen.

Every entry point builds one: the CLI from its parsed options (`RunConfig.from_args`), Python users through
`moeserve.LLM(...)`'s keyword arguments. `validate()` checks what can be checked without the checkpoint and gives
the one-line errors of the command line (they name the CLI flag; the Python keyword is the flag's name with
underscores). What needs the checkpoint (its MoE layers, its context) is checked by `moeserve.runtime.prepare`.
Nothing here imports torch: `moeserve --help` and argument errors answer at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from moeserve.demo import DEMO_MODEL
from moeserve.errors import MoeserveError
from moeserve.hybrid.placement import CACHE_POLICIES, EXPERT_BITS, STREAM_FROM
from moeserve.parallel.defaults import COLLECTIVE_TIMEOUT_S, STATIC_MAX_TOKENS
from moeserve.quant.defaults import DENSE_BITS
from moeserve.units import parse_bytes

OFFLOAD_POLICIES = ("lru", "lfu", "lhu", "fld", "hobbit")  # offload/policies.py's POLICIES, named without torch


def flag(default, name: str, inverted: bool = False):
    """A dataclass field whose command-line option is `name` (errors name the option the user typed); inverted: the
    option is a switch that turns the field off (--no-pin sets pin False)."""
    return field(default=default, metadata={"flag": name, "inverted": inverted})


def from_options(kind, args):
    """A `kind` config from an argparse namespace: each field from its option's value (absent or None: default)."""
    values = {}
    for f in fields(kind):
        given = getattr(args, f.metadata["flag"].removeprefix("--").replace("-", "_"), None)
        if given is not None:
            values[f.name] = not given if f.metadata["inverted"] else given
    return kind(**values)


def changed(config) -> list[str]:
    """The flags of `config`'s fields that differ from their defaults, in field order."""
    return [f.metadata["flag"] for f in fields(config) if getattr(config, f.name) != f.default]


@dataclass(frozen=True)
class ParallelConfig:
    """Ranks of a torchrun launch: tensor parallel x expert parallel."""
    tp: int = flag(1, "--tp")
    ep: int = flag(1, "--ep")
    hierarchical_a2a: int = flag(0, "--hierarchical-a2a")  # ranks per node of a hierarchical all-to-all (0: off)
    static_dispatch_tokens: int = flag(STATIC_MAX_TOKENS, "--static-dispatch-tokens")
    collective_timeout: float = flag(COLLECTIVE_TIMEOUT_S, "--collective-timeout")  # seconds a rank waits for a peer

    @property
    def ranks(self) -> int:
        return self.tp * self.ep


@dataclass(frozen=True)
class CacheConfig:
    """HOBBIT's expert cache of an --offload run: slots planned from the budget or given, and its policy."""
    high_slots: int | None = flag(None, "--high-slots")
    low_slots: int = flag(0, "--low-slots")
    policy: str = flag("hobbit", "--policy")
    all_high: bool = flag(False, "--all-high")  # no mixed precision: every expert high, none skipped
    per_layer: bool = flag(False, "--per-layer-cache")
    t1: float = flag(0.6, "--t1")
    t2: float = flag(0.9, "--t2")
    prefetch: int = flag(1, "--prefetch")  # MoE layers ahead whose predicted experts are prefetched
    cooperative: bool = flag(False, "--cooperative")
    pin: bool = flag(True, "--no-pin", inverted=True)


@dataclass(frozen=True)
class HybridConfig:
    """Routed experts in host RAM, computed on the CPU (llama.cpp's --cpu-moe / --n-cpu-moe), and their options."""
    cpu_moe: bool = flag(False, "--cpu-moe")
    n_cpu_moe: int | None = flag(None, "--n-cpu-moe")
    gpu_cache_experts: int | None = flag(None, "--gpu-cache-experts")
    cache_policy: str = flag("hobbit", "--cache-policy")
    cpu_threads: int | None = flag(None, "--cpu-threads")
    experts_bits: int | None = flag(None, "--experts-bits")
    mixed_precision: bool = flag(False, "--mixed-precision")
    stream_from: int | None = flag(None, "--stream-from")
    cpu_memory: str | int | None = flag(None, "--cpu-memory")  # host RAM for the CPU experts of a store on disk
    cpu_int8: bool = flag(False, "--cpu-int8")  # low-bit / MXFP4 CPU experts on int8 activations (VNNI dots)

    @property
    def requested(self) -> bool:
        return self.cpu_moe or self.n_cpu_moe is not None

    @property
    def cpu_memory_bytes(self) -> int | None:
        """--cpu-memory in bytes (None: not given): the disk tier's RAM cache budget (offload/disk_cache.py)."""
        if self.cpu_memory is None or isinstance(self.cpu_memory, int):
            return self.cpu_memory
        size = parse_bytes(self.cpu_memory)
        if size is None:
            raise MoeserveError(f"--cpu-memory {self.cpu_memory!r} is not a size like 100GiB")
        return size


@dataclass(frozen=True)
class RunConfig:
    """One run: the checkpoint, device and dtype, the placement request and the ranks.

    gpu_memory: without `offload`, the placement planner's GPU budget (it chooses where the experts live); with
    `offload` and no `cache.high_slots`, the budget the cache slots are planned from. offload: an expert store
    (`moeserve offload-prepare`): HOBBIT's cache over it, or with a hybrid request the store the CPU experts come
    from. command: the command line's name for this run (`generate`, `eval ppl`, ...), used in messages."""
    model: str = DEMO_MODEL
    device: str = "auto"
    dtype: str = "auto"
    gpu_memory: str | int | None = None  # "24GiB" or bytes
    offload: str | None = None
    dense_bits: int | None = None  # None: 16, or the plan's choice under gpu_memory
    cuda_graph: bool = True
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    command: str = "generate"

    @classmethod
    def from_args(cls, args, command: str) -> RunConfig:
        """The run an argparse namespace describes (options a command lacks keep their defaults)."""
        return cls(model=args.model, device=getattr(args, "device", "auto"), dtype=getattr(args, "dtype", "auto"),
                   gpu_memory=getattr(args, "memory", None), offload=getattr(args, "offload", None),
                   dense_bits=getattr(args, "dense_bits", None),
                   cuda_graph=not getattr(args, "no_cuda_graph", False), parallel=from_options(ParallelConfig, args),
                   cache=from_options(CacheConfig, args), hybrid=from_options(HybridConfig, args), command=command)

    @property
    def planning(self) -> bool:
        """gpu_memory without an offload store: the placement planner chooses (plan/placement.py)."""
        return self.gpu_memory is not None and not self.offload

    @property
    def gpu_memory_bytes(self) -> int | None:
        if self.gpu_memory is None or isinstance(self.gpu_memory, int):
            return self.gpu_memory
        size = parse_bytes(self.gpu_memory)
        if size is None:
            raise MoeserveError(f"--gpu-memory {self.gpu_memory!r} is not a size like 16GiB")
        return size

    def validate(self) -> RunConfig:
        """The one-line errors of options that cannot be met or do not go together; returns self."""
        self.gpu_memory_bytes  # noqa: B018 - a bad size is named here
        if self.hybrid.cpu_memory_bytes is not None and not self.offload:
            raise MoeserveError("--cpu-memory caps the RAM of experts read from a store on disk: it needs --offload "
                                "STORE (from `moeserve offload-prepare`) and --cpu-moe or --n-cpu-moe N")
        if self.dense_bits is not None and self.dense_bits not in DENSE_BITS:
            raise MoeserveError(f"--dense-bits {self.dense_bits} is not one of {', '.join(map(str, DENSE_BITS))}")
        self._check_parallel()
        if self.hybrid.requested:
            self._check_hybrid()
        elif self.offload:
            self._check_offload()
        else:
            self._check_resident()
        return self

    def _check_parallel(self) -> None:
        """--tp/--ep need a torchrun launch of exactly tp x ep ranks, and experts on the GPUs."""
        p = self.parallel
        if p.tp < 1 or p.ep < 1:
            raise MoeserveError("--tp and --ep must be >= 1")
        if not p.collective_timeout > 0:
            raise MoeserveError(f"--collective-timeout {p.collective_timeout:g} must be > 0 seconds")
        if p.ranks == 1:
            return
        if self.hybrid.requested or self.offload or self.planning:
            raise MoeserveError("--ep/--tp and experts off the GPU (--offload, --cpu-moe, --n-cpu-moe, --gpu-memory) "
                                "cannot be combined yet")
        flags = " ".join(f"--{name} {n}" for name, n in (("tp", p.tp), ("ep", p.ep)) if n > 1)
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            raise MoeserveError(f"{flags} runs one process per rank: launch it under torchrun, e.g. `torchrun "
                                f"--nproc-per-node {p.ranks} -m moeserve {self.command} {flags} ...`")
        if p.ranks != int(os.environ["WORLD_SIZE"]):
            raise MoeserveError(f"--tp {p.tp} x --ep {p.ep} must equal the number of ranks "
                                f"({os.environ['WORLD_SIZE']})")

    def _check_resident(self) -> None:
        """No hybrid request and no store: the cache's options mean nothing; the hybrid's only under a plan."""
        if changed(self.cache):
            raise MoeserveError(f"{changed(self.cache)[0]} needs --offload STORE (an expert store from "
                                f"`moeserve offload-prepare`)")
        if changed(self.hybrid) and not self.planning:
            raise MoeserveError(f"{changed(self.hybrid)[0]} needs --cpu-moe or --n-cpu-moe N (a hybrid placement) "
                                f"or --gpu-memory SIZE (a planned one)")

    def _check_offload(self) -> None:
        """--offload STORE without a hybrid request: HOBBIT's cache, its slots given or planned from the budget."""
        c = self.cache
        if changed(self.hybrid):
            raise MoeserveError(f"{changed(self.hybrid)[0]} needs --cpu-moe or --n-cpu-moe N (a hybrid placement); "
                                f"with --offload alone the experts are cached on the GPU (--high-slots, --gpu-memory)")
        if self.command == "eval ppl":
            raise MoeserveError("--offload needs --cpu-moe or --n-cpu-moe N here (eval runs a hybrid placement)")
        if c.policy not in OFFLOAD_POLICIES:
            raise MoeserveError(f"unknown policy {c.policy!r} (--policy); choose one of {', '.join(OFFLOAD_POLICIES)}")
        if c.high_slots is None:
            if self.gpu_memory is None:
                raise MoeserveError("--offload needs --gpu-memory SIZE or --high-slots N")
            if c.low_slots:
                raise MoeserveError("--low-slots needs --high-slots: with --gpu-memory the slots of both precisions "
                                    "are planned from the budget")
        check_cache_slots(c.high_slots or 0, c.low_slots, c.t1, c.t2)

    def _check_hybrid(self) -> None:
        """--cpu-moe/--n-cpu-moe: none of the offload cache's options (the hybrid has its own GPU cache)."""
        given = changed(self.cache) + (["--gpu-memory"] if self.offload and self.gpu_memory is not None else [])
        if given:
            raise MoeserveError(f"{given[0]} is an option of --offload's expert cache; with "
                                f"--cpu-moe/--n-cpu-moe the GPU cache is --gpu-cache-experts S")
        h = self.hybrid
        if h.cache_policy not in CACHE_POLICIES:
            raise MoeserveError(f"unknown cache policy {h.cache_policy!r}; choose one of {', '.join(CACHE_POLICIES)}")
        if h.experts_bits is not None and h.experts_bits not in EXPERT_BITS:
            raise MoeserveError(f"--experts-bits {h.experts_bits} is not one of {', '.join(map(str, EXPERT_BITS))}")
        if h.cpu_int8:
            from moeserve.kernels.cpu.machine import check_int8_dots  # moeserve.kernels imports torch: not at CLI parse
            check_int8_dots()
        if h.cpu_memory is not None and h.gpu_cache_experts:
            raise MoeserveError("--cpu-memory (experts read from disk) does not combine with --gpu-cache-experts: "
                                "the GPU cache copies from the store's mapping")


@dataclass(frozen=True)
class ServeConfig:
    """`moeserve serve`'s HTTP side: where it listens, the KV slots and queue, who may call it."""
    host: str = "127.0.0.1"
    port: int = 8000
    parallel: int = 8  # KV cache slots: requests decoded together
    ctx_size: int = 4096  # tokens per slot
    max_queue: int = 64
    prefill_chunk: int = 512
    prefix_reuse: bool = True  # copy the KV of prompt tokens another slot holds instead of computing it
    threads: int | None = None  # CPU threads of torch (None: its choice)
    api_key: str | None = None
    served_model_name: str | None = None
    metrics: bool = True
    allowed_origins: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args, ctx_size: int) -> ServeConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if f.name != "ctx_size"}, ctx_size=ctx_size)

    def validate(self) -> ServeConfig:
        if not 0 <= self.port <= 65535:
            raise MoeserveError(f"--port {self.port} is not a TCP port (0 to 65535)")
        if min(self.parallel, self.prefill_chunk, self.max_queue + 1, 1 if self.threads is None else self.threads) < 1:
            raise MoeserveError("--parallel, --prefill-chunk and --threads must be >= 1 and --max-queue >= 0")
        if self.api_key is not None and not self.api_key.strip():
            raise MoeserveError("--api-key must not be empty")
        return self


def check_cache_slots(high: int, low: int, t1: float, t2: float) -> None:
    if high < 0 or low < 0 or not 0 <= t1 <= t2:
        raise MoeserveError("slots must be >= 0 and thresholds 0 <= --t1 <= --t2")


__all__ = ["STREAM_FROM", "CacheConfig", "HybridConfig", "ParallelConfig", "RunConfig", "ServeConfig", "changed",
           "check_cache_slots"]
