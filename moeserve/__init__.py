"""moeserve: run Mixture-of-Experts language models fast and accurately."""

from moeserve.demo import DEMO_MODEL
from moeserve.errors import MoeserveError
from moeserve.families import SUPPORTED_ARCHITECTURES
from moeserve.spec import ModelSpec

__version__ = "0.1.0"


def load_model(path, device="cpu", dtype=None, progress=False, **options):
    """Open a checkpoint directory and return a ready `MoETransformer` (see moeserve.loader)."""
    from moeserve.loader import load_model as _load  # on call: `import moeserve` stays torch-free (moeserve --help)

    return _load(path, device=device, dtype=dtype, progress=progress, **options)


def __getattr__(name):
    """moeserve.LLM and moeserve.SamplingParams, imported on first use (they load torch)."""
    if name == "LLM":
        from moeserve.llm import LLM  # on first use: `import moeserve` stays torch-free

        return LLM
    if name == "SamplingParams":
        from moeserve.engine.params import SamplingParams  # on first use, as LLM

        return SamplingParams
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")


__all__ = ["DEMO_MODEL", "LLM", "MoeserveError", "ModelSpec", "SUPPORTED_ARCHITECTURES", "SamplingParams",
           "load_model", "__version__"]
