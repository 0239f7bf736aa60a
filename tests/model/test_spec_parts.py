"""ModelSpec's typed parts (spec.attention, spec.moe, spec.norm): the flat field names still build a spec
(ModelSpec.of, replace), and a spec JSON written before the parts (spec_flat_json.json: ModelSpec.to_json of the
flat ModelSpec, on the tiny test configs) reads as the same spec the configs read as now."""

import copy
import json
from pathlib import Path

import pytest

from moeserve import MoeserveError
from moeserve.spec import AttentionSpec, ModelSpec, MoESpec, NormSpec, RopeSpec
from tests.hf_models import family_configs

FLAT_JSON = json.loads((Path(__file__).parent / "spec_flat_json.json").read_text())


def spec_of(family: str) -> ModelSpec:
    """The ModelSpec of the tiny test config of `family`, as transformers' config class fills it."""
    import transformers

    cls_name, kw = family_configs()[family]
    cfg = getattr(transformers, cls_name)(**copy.deepcopy(kw)).to_dict()
    cfg["architectures"] = [{"Llama4TextConfig": "Llama4ForCausalLM"}.get(cls_name,
                                                                         cls_name.replace("Config", "ForCausalLM"))]
    return ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize("family", sorted(FLAT_JSON))
def test_a_flat_spec_json_reads_as_the_spec_with_parts(family):
    spec = spec_of(family)
    assert ModelSpec.from_json(json.dumps(FLAT_JSON[family])) == spec
    assert ModelSpec.from_json(spec.to_json()) == spec
    assert set(json.loads(spec.to_json())) >= {"attention", "moe", "norm"}


def test_flat_names_build_and_replace_the_parts():
    spec = ModelSpec.of(family="mixtral", vocab_size=10, hidden_size=8, num_layers=2, max_position_embeddings=64,
                        num_heads=2, num_kv_heads=1, head_dim=4, rope=RopeSpec(theta=1e6), attention_sinks=True,
                        num_experts=4, top_k=2, expert_ffn=16, moe_layers=(True, False), dense_ffn=12, norm="layer",
                        rms_norm_eps=1e-5)
    assert spec.attention == AttentionSpec(num_heads=2, num_kv_heads=1, head_dim=4, rope=RopeSpec(theta=1e6),
                                           sinks=True)
    assert spec.moe == MoESpec(num_experts=4, top_k=2, expert_ffn=16, layers=(True, False), dense_ffn=12)
    assert spec.norm == NormSpec(kind="layer", eps=1e-5)
    assert spec.moe.layer_indices() == [0] and spec.moe.experts_at(0) == 4
    half = spec.replace(num_heads=1, top_k=1, norm_fp32=True, vocab_size=12)
    assert (half.attention.num_heads, half.attention.num_kv_heads, half.moe.top_k, half.moe.num_experts) == (1, 1, 1, 4)
    assert half.norm == NormSpec(kind="layer", eps=1e-5, fp32=True) and half.vocab_size == 12
    assert spec.replace(attention=half.attention).attention == half.attention


def test_a_spec_json_that_is_no_object_is_refused():
    with pytest.raises(MoeserveError, match="must hold an object"):
        ModelSpec.from_json("[1, 2]")
