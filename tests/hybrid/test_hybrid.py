"""The hybrid expert backend (experts computed on the CPU where they lie, an optional slot cache) against the
resident model, on the CPU: exact greedy tokens for every family and split, with and without the cache; the
command line's flags, placement line and errors. GPU: tests/test_gpu_hybrid.py."""

import json

import pytest
import torch
from hf_models import FAMILIES

import moeserve
from moeserve.cli import main
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.errors import MoeserveError
from moeserve.hybrid import memory
from moeserve.plan.footprint import Precision, expert_bytes, footprint, hybrid_layout
from moeserve.hybrid.placement import HybridPlacement
from moeserve.hybrid.setup import build_store, enable_hybrid, store_layers
from moeserve.hybrid.worker import CpuWorker
from moeserve.model.paths import EXPERT_PATHS, GRAPH_SAFE, explain
from moeserve.offload.cache_state import CacheState
from moeserve.offload.policies import CachePolicy
from moeserve.offload.precision import HIGH
from moeserve.offload.store import ExpertStore


def greedy(model, prompts, n=8):
    return [r.token_ids for r in generate(model, prompts, SamplingParams(max_new_tokens=n, temperature=0.0))]


def moe_layers(spec) -> list[int]:
    return [i for i, moe in enumerate(spec.moe.layers) if moe]


def hybrid_model(path, placement: HybridPlacement, store: ExpertStore | None = None, **options):
    """The model of `path` with the placement's CPU layers hybrid; (model, runtime)."""
    stored = set(store_layers(placement))
    model = moeserve.load_model(path, routed_experts=[i for i in placement.moe_layers if i not in stored])
    store = store or build_store(path, placement, model.dtype, model.device, progress=False)
    return model, enable_hybrid(model, store, placement, **options)


@pytest.fixture(scope="module")
def references(hf_checkpoints):
    """family -> (prompts, resident greedy tokens, tokens, resident logits)."""
    out = {}
    g = torch.Generator().manual_seed(0)
    for fam in FAMILIES:
        resident = moeserve.load_model(hf_checkpoints[fam][1])
        prompts = [torch.randint(3, 97, (7,), generator=g).tolist(), torch.randint(3, 97, (4,), generator=g).tolist()]
        tokens = torch.randint(3, 97, (2, 9), generator=g)
        out[fam] = (prompts, greedy(resident, prompts), tokens, resident(tokens))
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("slots", [0, 3])
def test_hybrid_equals_resident_for_every_split(hf_checkpoints, references, family, slots):
    """fp32, mixed precision off: greedy tokens equal the resident model's, logits agree to fp32 rounding, with 0,
    some and all MoE layers' experts on the CPU, static (slots 0) or with a slot cache that fills as experts are
    used (so later calls run some experts in slots, some on the CPU)."""
    path = hf_checkpoints[family][1]
    prompts, expected, tokens, logits = references[family]
    layers = moe_layers(moeserve.load_model(path, routed_experts=False).spec)
    for n in sorted({0, 1, len(layers)}):
        placement = HybridPlacement.choose(layers, n_cpu_moe=n, cache_slots=slots, num_experts=8)
        model, runtime = hybrid_model(path, placement)
        assert greedy(model, prompts) == expected, (family, n, slots)
        torch.testing.assert_close(model(tokens), logits, atol=1e-5, rtol=1e-5)
        st = runtime.summary()
        assert st["skipped"] == st["low_pairs"] == 0
        assert (st["cpu_pairs"] > 0) == (n > 0)
        if slots and n:
            assert st["gpu_pairs"] > 0 and 0 < st["admitted"] and len(runtime.cache.pool.slot_of) <= slots


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bits", [16, 4])
def test_streamed_prompts_equal_the_cpu_path(hf_checkpoints, references, monkeypatch, family, bits):
    """Prompts of stream_from+ tokens stream their CPU layers' experts through the ring (on the CPU here: the same
    pass as on a GPU, copies are plain memcpys) and decode steps run on the CPU: fp32 greedy tokens and logits equal
    the resident model's (float experts) or the unstreamed hybrid run's (4-bit experts: same HQQ copies, the CPU's
    kernels against the slots' modules), with and without a slot cache; the ring (2 slots) is reused within a
    layer. One store serves every run."""
    monkeypatch.setattr(memory, "STREAM_RING_BYTES", 1)  # the smallest ring: 2 slots
    path = hf_checkpoints[family][1]
    prompts, expected, tokens, logits = references[family]
    spec = moeserve.load_model(path, routed_experts=False).spec
    layers = moe_layers(spec)
    if bits != 16 and (spec.hidden_size % 16 or spec.moe.expert_ffn % 16):
        pytest.skip(f"{family}'s tiny shape has no HQQ group (low-bit experts are refused by name)")
    unstreamed = HybridPlacement.choose(layers, cpu_moe=True, bits=bits, stream_from=0)
    store = build_store(path, unstreamed, torch.float32, torch.device("cpu"), progress=False)
    if bits != 16:
        model, _ = hybrid_model(path, unstreamed, store)
        expected, logits = greedy(model, prompts), model(tokens)
    for slots in (0, 2):
        placement = HybridPlacement.choose(layers, cpu_moe=True, cache_slots=slots, bits=bits, stream_from=4,
                                           num_experts=8)
        model, runtime = hybrid_model(path, placement, store, stream=True)
        assert runtime.streamer.pool.num_slots == 2
        assert greedy(model, prompts) == expected, (family, bits, slots)
        torch.testing.assert_close(model(tokens), logits, atol=2e-5, rtol=2e-5)
        st = runtime.summary()
        assert st["streamed_pairs"] > 0 and st["experts_streamed"] > len(layers) * 2  # more than the ring's slots
        model(tokens[:, :1])  # 2 tokens: below stream_from, on the CPU (or in a slot)
        after = runtime.summary()
        assert after["streamed_pairs"] == st["streamed_pairs"]
        assert after["cpu_pairs"] + after["gpu_pairs"] > st["cpu_pairs"] + st["gpu_pairs"]


def test_worker_thread_gives_the_same_output(hf_checkpoints, references):
    """The CPU experts on the worker thread (as with a GPU model) under the caller's inference mode."""
    path = hf_checkpoints["qwen2_moe"][1]
    prompts, expected, tokens, logits = references["qwen2_moe"]
    layers = moe_layers(moeserve.load_model(path, routed_experts=False).spec)
    model, runtime = hybrid_model(path, HybridPlacement.choose(layers, cpu_moe=True, cache_slots=2), threaded=True)
    assert not runtime.worker.inline
    assert greedy(model, prompts) == expected
    torch.testing.assert_close(model(tokens), logits, atol=1e-5, rtol=1e-5)
    runtime.close()


def test_worker_runs_jobs_on_one_thread_and_raises_their_errors():
    worker = CpuWorker(threads=1)
    names = {worker.submit(lambda: __import__("threading").current_thread().name).result() for _ in range(3)}
    assert len(names) == 1 and names.pop().startswith("moeserve-cpu-experts")
    with torch.inference_mode():
        assert worker.submit(torch.is_inference_mode_enabled).result()
    with pytest.raises(ZeroDivisionError):
        worker.submit(lambda: 1 / 0).result()
    worker.close()
    assert CpuWorker(inline=True).submit(lambda a: a + 1, 1).result() == 2


@pytest.mark.parametrize("policy", ["lru", "hobbit", "static"])
def test_cache_policies_give_the_same_tokens(hf_checkpoints, references, policy):
    path = hf_checkpoints["mixtral"][1]
    prompts, expected, _, _ = references["mixtral"]
    placement = HybridPlacement.choose([0, 1, 2], cpu_moe=True, cache_slots=4, policy=policy)
    model, runtime = hybrid_model(path, placement)
    assert greedy(model, prompts) == expected
    assert runtime.summary()["gpu_pairs"] > 0


def test_admission_only_when_hotter_keeps_the_most_used_experts():
    """static (LFU priority, admit only above the victim): a newcomer used less than every cached expert stays out."""
    state = CacheState(CachePolicy.named("lfu", 1), 2, 0)
    for key, uses in (((0, 1), 3), ((0, 2), 2)):
        for _ in range(uses):
            state.start_event(0)
            state.request(key, HIGH, {key}, admit=True)
    state.start_event(0)
    state.request((0, 3), HIGH, {(0, 3)}, admit=False)
    assert not state.admit((0, 3), HIGH, {(0, 3)}).keep  # 1 use < 2
    for _ in range(2):
        state.start_event(0)
        state.request((0, 3), HIGH, {(0, 3)}, admit=False)
    d = state.admit((0, 3), HIGH, {(0, 3)})
    assert d.keep and d.evicted == (0, 2)  # 3 uses > 2
    lru = CacheState(CachePolicy.named("lru", 1), 1, 0)
    lru.request((0, 1), HIGH, set(), admit=True)
    lru.start_event(0)
    lru.request((0, 2), HIGH, {(0, 2)}, admit=False)
    assert lru.admit((0, 2), HIGH, {(0, 2)}).keep  # LRU: the expert just used always ranks first
    sampled = CacheState(CachePolicy.named("lru", 1), 6, 0, victim_sample=2)  # victims drawn from 2 of the 6
    for e in range(6):
        sampled.start_event(0)
        sampled.request((0, e), HIGH, set(), admit=True)
    sampled.start_event(0)
    sampled.request((0, 9), HIGH, {(0, 9)}, admit=False)
    d = sampled.admit((0, 9), HIGH, {(0, 9), (0, 0)})
    assert d.keep and d.evicted not in (None, (0, 0)) and len(sampled.pools[HIGH]) == 6


def test_mixed_precision_runs_low_bit_and_skips(hf_checkpoints, references):
    path = hf_checkpoints["qwen2_moe"][1]  # top-3: some second and third experts are low-bit, some skipped
    _, _, tokens, logits = references["qwen2_moe"]
    layers = moe_layers(moeserve.load_model(path, routed_experts=False).spec)
    model, runtime = hybrid_model(path, HybridPlacement.choose(layers, cpu_moe=True, mixed=True),
                                  t1=0.3, t2=0.6)
    out = model(tokens)
    st = runtime.summary()
    assert st["low_pairs"] > 0 and st["skipped"] > 0
    assert (out - logits).abs().max() < 0.5 * logits.abs().max()  # an approximation, not garbage


def test_low_bit_experts_agree_on_the_cpu_in_slots_and_resident(hf_checkpoints):
    """--experts-bits 4: the same HQQ copies computed on the CPU, in cache slots, and resident (QuantizedExperts)."""
    path = hf_checkpoints["mixtral"][1]
    tokens = torch.randint(3, 97, (2, 7))
    store = build_store(path, HybridPlacement.choose([0, 1, 2], cpu_moe=True, bits=4), torch.float32,
                        torch.device("cpu"), progress=False)
    assert store.meta["low_bits"] == 4
    with pytest.raises(KeyError):  # no float copies
        store.host_parts(0, 0, low=False)
    outs = []
    for n, slots in ((3, 0), (3, 24), (1, 0), (0, 0)):
        placement = HybridPlacement.choose([0, 1, 2], n_cpu_moe=n, cache_slots=slots, bits=4)
        model, runtime = hybrid_model(path, placement, store)
        model(tokens)  # fills the slots
        outs.append(model(tokens))
        assert all(type(model.model.layers[i].mlp.experts).__name__ == "QuantizedExperts" for i in range(n, 3))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-4, rtol=1e-4)


def test_low_bit_layer_runs_in_one_native_call(byte_model_dir, monkeypatch):
    """4-bit experts on the CPU: each hybrid layer call is one native call (moe_layer: both projections of every
    routed expert), with the same tokens as the experts resident (QuantizedExperts: one kernel call per expert and
    projection); threaded (as with a GPU model) the call starts on the native helpers and the caller waits later."""
    from moeserve.kernels.cpu import gemv
    from moeserve.offload import host_compute

    if gemv.default_kernel(4) is None:
        pytest.skip("no C compiler for the generated CPU kernels here")
    calls = []

    def counted(kernel, experts, x, *args, start=False):
        calls.append((x.shape[0], start))
        return gemv.moe_layer(kernel, experts, x, *args, start=start)

    monkeypatch.setattr(host_compute, "moe_layer", counted)
    store = ExpertStore.from_checkpoint(byte_model_dir, low_bits=4, group=32, high=False, progress=False)
    prompts = [[72, 65, 77], [75, 73]]
    runs = []
    for n, threaded in ((2, False), (0, False), (2, True)):
        placement = HybridPlacement.choose([0, 1], n_cpu_moe=n, bits=4, threads=3)
        model, runtime = hybrid_model(byte_model_dir, placement, store, threaded=threaded)
        runs.append(greedy(model, prompts))
        runtime.close()
    assert runs[0] == runs[1] == runs[2]
    inline, started = [t for t, s in calls if not s], [t for t, s in calls if s]
    assert len(inline) >= 2 * 8 and max(inline) > 1  # both layers at every step, prefill rows included
    assert len(started) == len(inline)


def test_placement_checks_and_line():
    layers = list(range(32))
    with pytest.raises(MoeserveError, match="outside the model's 32 MoE layers"):
        HybridPlacement.choose(layers, n_cpu_moe=33)
    with pytest.raises(MoeserveError, match="cannot be combined"):
        HybridPlacement.choose(layers, cpu_moe=True, n_cpu_moe=3)
    with pytest.raises(MoeserveError, match="unknown cache policy"):
        HybridPlacement.choose(layers, cpu_moe=True, policy="mru")
    with pytest.raises(MoeserveError, match="--experts-bits 5"):
        HybridPlacement.choose(layers, cpu_moe=True, bits=5)
    p = HybridPlacement.choose(layers, n_cpu_moe=24, cache_slots=16, threads=16)
    assert p.cpu_layers == tuple(range(24))
    assert p.describe("cuda", "bfloat16") == ("[placement: hybrid, 24/32 MoE layers' experts on CPU (bfloat16), "
                                              "16 GPU cache slots (policy hobbit), 16 CPU threads, prompts of "
                                              "32+ tokens stream experts to the GPU]")
    assert "prompts on the CPU" in HybridPlacement.choose(layers, cpu_moe=True, stream_from=0).describe("cuda", "bf16")
    with pytest.raises(MoeserveError, match="--stream-from must be >= 0"):
        HybridPlacement.choose(layers, cpu_moe=True, stream_from=-1)
    assert "no GPU" in HybridPlacement.choose(layers, cpu_moe=True).describe("cpu", "float32")
    assert HybridPlacement.choose([0, 1], cpu_moe=True, cache_slots=100, num_experts=8).cache_slots == 16


def test_a_placement_naming_a_dense_layer_is_refused(hf_checkpoints):
    """DeepSeek-V2-Lite's first layer is dense: a placement over every layer instead of the MoE layers is refused by
    name before any layer changes (it would leave that layer dense and count experts it never runs)."""
    path = hf_checkpoints["deepseek_v2_lite"][1]
    model = moeserve.load_model(path, routed_experts=False)
    store = ExpertStore.from_checkpoint(path, low_bits=0, progress=False)
    placement = HybridPlacement.choose(list(range(model.spec.num_layers)), cpu_moe=True)
    before = [layer.mlp.experts for layer in model.model.layers[1:]]
    with pytest.raises(MoeserveError, match=r"names layers \[0\], which have a dense FFN .* MoE layers \[1, 2\]"):
        enable_hybrid(model, store, placement)
    assert [layer.mlp.experts for layer in model.model.layers[1:]] == before
    assert not hasattr(model.model.layers[0].mlp, "experts")


def test_host_bytes_match_the_store(hf_checkpoints):
    path = hf_checkpoints["mixtral"][1]
    spec = moeserve.load_model(path, routed_experts=False).spec
    store = ExpertStore.from_checkpoint(path, low_bits=4, group=16, progress=False)
    assert expert_bytes(spec, Precision.float(4)) == store.expert_bytes(False)
    assert expert_bytes(spec, Precision.hqq(4, 16)) == store.expert_bytes(True)
    mixed = HybridPlacement.choose([0, 1, 2], n_cpu_moe=2, mixed=True)
    need = footprint(spec, hybrid_layout(spec, mixed, "cpu", 4, 1, 1, 4, 16)).host["expert store"]
    assert need == 2 * 8 * (store.expert_bytes(False) + 2 * store.expert_bytes(True))


def test_only_the_named_layers_experts_are_read(hf_checkpoints):
    model = moeserve.load_model(hf_checkpoints["mixtral"][1], routed_experts=[1])
    assert [model.model.layers[i].mlp.experts.gate_up_proj.is_meta for i in range(3)] == [True, False, True]


def test_path_is_named_and_not_graph_safe(hf_checkpoints):
    path = hf_checkpoints["olmoe"][1]
    model, _ = hybrid_model(path, HybridPlacement.choose([0, 1, 2], n_cpu_moe=2))
    assert "hybrid" in EXPERT_PATHS and "hybrid" not in GRAPH_SAFE
    assert [p.experts for p in explain(model, (1,))] == [{1: "hybrid"}, {1: "hybrid"}, {1: "loop"}]


# ---- command line ---------------------------------------------------------------------------------------------


def test_cli_generate_and_eval_hybrid(capsys, byte_model_dir, tmp_path):
    base = ["generate", "--model", str(byte_model_dir), "--greedy", "--max-new-tokens", "6", "--ignore-eos",
            "--device", "cpu", "HAM"]
    assert main(base) == 0
    resident = capsys.readouterr().out
    for extra in (["--cpu-moe"], ["--n-cpu-moe", "1", "--gpu-cache-experts", "2", "--cpu-threads", "1"]):
        assert main(base + extra) == 0
        captured = capsys.readouterr()
        assert captured.out == resident
        lines = [ln for ln in captured.err.splitlines() if ln.startswith("[placement:")]
        assert len(lines) == 1 and "MoE layers' experts on CPU (float32)" in lines[0]
        assert "[hybrid experts:" in captured.err
    assert "2/2 MoE layers" in lines[0] or "1/2 MoE layers" in lines[0]
    store = tmp_path / "store"
    assert main(["offload-prepare", "--model", str(byte_model_dir), "--out", str(store),
                              "--group", "32"]) == 0
    capsys.readouterr()
    assert main(base + ["--cpu-moe", "--offload", str(store)]) == 0
    assert capsys.readouterr().out == resident
    ppl = ["eval", "ppl", "--model", str(byte_model_dir), "--device", "cpu", "--max-tokens", "64"]
    assert main(ppl) == 0
    expected = json.loads(capsys.readouterr().out)["perplexity"]
    assert main(ppl + ["--n-cpu-moe", "1", "--offload", str(store)]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert main(ppl + ["--cpu-moe", "--experts-bits", "4", "--offload", str(store)]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] == pytest.approx(expected, rel=0.2)


def test_cli_hybrid_errors(expect_cli_error, byte_model_dir, tmp_path, monkeypatch):
    gen = ["generate", "--model", byte_model_dir, "--max-new-tokens", "2", "--device", "cpu"]
    expect_cli_error(gen + ["--n-cpu-moe", "3"], "--n-cpu-moe 3 is outside the model's 2 MoE layers")
    expect_cli_error(gen + ["--cpu-moe", "--n-cpu-moe", "1"], "cannot be combined")
    expect_cli_error(gen + ["--gpu-cache-experts", "4"], "needs --cpu-moe or --n-cpu-moe")
    expect_cli_error(gen + ["--mixed-precision"], "needs --cpu-moe or --n-cpu-moe")
    expect_cli_error(gen + ["--cpu-int8"], "needs --cpu-moe or --n-cpu-moe")
    expect_cli_error(gen + ["--cpu-moe", "--high-slots", "2"], "--gpu-cache-experts")
    expect_cli_error(gen + ["--cpu-moe", "--cache-policy", "mru"], "unknown cache policy")
    expect_cli_error(gen + ["--cpu-moe", "--cpu-threads", "0"], "--cpu-threads must be >= 1")
    expect_cli_error(["eval", "ppl", "--model", byte_model_dir, "--offload", tmp_path], "needs --cpu-moe")
    monkeypatch.setattr("moeserve.hybrid.memory.available_ram", lambda: 1000)
    line = expect_cli_error(gen + ["--cpu-moe"], "not enough host RAM")
    assert "they need" in line and "available" in line
    monkeypatch.undo()
    store = tmp_path / "s"
    ExpertStore.build(byte_model_dir, store, low_bits=4, group=32, progress=False)
    expect_cli_error(gen + ["--cpu-moe", "--offload", store, "--experts-bits", "3"], "holds 4-bit copies", watch=store)


@pytest.fixture(scope="module")
def wide_byte_model_dir(tmp_path_factory):
    """The byte-vocabulary Mixtral with hidden size 64: a group of 64 divides its dense layers' inputs."""
    from hf_models import save_byte_model

    return save_byte_model(tmp_path_factory.mktemp("byte64"), hidden=64, ffn=64, seed=5)


def test_cli_generate_with_an_8bit_dense_part(capsys, wide_byte_model_dir, expect_cli_error):
    """`generate --cpu-moe --dense-bits 8` runs and says so in its placement line; with --gpu-memory (everything on the
    CPU here) the plan line names the dense bits; bad values and --tp are refused in one line."""
    base = ["generate", "--model", str(wide_byte_model_dir), "--device", "cpu", "--greedy", "--max-new-tokens", "5",
            "--ignore-eos"]
    assert main(base + ["--cpu-moe", "--dense-bits", "8", "Hi"]) == 0
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("[placement:")]
    assert len(lines) == 1 and "2/2 MoE layers' experts on CPU (float32)" in lines[0] and "dense part 8-bit" in lines[0]
    assert "[5 tokens in" in captured.err and captured.out.startswith("Hi")
    assert main(base + ["--cpu-moe", "--dense-bits", "8", "--gpu-memory", "1GiB", "Hi"]) == 0
    plans = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[plan:")]
    assert len(plans) == 1 and "; dense part 8-bit; no GPU" in plans[0]
    assert main(base + ["--dense-bits", "8", "Hi"]) == 0  # resident experts, 8-bit dense part
    capsys.readouterr()
    expect_cli_error(base + ["--dense-bits", "4", "Hi"], "argument --dense-bits: invalid choice: 4")
    expect_cli_error(base + ["--dense-bits", "8", "--tp", "2", "Hi"], "--tp 2 runs one process per rank: launch it under torchrun")


def test_help_explains_the_flags(capsys):
    for argv in (["generate", "--help"], ["eval", "ppl", "--help"], ["serve", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        for flag in ("--cpu-moe", "--n-cpu-moe N", "--gpu-cache-experts S", "--cpu-threads N", "--mixed-precision",
                     "--experts-bits B", "--cache-policy", "--dense-bits {16,8}", "--cpu-int8"):
            assert flag in text, (argv, flag)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_segmented_decode_runs_the_hybrid_layers_between_the_pieces(hf_checkpoints, family):
    """The static step cut at the hybrid layers (what a GPU captures as graphs between the host's layers) over a
    hybrid model with shared experts (the backend computes them while the CPU works): the logits of the dynamic
    forward."""
    from checks import slot_decode
    from moeserve.engine.cuda_graph import SlotDecoder

    path = hf_checkpoints[family][1]
    layers = moe_layers(moeserve.ModelSpec.from_dir(path))
    model, runtime = hybrid_model(path, HybridPlacement.choose(layers, n_cpu_moe=1))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (6, 3)]
    steps = torch.randint(3, 97, (5, 2), generator=g)  # [N, B]
    dynamic = slot_decode(model, lambda kv: SlotDecoder(model, kv, graph=False, static=False), prompts, steps)
    static = []  # the static decoder, to ask where it cut
    segmented = slot_decode(model, lambda kv: static.append(SlotDecoder(model, kv, graph=False, static=True))
                            or static[0], prompts, steps)
    torch.testing.assert_close(segmented, dynamic, rtol=1e-5, atol=1e-5)
    assert static[0].cut_sizes() == [2]
    assert runtime.stats.cpu_pairs > 0
    runtime.close()


def test_linked_cache_fills_with_the_most_used_experts_then_swaps(hf_checkpoints):
    """The device-link cache's bookkeeping (offload/slot_cache.py SlotCache.link; driven here on the CPU as the step hook
    drives it on a GPU): uses counted per call fill the free slots with the most used experts, whose slots then hold
    the store's copies and join the map the calls read; once full, an expert used more than the coldest cached one by
    the margin replaces it, one swap a step; a prompt's uses (the host path) count too."""
    from moeserve.offload import slot_cache as cache_mod
    path = hf_checkpoints["mixtral"][1]
    layers = moe_layers(moeserve.load_model(path, routed_experts=False).spec)
    model, runtime = hybrid_model(path, HybridPlacement.choose(layers, cpu_moe=True, cache_slots=3, bits=4))
    cache = runtime.cache
    cache.link(max_pairs=8)
    l0, l1 = layers[0], layers[1]
    for _ in range(3):  # one step: expert 5 of l0 three times, 2 of l1 twice, 7 of l0 once
        slot = cache.device_slots(l0, torch.tensor([[5, 7]]) if _ == 0 else torch.tensor([[5, 5]]))
        assert torch.equal(slot, torch.full((1, 2), -1))
    cache.device_slots(l1, torch.tensor([[2, 2]]))
    cache.maintain()  # fill: three free slots, three used experts
    cache.maintain()  # the copies have landed (a plain copy on the CPU): they join the map
    held = {key: slot for key, slot in cache.pool.slot_of.items()}
    assert set(held) == {(l0, 5), (l1, 2), (l0, 7)}
    for (layer, e), slot in held.items():
        assert int(cache.device_slots(layer, torch.tensor([[e, e]]))[0, 0]) == slot
        stored = cache.store.host_parts(layer, e, True)
        assert all(torch.equal(buf[slot], part) for buf, part in zip(cache.pool.buffers, stored))
    cache.account(l1, torch.tensor([[4, 4], [4, 4], [4, 4]]), torch.zeros(3, 2, dtype=torch.long),
                  torch.ones(3, 2, dtype=torch.bool))  # a prompt's uses: expert 4 of l1 six times
    cache.maintain()  # full: expert 4 (6 uses) replaces the coldest cached one, (l0, 7)
    cache.maintain()
    assert set(cache.pool.slot_of) == {(l0, 5), (l1, 2), (l1, 4)}
    assert int(cache.ready[l0][7]) == cache_mod.NOT_CACHED and cache.admitted == 4
    for _ in range(30):  # nothing used: counts decay, nothing leads by the margin, nothing moves
        cache.maintain()
    assert set(cache.pool.slot_of) == {(l0, 5), (l1, 2), (l1, 4)} and cache.admitted == 4
    runtime.close()


def test_int8_activations_stay_near_the_exact_cpu_experts(byte_model_dir):
    """--cpu-int8 (HybridPlacement.int8): 4-bit CPU experts on int8 activations give the exact kernels' greedy tokens
    and logits within a few percent of their spread; the placement line says so. Skipped without VNNI."""
    from moeserve.kernels.cpu import gemv, tuning
    from moeserve.kernels.cpu.machine import INT8_ISA, cpu_info

    if not cpu_info().int8_dots or gemv.default_kernel(4) is None:
        pytest.skip("no AVX512-VNNI (or no C compiler) here")
    if tuning.stored_tile(INT8_ISA) is None:
        tuning.store_tile(INT8_ISA, (4, 2), {})  # a valid tile: no register-tile search inside the tests
    store = ExpertStore.from_checkpoint(byte_model_dir, low_bits=4, group=32, high=False, progress=False)
    prompts, tokens = [[72, 65, 77, 80], [75, 73]], torch.tensor([[72, 65, 77, 80, 76, 69, 83]])
    runs = {}
    for int8 in (False, True):
        placement = HybridPlacement.choose([0, 1], cpu_moe=True, bits=4, int8=int8)
        model, runtime = hybrid_model(byte_model_dir, placement, store)
        assert runtime.host.native_kernel(True).isa == (INT8_ISA if int8 else cpu_info().isas[0])
        runs[int8] = greedy(model, prompts), model(tokens)
        runtime.close()
    assert runs[True][0] == runs[False][0]
    exact, int8 = runs[False][1], runs[True][1]  # [1, 7, V]
    assert float((int8 - exact).norm() / exact.norm()) < 0.02
    assert "int8 activations on the CPU" in HybridPlacement.choose([0, 1], cpu_moe=True, bits=4,
                                                                   int8=True).describe("cpu", "float32")
