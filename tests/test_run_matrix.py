"""The run matrix: every family in every placement, every placement through every entry point, equal to the
resident model (fp32, CPU). Exact placements give the same greedy tokens; a refused cell asserts its one-line
refusal (and is a row of the README's table). Parallel placements (--ep/--tp under gloo) are covered by
tests/parallel (generate, eval ppl, serve)."""

from __future__ import annotations

import json

import pytest
import torch

import moeserve
from hf_models import FAMILIES
from moeserve.cli import main
from moeserve.engine.params import SamplingParams
from moeserve.offload.store import ExpertStore

GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
# placement -> LLM keyword arguments ({store}: the model's expert store from offload-prepare)
PLACEMENTS = {"cpu_moe": {"cpu_moe": True},
              "n_cpu_moe_cache": {"n_cpu_moe": 1, "gpu_cache_experts": 2},  # the slot cache on the CPU stands in
              "offload": {"offload": "{store}", "high_slots": 4, "all_high": True}}
FLAGS = {"resident": [], "cpu_moe": ["--cpu-moe"], "n_cpu_moe_cache": ["--n-cpu-moe", "1", "--gpu-cache-experts", "2"],
         "offload": ["--offload", "{store}", "--high-slots", "4", "--all-high"]}
# (family, placement) -> the refusal that cell gives
REFUSED: dict[tuple[str, str], str] = {}  # none today: every family runs in every placement


def with_store(options: dict, store) -> dict:
    return {k: str(store) if v == "{store}" else v for k, v in options.items()}


@pytest.fixture(scope="module")
def stores(hf_checkpoints, tmp_path_factory):
    """family -> an expert store of its checkpoint (None where stores refuse the family)."""
    out = {}
    for fam in FAMILIES:
        path = tmp_path_factory.mktemp(f"store-{fam}")
        if (fam, "offload") in REFUSED:
            with pytest.raises(moeserve.MoeserveError, match=REFUSED[fam, "offload"]):
                ExpertStore.build(hf_checkpoints[fam][1], path, low_bits=4, group=8)
            out[fam] = None
        else:
            ExpertStore.build(hf_checkpoints[fam][1], path, low_bits=4, group=8)  # 8 divides every tiny shape
            out[fam] = path
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_in_every_placement_equals_resident(hf_checkpoints, stores, family):
    """moeserve.LLM (the Python entry point, the CLI's run path): greedy tokens of two prompts of different
    lengths, 16 new tokens each, equal to the resident model's in every placement."""
    path = hf_checkpoints[family][1]
    g = torch.Generator().manual_seed(len(family))
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (7, 3)]
    expected = [r.token_ids for r in moeserve.LLM(path).generate(prompts, GREEDY)]
    for name, options in PLACEMENTS.items():
        refusal = REFUSED.get((family, name))
        if name == "offload" and refusal is not None:
            continue  # refused where the store is built (the stores fixture asserts it)
        if refusal is not None:
            with pytest.raises(moeserve.MoeserveError, match=refusal):
                moeserve.LLM(path, **with_store(options, stores[family] or "missing-store"))
            continue
        llm = moeserve.LLM(path, **with_store(options, stores[family]))
        assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected, (family, name, llm.placement)


@pytest.fixture(scope="module")
def byte_store(byte_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("byte-store")
    ExpertStore.build(byte_model_dir, path, low_bits=4, group=16)
    return path


def cli(capsys, *argv) -> tuple[str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


@pytest.mark.parametrize("placement", list(FLAGS))
def test_every_placement_through_every_entry_point(capsys, byte_model_dir, byte_store, placement):
    """The byte-vocabulary model: `generate` (greedy, 16 tokens), `eval ppl` and moeserve.LLM give the resident
    model's text and perplexity in each placement (eval ppl's hybrid rows read the store too)."""
    flags = [f.format(store=byte_store) for f in FLAGS[placement]]
    resident = moeserve.LLM(byte_model_dir).generate(["To be, or"], GREEDY)[0]
    out, _ = cli(capsys, "generate", "--model", byte_model_dir, "--greedy", "--ignore-eos", "--max-new-tokens", 16,
                 "To be, or", *flags)
    assert out == f"To be, or{resident.text}\n"
    options = with_store(PLACEMENTS.get(placement, {}), byte_store)
    assert moeserve.LLM(byte_model_dir, **options).generate(["To be, or"], GREEDY)[0].text == resident.text
    if placement == "offload":  # eval runs HOBBIT's cache only as the hybrid's store
        flags = ["--cpu-moe", "--offload", str(byte_store)]
    ppl = json.loads(cli(capsys, "eval", "ppl", "--model", byte_model_dir, *flags)[0])["perplexity"]
    base = json.loads(cli(capsys, "eval", "ppl", "--model", byte_model_dir)[0])["perplexity"]
    assert ppl == pytest.approx(base, rel=1e-4)
