"""GPT-OSS's MXFP4 experts on the CPU kept packed as shipped (the hybrid's store, meta high_mxfp4): computed by the
generated MXFP4 kernels with their biases and clamped SwiGLU, a layer in one native call, they give the resident
model's logits (to float rounding) and greedy tokens with --cpu-moe and --n-cpu-moe; the native call equals the
grouped path; device slots holding them dequantize as they compute; the host RAM accounting counts the packed bytes.
GPU (the device link, slots, the prompt streamer): tests/hybrid/test_gpu_hybrid_mxfp4.py."""

import pytest
import torch
from hf_models import build_hf_model, write_mxfp4_pair

import moeserve
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.hybrid.placement import HybridPlacement
from moeserve.hybrid.setup import build_store, enable_hybrid, store_layers
from moeserve.offload.host_compute import CpuPairs, HostExperts
from moeserve.offload.slot_compute import slot_ffn
from moeserve.offload.slots import SlotPool
from moeserve.offload.transfer import Copier
from moeserve.plan.footprint import Precision, expert_bytes, footprint, hybrid_layout
from moeserve.quant.mxfp4 import Mxfp4Expert, Mxfp4Experts


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """The tiny GPT-OSS (hf_models) with its experts MXFP4 as shipped (quantized from random floats: varied
    exponents)."""
    src, packed, twin = (tmp_path_factory.mktemp(n) for n in ("gpt_oss_src", "gpt_oss_mxfp4", "gpt_oss_twin"))
    build_hf_model("gpt_oss", seed=11).save_pretrained(src)
    write_mxfp4_pair(src, packed, twin)
    return packed


def hybrid_model(path, placement: HybridPlacement):
    stored = set(store_layers(placement))
    model = moeserve.load_model(path, device="cpu", routed_experts=[i for i in placement.moe_layers if i not in stored])
    store = build_store(path, placement, model.dtype, model.device, progress=False)
    return model, enable_hybrid(model, store, placement)


def test_cpu_layers_keep_mxfp4_packed_and_equal_the_resident_model(mxfp4_checkpoint):
    resident = moeserve.load_model(mxfp4_checkpoint, device="cpu")
    assert isinstance(resident.model.layers[0].mlp.experts, Mxfp4Experts)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 97, (2, 9), generator=g)
    prompts = [torch.randint(3, 97, (7,), generator=g).tolist(), torch.randint(3, 97, (3,), generator=g).tolist()]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    with torch.no_grad():
        want_logits = resident(tokens)
    want = [r.token_ids for r in generate(resident, prompts, params)]
    moe = [i for i, m in enumerate(resident.spec.moe.layers) if m]
    for placement in (HybridPlacement.choose(moe, cpu_moe=True), HybridPlacement.choose(moe, n_cpu_moe=1)):
        model, runtime = hybrid_model(mxfp4_checkpoint, placement)
        store = runtime.host.store
        assert store.mxfp4 and {t.dtype for t in store.host_parts(placement.cpu_layers[0], 0, low=False)[:4]} == {
            torch.uint8}
        assert store.expert_bytes(False) == expert_bytes(resident.spec, Precision.mxfp4(model.dtype.itemsize))
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), want_logits, atol=1e-4, rtol=1e-4)
        assert [r.token_ids for r in generate(model, prompts, params)] == want
        layer = placement.cpu_layers[0]
        assert runtime.host.native_layer(layer, tokens, low=False) is not None  # each CPU layer is one native call
        runtime.close()


def test_the_native_layer_call_equals_the_grouped_path(mxfp4_checkpoint):
    """A GPT-OSS CPU layer in one native call (moe_layer: biases and the clamped SwiGLU in C) against the grouped
    path (per-expert batched projections, biases and activation in torch), masked pairs included."""
    resident = moeserve.load_model(mxfp4_checkpoint, device="cpu")
    moe = [i for i, m in enumerate(resident.spec.moe.layers) if m]
    store = build_store(mxfp4_checkpoint, HybridPlacement.choose(moe, cpu_moe=True), torch.float32,
                        torch.device("cpu"), progress=False)
    host, g = HostExperts(store, torch.float32), torch.Generator().manual_seed(6)
    E, k = resident.spec.moe.experts_at(moe[1]), resident.spec.moe.top_k
    for T in (1, 5):
        x = torch.randn(T, resident.spec.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
        weights, mask = torch.rand(T, k, generator=g), torch.rand(T, k, generator=g) > 0.3
        native = host.run_layer(moe[1], x, CpuPairs(ids, weights, mask, low=False))
        grouped = host.run_layer(moe[1], x, CpuPairs(ids, weights, mask, low=torch.zeros(T, k, dtype=torch.bool)))
        want = resident.model.layers[moe[1]].mlp.experts(x, torch.where(mask, ids, 0), weights * mask)
        torch.testing.assert_close(native, grouped, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(native, want, atol=1e-5, rtol=1e-5)
    assert host.native_layer(moe[1], x, low=False) is not None and host.native(False)


def test_a_slot_of_mxfp4_parts_computes_the_resident_expert(mxfp4_checkpoint):
    """A device slot (here on the CPU) of an MXFP4 store holds the packed parts and computes the expert as the
    resident Mxfp4Experts does."""
    resident = moeserve.load_model(mxfp4_checkpoint, device="cpu")
    moe = [i for i, m in enumerate(resident.spec.moe.layers) if m]
    store = build_store(mxfp4_checkpoint, HybridPlacement.choose(moe, cpu_moe=True), torch.float32,
                        torch.device("cpu"), progress=False)
    pool = SlotPool(2, store.slot_parts(False, torch.float32), "cpu", store.slot_weights(False))
    assert isinstance(pool.weights[0], Mxfp4Expert) and pool.buffers[0].dtype == torch.uint8
    Copier(torch.device("cpu")).load(pool.load_parts(1), store.host_parts(moe[0], 3, low=False), None, None)
    rows = torch.randn(5, resident.spec.hidden_size)
    experts = resident.model.layers[moe[0]].mlp.experts
    torch.testing.assert_close(slot_ffn(pool.weights[1], rows, store.act), experts.expert_ffn(3, rows))


def test_host_bytes_count_the_packed_experts(mxfp4_checkpoint):
    spec = moeserve.ModelSpec.from_dir(mxfp4_checkpoint)
    moe = spec.moe.layer_indices()
    packed = expert_bytes(spec, Precision.mxfp4(2))
    assert packed * 3 < expert_bytes(spec, Precision.float(2))  # 17 bytes per 32 weights against 64
    placement = HybridPlacement.choose(moe, n_cpu_moe=1)
    E = spec.moe.experts_at(moe[0])

    def store_bytes(**mapped) -> int:
        return footprint(spec, hybrid_layout(spec, placement, "cuda", 2, 1, 8, 0, 32, **mapped)).host["expert store"]

    assert store_bytes() == E * 2 * packed  # the store's copy and the kernels' repack
    assert store_bytes(mapped_float_bytes=2) == E * expert_bytes(spec, Precision.float(2))  # a store on disk


def test_a_pool_of_mxfp4_slots_runs_in_one_triton_pass(mxfp4_checkpoint):
    """SlotExperts.device_pass over MXFP4 slots (the linked cache's pass: the pool's stacked buffers through the
    Triton MXFP4 kernels; here in Triton's interpreter) equals each kept pair's expert dequantized, weighted; pairs
    not kept (an unloaded, zeroed slot among them) add nothing."""
    pytest.importorskip("triton")
    from moeserve.offload.slot_compute import SlotExperts

    spec = moeserve.ModelSpec.from_dir(mxfp4_checkpoint)
    moe = spec.moe.layer_indices()
    store = build_store(mxfp4_checkpoint, HybridPlacement.choose(moe, cpu_moe=True), torch.float32,
                        torch.device("cpu"), progress=False)
    pool = SlotPool(4, store.slot_parts(False, torch.float32), "cpu", store.slot_weights(False))
    for slot, e in enumerate((3, 1, 5)):  # slot 3 stays unloaded
        Copier(torch.device("cpu")).load(pool.load_parts(slot), store.host_parts(moe[0], e, low=False), None, None)
    g = torch.Generator().manual_seed(7)
    T, k = 3, spec.moe.top_k
    x = torch.randn(T, spec.hidden_size, generator=g)
    slots = torch.randint(0, 3, (T, k), generator=g)
    slots[0, 0] = 3
    kept = slots < 3
    weights = torch.rand(T, k, generator=g)
    y = SlotExperts([pool], store.act).device_pass(0, x, weights, slots, kept)
    ref = torch.zeros_like(x)
    for t in range(T):
        for j in range(k):
            if kept[t, j]:
                ref[t] += weights[t, j] * slot_ffn(pool.weights[int(slots[t, j])], x[t:t + 1], store.act)[0]
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


def test_the_placement_line_names_mxfp4_cpu_experts(mxfp4_checkpoint):
    """The run's placement line and bench's placement name say the CPU experts run MXFP4 as shipped, not the
    compute dtype; 4-bit experts keep their bits."""
    from moeserve.build import describe_hybrid

    run = moeserve.LLM(mxfp4_checkpoint, cpu_moe=True)
    assert "experts on CPU (MXFP4)" in describe_hybrid(run.runtime) and "on CPU (MXFP4)" in run.placement
    run = moeserve.LLM(mxfp4_checkpoint, cpu_moe=True, experts_bits=4)
    assert "experts on CPU (4-bit)" in describe_hybrid(run.runtime)


def test_int8_activations_stay_near_the_resident_mxfp4_experts(mxfp4_checkpoint):
    """--cpu-int8 on GPT-OSS's MXFP4 CPU experts (biases, clamped SwiGLU): the native layer call within a bounded
    relative error of the resident experts, and the model's greedy tokens and logits near the resident model's.
    Skipped without VNNI."""
    from moeserve.kernels.cpu import tuning
    from moeserve.kernels.cpu.machine import INT8_ISA, cpu_info

    if not cpu_info().int8_dots:
        pytest.skip("no AVX512-VNNI here")
    if tuning.stored_tile(INT8_ISA) is None:
        tuning.store_tile(INT8_ISA, (4, 2), {})  # a valid tile: no register-tile search inside the tests
    resident = moeserve.load_model(mxfp4_checkpoint, device="cpu")
    moe = [i for i, m in enumerate(resident.spec.moe.layers) if m]
    placement = HybridPlacement.choose(moe, cpu_moe=True, int8=True)
    store = build_store(mxfp4_checkpoint, placement, torch.float32, torch.device("cpu"), progress=False)
    host, g = HostExperts(store, torch.float32, int8=True), torch.Generator().manual_seed(8)
    assert host.mxfp4_kernel().isa == INT8_ISA
    E, k = resident.spec.moe.experts_at(moe[0]), resident.spec.moe.top_k
    for T in (1, 6):
        x = torch.randn(T, resident.spec.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
        weights = torch.rand(T, k, generator=g)  # [T, k]
        got = host.run_layer(moe[0], x, CpuPairs(ids, weights, low=False))  # [T, D]
        want = resident.model.layers[moe[0]].mlp.experts(x, ids, weights)  # [T, D]
        assert float((got - want).norm() / want.norm()) < 0.02, T
    tokens = torch.randint(3, 97, (2, 9), generator=g)
    prompts = [torch.randint(3, 97, (7,), generator=g).tolist()]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    model, runtime = hybrid_model(mxfp4_checkpoint, placement)
    with torch.no_grad():
        want, got = resident(tokens), model(tokens)  # [2, 9, V]
    assert float((got - want).norm() / want.norm()) < 0.02
    assert [r.token_ids for r in generate(model, prompts, params)] == [
        r.token_ids for r in generate(resident, prompts, params)]
    runtime.close()
