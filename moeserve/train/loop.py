"""The training loop of every model moeserve trains: the demo model, the PR-MoE family and Mixture-of-Students.

A fresh MoETransformer trained with AdamW (warmup + cosine), bf16 autocast on a GPU over fp32 master weights, the
Switch/Mixtral load-balancing loss read from the routers by forward hooks (the MoE block returns only its output),
and, for a student, a teacher's KD term on the staged schedule of distill.py. Held-out loss is measured every
`eval_every` steps as `moeserve eval ppl` measures it and kept in the run's record (training.json).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.errors import MoeserveError
from moeserve.evaluate import perplexity
from moeserve.model.router import TopKRouter
from moeserve.model.transformer import MoETransformer
from moeserve.progress import Progress
from moeserve.spec import ModelSpec
from moeserve.train.arch import AUX_LOSS_COEF
from moeserve.train.distill import DistillConfig, kd_loss, kd_weight_at

# The step count is fitted to --minutes at step FIT_AT, timed from FIT_FROM. FIT_AT <= warmup, so the
# run so far does not depend on the step count and `--steps <fitted> --minutes 0` reproduces it.
FIT_FROM, FIT_AT = 10, 40


@dataclass(frozen=True)
class TrainConfig:
    # 6000 steps: about 3.5 minutes on one H100, *estimated* (FLOPs and kernel launches, ~35 ms/step),
    # not measured; --minutes lowers the count if the GPU turns out slower.
    steps: int = 6000
    minutes: float = 4.0  # training wall-clock budget (0 = none)
    batch_size: int = 64
    seq_len: int = 512  # bytes per training window
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: int = 100
    weight_decay: float = 0.1  # matrices only; norms are not decayed
    grad_clip: float = 1.0
    aux_coef: float = AUX_LOSS_COEF  # load-balancing loss weight
    init_std: float = 0.02
    eval_every: int = 250
    eval_windows: int = 8  # held-out windows evaluated every eval_every steps
    final_eval_windows: int = 0  # 0 = every window of the held-out text
    seed: int = 0
    checkpoint_minutes: float = 0.0  # minutes between trainer states written for a resume (0 = only when stopped)


QUICK = {"steps": 30, "minutes": 0.0, "batch_size": 8, "seq_len": 64, "warmup": 3, "eval_every": 10,
         "eval_windows": 4, "final_eval_windows": 8}
# The wide model (arch.WIDE) on one H200: 32 windows of 1024 tokens a step, a peak rate for 0.65B parameters, a
# bounded held-out evaluation (64 windows, 64K tokens), and a trainer state every 3 minutes (a killed run resumes).
WIDE = {"steps": 20000, "minutes": 7.0, "batch_size": 32, "seq_len": 1024, "lr": 1e-3, "warmup": 50,
        "eval_every": 100, "eval_windows": 16, "final_eval_windows": 64, "checkpoint_minutes": 3.0}
STATE_FILE = "trainer_state.pt"  # in the output directory while a run is unfinished: what --resume reads


# ---- model and optimiser ------------------------------------------------------------------


def init_weights(model: MoETransformer, std: float, seed: int) -> None:
    """Seeded: matrices ~ N(0, std), residual output projections scaled by 1/sqrt(2L), norms 1."""
    gen = torch.Generator().manual_seed(seed)
    out_std = std / math.sqrt(2 * model.spec.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                s = out_std if name.endswith(("o_proj.weight", "experts.down_proj")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)


def make_optimizer(model: nn.Module, cfg: TrainConfig, fused: bool) -> torch.optim.AdamW:
    """AdamW that decays matrices (embeddings, projections, experts, routers) but not norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def lr_at(step: int, steps: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine from lr down to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, steps - 1 - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ---- load balancing -------------------------------------------------------------------------


def load_balancing_loss(expert_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Switch/Mixtral auxiliary loss of one layer: E * sum_e (tokens sent to e / T) * mean router prob of e.

    expert_ids [T, k], logits [T, E]. Counting all k choices, as transformers' Mixtral does,
    perfectly uniform routing scores k; only the probabilities carry gradient.
    """
    T, E = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    counts = torch.bincount(expert_ids.reshape(-1), minlength=E).float()  # [E]
    return E * torch.dot(counts / T, probs.mean(0))


class RouterTap:
    """Forward hooks that keep each router's (expert_ids, logits) from the last forward pass."""

    def __init__(self, model: nn.Module):
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, TopKRouter)]

    def _hook(self, module, inputs, output):
        ids, _, logits = output
        self.outputs.append((ids, logits))

    def aux_loss(self) -> torch.Tensor:
        """Mean load-balancing loss over the layers seen since the last call (which it forgets)."""
        loss = torch.stack([load_balancing_loss(ids, logits) for ids, logits in self.outputs]).mean()
        self.outputs.clear()
        return loss


# ---- data and evaluation ----------------------------------------------------------------------


def sample_batch(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[B, seq_len + 1] random windows of the training tokens (inputs and shifted targets)."""
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=gen)  # [B]
    idx = starts[:, None] + torch.arange(seq_len + 1)  # [B, S+1]
    return data[idx.to(data.device)]


def bits_per_byte(model: MoETransformer, heldout: torch.Tensor, cfg: "TrainConfig", max_windows: int,
                  autocast) -> tuple[float, int]:
    """Held-out bits per byte and the windows used, measured as `moeserve eval ppl` measures them."""
    with autocast():
        r = perplexity(model, heldout.tolist(), cfg.seq_len, cfg.batch_size, progress=False, max_windows=max_windows)
    return r["bits_per_token"], r["windows"]


# ---- training -------------------------------------------------------------------------------


def train_step(model: MoETransformer, opt: torch.optim.Optimizer, tap: RouterTap, batch: torch.Tensor, lr: float,
               cfg: TrainConfig, autocast, teacher: MoETransformer | None = None, kd_weight: float = 0.0,
               temperature: float = 1.0) -> tuple[float, float, float]:
    """One AdamW step on batch [B, S+1]; returns (cross-entropy in nats, load-balancing loss, KD loss). The KD term
    (the teacher's logits at `temperature`, weight kd_weight) is computed only while its weight is above 0 (0.0 is
    returned after)."""
    for group in opt.param_groups:
        group["lr"] = lr
    with autocast():
        logits = model(batch[:, :-1])  # [B, S, V]
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    aux = tap.aux_loss()
    total = loss + cfg.aux_coef * aux
    kd = torch.zeros(())
    if teacher is not None and kd_weight > 0:
        with torch.no_grad(), autocast():
            teacher_logits = teacher(batch[:, :-1])  # [B, S, V]
        kd = kd_loss(logits, teacher_logits, temperature)
        total = total + kd_weight * kd
    total.backward()
    nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), aux.item(), kd.item()


def fit_steps(steps: int, step: int, elapsed: float, per_step: float, budget: float) -> int:
    """The step count that ends within the budget (10% margin), never more than asked for."""
    return min(steps, step + int(0.9 * (budget - elapsed) / per_step))


def save_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, step: int, steps: int,
               history: list[dict], seconds: float, settings: dict) -> None:
    """Everything a resumed run needs (weights, AdamW moments, the batch generator, the schedule's position and the
    curve so far), written atomically: a kill while writing leaves the previous state."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                "step": step, "steps": steps, "history": history, "seconds": seconds, "settings": settings}, tmp)
    os.replace(tmp, path)


def load_state(path: Path, settings: dict, device: torch.device) -> dict:
    """The trainer state at `path`, refused (one line) when it was written by a run of other settings."""
    state = torch.load(path, map_location=device, weights_only=False)
    if state["settings"] != settings:
        differ = sorted(k for k in {**settings, **state["settings"]} if settings.get(k) != state["settings"].get(k))
        raise MoeserveError(f"{path} is the state of a run with other settings ({', '.join(differ)}); rerun with "
                            f"those settings to resume it, or delete it to start over")
    return state


def train(cfg: TrainConfig, spec: ModelSpec, data: torch.Tensor, heldout: torch.Tensor, device: torch.device,
          distill: DistillConfig | None = None, teacher: MoETransformer | None = None,
          state_path: Path | None = None, settings: dict | None = None) -> tuple[MoETransformer, dict]:
    """Train a fresh MoETransformer, or resume the run whose trainer state is at state_path (written there every
    cfg.checkpoint_minutes and when --minutes runs out; deleted once the run is complete); returns the model
    (fp32, rounded to bf16 values) and the run's record. settings: what a state must match to be resumed (the
    run's architecture and data; cfg is added). distill and teacher (loaded on `device`): a student's KD term and
    its schedule."""
    model = MoETransformer(spec)
    init_weights(model, cfg.init_std, cfg.seed)
    model.to(device).train()
    opt = make_optimizer(model, cfg, fused=device.type == "cuda")
    tap = RouterTap(model)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    data = data.to(device)
    autocast = partial(torch.autocast, "cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    steps, budget = cfg.steps, cfg.minutes * 60
    history, recent, recent_kd, stopped_early = [], [], [], False
    step, seconds_before = 0, 0.0  # a resumed run's steps and training seconds so far
    settings = {**(settings or {}), "config": {k: v for k, v in asdict(cfg).items()
                                               if k not in ("minutes", "checkpoint_minutes")}}
    resumed = state_path is not None and state_path.is_file()
    if resumed:
        state = load_state(state_path, settings, device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step, steps, history, seconds_before = state["step"], state["steps"], state["history"], state["seconds"]
        del state
    tokens_per_step = cfg.batch_size * cfg.seq_len
    if teacher is not None:
        teacher.eval()

    def checkpoint() -> None:
        if state_path is not None:
            save_state(state_path, model, opt, gen, step, steps, history,
                       seconds_before + time.perf_counter() - t0, settings)
            bar.write(f"step {step}: trainer state written to {state_path}")

    def evaluate(step: int) -> None:
        model.eval()
        bpb, _ = bits_per_byte(model, heldout, cfg, cfg.eval_windows, autocast)
        tap.outputs.clear()
        model.train()
        history.append({"step": step, "train_loss": round(sum(recent) / len(recent), 4),
                        "heldout_loss": round(bpb * math.log(2), 4), "heldout_bits_per_byte": round(bpb, 4),
                        "seconds": round(time.perf_counter() - t0, 1)})
        if teacher is not None:
            history[-1]["kd_loss"] = round(sum(recent_kd) / len(recent_kd), 4)  # 0 once staged KD has stopped
        rate = (step - first_step) * tokens_per_step / max(time.perf_counter() - t0, 1e-9)
        bar.write(f"step {step}/{steps}: train loss {history[-1]['train_loss']:.4f} nats, held-out {bpb:.4f} "
                  f"bits/token, {rate:,.0f} tokens/s")
        recent.clear()
        recent_kd.clear()

    bar = Progress(steps, "training", "steps")
    bar.update(step)
    if resumed:
        bar.write(f"resuming {state_path} at step {step} of {steps}")
    t0 = last_checkpoint = time.perf_counter()
    first_step = step
    while step < steps:
        elapsed = time.perf_counter() - t0
        if step == FIT_FROM:
            t_fit = elapsed
        if step == FIT_AT and budget and not resumed:
            per_step = (elapsed - t_fit) / (FIT_AT - FIT_FROM)
            fitted = fit_steps(steps, step, elapsed, per_step, budget)
            if fitted < steps:
                bar.write(f"{per_step * 1e3:.0f} ms/step: {steps} steps would exceed --minutes {cfg.minutes:g}; "
                          f"training {fitted} steps (rerun with --steps {fitted} --minutes 0 to reproduce)")
                steps = fitted
                bar.set_total(fitted)
        if budget and elapsed > budget and step > first_step:  # every call trains at least one step
            bar.write(f"--minutes {cfg.minutes:g} ran out at step {step}; stopping early")
            stopped_early = True
            checkpoint()
            break
        if cfg.checkpoint_minutes and time.perf_counter() - last_checkpoint > cfg.checkpoint_minutes * 60:
            checkpoint()
            last_checkpoint = time.perf_counter()
        lr = lr_at(step, steps, cfg)
        loss, aux, kd = train_step(model, opt, tap, sample_batch(data, cfg.batch_size, cfg.seq_len, gen), lr, cfg,
                                   autocast, teacher, kd_weight_at(step, distill),
                                   distill.temperature if distill is not None else 1.0)
        step += 1
        recent.append(loss)
        recent_kd.append(kd)
        rate = (step - first_step) * tokens_per_step / max(time.perf_counter() - t0, 1e-9)
        bar.update(1, note=f"loss {loss:.3f}, aux {aux:.3f}, lr {lr:.1e}, {rate:,.0f} tokens/s")
        if step % cfg.eval_every == 0 or step == steps:
            evaluate(step)
    if recent:
        evaluate(step)
    bar.close()
    seconds = seconds_before + time.perf_counter() - t0
    if state_path is not None and not stopped_early and state_path.is_file():
        state_path.unlink()  # complete: the model files are what remains

    model.eval()
    with torch.no_grad():  # evaluate the weights that ship: bf16
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    final_bpb, final_windows = bits_per_byte(model, heldout, cfg, cfg.final_eval_windows, autocast)
    for h in tap.handles:
        h.remove()
    record = {
        "steps": step,
        "stopped_early": stopped_early,
        "final_train_loss": history[-1]["train_loss"],  # nats, mean over the steps since the last evaluation
        "final_train_bits_per_byte": round(history[-1]["train_loss"] / math.log(2), 4),
        "heldout_loss": round(final_bpb * math.log(2), 4),  # nats per byte
        "heldout_bits_per_byte": round(final_bpb, 4),
        "heldout_perplexity": round(2 ** final_bpb, 4),  # per byte
        "heldout_windows": final_windows,
        "seconds": round(seconds, 1),
        "tokens_seen": step * tokens_per_step,
        "resumed": resumed,
        "train_tokens": len(data),
        "history": history,
    }
    return model, record


