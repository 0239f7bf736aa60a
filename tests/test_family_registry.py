"""The family registry (moeserve/families/): every supported architecture has a family, found by its name, its
architectures and its model_type, and every family module declares what the registry needs."""

import pytest

from moeserve import MoeserveError
from moeserve.families import FAMILIES, MODULES, SUPPORTED_ARCHITECTURES, config_family, lookup
from moeserve.families.common import ExpertNames, Family


def test_every_supported_architecture_has_its_family():
    assert len(SUPPORTED_ARCHITECTURES) >= 15
    for arch, name in SUPPORTED_ARCHITECTURES.items():
        family = lookup(arch)
        assert family is lookup(name) and family.name == name and arch in family.architectures
        assert config_family({"architectures": [arch]}) is family
        assert config_family({"model_type": name}) is family  # no architectures: the model_type names it
    assert {f.name for f in FAMILIES.values()} == set(SUPPORTED_ARCHITECTURES.values())


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_each_family_module_declares_what_the_registry_needs(module):
    assert module.FAMILIES and all(isinstance(f, Family) for f in module.FAMILIES)
    for f in module.FAMILIES:
        assert f.name and f.architectures and all(a.endswith(("ForCausalLM", "ForConditionalGeneration"))
                                                  for a in f.architectures)
        assert callable(f.read) and isinstance(f.defaults, dict) and isinstance(f.expert_names, ExpertNames)
        assert f.layout is None or callable(f.layout)
        assert FAMILIES[f.name] is f


def test_unknown_families_are_refused_in_one_line():
    with pytest.raises(MoeserveError, match="unknown model family 'nope'"):
        lookup("nope")
    with pytest.raises(MoeserveError, match=r"unsupported architecture \['LlamaForCausalLM'\]"):
        config_family({"architectures": ["LlamaForCausalLM"], "model_type": "mixtral"})
    with pytest.raises(MoeserveError, match="unsupported architecture 'llama'"):
        config_family({"model_type": "llama"})
