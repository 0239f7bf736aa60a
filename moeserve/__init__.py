"""moeserve: run Mixture-of-Experts language models fast and accurately."""

from moeserve.errors import MoeserveError
from moeserve.spec import ModelSpec, SUPPORTED_ARCHITECTURES

__version__ = "0.1.0"


def load_model(path, device="cpu", dtype=None, progress=False, **options):
    """Open a checkpoint directory and return a ready `MoETransformer` (see moeserve.loader)."""
    from moeserve.loader import load_model as _load

    return _load(path, device=device, dtype=dtype, progress=progress, **options)


__all__ = ["MoeserveError", "ModelSpec", "SUPPORTED_ARCHITECTURES", "load_model", "__version__"]
