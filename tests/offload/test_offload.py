"""Offloaded experts (store -> cache -> backend) against the resident model and the simulator."""

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import moeserve
from moeserve.cli import main
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.errors import MoeserveError
from moeserve.kernels.pack import units_from_planar
from moeserve.offload.setup import enable_offload
from moeserve.offload.policies import POLICIES, CachePolicy
from moeserve.offload.simulate import simulate
from moeserve.offload.store import META_FILE, ExpertStore


@pytest.fixture(scope="module")
def tiny(hf_checkpoints, tmp_path_factory):
    _, path = hf_checkpoints["mixtral"]
    store_dir = tmp_path_factory.mktemp("store")
    ExpertStore.build(path, store_dir, low_bits=4, group=16, progress=False)
    return path, store_dir


def greedy(model, prompts, n=8):
    return [r.token_ids for r in generate(model, prompts, SamplingParams(max_new_tokens=n, temperature=0.0))]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_forced_high_offload_equals_resident_for_every_policy_and_size(tiny, policy):
    path, store_dir = tiny
    resident = moeserve.load_model(path)
    prompts = [torch.randint(3, 97, (7,)).tolist(), torch.randint(3, 97, (4,)).tolist()]
    tokens = torch.randint(3, 97, (2, 9))
    expected, ref_logits = greedy(resident, prompts), resident(tokens)
    n_experts = resident.spec.num_layers * resident.spec.moe.num_experts
    for slots in (0, 1, 3, n_experts):
        model = moeserve.load_model(path, routed_experts=False)
        cache = enable_offload(model, ExpertStore.open(store_dir), high_slots=slots, policy=policy, mixed=False)
        assert greedy(model, prompts) == expected
        torch.testing.assert_close(model(tokens), ref_logits, atol=1e-5, rtol=1e-5)
        assert cache.stats.skipped == 0 and cache.stats.low_misses == 0
        assert len(cache.resident[0]) <= slots
        if slots == n_experts:
            assert cache.stats.high_misses == len({k for k in cache.state.stats})  # each expert loaded once


def test_simulator_agrees_with_the_real_cache(tiny):
    path, store_dir = tiny
    model = moeserve.load_model(path, routed_experts=False)
    cache = enable_offload(model, ExpertStore.open(store_dir), high_slots=3, low_slots=2, policy="hobbit",
                           t1=0.55, t2=0.7)  # top-2: s = top weight in [.5, 1]: highs, lows, skips
    for prompt in ([5, 6, 7, 8], [9, 10, 11]):
        cache.new_sequence()
        greedy(model, [prompt], n=10)
    sim = simulate(cache.trace(model.spec.num_layers, model.spec.moe.num_experts), CachePolicy.named("hobbit", 3), 3, 2,
                   t1=0.55, t2=0.7)
    real = cache.stats
    assert (real.requests, real.hits, real.high_misses, real.low_misses, real.skipped) == (
        sim.requests, sim.hits, sim.high_misses, sim.low_misses, sim.skipped)
    assert real.miss_penalty == pytest.approx(sim.miss_penalty) and real.low_misses > 0 and real.skipped > 0


def test_store_round_trip(tiny, tmp_path):
    path, store_dir = tiny
    built = ExpertStore.open(store_dir)
    in_memory = ExpertStore.from_model(moeserve.load_model(path), low_bits=4, group=16)
    in_memory.save(tmp_path / "s")
    saved = ExpertStore.open(tmp_path / "s")
    for store in (in_memory, saved):
        for low in (False, True):
            a, b = built.host_parts(1, 2, low), store.host_parts(1, 2, low)
            assert len(a) == (6 if low else 2)  # gate_up, down: (qweight, scale, zero) each, or the float weights
            for x, y in zip(a, b):
                assert torch.equal(x, y)
    with pytest.raises(MoeserveError, match="not an expert store"):
        ExpertStore.open(tmp_path)
    three = ExpertStore.from_model(moeserve.load_model(path), low_bits=3, group=16)
    three.save(tmp_path / "s3")
    assert ExpertStore.open(tmp_path / "s3").meta["low_bits"] == 3


def test_store_of_older_3bit_layouts(tiny, tmp_path):
    """Layout 2 (3-bit rows unit after unit) is read through a permutation; layout 1 (codes in order) is refused."""
    from safetensors.torch import load_file, save_file

    path, _ = tiny
    three = ExpertStore.from_model(moeserve.load_model(path), low_bits=3, group=16)
    three.save(tmp_path / "s")
    moved = 0
    for f in (tmp_path / "s").glob("*.safetensors"):
        state = load_file(f)
        old = {k: units_from_planar(t) if k.endswith(".qweight") else t for k, t in state.items()}
        moved += sum(not torch.equal(old[k], state[k]) for k in state)
        save_file(old, f)
    assert moved  # rows of several units: the stored words differ from those of layout 3
    meta = json.loads((tmp_path / "s" / META_FILE).read_text())
    del meta["source"]  # stores of those layouts predate the recorded provenance
    (tmp_path / "s" / META_FILE).write_text(json.dumps({**meta, "pack_layout": 2}))
    older = ExpertStore.open(tmp_path / "s")
    first = older.meta["layers"][0]
    assert older.host_parts(first, 0, True)[0] is older.host_parts(first, 0, True)[0]  # converted once (CpuExperts)
    older.save(tmp_path / "resaved")  # written in this moeserve's layout
    for store in (older, ExpertStore.open(tmp_path / "resaved")):
        for layer in three.meta["layers"]:
            for e in range(three.meta["num_experts"]):
                for a, b in zip(three.host_parts(layer, e, True), store.host_parts(layer, e, True)):
                    assert torch.equal(a, b)
    del meta["pack_layout"]  # a store of the first 3-bit layout (codes in order)
    (tmp_path / "s" / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(MoeserveError, match="offload-prepare"):
        ExpertStore.open(tmp_path / "s")


def store_parts(store: ExpertStore) -> dict:
    return {(layer, e, low): store.host_parts(layer, e, low) for layer in store.meta["layers"]
            for e in range(store.meta["num_experts"]) for low in (False, True)}


def assert_same_store(a: ExpertStore, b: ExpertStore) -> None:
    pa, pb = store_parts(a), store_parts(b)
    assert pa.keys() == pb.keys() and a.meta["low_bits"] == b.meta["low_bits"]
    for key in pa:
        assert all(torch.equal(x, y) for x, y in zip(pa[key], pb[key])), key


def test_rebuilt_store_reuses_only_layers_of_the_same_source_and_settings(capsys, byte_model_dir, tmp_path,
                                                                          monkeypatch):
    """offload-prepare into an existing store: other --low-bits or another --model of the same shapes rebuild
    every layer (the result equals a fresh build); an interrupted build of the same job resumes."""
    from hf_models import save_byte_model
    from moeserve.offload import store as store_module

    twin = save_byte_model(tmp_path / "twin", seed=1)
    out = tmp_path / "s"
    prepare = ["offload-prepare", "--model", str(byte_model_dir), "--out", str(out), "--group", "32"]
    assert main(prepare + ["--low-bits", "3"]) == 0
    assert main(prepare + ["--low-bits", "2"]) == 0
    assert_same_store(ExpertStore.open(out), ExpertStore.build(byte_model_dir, tmp_path / "fresh2", low_bits=2,
                                                               group=32, progress=False))
    assert main(["offload-prepare", "--model", str(twin), "--out", str(out), "--group", "32", "--low-bits", "2"]) == 0
    twin_store = ExpertStore.build(twin, tmp_path / "twin2", low_bits=2, group=32, progress=False)
    assert_same_store(ExpertStore.open(out), twin_store)
    capsys.readouterr()

    real, calls = store_module.layer_tensors, []

    def dies_in_layer_1(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(store_module, "layer_tensors", dies_in_layer_1)
    with pytest.raises(KeyboardInterrupt):
        ExpertStore.build(byte_model_dir, tmp_path / "r", low_bits=4, group=32, progress=False)
    assert not (tmp_path / "r" / META_FILE).exists()
    with pytest.raises(MoeserveError, match="incomplete"):
        ExpertStore.open(tmp_path / "r")
    calls.clear()
    resumed = ExpertStore.build(byte_model_dir, tmp_path / "r", low_bits=4, group=32, progress=False)
    assert len(calls) == 1  # layer 0 proven and kept, layer 1 built
    monkeypatch.undo()
    assert_same_store(resumed, ExpertStore.build(byte_model_dir, tmp_path / "fresh4", low_bits=4, group=32,
                                                 progress=False))


def test_cli_offload(capsys, byte_model_dir, hf_checkpoints, tmp_path):
    store = tmp_path / "store"
    assert main(["offload-prepare", "--model", str(byte_model_dir), "--out", str(store), "--group", "32"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == 2
    base = ["generate", "--model", str(byte_model_dir), "--greedy", "--max-new-tokens", "6", "--offload", str(store)]
    assert main(base + ["--high-slots", "2", "--low-slots", "2"]) == 0
    assert "expert cache" in capsys.readouterr().err
    assert main(base + ["--memory", "1KB"]) == 2 and "at least" in capsys.readouterr().err
    assert main(base) == 2 and "--gpu-memory" in capsys.readouterr().err
    assert main(base + ["--high-slots", "2", "--policy", "mru"]) == 2 and "unknown policy" in capsys.readouterr().err
    other = tmp_path / "olmoe"  # with a tokenizer: generate checks the prompts before it loads anything
    shutil.copytree(hf_checkpoints["olmoe"][1], other)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(other / "tokenizer.json"))
    assert main(["generate", "--model", str(other), "--max-new-tokens", "2", "--offload", str(store),
                 "--high-slots", "1"]) == 2
    assert "another model" in capsys.readouterr().err


def test_quantized_checkpoint_runs_with_the_store_of_its_source(capsys, byte_model_dir, tmp_path):
    """A moeserve quantized checkpoint stores its experts low-bit; its manifest records its source's sampled
    expert rows, so the store built from that source is accepted."""
    from moeserve.compress import QuantConfig, quantize_checkpoint

    quantize_checkpoint(byte_model_dir, tmp_path / "q", QuantConfig(bits=8, group=16, method="rtn"), progress=False)
    ExpertStore.build(byte_model_dir, tmp_path / "s", low_bits=4, group=32, progress=False)
    assert main(["generate", "--model", str(tmp_path / "q"), "--offload", str(tmp_path / "s"), "--high-slots", "2",
                 "--max-new-tokens", "3", "--greedy"]) == 0
    assert "expert cache" in capsys.readouterr().err


@pytest.mark.parametrize("mixed", [False, True])
def test_prefetch_never_changes_outputs(tiny, mixed):
    path, store_dir = tiny
    prompts = [torch.randint(3, 97, (6,)).tolist()]
    runs = {}
    for n in (0, 2):
        model = moeserve.load_model(path, routed_experts=False)
        cache = enable_offload(model, ExpertStore.open(store_dir), high_slots=4, low_slots=4, mixed=mixed,
                               t1=0.55, t2=0.7, prefetch_layers=n)
        runs[n] = (greedy(model, prompts, n=12), cache)
    assert runs[0][0] == runs[2][0]
    assert runs[2][1].prefetched > 0 and runs[0][1].prefetched == 0
    cache = runs[2][1]
    assert 0 < cache.prefetch_used <= cache.prefetched  # some predictions were used before eviction
    assert cache.summary()["prefetch_accuracy"] == cache.prefetch_used / cache.prefetched


def test_cooperative_cpu_experts_give_the_same_outputs(tiny, monkeypatch):
    """Every miss computed on the CPU (forced): same logits as resident, no bytes moved for them."""
    from moeserve.offload.slot_cache import SlotCache

    path, store_dir = tiny
    tokens = torch.randint(3, 97, (2, 7))
    expected = moeserve.load_model(path)(tokens)
    model = moeserve.load_model(path, routed_experts=False)
    cache = enable_offload(model, ExpertStore.open(store_dir), high_slots=2, policy="lru", mixed=False,
                           cooperative=True)
    monkeypatch.setattr(SlotCache, "_cpu_is_faster", lambda self, low, rows, busy: rows % 2 == 1)  # some of each
    torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=1e-5)
    st = cache.summary()
    assert 0 < st["cpu_experts"] < st["requests"] - st["hits"]
    assert st["bytes_moved"] == (st["high_misses"] - st["cpu_experts"]) * cache.store.expert_bytes(False)
    assert cache.cpu.cost(True, 1) > 0 and cache.cpu.cost(False, 16) >= cache.cpu.cost(False, 1)


def test_store_pinning_falls_back_to_mapped_memory(tiny, monkeypatch):
    _, store_dir = tiny
    store = ExpertStore.open(store_dir)
    before = [p.clone() for p in store.host_parts(2, 3, low=True)]
    calls = []

    def pin_memory(self):  # pinned memory runs out after the first layer
        calls.append(1)
        if len(calls) > len(store.part_names(0, False) + store.part_names(0, True)) * store.meta["num_experts"]:
            raise RuntimeError("CUDA error: out of memory")
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    with pytest.warns(UserWarning, match="could not pin the expert store past layer 1"):
        assert store.pin() == 1
    for a, b in zip(before, store.host_parts(2, 3, low=True)):
        assert torch.equal(a, b)


def test_prefetch_stops_when_predictions_are_mostly_wrong(tiny):
    """A predictor naming every expert of the next layer is right for top_k / E of them: the adaptive gate
    cuts prefetching down, and wrong guesses are released for eviction once their layer has run."""
    path, store_dir = tiny
    prompts = [torch.randint(3, 97, (5,)).tolist()]
    runs = {}
    for min_accuracy in (0.0, 0.5):
        model = moeserve.load_model(path, routed_experts=False)
        cache = enable_offload(model, ExpertStore.open(store_dir), high_slots=6, mixed=False, prefetch_layers=1,
                               prefetch_min_accuracy=min_accuracy)
        for layer in model.model.layers:
            ex = layer.mlp.experts
            ex.predict_next = lambda x, ex=ex: [(ex.next_layers[0], e) for e in range(ex.num_experts)] \
                if ex.next_layers else []
        runs[min_accuracy] = (greedy(model, prompts, n=12), cache)
        assert not cache.state.pinned - cache.unused_prefetches  # settled guesses are evictable
    assert runs[0.0][0] == runs[0.5][0]
    assert runs[0.5][1].prefetched < runs[0.0][1].prefetched / 2


def test_per_layer_cache_equals_resident_and_keeps_each_layers_share(tiny):
    path, store_dir = tiny
    tokens = torch.randint(3, 97, (2, 7))
    expected = moeserve.load_model(path)(tokens)
    model = moeserve.load_model(path, routed_experts=False)
    cache = enable_offload(model, ExpertStore.open(store_dir), high_slots=4, policy="lru", mixed=False, per_layer=True)
    torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=1e-5)
    per_layer = [sum(1 for k in cache.resident[0] if k[0] == layer) for layer in range(model.spec.num_layers)]
    assert per_layer == [2, 1, 1]  # 4 slots over 3 layers
