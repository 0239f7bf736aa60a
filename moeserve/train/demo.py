"""Train the built-in demo model from scratch: a 6M-parameter byte-level Mixtral on Shakespeare.

    python -m moeserve.train.demo --texts DIR --out DIR [--steps N] [--minutes M] [--device cuda] [--quick]

The model is an ordinary MoETransformer trained with AdamW (warmup + cosine), bf16 autocast on a
GPU over fp32 master weights, and the Switch/Mixtral load-balancing loss read from the routers by
forward hooks (the MoE block returns only its output). `--out` receives an HF Mixtral checkpoint
(config.json + bf16 model.safetensors with per-expert names), the byte tokenizer, the held-out
Hamlet and training.json; the files appear only once all of them are written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from moeserve.checkpoint import save_safetensors_atomic, to_per_expert
from moeserve.errors import MoeserveError
from moeserve.evaluate import perplexity
from moeserve.loader import resolve_device
from moeserve.model.router import TopKRouter
from moeserve.model.transformer import MoETransformer
from moeserve.spec import ModelSpec
from moeserve.tokenizer import ByteTokenizer
from moeserve.train.data import GET_TEXTS, encode_documents, load_corpus

# HF MixtralForCausalLM config.json of the demo model: 6.0M parameters, 12 MB in bf16
DEMO_CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 258,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "intermediate_size": 128,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,  # the training windows' length (demo_config sets it from seq_len)
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rms_norm_eps": 1e-5,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": None,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.0,
    "output_router_logits": False,
    "use_cache": True,
    "dtype": "bfloat16",
}
# --quick: the same architecture at a size a CPU trains in seconds (for the tests)
QUICK_SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4}

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
    aux_coef: float = DEMO_CONFIG["router_aux_loss_coef"]  # load-balancing loss weight
    init_std: float = 0.02
    eval_every: int = 250
    eval_windows: int = 8  # held-out windows evaluated every eval_every steps
    final_eval_windows: int = 0  # 0 = every window of the held-out text
    seed: int = 0


QUICK = {"steps": 30, "minutes": 0.0, "batch_size": 8, "seq_len": 64, "warmup": 3, "eval_every": 10,
         "eval_windows": 4, "final_eval_windows": 8}


def demo_config(seq_len: int, quick: bool = False) -> dict:
    """The config.json to write. Its context is the training window: positions beyond it were never trained
    (the model's perplexity climbs past them), so the config must not promise more."""
    return {**DEMO_CONFIG, **(QUICK_SIZES if quick else {}), "max_position_embeddings": seq_len}


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
               cfg: TrainConfig, autocast) -> tuple[float, float]:
    """One AdamW step on batch [B, S+1]; returns (cross-entropy in nats, load-balancing loss)."""
    for group in opt.param_groups:
        group["lr"] = lr
    with autocast():
        logits = model(batch[:, :-1])  # [B, S, V]
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    aux = tap.aux_loss()
    (loss + cfg.aux_coef * aux).backward()
    nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), aux.item()


def fit_steps(steps: int, step: int, elapsed: float, per_step: float, budget: float) -> int:
    """The step count that ends within the budget (10% margin), never more than asked for."""
    return min(steps, step + int(0.9 * (budget - elapsed) / per_step))


def train(cfg: TrainConfig, spec: ModelSpec, data: torch.Tensor, heldout: torch.Tensor,
          device: torch.device) -> tuple[MoETransformer, dict]:
    """Train a fresh MoETransformer; returns it (fp32, rounded to bf16 values) and the run's record."""
    model = MoETransformer(spec)
    init_weights(model, cfg.init_std, cfg.seed)
    model.to(device).train()
    opt = make_optimizer(model, cfg, fused=device.type == "cuda")
    tap = RouterTap(model)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    data = data.to(device)
    autocast = partial(torch.autocast, "cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    steps, budget = cfg.steps, cfg.minutes * 60
    history, recent, stopped_early = [], [], False

    def evaluate(step: int) -> None:
        model.eval()
        bpb, _ = bits_per_byte(model, heldout, cfg, cfg.eval_windows, autocast)
        tap.outputs.clear()
        model.train()
        history.append({"step": step, "train_loss": round(sum(recent) / len(recent), 4),
                        "heldout_bits_per_byte": round(bpb, 4), "seconds": round(time.perf_counter() - t0, 1)})
        tqdm.write(f"step {step}: train loss {history[-1]['train_loss']:.4f} nats, held-out {bpb:.4f} bits/byte",
                   file=sys.stderr)
        recent.clear()

    bar = tqdm(total=steps, desc="training", unit="step", mininterval=1.0, file=sys.stderr)
    t0 = time.perf_counter()
    step = 0
    while step < steps:
        elapsed = time.perf_counter() - t0
        if step == FIT_FROM:
            t_fit = elapsed
        if step == FIT_AT and budget:
            per_step = (elapsed - t_fit) / (FIT_AT - FIT_FROM)
            fitted = fit_steps(steps, step, elapsed, per_step, budget)
            if fitted < steps:
                tqdm.write(f"{per_step * 1e3:.0f} ms/step: {steps} steps would exceed --minutes {cfg.minutes:g}; "
                           f"training {fitted} steps (rerun with --steps {fitted} --minutes 0 to reproduce)",
                           file=sys.stderr)
                steps = bar.total = fitted
        if budget and elapsed > budget:
            tqdm.write(f"--minutes {cfg.minutes:g} ran out at step {step}; stopping early", file=sys.stderr)
            stopped_early = True
            break
        lr = lr_at(step, steps, cfg)
        loss, aux = train_step(model, opt, tap, sample_batch(data, cfg.batch_size, cfg.seq_len, gen), lr, cfg,
                               autocast)
        step += 1
        recent.append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", aux=f"{aux:.3f}", lr=f"{lr:.1e}", refresh=False)
        if step % cfg.eval_every == 0 or step == steps:
            evaluate(step)
    if recent:
        evaluate(step)
    bar.close()
    seconds = time.perf_counter() - t0

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
        "heldout_bits_per_byte": round(final_bpb, 4),
        "heldout_windows": final_windows,
        "seconds": round(seconds, 1),
        "tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "train_tokens": len(data),
        "history": history,
    }
    return model, record


# ---- output ---------------------------------------------------------------------------------


def save_demo(model: MoETransformer, hf_config: dict, tok: ByteTokenizer, heldout_text: str, record: dict,
              out: Path) -> None:
    """Write every file into a temporary directory beside `out`, then rename them into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        state = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
        save_safetensors_atomic(to_per_expert(state, model.spec.family), tmp / "model.safetensors")
        tok.save(tmp)
        (tmp / "heldout.txt").write_text(heldout_text, encoding="utf-8", newline="\n")
        (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp and safetensors create owner-only entries
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():  # e.g. moeserve/demo itself: replace our files, keep the others
            for f in sorted(tmp.iterdir()):
                os.replace(f, out / f.name)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def git_commit() -> str | None:
    """HEAD of the checkout this file lives in (with -dirty for local changes), or None."""
    try:
        cwd = Path(__file__).parent
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ---- command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m moeserve.train.demo", description=__doc__.split("\n\n")[0],
                                epilog=f"Shakespeare texts: {GET_TEXTS}.")
    p.add_argument("--texts", default=None,
                   help="the shksprdata/texts directory (default: the installed shksprdata package)")
    p.add_argument("--out", required=True, help="output directory (created, or its files replaced)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimiser steps (default {d.steps}; --quick {QUICK['steps']})")
    p.add_argument("--minutes", type=float, default=None,
                   help=f"training time budget: the step count is reduced to fit it, and training stops "
                        f"when it runs out (default {d.minutes:g}; 0 = none)")
    p.add_argument("--batch-size", type=int, default=None, help=f"windows per step (default {d.batch_size})")
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default {d.lr:g})")
    p.add_argument("--eval-every", type=int, default=None, help=f"steps between held-out evaluations "
                                                                 f"(default {d.eval_every})")
    p.add_argument("--seed", type=int, default=None, help=f"seed of the init and the batches (default {d.seed})")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    p.add_argument("--quick", action="store_true", help="a tiny model for a few steps (for the tests)")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    given = {"steps": args.steps, "minutes": args.minutes, "batch_size": args.batch_size, "lr": args.lr,
             "eval_every": args.eval_every, "seed": args.seed}
    cfg = TrainConfig(**{**(QUICK if args.quick else {}), **{k: v for k, v in given.items() if v is not None}})
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.minutes < 0 or cfg.eval_every < 1 or cfg.lr <= 0:
        raise MoeserveError("--steps, --batch-size and --eval-every must be >= 1, --minutes >= 0, --lr > 0")
    return cfg


def run(args: argparse.Namespace) -> dict:
    cfg = config_from_args(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise MoeserveError(f"--out {str(out)!r} exists and is not a directory")
    device = resolve_device(args.device)
    hf_config = demo_config(cfg.seq_len, args.quick)
    spec = ModelSpec.from_hf_config(hf_config)
    tok = ByteTokenizer(hf_config["bos_token_id"], hf_config["eos_token_id"])
    corpus = load_corpus(args.texts)
    data = encode_documents(corpus.train, tok)  # [N]
    heldout = torch.tensor(tok.encode(corpus.heldout), dtype=torch.int64)  # [M], as `moeserve eval ppl` reads it
    counts = spec.parameter_counts()
    print(f"{len(corpus.train)} training texts, {len(data):,} tokens; held-out Hamlet {len(heldout):,} tokens; "
          f"model {counts['total']:,} parameters ({counts['active_per_token']:,} active); device "
          f"{device_name(device)}", file=sys.stderr)
    model, record = train(cfg, spec, data, heldout, device)
    record = {**record, "device": device_name(device), "seed": cfg.seed, "torch": torch.__version__,
              "git_commit": git_commit(), "parameters": counts["total"], "train_texts": corpus.names,
              "config": dataclasses.asdict(cfg)}
    save_demo(model, hf_config, tok, corpus.heldout, record, out)
    print(f"wrote {out}: {record['steps']} steps in {record['seconds']:.0f} s, train loss "
          f"{record['final_train_loss']:.4f}, held-out {record['heldout_bits_per_byte']:.4f} bits/byte",
          file=sys.stderr)
    return record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except MoeserveError as e:
        print(f"moeserve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
