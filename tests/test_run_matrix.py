"""The run matrix: every family in every placement, every placement through every entry point, equal to the
resident model (fp32, CPU). Exact placements give the same greedy tokens; a refused cell asserts its one-line
refusal (and is a row of the README's table). Parallel placements (--ep/--tp under gloo) are covered by
tests/parallel (generate, eval ppl, serve)."""

from __future__ import annotations

import json
import shutil

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


# ---- moeserve quantized checkpoints -----------------------------------------------------------------------------
QUICK = SamplingParams(max_new_tokens=8, ignore_eos=True)
# (name, family, config overrides: fewer layers and experts, so that quantizing takes seconds; quantize flags)
QUANTIZED = [("mixtral-hqq4", "mixtral", dict(num_hidden_layers=2, num_local_experts=4),
              ["--bits", "4", "--group", "8", "--method", "hqq"]),
             ("qwen3_moe-hqq4", "qwen3_moe", dict(num_hidden_layers=2, num_experts=4, decoder_sparse_step=1),
              ["--bits", "4", "--group", "8", "--method", "hqq"]),
             ("deepseek_v3-hqq4", "deepseek_v3", dict(n_routed_experts=8),
              ["--bits", "4", "--group", "8", "--method", "hqq"]),
             ("mixtral-milo3", "mixtral", dict(num_hidden_layers=2, num_local_experts=4),  # INT3 compensators
              ["--bits", "3", "--group", "8", "--method", "milo", "--ranks", "experts=uniform:4", "--compensator-bits",
               "3", "--skip", "attention"])]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """name -> (its `moeserve quantize` checkpoint, the expert store `offload-prepare` built from it, the float
    checkpoint it was quantized from)."""
    from hf_models import build_hf_model

    out = {}
    for n, (name, family, overrides, flags) in enumerate(QUANTIZED):
        root = tmp_path_factory.mktemp(name)
        build_hf_model(family, seed=300 + n, **overrides).save_pretrained(root / "float")
        assert main(["quantize", "--model", str(root / "float"), "--out", str(root / "q"), *flags]) == 0
        assert main(["offload-prepare", "--model", str(root / "q"), "--out", str(root / "store")]) == 0
        out[name] = root / "q", root / "store", root / "float"
    return out


@pytest.mark.parametrize("name", [q[0] for q in QUANTIZED])
def test_quantized_checkpoint_in_every_placement_equals_resident(quantized, name):
    """A quantized checkpoint (HQQ, or MiLo with INT3 compensators) in --cpu-moe, --n-cpu-moe 1 with cache slots and
    --offload of its own store: the experts as stored, computed as the resident QuantizedExperts compute them, so
    the greedy tokens equal the resident model's."""
    path, store, _ = quantized[name]
    meta = ExpertStore.open(store).meta
    assert meta["low_bits"] == int(QUANTIZED[[q[0] for q in QUANTIZED].index(name)][3][1])
    assert meta["quantized"]["rank"] == (4 if "milo" in name else 0)
    g = torch.Generator().manual_seed(len(name))
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (7, 3)]
    expected = [r.token_ids for r in moeserve.LLM(path).generate(prompts, QUICK)]
    for placement, options in PLACEMENTS.items():
        llm = moeserve.LLM(path, **with_store(options, store))
        assert [r.token_ids for r in llm.generate(prompts, QUICK)] == expected, (name, placement, llm.placement)


def test_quantized_checkpoint_refusals(quantized):
    """Bits other than the stored ones, a quantized checkpoint's store for its float source and one of another
    quantization are refused in one line naming what is stored (a float store of the source serves its quantized
    checkpoints: tests/offload/test_offload.py)."""
    path, store, source = quantized["mixtral-hqq4"]
    with pytest.raises(moeserve.MoeserveError, match="quantized checkpoint of 4-bit experts.*--experts-bits 4"):
        moeserve.LLM(path, cpu_moe=True, experts_bits=3)
    with pytest.raises(moeserve.MoeserveError, match="4-bit experts \\(group 8\\).*give 4/8"):
        ExpertStore.build(path, store.parent / "other", low_bits=3)
    with pytest.raises(moeserve.MoeserveError, match="holds a moeserve quantized checkpoint's experts and .* is the "
                                                     "float checkpoint"):
        moeserve.LLM(source, **with_store(PLACEMENTS["offload"], store))
    other = shutil.copytree(store, store.parent / "requantized")  # as if from another quantization of the source
    meta = json.loads((other / "expert_store.json").read_text())
    meta["quantized"]["checkpoint"] = "0" * 64
    (other / "expert_store.json").write_text(json.dumps(meta))
    with pytest.raises(moeserve.MoeserveError, match="built from another quantized checkpoint"):
        moeserve.LLM(path, **with_store(PLACEMENTS["offload"], other))


def test_planner_counts_a_quantized_checkpoints_experts_as_stored(quantized):
    """--gpu-memory with a quantized checkpoint: the planner places its experts at the stored bits and group, the
    ledger's bytes of each MoE layer's experts equal the loaded QuantizedExperts' buffers, and it runs equal to
    the resident model."""
    from moeserve.plan.footprint import Precision, expert_bytes

    path = quantized["deepseek_v3-hqq4"][0]
    resident = moeserve.LLM(path)
    prompts = [[5, 9, 13, 22, 40]]
    llm = moeserve.LLM(path, gpu_memory="1GiB")
    assert llm.plan.hybrid is not None and (llm.plan.hybrid.bits, llm.plan.low_bits) == (4, 4)
    spec = resident.model.spec
    for i in spec.moe.layer_indices():
        buffers = sum(b.nbytes for b in resident.model.model.layers[i].mlp.experts.buffers())
        assert spec.moe.experts_at(i) * expert_bytes(spec, Precision.hqq(4, 8)) == buffers
    assert llm.generate(prompts, QUICK)[0].token_ids == resident.generate(prompts, QUICK)[0].token_ids


@pytest.fixture(scope="module")
def byte_quantized(byte_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("byte-q") / "q"
    assert main(["quantize", "--model", str(byte_model_dir), "--out", str(out), "--bits", "4", "--group", "16",
                 "--method", "hqq"]) == 0
    return out


def test_quantized_byte_model_through_generate_and_eval(capsys, byte_quantized):
    """`generate` and `eval ppl` of a quantized checkpoint with --cpu-moe give the resident model's text and
    perplexity."""
    capsys.readouterr()
    resident = moeserve.LLM(byte_quantized).generate(["To be, or"], GREEDY)[0]
    out, _ = cli(capsys, "generate", "--model", byte_quantized, "--greedy", "--ignore-eos", "--max-new-tokens", 16,
                 "To be, or", "--cpu-moe")
    assert out == f"To be, or{resident.text}\n"
    ppl = json.loads(cli(capsys, "eval", "ppl", "--model", byte_quantized, "--cpu-moe")[0])["perplexity"]
    base = json.loads(cli(capsys, "eval", "ppl", "--model", byte_quantized)[0])["perplexity"]
    assert ppl == pytest.approx(base, rel=1e-4)
