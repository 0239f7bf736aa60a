"""A throughput policy: what the planner chooses and the pipeline executes.

Decode runs layer by layer over a batch of N sequences split into micro-batches of n; each layer's
attention and MoE FFN run on the GPU or the CPU; a fraction of the layer weights stays on the GPU (the
rest is streamed from pinned host memory every layer), and a fraction of the KV cache lives on the GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moeserve.errors import MoeserveError


@dataclass(frozen=True)
class ThroughputPolicy:
    batch_size: int  # N: sequences decoded together
    micro_batch: int  # n: sequences per micro-batch (N is a multiple of n)
    attention_on_gpu: bool  # False: attention over the KV cache runs on the CPU (KV stays in host memory)
    ffn_on_gpu: bool  # False: the MoE FFN runs on the CPU from host weights
    weights_gpu_fraction: float  # [0, 1] of the layer weights resident on the GPU; the rest is streamed
    kv_gpu_fraction: float  # [0, 1] of the KV cache on the GPU (0 with CPU attention)

    def __post_init__(self):
        if self.batch_size < 1 or self.micro_batch < 1 or self.batch_size % self.micro_batch:
            raise MoeserveError(f"batch size {self.batch_size} must be a positive multiple of the micro-batch "
                                f"size {self.micro_batch}")
        for name in ("weights_gpu_fraction", "kv_gpu_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise MoeserveError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    @property
    def num_micro_batches(self) -> int:
        return self.batch_size // self.micro_batch

    def as_dict(self) -> dict:
        return asdict(self)
