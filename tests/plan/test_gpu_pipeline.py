"""CGOPipe executor on a GPU (copy stream, pinned host KV, CPU-attention worker thread): the same greedy
tokens and step logits as the plain engine under every schedule, for every kind of attention and expert; skipped
without a GPU."""

import random

import pytest
import torch

import moeserve
from hf_models import write_mxfp4_pair
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.plan.pipeline import SCHEDULES, Pipeline
from moeserve.plan.policy import ThroughputPolicy
from test_pipeline import PROMPTS, plain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("fraction,n", [(0.0, 1), (0.5, 2), (1.0, 4)])
def test_gpu_pipeline_matches_plain_engine(hf_checkpoints, schedule, fraction, n):
    path = hf_checkpoints["qwen2_moe"][1]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    ref_tokens, ref_logits = plain(moeserve.load_model(path, device="cuda", dtype="float32"), PROMPTS, params)
    host = moeserve.load_model(path, device="cpu", dtype="float32")
    pipeline = Pipeline(host, ThroughputPolicy(batch_size=4, micro_batch=n, weights_gpu_fraction=fraction,
                                               **SCHEDULES[schedule]), "cuda")
    steps = [(gens, logits.clone()) for gens, _, logits in pipeline.generate(PROMPTS, params)]
    pipeline.close()
    assert [g.token_ids for g in steps[-1][0]] == ref_tokens
    for (_, a), b in zip(steps, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("schedule", ["cgopipe", "flexgen"])
def test_gpu_pipeline_reuses_buffers_safely(hf_checkpoints, schedule):
    """One pipeline, two batches of fresh random prompts, 12 steps each: the page-locked buffers, host KV rows
    and copy-stream tensors reused every step and batch never corrupt a result."""
    path = hf_checkpoints["mixtral"][1]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    device_model = moeserve.load_model(path, device="cuda", dtype="float32")
    host = moeserve.load_model(path, device="cpu", dtype="float32")
    pipeline = Pipeline(host, ThroughputPolicy(batch_size=6, micro_batch=2, weights_gpu_fraction=0.0,
                                               **SCHEDULES[schedule]), "cuda")
    rng = random.Random(11)
    for _ in range(2):
        prompts = [[rng.randrange(host.spec.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(5)]
        ref_tokens, ref_logits = plain(device_model, prompts, params)
        steps = [(gens, logits.clone()) for gens, _, logits in pipeline.generate(prompts, params)]
        assert [g.token_ids for g in steps[-1][0]] == ref_tokens
        for (_, a), b in zip(steps, ref_logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    pipeline.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "granitemoe", "gpt_oss", "gpt_oss_mxfp4"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_gpu_pipeline_runs_each_family(hf_checkpoints, tmp_path_factory, family, schedule):
    """MLA (latent query on the GPU, attention over the latents on the CPU), Granite's multipliers and GPT-OSS (sinks,
    sliding windows, expert biases, clamped SwiGLU; MXFP4 blocks streamed as they are): greedy tokens as the plain
    engine's on the GPU, half the layers streamed."""
    path = hf_checkpoints[family.removesuffix("_mxfp4")][1]
    if family.endswith("_mxfp4"):
        packed = tmp_path_factory.mktemp("mxfp4")
        write_mxfp4_pair(path, packed, tmp_path_factory.mktemp("twin"))
        path = packed
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    want = [g.token_ids for g in generate(moeserve.load_model(path, device="cuda", dtype="float32"), PROMPTS, params)]
    host = moeserve.load_model(path, device="cpu", dtype="float32")
    pipeline = Pipeline(host, ThroughputPolicy(batch_size=4, micro_batch=2, weights_gpu_fraction=0.5,
                                               **SCHEDULES[schedule]), "cuda")
    *_, (gens, _, _) = pipeline.generate(PROMPTS, params)
    pipeline.close()
    assert [g.token_ids for g in gens] == want
