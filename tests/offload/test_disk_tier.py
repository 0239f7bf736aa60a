"""The disk tier (offload/disk_cache.py): a hybrid run over a store on disk with --cpu-memory smaller than the CPU
layers' experts gives the same greedy tokens as the run without the cap and the resident model, reads from disk,
and never holds more than the budget; the cache's reads equal the store's tensors (O_DIRECT and buffered); a budget
below one layer's top-k experts is refused in one line. CPU only (a GPU run pins the arena: test_gpu_disk_tier)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moeserve
from moeserve.cli import main
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.errors import MoeserveError
from moeserve.hybrid.placement import HybridPlacement
from moeserve.hybrid.setup import enable_hybrid, store_layers
from moeserve.kernels.cpu import gemv
from moeserve.offload import disk_cache
from moeserve.offload.disk_cache import DiskCache, minimum_budget, slot_bytes
from moeserve.offload.store import ExpertStore


@pytest.fixture(scope="module")
def store_dir(byte_model_dir, tmp_path_factory):
    """The byte model's store as `moeserve offload-prepare` writes it (float copies and 4-bit ones, group 32)."""
    out = tmp_path_factory.mktemp("disk") / "store"
    assert main(["offload-prepare", "--model", str(byte_model_dir), "--out", str(out), "--group", "32"]) == 0
    return out


def expert_total(store: ExpertStore, low: bool) -> int:
    """Bytes of every expert of the store at a precision, as the disk tier's slots hold them."""
    return slot_bytes(store, (low,)) * store.meta["num_experts"] * len(store.meta["layers"])


def greedy(model, prompts, n=8):
    return [r.token_ids for r in generate(model, prompts, SamplingParams(max_new_tokens=n, temperature=0.0))]


def hybrid_run(path, store, placement, disk_budget=None, **options):
    stored = set(store_layers(placement))
    model = moeserve.load_model(path, routed_experts=[i for i in placement.moe_layers if i not in stored])
    return model, enable_hybrid(model, store, placement, threaded=False, disk_budget=disk_budget, **options)


@pytest.mark.parametrize("direct", [True, False])
def test_cache_reads_equal_the_store_and_stay_in_budget(store_dir, direct):
    """Random lookups of both precisions: each expert's parts equal the mapped store's, bit for bit; the slots hold
    at most the budget; repeated lookups hit; what was evicted is read again."""
    store = ExpertStore.open(store_dir)
    layers = tuple(store.meta["layers"])
    budget = 3 * slot_bytes(store, (False, True)) + 100  # three slots, room for no fourth
    cache = DiskCache(store, layers, budget, (False, True), top_k=2, direct=direct)
    assert cache.slots == 3 and cache.arena.numel() <= budget
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        layer = layers[int(torch.randint(len(layers), (1,), generator=g))]
        e, low = int(torch.randint(store.meta["num_experts"], (1,), generator=g)), bool(torch.randint(2, (1,),
                                                                                                  generator=g))
        for got, want in zip(cache.parts(layer, e, low), store.host_parts(layer, e, low), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert cache.held_bytes <= budget
    st = cache.stats
    assert st.misses > 3 and st.hits > 0 and st.bytes_read >= st.misses * 1 and st.direct in (direct, False)
    hits = st.hits
    cache.parts(layers[0], 0, False)
    cache.parts(layers[0], 0, False)
    assert cache.stats.hits == hits + 1
    cache.close()


@pytest.mark.parametrize("bits", [16, 4])
def test_capped_run_equals_the_uncapped_and_resident(byte_model_dir, store_dir, bits):
    """--cpu-moe over the store with a RAM cap of about 2/3 of the experts it reads: greedy tokens equal the run
    without the cap (float: and the resident model's); disk reads happen, the cache stays within the cap."""
    store = ExpertStore.open(store_dir)
    layers = store.meta["layers"]
    placement = HybridPlacement.choose(layers, cpu_moe=True, bits=bits, num_experts=4)
    low = bits < 16
    cap = expert_total(store, low) * 2 // 3
    assert cap >= minimum_budget(store, (low,), 2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (9,), generator=g).tolist(), torch.randint(3, 250, (5,), generator=g).tolist()]
    tokens = torch.randint(3, 250, (2, 7), generator=g)
    model, _ = hybrid_run(byte_model_dir, store, placement)
    expected, logits = greedy(model, prompts), model(tokens)
    if not low:
        assert expected == greedy(moeserve.load_model(byte_model_dir), prompts)
    capped, runtime = hybrid_run(byte_model_dir, store, placement, disk_budget=cap)
    assert greedy(capped, prompts) == expected
    torch.testing.assert_close(capped(tokens), logits, atol=1e-5, rtol=1e-5)
    st = runtime.summary()
    assert st["disk_bytes_read"] > 0 and st["disk_misses"] > 0 and 0 < st["disk_hit_rate"] < 1
    assert st["disk_bytes_per_token"] > 0 and runtime.stats.tokens > 0
    assert runtime.disk.held_bytes <= cap and runtime.disk.arena.numel() <= cap
    runtime.close()


def test_low_bit_experts_are_kept_repacked_in_the_cache(byte_model_dir, store_dir, monkeypatch):
    """A 4-bit run through the disk tier keeps each low-bit expert in the CPU kernel's form: repacked once, at the miss
    that read it (gate_up and down: two repacks a miss), never at a hit nor by QuantizedLinear; greedy tokens equal
    the all-in-RAM run's, and so do the logits of a prompt long enough for the dequantized path (more than MAX_ROWS
    rows an expert: the parts unpacked from the kernel form); the slots hold that form within the cap."""
    store = ExpertStore.open(store_dir)
    placement = HybridPlacement.choose(store.meta["layers"], cpu_moe=True, bits=4, num_experts=4)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (9,), generator=g).tolist(), torch.randint(3, 250, (4,), generator=g).tolist()]
    long = torch.randint(3, 250, (1, 4 * gemv.MAX_ROWS), generator=g)
    model, _ = hybrid_run(byte_model_dir, store, placement)
    expected, logits = greedy(model, prompts), model(long)
    repacks = []
    pack = disk_cache.pack_for_cpu
    monkeypatch.setattr(disk_cache, "pack_for_cpu", lambda *a, **k: repacks.append(a[3]) or pack(*a, **k))
    monkeypatch.setattr(gemv, "pack_for_cpu", lambda *a, **k: pytest.fail("an expert repacked outside the cache"))
    cap = expert_total(store, True) * 2 // 3
    capped, runtime = hybrid_run(byte_model_dir, store, placement, disk_budget=cap)
    assert runtime.disk.kernel is not None and runtime.disk.slot_size == slot_bytes(store, (True,))
    assert greedy(capped, prompts) == expected
    st = runtime.disk.stats
    assert st.hits > 0 and st.misses > 0 and len(repacks) == 2 * st.misses and set(repacks) == {4}
    torch.testing.assert_close(capped(long), logits, atol=1e-5, rtol=1e-5)
    assert runtime.disk.held_bytes <= cap and runtime.disk.arena.numel() <= cap
    runtime.close()


def test_mixed_precision_through_the_disk_tier(byte_model_dir, store_dir):
    """A float run with HOBBIT's rule reads both copies through one cache: its output equals the uncapped run's
    (thresholds that put every second expert on its low-bit copy)."""
    store = ExpertStore.open(store_dir)
    placement = HybridPlacement.choose(store.meta["layers"], cpu_moe=True, mixed=True, num_experts=4)
    tokens = torch.randint(3, 250, (2, 7), generator=torch.Generator().manual_seed(4))
    model, _ = hybrid_run(byte_model_dir, store, placement, t1=0.3, t2=1.0)
    capped, runtime = hybrid_run(byte_model_dir, store, placement, disk_budget=expert_total(store, False) // 2,
                                 t1=0.3, t2=1.0)
    torch.testing.assert_close(capped(tokens), model(tokens), atol=1e-5, rtol=1e-5)
    assert runtime.summary()["low_pairs"] > 0 and runtime.disk.stats.misses > 0


def test_budget_below_the_minimum_is_refused(store_dir):
    store = ExpertStore.open(store_dir)
    need = minimum_budget(store, (False,), 2)
    with pytest.raises(MoeserveError, match="below the disk tier's minimum"):
        DiskCache(store, tuple(store.meta["layers"]), need - 1, (False,), top_k=2)


def test_cli_generate_and_bench_with_a_ram_cap(capsys, byte_model_dir, store_dir):
    """The command line: same text with and without --cpu-memory, the disk tier's stats line, bench's JSON."""
    base = ["generate", "--model", str(byte_model_dir), "--greedy", "--max-new-tokens", "6", "--ignore-eos",
            "--device", "cpu", "HAM", "--cpu-moe", "--offload", str(store_dir)]
    assert main(base) == 0
    expected = capsys.readouterr().out
    cap = str(expert_total(ExpertStore.open(store_dir), False) * 2 // 3)
    assert main(base + ["--cpu-memory", f"{cap}B"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected
    line = next(ln for ln in captured.err.splitlines() if ln.startswith("[disk tier:"))
    assert "read from disk" in line and "per token" in line
    assert main(["bench", "--model", str(byte_model_dir), "--device", "cpu", "--cpu-moe", "--offload", str(store_dir),
                 "--cpu-memory", f"{cap}B", "-p", "4", "-n", "3", "-r", "1", "--json"]) == 0
    disk = json.loads(capsys.readouterr().out)["disk_tier"]
    assert disk["disk_bytes_read"] > 0 and disk["disk_held_bytes"] <= int(cap)


def test_llm_takes_the_cap_as_a_keyword(byte_model_dir, store_dir):
    """LLM(..., cpu_memory=bytes) runs the disk tier: the same tokens as LLM without it."""
    options = dict(cpu_moe=True, offload=str(store_dir), device="cpu", context=32)
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    expected = [r.token_ids for r in moeserve.LLM(byte_model_dir, **options).generate([[5, 9, 200, 7]], params)]
    cap = expert_total(ExpertStore.open(store_dir), False) // 2
    llm = moeserve.LLM(byte_model_dir, cpu_memory=cap, **options)
    assert [r.token_ids for r in llm.generate([[5, 9, 200, 7]], params)] == expected
    assert llm.plan.disk_budget == cap and llm.runtime.hybrid.disk.stats.bytes_read > 0


def test_a_quantized_checkpoints_store_through_the_disk_tier(capsys, byte_model_dir, tmp_path):
    """A MiLo checkpoint's store (low-bit experts with compensators) read through a cache of 3/4 of its experts: the
    same text as over the mapped store."""
    q, store = tmp_path / "q", tmp_path / "qs"
    assert main(["quantize", "--model", str(byte_model_dir), "--out", str(q), "--bits", "4", "--group", "32",
                 "--method", "milo", "--ranks", "experts=4"]) == 0
    assert main(["offload-prepare", "--model", str(q), "--out", str(store)]) == 0
    base = ["generate", "--model", str(q), "--greedy", "--max-new-tokens", "8", "--ignore-eos", "--device", "cpu",
            "HAM", "--cpu-moe", "--offload", str(store)]
    capsys.readouterr()
    assert main(base) == 0
    expected = capsys.readouterr().out
    cap = expert_total(ExpertStore.open(store), True) * 3 // 4
    assert main(base + ["--cpu-memory", f"{cap}B"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected and "[disk tier:" in captured.err


def test_cli_errors(expect_cli_error, byte_model_dir, store_dir):
    gen = ["generate", "--model", byte_model_dir, "--max-new-tokens", "2", "--device", "cpu"]
    need = minimum_budget(ExpertStore.open(store_dir), (False,), 2)
    line = expect_cli_error(gen + ["--cpu-moe", "--offload", store_dir, "--cpu-memory", f"{need - 1}B"],
                            "below the disk tier's minimum", watch=store_dir)
    assert "give at least" in line
    expect_cli_error(gen + ["--cpu-moe", "--cpu-memory", "1GiB"], "needs --offload STORE")
    expect_cli_error(gen + ["--cpu-moe", "--offload", store_dir, "--cpu-memory", "100000GiB"], "of host RAM available",
                     watch=store_dir)
    expect_cli_error(gen + ["--cpu-moe", "--offload", store_dir, "--cpu-memory", "lots"], "is not a size",
                     watch=store_dir)
    expect_cli_error(gen + ["--cpu-moe", "--offload", store_dir, "--cpu-memory", "1GiB", "--gpu-cache-experts", "2"],
                     "does not combine with --gpu-cache-experts", watch=store_dir)


def test_bench_script_quick(tmp_path):
    """bench/disk_tier.py --quick: a random store 1.5x the RAM cap, the same tokens as the all-in-RAM run, tok/s and
    bytes read per token in its JSON."""
    script = Path(__file__).resolve().parents[2] / "bench" / "disk_tier.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(script), "--quick", "--threads", "1", "--out", str(tmp_path),
                           "--dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = json.loads(next(tmp_path.glob("disk_tier-quick-*.json")).read_text())["results"]
    assert result["same_tokens"] and result["store_expert_bytes"] >= 1.49 * result["cpu_memory"]
    assert result["disk_tg_tokens_per_s"] > 0 and result["tg_disk_bytes_per_token"] > 0
    assert result["disk_held_bytes"] <= result["cpu_memory"]


def test_a_filesystem_without_o_direct_reads_through_the_page_cache(store_dir, monkeypatch, capsys):
    """Where O_DIRECT is refused the cache says so in one note and reads buffered, the same bytes."""
    monkeypatch.setattr(DiskCache, "_open_direct", lambda self, layers: False)
    store = ExpertStore.open(store_dir)
    cache = DiskCache(store, tuple(store.meta["layers"]), 1 << 20, (False,), top_k=2)
    assert not cache.stats.direct and "refuses O_DIRECT" in capsys.readouterr().err
    for got, want in zip(cache.parts(store.meta["layers"][-1], 3, False), store.host_parts(store.meta["layers"][-1],
                                                                                              3, False), strict=True):
        assert torch.equal(got, want)
    cache.close()
