"""`moeserve tune`: this GPU's Triton launch configs for a model's MoE shapes, kept in the tuning cache."""

from __future__ import annotations

from moeserve.cli.common import check_output_path, token_counts
from moeserve.errors import MoeserveError
from moeserve.spec import ModelSpec

def run(args) -> int:
    tokens = token_counts(args.tokens)
    try:
        bits = [int(b) for b in args.bits.split(",")] if args.bits is not None else None
    except ValueError:
        bits = []
    if bits is not None and (not bits or set(bits) - {16, 8, 4, 3, 2}):
        raise MoeserveError(f"--bits takes comma-separated widths among 16, 8, 4, 3 and 2, got {args.bits!r}")
    if args.rank is not None and args.rank < 0:
        raise MoeserveError(f"--rank must be 0 or more, got {args.rank}")
    if args.budget is not None and args.budget <= 0:
        raise MoeserveError(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.out is not None:
        check_output_path(args.out, "--out")
    ModelSpec.from_dir(args.model)  # a bad checkpoint is named before the GPU check
    import torch  # after the checks above, which answer without it

    if not torch.cuda.is_available():
        raise MoeserveError("moeserve tune needs a CUDA GPU (it times the Triton kernels on it)")
    from moeserve.tune import checkpoint_kinds, format_rows, tune_model  # needs triton: after the GPU check

    kinds = checkpoint_kinds(args.model, bits, args.rank)
    rows = tune_model(args.model, list(tokens), kinds, "quick" if args.quick else "full", args.budget, args.out)
    print(f"launch configs on {torch.cuda.get_device_name()} (GPU ms of the experts call; default: the stored or "
          "default config before this run):")
    for line in format_rows(rows):
        print(line)
    if args.out is not None:
        print(f"wrote {args.out}")
    return 0
