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
import time
from pathlib import Path

import torch

from moeserve.checkpoint import check_output_dir
from moeserve.errors import MoeserveError
from moeserve.loader import load_model, resolve_device
from moeserve.spec import ModelSpec
from moeserve.tokenizer import ByteTokenizer
from moeserve.train.arch import ArchConfig, architecture
from moeserve.train.corpus import BpeTokenizer, default_code_roots, encode_with_bpe, load_code_corpus
from moeserve.train.data import GET_TEXTS, encode_documents, load_corpus
from moeserve.train.distill import DistillConfig
from moeserve.train.loop import QUICK, STATE_FILE, WIDE, TrainConfig, train
from moeserve.train.options import DESCRIPTION, add_train_args
from moeserve.train.output import device_name, git_commit, save_model
from moeserve.train.plot import plot_curves


def config_from_args(args: argparse.Namespace) -> tuple[ArchConfig, TrainConfig, DistillConfig | None]:
    given = {"steps": args.steps, "minutes": args.minutes, "batch_size": args.batch_size, "lr": args.lr,
             "eval_every": args.eval_every, "seed": args.seed}
    arch = architecture(args.arch, args.scale, args.quick)
    defaults = {**(WIDE if arch.bpe_vocab else {}), **(QUICK if args.quick else {})}
    cfg = TrainConfig(**{**defaults, **{k: v for k, v in given.items() if v is not None}})
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.minutes < 0 or cfg.eval_every < 1 or cfg.lr <= 0:
        raise MoeserveError("--steps, --batch-size and --eval-every must be >= 1, --minutes >= 0, --lr > 0")
    if args.code and not arch.bpe_vocab:
        raise MoeserveError(f"--code is the wide model's corpus; --arch {args.arch} trains on the Shakespeare texts")
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


@dataclasses.dataclass
class TrainingData:
    """What a run trains and evaluates on: token streams, the tokenizer the model ships with, the held-out text it
    ships (heldout.txt), and the names of the training and held-out documents."""
    train: torch.Tensor  # [N] int64
    heldout: torch.Tensor  # [M] int64
    tokenizer: ByteTokenizer | BpeTokenizer
    heldout_text: str
    train_names: list[str]
    heldout_names: list[str]


def shakespeare_data(args: argparse.Namespace, arch: ArchConfig) -> TrainingData:
    """Bytes of every play but Hamlet; Hamlet held out, read as `moeserve eval ppl` reads it."""
    tok = ByteTokenizer(arch.bos_token_id, arch.eos_token_id)
    corpus = load_corpus(args.texts)
    heldout = torch.tensor(tok.encode(corpus.heldout), dtype=torch.int64)
    return TrainingData(encode_documents(corpus.train, tok), heldout, tok, corpus.heldout, corpus.names,
                        ["hamlet_gut.txt"])


def code_data(args: argparse.Namespace, arch: ArchConfig, out: Path) -> TrainingData:
    """The code corpus (corpus.py) in a BPE tokenizer fitted on its training files, or, when resuming, the one the
    run fitted (written to OUT at once, so a resumed run reads the ids it trained on)."""
    corpus = load_code_corpus(args.code or None, args.texts, shakespeare=not args.no_shakespeare)
    if (out / STATE_FILE).is_file() and (out / "tokenizer.json").is_file():
        tok = BpeTokenizer.load(out)
    else:
        tok = BpeTokenizer.fit(corpus.train, arch.bpe_vocab)
        out.mkdir(parents=True, exist_ok=True)
        tok.save(out)
    return TrainingData(encode_with_bpe(tok.tokenizer, corpus.train), encode_with_bpe(tok.tokenizer, corpus.heldout),
                        tok, corpus.heldout_text(), corpus.names, corpus.heldout_names)


def run(args: argparse.Namespace) -> dict:
    arch, cfg, distill = config_from_args(args)
    out = check_output_dir(args.out)
    device = resolve_device(args.device)
    hf_config = arch.hf_config(cfg.seq_len)  # the context is the training window: never promise more
    spec = ModelSpec.from_hf_config(hf_config)
    teacher = load_teacher(distill, spec, device) if distill is not None else None
    t0 = time.perf_counter()
    data = code_data(args, arch, Path(out)) if arch.bpe_vocab else shakespeare_data(args, arch)
    counts = spec.parameter_counts()
    print(f"{len(data.train_names)} training texts, {len(data.train):,} tokens; {len(data.heldout_names)} held-out, "
          f"{len(data.heldout):,} tokens ({time.perf_counter() - t0:.0f} s); {args.arch} model "
          f"{counts['total']:,} parameters ({counts['active_per_token']:,} active)"
          f"{', distilled from ' + distill.teacher if distill else ''}; device {device_name(device)}", file=sys.stderr)
    settings = {"arch": dataclasses.asdict(arch), "train_texts": data.train_names, "tokens": len(data.train)}
    state = Path(out) / STATE_FILE if arch.bpe_vocab else None  # the wide model's runs checkpoint and resume
    model, record = train(cfg, spec, data.train, data.heldout, device, distill, teacher, state, settings)
    record = {**record, "device": device_name(device), "seed": cfg.seed, "torch": torch.__version__,
              "git_commit": git_commit(), "parameters": counts["total"],
              "active_parameters": counts["active_per_token"],
              "architecture": args.arch, "scale": args.scale, "arch": dataclasses.asdict(arch),
              "distill": dataclasses.asdict(distill) if distill else None, "train_texts": data.train_names,
              "heldout_texts": data.heldout_names,
              "code_roots": [str(Path(r).resolve()) for r in args.code or default_code_roots()] if arch.bpe_vocab
              else None, "token_unit": "BPE token" if arch.bpe_vocab else "byte",
              "config": dataclasses.asdict(cfg)}
    save_model(model, hf_config, data.tokenizer, data.heldout_text, record, Path(out))
    print(f"wrote {out}: {record['steps']} steps in {record['seconds']:.0f} s, train loss "
          f"{record['final_train_loss']:.4f}, held-out {record['heldout_bits_per_byte']:.4f} "
          f"bits/{record['token_unit']}",
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
