"""`python -m moeserve.train` and `moeserve train`: one trainer for every architecture of arch.py and for
Mixture-of-Students students; the settings become dataclasses (ArchConfig, TrainConfig, DistillConfig) and the
run's record keeps them beside the held-out loss curve.

    python -m moeserve.train --arch prmoe --scale demo --out DIR [--steps N] [--device cuda]
    python -m moeserve.train --arch prmoe --layers 5 --teacher DIR --kd-stop 400 --out DIR     # MoS, staged KD
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from moeserve.checkpoint import check_output_dir
from moeserve.errors import MoeserveError
from moeserve.loader import load_model, resolve_device
from moeserve.spec import ModelSpec
from moeserve.tokenizer import ByteTokenizer
from moeserve.train.arch import ArchConfig, architecture
from moeserve.train.data import GET_TEXTS, encode_documents, load_corpus
from moeserve.train.distill import DistillConfig
from moeserve.train.loop import QUICK, TrainConfig, train
from moeserve.train.options import DESCRIPTION, add_train_args
from moeserve.train.output import device_name, git_commit, save_model
from moeserve.train.plot import plot_curves


def config_from_args(args: argparse.Namespace) -> tuple[ArchConfig, TrainConfig, DistillConfig | None]:
    given = {"steps": args.steps, "minutes": args.minutes, "batch_size": args.batch_size, "lr": args.lr,
             "eval_every": args.eval_every, "seed": args.seed}
    cfg = TrainConfig(**{**(QUICK if args.quick else {}), **{k: v for k, v in given.items() if v is not None}})
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.minutes < 0 or cfg.eval_every < 1 or cfg.lr <= 0:
        raise MoeserveError("--steps, --batch-size and --eval-every must be >= 1, --minutes >= 0, --lr > 0")
    arch = architecture(args.arch, args.scale, args.quick)
    if args.layers is not None:
        arch = arch.at_depth(args.layers)
    distill = None
    if args.teacher is not None:
        distill = DistillConfig(args.teacher, args.kd_weight, args.kd_stop, args.kd_temperature)
    elif args.kd_stop is not None:
        raise MoeserveError("--kd-stop needs --teacher")
    return arch, cfg, distill


def load_teacher(distill: DistillConfig, spec: ModelSpec, device: torch.device):
    """The teacher, frozen, in fp32 on `device` (autocast computes it in bf16 on a GPU)."""
    teacher_spec = ModelSpec.from_dir(distill.teacher)
    if teacher_spec.vocab_size != spec.vocab_size:
        raise MoeserveError(f"--teacher {distill.teacher} has a vocabulary of {teacher_spec.vocab_size} tokens, the "
                            f"student {spec.vocab_size}")
    return load_model(distill.teacher, device=device, dtype=torch.float32)


def run(args: argparse.Namespace) -> dict:
    arch, cfg, distill = config_from_args(args)
    out = check_output_dir(args.out)
    device = resolve_device(args.device)
    hf_config = arch.hf_config(cfg.seq_len)  # the context is the training window: never promise more
    spec = ModelSpec.from_hf_config(hf_config)
    teacher = load_teacher(distill, spec, device) if distill is not None else None
    tok = ByteTokenizer(arch.bos_token_id, arch.eos_token_id)
    corpus = load_corpus(args.texts)
    data = encode_documents(corpus.train, tok)  # [N]
    heldout = torch.tensor(tok.encode(corpus.heldout), dtype=torch.int64)  # [M], as `moeserve eval ppl` reads it
    counts = spec.parameter_counts()
    print(f"{len(corpus.train)} training texts, {len(data):,} tokens; held-out Hamlet {len(heldout):,} tokens; "
          f"{args.arch} model {counts['total']:,} parameters ({counts['active_per_token']:,} active)"
          f"{', distilled from ' + distill.teacher if distill else ''}; device {device_name(device)}", file=sys.stderr)
    model, record = train(cfg, spec, data, heldout, device, distill, teacher)
    record = {**record, "device": device_name(device), "seed": cfg.seed, "torch": torch.__version__,
              "git_commit": git_commit(), "parameters": counts["total"],
              "active_parameters": counts["active_per_token"],
              "architecture": args.arch, "scale": args.scale, "arch": dataclasses.asdict(arch),
              "distill": dataclasses.asdict(distill) if distill else None, "train_texts": corpus.names,
              "config": dataclasses.asdict(cfg)}
    save_model(model, hf_config, tok, corpus.heldout, record, Path(out))
    print(f"wrote {out}: {record['steps']} steps in {record['seconds']:.0f} s, train loss "
          f"{record['final_train_loss']:.4f}, held-out {record['heldout_bits_per_byte']:.4f} bits/byte",
          file=sys.stderr)
    if args.plot:
        problem = plot_curves({args.arch: record["history"]}, args.plot, f"{args.arch} ({args.scale})")
        print(f"moeserve: {problem}" if problem else f"wrote {args.plot}", file=sys.stderr)
    return record


def build_parser(prog: str = "python -m moeserve.train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=f"Shakespeare texts: {GET_TEXTS}.")
    add_train_args(p)
    return p


def main(argv: list[str] | None = None, prog: str = "python -m moeserve.train") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        run(args)
    except MoeserveError as e:
        print(f"moeserve: error: {e}", file=sys.stderr)
        return 2
    return 0
