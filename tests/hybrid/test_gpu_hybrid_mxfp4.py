"""GPT-OSS's MXFP4 experts kept packed in the hybrid's store, with the model on a GPU; skipped without one.

Each CPU layer is one native MXFP4 call driven over the device link (the decode step one CUDA graph), with or without
a linked cache whose MXFP4 slots run the Triton MXFP4 kernels; its greedy tokens are those of the host path
(MOESERVE_DEVICE_LINK=0), where slots dequantize as they compute and prompts of stream_from+ tokens stream the packed
experts to the GPU. fp32 logits agree with the resident model's (its Triton MXFP4 kernels) to float rounding."""

import pytest
import torch
from hf_models import build_hf_model, write_mxfp4_pair

import moeserve
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.hybrid.placement import HybridPlacement
from moeserve.hybrid.setup import build_store, enable_hybrid, store_layers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    src, packed, twin = (tmp_path_factory.mktemp(n) for n in ("gpt_oss_src", "gpt_oss_mxfp4", "gpt_oss_twin"))
    build_hf_model("gpt_oss", seed=11).save_pretrained(src)
    write_mxfp4_pair(src, packed, twin)
    return packed


def hybrid_model(path, placement):
    stored = set(store_layers(placement))
    model = moeserve.load_model(path, device="cuda", dtype="float32",
                                routed_experts=[i for i in placement.moe_layers if i not in stored])
    store = build_store(path, placement, model.dtype, model.device, progress=False)
    assert store.mxfp4
    return model, enable_hybrid(model, store, placement)


@pytest.mark.parametrize("slots", [0, 6])
def test_gpu_mxfp4_cpu_layers_go_over_the_device_link(mxfp4_checkpoint, monkeypatch, slots):
    """The CPU layers' native MXFP4 calls driven over the device link, with or without a linked cache of MXFP4 slots
    (the Triton MXFP4 pass): one CUDA graph a decode step, the host path's greedy tokens, the resident logits."""
    from moeserve.engine.cuda_graph import host_layers
    moe = moeserve.ModelSpec.from_dir(mxfp4_checkpoint).moe.layer_indices()
    prompts = [torch.randint(3, 97, (n,)).tolist() for n in (5, 9, 3)]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = torch.randint(3, 97, (2, 7), device="cuda")
    expected = moeserve.load_model(mxfp4_checkpoint, device="cuda", dtype="float32")(tokens)
    runs = []
    for link in ("1", "0"):
        monkeypatch.setenv("MOESERVE_DEVICE_LINK", link)
        model, runtime = hybrid_model(mxfp4_checkpoint, HybridPlacement.choose(moe, cpu_moe=True, cache_slots=slots))
        assert (runtime.link is not None) == (link == "1")
        assert (host_layers(model, 1) == []) == (link == "1")
        runs.append([[g.token_ids for g in generate(model, p, params)] for p in (prompts[:1], prompts)])
        torch.testing.assert_close(model(tokens), expected, atol=1e-3, rtol=1e-3)
        summary = runtime.summary()
        assert summary.get("linked_pairs", 0) > 0 if link == "1" else runtime.link is None
        if slots:
            assert summary["admitted"] > 0 and summary["gpu_pairs"] > 0
        runtime.close()
    assert runs[0] == runs[1]


def test_gpu_mxfp4_host_path_slots_and_streamed_prompts_equal_resident(mxfp4_checkpoint, monkeypatch):
    """The host path (MOESERVE_DEVICE_LINK=0): MXFP4 slots dequantized as they compute, and a prompt past
    stream_from streaming the packed experts to the GPU, give the resident logits."""
    monkeypatch.setenv("MOESERVE_DEVICE_LINK", "0")
    moe = moeserve.ModelSpec.from_dir(mxfp4_checkpoint).moe.layer_indices()
    tokens = torch.randint(3, 97, (2, 40), device="cuda")  # 80 tokens a layer call: past stream_from
    expected = moeserve.load_model(mxfp4_checkpoint, device="cuda", dtype="float32")
    want_long, want_short = expected(tokens), expected(tokens[:, :6])
    model, runtime = hybrid_model(mxfp4_checkpoint, HybridPlacement.choose(moe, cpu_moe=True, cache_slots=6))
    assert runtime.streamer is not None and runtime.streamer.pool.buffers[0].dtype == torch.uint8
    for _ in range(3):  # later passes: admitted experts in slots
        torch.testing.assert_close(model(tokens[:, :6]), want_short, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(model(tokens), want_long, atol=1e-3, rtol=1e-3)
    summary = runtime.summary()
    assert summary["experts_streamed"] > 0 and summary["admitted"] > 0 and summary["gpu_pairs"] > 0
    runtime.close()
