"""The family registry: every supported family, by its name (ModelSpec.family, config.json's model_type) and by
the HF architectures that name it, each from the one module that knows it (config defaults and reader, tensor
layout, capabilities; see common.Family). Adding a family is a module with a FAMILIES tuple, listed in MODULES.

lookup(name) is how the rest of moeserve asks about a family (spec.py, checkpoint.py, parallel/loading.py);
config_family picks the family of a config.json; read_fields reads one into ModelSpec fields.
"""

from __future__ import annotations

from moeserve.errors import MoeserveError
from moeserve.families import dbrx, deepseek, glm, gpt_oss, granite, llama4, mixtral, olmoe, phimoe, prmoe, qwen
from moeserve.families.common import Family, partial_rotary, rope_params

MODULES = (mixtral, qwen, olmoe, prmoe, deepseek, glm, phimoe, granite, dbrx, gpt_oss, llama4)
FAMILIES: dict[str, Family] = {f.name: f for m in MODULES for f in m.FAMILIES}
# architectures value in config.json -> family name
SUPPORTED_ARCHITECTURES: dict[str, str] = {a: f.name for f in FAMILIES.values() for a in f.architectures}


def lookup(name: str) -> Family:
    """The family named `name` (ModelSpec.family) or by the architecture `name`."""
    family = FAMILIES.get(SUPPORTED_ARCHITECTURES.get(name, name))
    if family is None:
        raise MoeserveError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return family


def config_family(cfg: dict) -> Family:
    """The family of config.json `cfg`: by its architectures, else (where it names none) by its model_type."""
    archs = cfg.get("architectures") or []
    name = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if name is None and not archs:
        name = cfg.get("model_type") if cfg.get("model_type") in FAMILIES else None
    if name is None:
        raise MoeserveError(f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: "
                            + ", ".join(SUPPORTED_ARCHITECTURES))
    return lookup(name)


def with_family_defaults(cfg: dict, family: Family) -> dict:
    """cfg over its family's defaults. A rope that cfg gives (rope_parameters or rope_scaling) is taken whole, as
    transformers takes it: the family's default rope_parameters do not fill its gaps."""
    defaults = family.defaults
    if rope_params(cfg):
        defaults = {k: v for k, v in defaults.items() if k != "rope_parameters"}
    return {**defaults, **cfg}


def fp8_block_size(cfg: dict) -> tuple[int, int] | None:
    """(rows, columns) of the FP8 scale blocks config.json's quantization_config names (quant_method "fp8",
    weight_block_size, 128 x 128 by default); None for a float checkpoint or the MXFP4 experts of a family that
    stores them so (Family.mxfp4_experts, read as they are). Another quant_method is refused."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    family = FAMILIES.get(cfg.get("model_type"))
    if method == "mxfp4" and family is not None and family.mxfp4_experts:
        return None
    if method != "fp8":
        raise MoeserveError(f"quantization_config.quant_method {method!r} is not supported; moeserve reads float "
                            f"checkpoints, block-scaled 'fp8' ones and GPT-OSS's 'mxfp4' experts")
    block = quant.get("weight_block_size") or [128, 128]
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise MoeserveError(f"quantization_config.weight_block_size {block!r} is not two positive integers")
    return block[0], block[1]


def read_fields(cfg: dict) -> dict:
    """config.json -> the ModelSpec fields its family's reader gives, over the family's defaults; what no family runs
    (another quantization, partial rotary where the family has none, a missing field) refused in one line."""
    family = config_family(cfg)
    cfg = with_family_defaults(cfg, family)
    fp8_block_size(cfg)  # refuses quantized formats other than block-scaled FP8 (and MXFP4 experts)
    if not family.partial_rotary and partial_rotary(cfg, 1.0) != 1.0:
        raise MoeserveError(f"partial rotary embeddings (partial_rotary_factor != 1) are not supported for "
                            f"{family.name}")
    try:
        return family.read(cfg)
    except KeyError as e:
        raise MoeserveError(f"config.json for {family.name} lacks the field {e.args[0]!r}") from None
