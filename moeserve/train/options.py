"""The trainer's command-line options, shared by `python -m moeserve.train` and `moeserve train`. No torch here:
`moeserve --help` stays instant."""

from __future__ import annotations

import argparse

from moeserve.train.arch import ARCHITECTURES, SCALES

DESCRIPTION = ("Train an MoE language model on the Shakespeare corpus (Hamlet held out): a standard MoE, a "
               "Pyramid-MoE, a Residual-MoE or a PR-MoE, or a Mixture-of-Students student distilled from a "
               "teacher with staged KD; or the wide model on Python source and Shakespeare (held-out files). "
               "Writes a checkpoint every moeserve command loads, with training.json (settings and the held-out "
               "loss curve).")


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="moe-8", choices=list(ARCHITECTURES),
                   help="moe-8 / moe-16: standard MoE, 8 or 16 experts in each of 6 layers, top-2 (moe-8 is the "
                        "demo model); pyramid: 4,4,4,4,8,8 experts; residual: 8 experts top-1 + a dense MLP per "
                        "layer; prmoe: both; wide: hidden 1024, expert FFN 2048, 12 layers of 8 experts top-2 "
                        "(0.65B parameters) over a BPE tokenizer, trained on Python source and Shakespeare, "
                        "checkpointed and resumed from OUT (default moe-8)")
    p.add_argument("--scale", default="demo", choices=list(SCALES),
                   help="demo: the demo's width (hidden 256, expert FFN 128); 4x: twice the width, about 4x the "
                        "parameters (default demo)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="train a shallower model: the last N layers of the architecture (a Mixture-of-Students "
                        "student's depth)")
    p.add_argument("--teacher", default=None, metavar="DIR",
                   help="distil from this checkpoint (Mixture-of-Students): KD loss against its logits")
    p.add_argument("--kd-weight", type=float, default=1.0, help="weight of the KD term (default 1)")
    p.add_argument("--kd-stop", type=int, default=None, metavar="STEP",
                   help="staged KD: no KD term from this step on (default: KD throughout)")
    p.add_argument("--kd-temperature", type=float, default=1.0, help="softmax temperature of the KD term "
                                                                     "(default 1)")
    p.add_argument("--texts", default=None,
                   help="the shksprdata/texts directory (default: the installed shksprdata package)")
    p.add_argument("--code", action="append", default=None, metavar="DIR",
                   help="--arch wide: a directory of Python source to train on (repeatable; default the standard "
                        "library of the Python that runs the trainer); 2%% of its files, chosen by a hash of their "
                        "paths, are held out")
    p.add_argument("--no-shakespeare", action="store_true",
                   help="--arch wide: train on the code alone (default: the Shakespeare texts too, Hamlet held out)")
    p.add_argument("--out", required=True, help="output directory (created, or its files replaced)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimiser steps (default 6000, wide 20000 cut to --minutes; --quick 30)")
    p.add_argument("--minutes", type=float, default=None,
                   help="training time budget: the step count is reduced to fit it, and training stops when it "
                        "runs out (default 4, wide 7; 0 = none)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="windows per step (default 64, wide 32 of 1024 tokens)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 0.003, wide 0.001)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="steps between held-out evaluations (default 250, wide 100)")
    p.add_argument("--seed", type=int, default=None, help="seed of the init and the batches (default 0)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also plot the held-out loss curve to this file (needs matplotlib)")
    p.add_argument("--quick", action="store_true", help="a tiny model for a few steps (for the tests)")
