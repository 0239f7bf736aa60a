"""moeserve: run Mixture-of-Experts language models fast and accurately."""

from pathlib import Path

from moeserve.errors import MoeserveError
from moeserve.spec import ModelSpec, SUPPORTED_ARCHITECTURES

__version__ = "0.1.0"
DEMO_MODEL = str(Path(__file__).parent / "demo")  # the built-in demo checkpoint's directory, wherever installed


def load_model(path, device="cpu", dtype=None, progress=False, **options):
    """Open a checkpoint directory and return a ready `MoETransformer` (see moeserve.loader)."""
    from moeserve.loader import load_model as _load  # on call: `import moeserve` stays torch-free (moeserve --help)

    return _load(path, device=device, dtype=dtype, progress=progress, **options)


__all__ = ["DEMO_MODEL", "MoeserveError", "ModelSpec", "SUPPORTED_ARCHITECTURES", "load_model", "__version__"]
