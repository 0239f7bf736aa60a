"""The dense part at 8 bits on a GPU (skipped without one): the demo model in bf16 with its dense layers 8-bit runs
them through the Triton low-bit kernel, its logits stay as close to the float bf16 model's as tests/quant/test_dense.py
allows on the CPU, decode as CUDA graphs gives the eager tokens, and the GPU holds what the planner counts."""

import math

import pytest
import torch

import moeserve
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.loader import is_routed_expert
from moeserve.plan.footprint import dense_bytes
from moeserve.quant.dense import dense_linears
from moeserve.quant.qlinear import triton_applies

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LAYER_ERROR = 5 / 255 / math.sqrt(12)  # HQQ 8-bit's rounding error relative to the weights' RMS (test_dense.py)


@pytest.fixture(scope="module")
def demo_models():
    """(bf16 demo model on the GPU, the same with its dense part 8-bit)."""
    return (moeserve.load_model(moeserve.DEMO_MODEL, device="cuda", dtype="bfloat16"),
            moeserve.load_model(moeserve.DEMO_MODEL, device="cuda", dtype="bfloat16", dense_bits=8))


def test_gpu_logits_close_and_graph_decode_equals_eager(demo_models):
    ref, model = demo_models
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(1, 1, q.in_features, device="cuda", dtype=torch.bfloat16)  # [B, S, D]
    assert triton_applies(x, 1, q.bits, q.group, q.in_features)
    tokens = torch.randint(0, 256, (6, 48), device="cuda", generator=torch.Generator("cuda").manual_seed(11))
    with torch.inference_mode():
        want, got = ref(tokens).float(), model(tokens).float()  # [B, S, V]
    err = float((got - want).norm() / want.norm())
    assert 0 < err < 2 * math.sqrt(len(dense_linears(model.spec))) * LAYER_ERROR
    prompts = [[256, *b"HAMLET. To be"], [256, *b"KING. What says"]]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    graphed = [r.token_ids for r in generate(model, prompts, params, cuda_graph=True)]
    assert graphed == [r.token_ids for r in generate(model, prompts, params, cuda_graph=False)]


def test_gpu_holds_what_the_planner_counts(demo_models):
    for model, bits in zip(demo_models, (16, 8)):
        held = sum(t.numel() * t.element_size() for name, t in (*model.named_parameters(), *model.named_buffers())
                   if not is_routed_expert(name) and not name.startswith("rotary."))
        assert held == dense_bytes(model.spec, 2, bits)
