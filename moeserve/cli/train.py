"""`moeserve train`: train a standard MoE, PR-MoE or Mixture-of-Students model on Shakespeare."""

from __future__ import annotations

from moeserve.train.run import run as train


def run(args) -> int:
    train(args)
    return 0
