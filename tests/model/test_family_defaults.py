"""A config.json that leaves fields out means what transformers makes of it: each family's own defaults fill them
(moeserve/families/: Family.defaults), checked against the transformers config class of every family."""

import copy
import dataclasses
import json

import pytest
import torch

import moeserve
from moeserve.families import FAMILIES
from moeserve.spec import ModelSpec
from tests.hf_models import family_configs, random_hf_model

# the model's sizes and token ids: a config.json always names them; every other key is left out of the trimmed config
SHAPE_KEYS = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "intermediate_size_mlp", "moe_intermediate_size", "num_experts", "num_local_experts",
              "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "bos_token_id", "eos_token_id", "pad_token_id", "d_model", "n_heads", "n_layers",
              "attn_config", "ffn_config"}
# ropes config.json gives in part: transformers takes a given rope dict whole (the family's default rope only without
# one) and fills its rope_theta from the top level or the family's base
PARTIAL_ROPES = {
    "gpt_oss": [{"rope_theta": 50000.0}, {"rope_scaling": None},
                {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
                {"rope_parameters": {"rope_type": "default"}},
                {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}],
    "mixtral": [{"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, {"rope_scaling": None}],
    "llama4": [{"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}],
}


def trimmed_and_full(family: str, **extra) -> tuple[dict, dict]:
    """The test model's sizes alone (and its architecture, and `extra`), and what transformers' config class makes of
    them (a copy: the class fills the rope dicts it is given)."""
    import transformers

    cls_name, kw = family_configs()[family]
    kw = {**{k: v for k, v in kw.items() if k in SHAPE_KEYS}, **extra}
    full = getattr(transformers, cls_name)(**copy.deepcopy(kw)).to_dict()
    arch = {"Llama4TextConfig": "Llama4ForCausalLM"}.get(cls_name, cls_name.replace("Config", "ForCausalLM"))
    return {**kw, "architectures": [arch], "model_type": full["model_type"]}, {**full, "architectures": [arch]}


def spec_differences(trimmed: dict, full: dict, monkeypatch) -> dict:
    """ModelSpec fields that differ between the two configs' readings: field -> (trimmed's, full's). full is read
    without the family's defaults, so nothing of the table reaches the reference."""
    spec = ModelSpec.from_hf_config(copy.deepcopy(trimmed))
    for name, family in FAMILIES.items():
        monkeypatch.setitem(FAMILIES, name, dataclasses.replace(family, defaults={}))
    reference = ModelSpec.from_hf_config(full)
    return {f.name: (getattr(spec, f.name), getattr(reference, f.name)) for f in dataclasses.fields(ModelSpec)
            if getattr(spec, f.name) != getattr(reference, f.name)}


@pytest.mark.parametrize("family", list(family_configs()))
def test_a_trimmed_config_reads_as_transformers_fills_it(family, monkeypatch):
    differ = spec_differences(*trimmed_and_full(family), monkeypatch)
    assert not differ, differ


@pytest.mark.parametrize("family,extra", [(f, e) for f, ropes in PARTIAL_ROPES.items() for e in ropes])
def test_a_partly_given_rope_reads_as_transformers_fills_it(family, extra, monkeypatch):
    differ = spec_differences(*trimmed_and_full(family, **extra), monkeypatch)
    assert not differ, differ


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_logits_of_a_checkpoint_with_a_trimmed_config_match_hf(family, tmp_path):
    """A tiny model transformers builds from the sizes alone, saved with its config.json trimmed back to them:
    moeserve's logits are transformers' (Mixtral's eps and rope base, Qwen3's unnormalised top-k come from
    the family's defaults)."""
    import transformers

    trimmed, _ = trimmed_and_full(family)
    cls_name, _ = family_configs()[family]
    hf = random_hf_model(getattr(transformers, cls_name)(**copy.deepcopy(trimmed)), seed=7)
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(trimmed))
    ours = moeserve.load_model(tmp_path, dtype=torch.float32)
    tokens = torch.randint(3, trimmed["vocab_size"], (2, 17))
    with torch.no_grad():
        ref, out = hf(tokens).logits, ours(tokens)  # [B, S, V]
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max()
