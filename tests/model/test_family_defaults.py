"""A config.json that leaves fields out means what transformers makes of it: each family's own defaults fill them
(spec.FAMILY_DEFAULTS), checked against the transformers config class of every family."""

import dataclasses

import pytest
import torch

from moeserve.spec import ModelSpec
from tests.hf_models import family_configs


# the model's sizes and token ids: a config.json always names them; every other key is left out of the trimmed config
SHAPE_KEYS = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "intermediate_size_mlp", "moe_intermediate_size", "num_experts", "num_local_experts",
              "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "bos_token_id", "eos_token_id", "pad_token_id", "d_model", "n_heads", "n_layers",
              "attn_config", "ffn_config"}


def trimmed_and_full(family: str) -> tuple[dict, dict]:
    """The test model's sizes alone (and its architecture), and what transformers' config class makes of them."""
    import transformers

    cls_name, kw = family_configs()[family]
    kw = {k: v for k, v in kw.items() if k in SHAPE_KEYS}
    full = getattr(transformers, cls_name)(**kw).to_dict()
    arch = {"Llama4TextConfig": "Llama4ForCausalLM"}.get(cls_name, cls_name.replace("Config", "ForCausalLM"))
    return {**kw, "architectures": [arch], "model_type": full["model_type"]}, {**full, "architectures": [arch]}


@pytest.mark.parametrize("family", list(family_configs()))
def test_a_trimmed_config_reads_as_transformers_fills_it(family):
    trimmed, full = trimmed_and_full(family)
    spec, reference = ModelSpec.from_hf_config(trimmed), ModelSpec.from_hf_config(full)
    differ = {f.name: (getattr(spec, f.name), getattr(reference, f.name)) for f in dataclasses.fields(ModelSpec)
              if getattr(spec, f.name) != getattr(reference, f.name)}
    assert not differ, differ
