"""The CGOPipe pipeline runs each family's own layer code: DeepSeek-V3 (MLA: a latent cache, attention in the latent
space on the CPU), Granite-MoE (embedding, residual, attention and logits multipliers), GPT-OSS with MXFP4 experts as
shipped (sinks, sliding windows, expert biases, clamped SwiGLU) and Qwen3-MoE give the resident model's greedy tokens;
`moeserve plan --for batch` plans for each, and the roofline counts MLA's latents and MXFP4's bytes."""


import numpy as np
import pytest

import moeserve
from hf_models import write_mxfp4_pair
from moeserve.cli import main
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.plan.pipeline import SCHEDULES, Pipeline, host_kv_bytes
from moeserve.plan.policy import ThroughputPolicy
from moeserve.plan.roofline import Workload, layer_ops

FAMILIES = ["deepseek_v3", "granitemoe", "gpt_oss_mxfp4", "qwen3_moe"]
# the 12-token prompt and 6 new tokens cross GPT-OSS's sliding window of 8
PROMPTS = [[5, 9, 13, 7, 21, 3, 8], [11, 4], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], [6, 17, 19, 23]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
POLICIES = [  # CPU attention with half the layers streamed; FlexGen with one micro-batch's KV on the GPU, FFN on the CPU
    ThroughputPolicy(4, 2, weights_gpu_fraction=0.5, **SCHEDULES["cgopipe"]),
    ThroughputPolicy(4, 2, attention_on_gpu=True, ffn_on_gpu=False, weights_gpu_fraction=0.0, kv_gpu_fraction=0.5),
]


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoints, tmp_path_factory):
    """family -> checkpoint directory; gpt_oss_mxfp4: the tiny GPT-OSS with its experts as MXFP4 blocks."""
    packed, twin = tmp_path_factory.mktemp("gpt_oss_mxfp4"), tmp_path_factory.mktemp("gpt_oss_twin")
    write_mxfp4_pair(hf_checkpoints["gpt_oss"][1], packed, twin)
    return {**{f: hf_checkpoints[f][1] for f in FAMILIES if f in hf_checkpoints}, "gpt_oss_mxfp4": packed}


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_equals_resident_greedy_generate(checkpoints, family):
    model = moeserve.load_model(checkpoints[family], device="cpu", dtype="float32")
    want = [g.token_ids for g in generate(model, PROMPTS, GREEDY)]
    for policy in POLICIES:
        pipeline = Pipeline(model, policy, "cpu")
        *_, (gens, _, _) = pipeline.generate(PROMPTS, GREEDY)
        pipeline.close()
        assert [g.token_ids for g in gens] == want, policy


def test_host_kv_bytes_counts_mla_latents(checkpoints):
    """MLA's host cache is one latent tensor per micro-batch; Staging holds the latent and the latent query."""
    model = moeserve.load_model(checkpoints["deepseek_v3"], device="cpu", dtype="float32")
    policy = ThroughputPolicy(4, 2, **SCHEDULES["cgopipe"], weights_gpu_fraction=1.0)
    pipeline = Pipeline(model, policy, "cpu")
    mbs = [pipeline._micro_batch([[1, 2, 3]] * 4, g, 5, False) for g in ([0, 1], [2, 3])]
    pipeline.close()
    assert all(mb.kv.v is None for mb in mbs)
    allocated = sum(t.nbytes for mb in mbs for t in (mb.kv.k, mb.staging.qkv, mb.staging.out))
    assert host_kv_bytes(model.spec, policy, 3 + 5, 4, pinned=False) == allocated


def test_roofline_counts_mla_latents_and_mxfp4_experts(checkpoints):
    wl = Workload(prompt_len=6, gen_len=4)
    mla = moeserve.ModelSpec.from_dir(checkpoints["deepseek_v3"])
    attn = layer_ops(mla, wl, True, None, np.array([2.0]), 1, 8.5, 8.5)["attention"]
    m, H = mla.attention.mla, mla.attention.num_heads
    # 2 sequences read 8.5 latents of r + rope values (2 bytes each); every head's query scores them over r + rope
    # values and mixes r
    assert attn.kv[0] == 2 * 8.5 * m.latent_dim * 2
    assert attn.flops[0] == 2 * 2 * H * 8.5 * (m.latent_dim + m.kv_lora_rank)
    mx = moeserve.ModelSpec.from_dir(checkpoints["gpt_oss_mxfp4"])
    assert mx.moe.experts_mxfp4
    post_mx = layer_ops(mx, wl, True, None, 1, 1, 8.5, 8.5)["post_attention"]
    post_float = layer_ops(mx.replace(experts_mxfp4=False), wl, True, None, 1, 1, 8.5, 8.5)["post_attention"]
    matrices = mx.moe.num_experts * 3 * mx.hidden_size * mx.moe.expert_ffn
    assert post_float.weights - post_mx.weights == pytest.approx(matrices * (2 - 17 / 32))  # MXFP4: 17 bytes a 32


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_plan_for_batch(checkpoints, family, h100_json, capsys):
    assert main(["plan", "--for", "batch", "--model", str(checkpoints[family]), "--profile", str(h100_json),
                 "--gpu-memory", "1GiB", "--cpu-memory", "16GiB", "--max-batch", "64", "--gen-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "policy" in out and "tokens/s" in out and "post_attention" in out
