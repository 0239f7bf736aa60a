"""The hybrid backend with the model on a GPU: CPU experts on the worker thread overlapped with the GPU's cached
experts and shared expert, background admissions on the copy stream; skipped without a GPU.

fp32 on CUDA: logits agree with the resident model to fp32 rounding. bf16: the resident bf16 model's experts run on
the GPU where the hybrid's run on the CPU (other kernels, other rounding): the prompt's last logits agree within bf16
rounding, and greedy decoding starts with the same token (tiny random models have near-ties that flip later tokens).
Prompts of stream_from+ tokens stream the CPU layers' experts to the GPU: the same logits as on the CPU."""

import pytest
import torch

import moeserve
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.hybrid.placement import HybridPlacement
from moeserve.hybrid.setup import build_store, enable_hybrid, store_layers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def hybrid_model(path, placement, dtype, **options):
    stored = set(store_layers(placement))
    model = moeserve.load_model(path, device="cuda", dtype=dtype,
                                routed_experts=[i for i in placement.moe_layers if i not in stored])
    store = build_store(path, placement, model.dtype, model.device, progress=False)
    return model, enable_hybrid(model, store, placement, **options)


def moe_layers(path) -> list[int]:
    spec = moeserve.load_model(path, routed_experts=False).spec
    return [i for i, moe in enumerate(spec.moe.layers) if moe]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "llama4", "gpt_oss"])  # llama4: scaled expert input;
# gpt_oss: biases and the clamped SwiGLU
@pytest.mark.parametrize("split,slots", [("all", 0), ("some", 0), ("all", 3), ("some", 5)])
def test_gpu_hybrid_fp32_equals_resident(hf_checkpoints, family, split, slots):
    path = hf_checkpoints[family][1]
    layers = moe_layers(path)
    tokens = torch.randint(3, 97, (3, 6), device="cuda")
    expected = moeserve.load_model(path, device="cuda", dtype="float32")(tokens)
    placement = HybridPlacement.choose(layers, n_cpu_moe=len(layers) if split == "all" else 1, cache_slots=slots,
                                       threads=4)
    model, runtime = hybrid_model(path, placement, "float32")
    assert not runtime.worker.inline
    for _ in range(4):  # later passes run admitted experts in slots, loaded while earlier work was in flight
        torch.testing.assert_close(model(tokens), expected, atol=1e-4, rtol=1e-4)
    st = runtime.summary()
    assert st["cpu_pairs"] > 0
    if slots:
        assert st["admitted"] > 0 and st["gpu_pairs"] > 0 and runtime.cache.copier.stream is not None
    runtime.close()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
@pytest.mark.parametrize("slots", [0, 4])
def test_gpu_hybrid_bf16_follows_resident(hf_checkpoints, family, slots):
    path = hf_checkpoints[family][1]
    layers = moe_layers(path)
    prompts = [[5, 17, 33, 8, 61, 12, 40], [71, 9, 22, 3]]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = torch.tensor([prompts[0]], device="cuda")
    resident_model = moeserve.load_model(path, device="cuda", dtype="bfloat16")
    expected = resident_model(tokens)[0, -1].float()  # [V]
    resident = [r.token_ids for r in generate(resident_model, prompts, params)]  # the static step as one graph
    placement = HybridPlacement.choose(layers, cpu_moe=True, cache_slots=slots, threads=4)
    model, runtime = hybrid_model(path, placement, "bfloat16")
    torch.testing.assert_close(model(tokens)[0, -1].float(), expected, atol=0.03 * expected.abs().max().item(),
                               rtol=0.0)
    hybrid = [r.token_ids for r in generate(model, prompts, params)]  # hybrid: graphs of the segments
    shared = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(hybrid, resident)]
    print(f"\n{family}, {slots} slots: greedy tokens shared with resident bf16: {shared} of 16")
    assert min(shared) >= 1, shared
    runtime.close()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("bits,slots", [(16, 0), (16, 4), (4, 0)])
def test_gpu_streamed_prompt_equals_the_cpu_path(hf_checkpoints, family, bits, slots):
    """fp32: a prompt of 40 tokens (>= stream_from 32) streams its experts through the GPU ring, a 2-token call runs
    them on the CPU; both agree with the experts on the CPU (float: the resident model; 4-bit: stream_from 0), and
    the decode steps after a streamed prompt give the same tokens."""
    path = hf_checkpoints[family][1]
    layers = moe_layers(path)
    tokens = torch.randint(3, 97, (2, 40), device="cuda")
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = tokens[0].tolist()
    runs = []
    for stream_from in (0, 32):
        placement = HybridPlacement.choose(layers, cpu_moe=True, cache_slots=slots, threads=4, bits=bits,
                                           stream_from=stream_from, num_experts=8)
        model, runtime = hybrid_model(path, placement, "float32")
        runs.append((model(tokens), model(tokens[:, :1]), generate(model, [prompt], params)[0].token_ids))
        st = runtime.summary()
        assert (st["streamed_pairs"] > 0) == bool(stream_from) and st["cpu_pairs"] + st["gpu_pairs"] > 0
        runtime.close()
    if bits == 16:
        resident = moeserve.load_model(path, device="cuda", dtype="float32")
        runs[0] = (resident(tokens), resident(tokens[:, :1]), runs[0][2])
    tol = 1e-4 if bits == 16 else 2e-3
    for got, want in zip(runs[1][:2], runs[0][:2]):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert runs[1][2] == runs[0][2]


# qwen3_moe: its CPU layers over the device link; gpt_oss: biases and the clamped SwiGLU in the Triton slots, the
# resident QuantizedExperts and the native CPU call (over the device link too)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_gpu_hybrid_low_bit_cpu_and_slots_agree(hf_checkpoints, family):
    """--experts-bits 4: CPU kernels, GPU slots (Triton low-bit; one token: the fused slot-order pass) and resident
    QuantizedExperts read the same copies."""
    path = hf_checkpoints[family][1]
    tokens = torch.randint(3, 97, (2, 7), device="cuda")
    layers, outs = moe_layers(path), []
    for n, slots in ((len(layers), 0), (len(layers), 24), (1, 0)):
        model, runtime = hybrid_model(path, HybridPlacement.choose(layers, n_cpu_moe=n, cache_slots=slots, bits=4),
                                      "float32")
        for _ in range(3):
            out = (model(tokens), model(tokens[:1, :1]))
            torch.cuda.synchronize()
        outs.append(out)
        runtime.close()
    for out in outs[1:]:
        for got, want in zip(out, outs[0]):
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_gpu_wait_for_host_holds_the_stream_and_gives_up():
    """The device end's wait: a word already written passes at once; one never written is read `reads` times,
    then the kernel gives up and says so."""
    from moeserve.kernels.triton.host_wait import wait_for_host
    word, status = torch.zeros(8, dtype=torch.int64).pin_memory(), torch.zeros(8, dtype=torch.int32).pin_memory()
    want = torch.tensor([5], dtype=torch.int64, device="cuda")
    word[0] = 5
    wait_for_host(word, want, status, reads=1000)
    torch.cuda.synchronize()
    assert status[0] == 0
    want.fill_(6)
    wait_for_host(word, want, status, reads=1000)
    torch.cuda.synchronize()
    assert status[0] == 1


# families whose tiny experts the generated kernels read (sizes multiples of 32); qwen2_moe: a shared expert
@pytest.mark.parametrize("family,mixed", [("qwen3_moe", False), ("qwen2_moe", False), ("qwen3_moe", True)])
def test_gpu_linked_decode_is_one_graph_and_equals_the_host_path(hf_checkpoints, family, mixed, monkeypatch):
    """Low-bit CPU experts over the device link: the decode step has no host layer (one CUDA graph), and greedy
    generation (batch 1 and 3) gives the tokens of the host path (MOESERVE_DEVICE_LINK=0, segmented graphs); the
    runtime counts the linked pairs. With mixed precision the device skips pairs as the host path does (the same
    tokens, where a skip rule of T2 0.55 skips often)."""
    from moeserve.engine.cuda_graph import host_layers
    path = hf_checkpoints[family][1]
    prompts = [torch.randint(3, 97, (n,)).tolist() for n in (5, 9, 3)]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    runs, skipped = [], []
    for link in ("1", "0"):
        monkeypatch.setenv("MOESERVE_DEVICE_LINK", link)
        layers = moe_layers(path)
        model, runtime = hybrid_model(path, HybridPlacement.choose(layers, cpu_moe=True, bits=4, mixed=mixed),
                                      "float32", t1=0.3, t2=0.55)  # random top-2: skips often
        assert (runtime.link is not None) == (link == "1")
        assert (host_layers(model, 1) == []) == (link == "1")
        runs.append([[g.token_ids for g in generate(model, p, params)] for p in (prompts[:1], prompts)])
        summary = runtime.summary()
        assert summary.get("linked_pairs", 0) > 0 if link == "1" else "linked_pairs" not in summary
        skipped.append(summary["skipped"])
        runtime.close()
    assert runs[0] == runs[1]
    assert (min(skipped) > 0) == mixed  # not equal counts: the link's also count the graph capture's warm-up runs


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_gpu_linked_cache_decode_is_one_graph_and_follows_the_cpu(hf_checkpoints, family):
    """A GPU cache under the device link: the decode step is still one graph, the cache fills between steps (the
    step hook) and serves pairs on the GPU, and greedy tokens (batch 1 and 3) are those of the same low-bit experts
    all on the CPU; the step's own logits agree with the CPU-only run's to fp32 rounding."""
    from moeserve.engine.cuda_graph import host_layers
    path = hf_checkpoints[family][1]
    prompts = [torch.randint(3, 97, (n,)).tolist() for n in (5, 9, 3)]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = torch.randint(3, 97, (2, 7), device="cuda")
    runs, logits = [], []
    for slots in (0, 24):
        model, runtime = hybrid_model(path, HybridPlacement.choose(moe_layers(path), cpu_moe=True, bits=4,
                                                                   cache_slots=slots), "float32")
        assert runtime.link is not None and host_layers(model, 1) == []
        runs.append([[g.token_ids for g in generate(model, p, params)] for p in (prompts[:1], prompts, prompts)])
        logits.append(model(tokens))  # after the runs: the cache holds what they used
        summary = runtime.summary()
        if slots:
            assert summary["admitted"] > 0 and summary["gpu_pairs"] > 0 and summary["cpu_pairs"] > 0
            assert summary["cache_ranking"].startswith("decayed use counts")
        else:
            assert summary["gpu_pairs"] == 0
        runtime.close()
    assert runs[0] == runs[1]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-3, rtol=1e-3)


def test_gpu_linked_serving_graphs_give_solo_tokens(hf_checkpoints):
    """The server's continuous batch over CPU experts on the device link: each padded batch size is one captured
    graph, and each request (joining mid-run, 4 requests over 3 slots) gets the greedy tokens it gets alone."""
    from moeserve.engine.batching import ContinuousBatch, Request
    path = hf_checkpoints["qwen3_moe"][1]
    model, runtime = hybrid_model(path, HybridPlacement.choose(moe_layers(path), cpu_moe=True, bits=4), "float32")
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (6, 11, 3, 8)]
    alone = [generate(model, [p], params)[0].token_ids for p in prompts]
    batch = ContinuousBatch(model, None, slots=3, context=40, prefill_tokens=16)
    requests = [Request(p, params, None) for p in prompts]
    got = {id(r): [] for r in requests}
    for r in requests:
        r.on_update = lambda req, u: got[id(req)].extend(u.token_ids)
    for r in requests[:3]:
        batch.add(r)
    for n in range(200):
        if n == 2:
            batch.add(requests[3])
        if not batch.step() and n > 2:
            break
    assert batch.decoder.graphed_sizes() and not batch.decoder.cut_sizes(), "no decode step was captured whole"
    assert [got[id(r)] for r in requests] == alone
    runtime.close()


@pytest.mark.parametrize("family,slots", [("mixtral", 0), ("qwen2_moe", 3)])
def test_gpu_serving_batch_decodes_hybrid_layers_in_graph_segments(hf_checkpoints, family, slots):
    """Continuous batching (serve's engine) over float CPU experts: each padded batch size's decode step is
    captured in segments between the CPU layers and replayed; requests joining and leaving get the tokens of the
    same batch decoded eagerly (fp32)."""
    from moeserve.engine.batching import ContinuousBatch, Request

    path = hf_checkpoints[family][1]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 2)]
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    outputs = []
    for graph in (True, False):
        model, _ = hybrid_model(path, HybridPlacement.choose(moe_layers(path), cpu_moe=True, cache_slots=slots,
                                                             num_experts=8), "float32")
        batch = ContinuousBatch(model, None, slots=4, context=32, prefill_tokens=8, cuda_graph=graph)
        warm = batch.warm_up()
        if graph:
            assert warm.graphed_sizes == warm.decode_sizes == [1, 2, 4] and batch.decoder.cut_sizes() == [1, 2, 4]
        requests = [Request(p, params, lambda *_: None) for p in prompts]
        for r in requests[:3]:
            batch.add(r)
        steps = 0
        while batch.step():
            steps += 1
            if steps == 2:
                for r in requests[3:]:
                    batch.add(r)
        outputs.append([r.gen.token_ids for r in requests])
    assert outputs[0] == outputs[1]


def test_gpu_linked_int8_activations_follow_the_exact_cpu_experts(hf_checkpoints):
    """--cpu-int8 over the device link: 4-bit CPU experts on the int8-activation kernels (the link's layer table runs
    them) give logits within a few percent of the exact kernels' and the same first greedy token (tiny random
    models have near-ties later). Skipped on a host without AVX512-VNNI."""
    from moeserve.kernels.cpu.machine import INT8_ISA, cpu_info
    if not cpu_info().int8_dots:
        pytest.skip("no AVX512-VNNI on this host")
    path = hf_checkpoints["qwen3_moe"][1]
    tokens = torch.randint(3, 97, (2, 7), device="cuda")
    prompt = torch.randint(3, 97, (6,)).tolist()
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    logits, first = [], []
    for int8 in (False, True):
        model, runtime = hybrid_model(path, HybridPlacement.choose(moe_layers(path), cpu_moe=True, bits=4, int8=int8),
                                      "float32")
        assert runtime.link is not None
        assert (runtime.host.native_kernel(True).isa == INT8_ISA) == int8
        logits.append(model(tokens))  # [2, 7, V]
        first.append(generate(model, [prompt], params)[0].token_ids[0])
        runtime.close()
    assert float((logits[1] - logits[0]).norm() / logits[0].norm()) < 0.03
    assert first[0] == first[1]
