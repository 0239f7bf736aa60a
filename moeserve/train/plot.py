"""Validation curves of training runs (their training.json histories) as one PNG; matplotlib is optional."""

from __future__ import annotations

from pathlib import Path

MISSING = "no plot: matplotlib is not installed (pip install matplotlib, or pip install 'moeserve[plot]')"


def plot_curves(runs: dict[str, list[dict]], path: str | Path, title: str = "") -> str | None:
    """Held-out loss (nats per byte) against step, one line per run (name -> history). Returns None when written,
    else the one-line reason it was not (no matplotlib)."""
    try:  # matplotlib is optional (the `plot` extra)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return MISSING
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, history in runs.items():
        ax.plot([h["step"] for h in history], [h["heldout_loss"] for h in history], label=name, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_title(title or "validation loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
