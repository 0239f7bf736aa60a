"""Mixture-of-Students (DeepSpeed-MoE): a shallower student trained against a teacher's output distribution with
*staged* knowledge distillation. The KD term is added for the first `stop_step` steps and then switched off: the
paper found KD throughout the run hurts at the end, once the student's capacity, not the signal, is the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.errors import MoeserveError


@dataclass(frozen=True)
class DistillConfig:
    teacher: str  # checkpoint directory of the teacher (any model moeserve loads, same vocabulary)
    weight: float = 1.0  # the KD term's weight beside the cross-entropy
    stop_step: int | None = None  # staged KD: no KD term from this step on (None: KD throughout)
    temperature: float = 1.0

    def __post_init__(self):
        if self.weight < 0 or self.temperature <= 0 or (self.stop_step is not None and self.stop_step < 0):
            raise MoeserveError("the KD weight must be >= 0, its temperature > 0 and its stop step >= 0")


def kd_weight_at(step: int, cfg: DistillConfig | None) -> float:
    """The KD term's weight at optimiser step `step` (0-based): cfg.weight before the stop step, 0 from it on."""
    if cfg is None or (cfg.stop_step is not None and step >= cfg.stop_step):
        return 0.0
    return cfg.weight


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the softened distributions, mean per token, times T^2 (so the gradient's scale
    does not depend on T). logits [.., V]."""
    V = student_logits.shape[-1]
    log_student = F.log_softmax(student_logits.float().reshape(-1, V) / temperature, dim=-1)  # [T, V]
    log_teacher = F.log_softmax(teacher_logits.float().reshape(-1, V) / temperature, dim=-1)  # [T, V]
    return F.kl_div(log_student, log_teacher, log_target=True, reduction="batchmean") * temperature ** 2
