"""The dense part at 8 bits (quant/dense.py, load_model(dense_bits=8)): each converted layer is exactly HQQ 8-bit of
the float weight, the rest untouched, the planner's byte count is the loaded model's, the logits stay close to the
float model's and greedy tokens of the demo model mostly agree; only plain nn.Linear layers are converted.

Tolerances from HQQ's 8-bit error: a group of 64 weights rounds to a step of (max - min) / 255 of the group; Gaussian
weights span about 5 sigma in 64 draws, so the rounding error is about step / sqrt(12) = 5 / 255 / 3.46 = 0.57% of
the weights' RMS (measured: 0.51-0.55% on the demo's layers), and a layer's output moves by as much relative to its
RMS. The logits gather the errors of the n quantized layers on the way; independent errors add in quadrature, so
about sqrt(n) x 0.57% (2.8% over the demo's 25 layers; MoE routing that flips on a near tie adds to it): the test
allows twice that. Bf16 compute moves the demo's logits by as much (0.6% to 3.5% on random tokens)."""

import math

import pytest
import torch
from torch import nn

import moeserve
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.loader import is_routed_expert
from moeserve.parallel.tensor_parallel import RowParallelLinear
from moeserve.plan.footprint import dense_bytes
from moeserve.quant import hqq
from moeserve.quant.dense import DENSE_GROUP, dense_linears, quantize_dense
from moeserve.quant.qlinear import QuantizedLinear
from moeserve.tokenizer import load_tokenizer

FAMILIES = ["qwen2_moe", "deepseek_v2", "phimoe", "llama4"]  # shared experts + a dense layer, MLA, biases, Llama-4
LAYER_ERROR = 5 / 255 / math.sqrt(12)  # HQQ 8-bit's rounding error relative to the weights' RMS (module docstring)


def non_expert_bytes(model) -> int:
    """Bytes of every parameter and buffer but the routed experts and the rotary tables (computed, not stored)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.numel() * t.element_size() for name, t in named
               if not is_routed_expert(name) and not name.startswith("rotary."))


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_layers_are_hqq_8bit_of_the_float_weights(hf_checkpoints, family):
    path = hf_checkpoints[family][1]
    ref = moeserve.load_model(path)
    model = moeserve.load_model(path, dense_bits=8)
    names = {t.name for t in dense_linears(model.spec)}
    assert names, "the shape has layers to convert"
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            assert name in names and (module.bits, module.group) == (8, DENSE_GROUP)
    params = dict(model.named_parameters())
    for name in names:
        q, w = model.get_submodule(name), ref.get_submodule(name)
        by_hand = hqq.dequantize(hqq.quantize_hqq(w.weight.float(), 8, DENSE_GROUP))  # [out, in]
        assert isinstance(q, QuantizedLinear) and torch.equal(q.weight(torch.float32), by_hand), name
        assert (q.bias is None) == (w.bias is None) and (q.bias is None or torch.equal(q.bias, w.bias))
    for name, p in ref.named_parameters():  # embeddings, norms, routers, experts, layers no group divides: as read
        if name.rsplit(".", 1)[0] not in names:
            assert torch.equal(params[name], p), name


def test_mla_layers_no_group_divides_stay_float(hf_checkpoints):
    """DeepSeek-V2's kv_b_proj reads the 32 latents and o_proj 4 heads x 12 values: no group of 64 divides them."""
    model = moeserve.load_model(hf_checkpoints["deepseek_v2"][1], dense_bits=8)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_a_proj, QuantizedLinear) and isinstance(attn.kv_a_proj_with_mqa, QuantizedLinear)
    assert type(attn.kv_b_proj) is nn.Linear and type(attn.o_proj) is nn.Linear


@pytest.mark.parametrize("family", FAMILIES)
def test_planner_counts_the_loaded_bytes(hf_checkpoints, family):
    """dense_bytes at 8 (and 16) bits is what the loaded model holds besides its routed experts, scales and zeros
    included."""
    path = hf_checkpoints[family][1]
    spec = moeserve.ModelSpec.from_dir(path)
    assert non_expert_bytes(moeserve.load_model(path)) == dense_bytes(spec, 4)
    assert non_expert_bytes(moeserve.load_model(path, dense_bits=8)) == dense_bytes(spec, 4, 8) < dense_bytes(spec, 4)


@pytest.fixture(scope="module")
def demo_models():
    """(float32 demo model, the same with its dense part 8-bit)."""
    return moeserve.load_model(moeserve.DEMO_MODEL), moeserve.load_model(moeserve.DEMO_MODEL, dense_bits=8)


def test_each_layer_moves_by_the_rounding_error(demo_models):
    ref, model = demo_models
    g = torch.Generator().manual_seed(3)
    for t in dense_linears(model.spec):
        x = torch.randn(16, t.shape[1], generator=g)  # [T, in]
        want = ref.get_submodule(t.name)(x)
        err = (model.get_submodule(t.name)(x) - want).norm() / want.norm()
        assert 0 < err < 1.5 * LAYER_ERROR, t.name


def test_logits_close_to_the_float_model(demo_models):
    ref, model = demo_models
    n = len(dense_linears(model.spec))
    tokens = torch.randint(0, 256, (6, 48), generator=torch.Generator().manual_seed(11))  # [B, S]
    with torch.inference_mode():
        want, got = ref(tokens), model(tokens)  # [B, S, V]
    err = float((got - want).norm() / want.norm())
    assert 0 < err < 2 * math.sqrt(n) * LAYER_ERROR
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_greedy_tokens_mostly_agree(demo_models):
    """Greedy continuations of the trained demo model: its 8-bit dense twin picks the float model's token at >= 90% of
    the steps of the float model's continuations (teacher-forced), and continues at least half the prompts alike."""
    ref, model = demo_models
    tok = load_tokenizer(moeserve.DEMO_MODEL)
    prompts = [tok.encode(p) for p in ("HAMLET. To be, or not to be", "KING. What says", "OPHELIA. My lord,",
                                       "Enter HORATIO and")]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = [r.token_ids for r in generate(ref, prompts, params)]
    got = [r.token_ids for r in generate(model, prompts, params)]
    assert sum(a == b for a, b in zip(want, got)) >= len(prompts) / 2
    agree = []
    with torch.inference_mode():
        for prompt, cont in zip(prompts, want):
            seq = torch.tensor([prompt + cont[:-1]])  # [1, S]
            picked = model(seq)[0, len(prompt) - 1:].argmax(-1)  # [24]: the 8-bit model's pick at each step
            agree += (picked == torch.tensor(cont)).tolist()
    assert sum(agree) / len(agree) >= 0.9


def test_only_plain_linear_layers_are_converted(hf_checkpoints):
    """A tensor-parallel closing projection (RowParallelLinear) and an nn.Linear subclass keep their float weights;
    quantize_dense converts the others, in place."""

    class Tagged(nn.Linear):
        pass

    model = moeserve.load_model(hf_checkpoints["qwen2_moe"][1])
    attn = model.model.layers[0].self_attn
    attn.o_proj = RowParallelLinear(attn.o_proj.weight, None, group=None)
    head = Tagged(model.spec.hidden_size, model.spec.vocab_size, bias=False)
    model.lm_head = head
    names = quantize_dense(model)
    assert "model.layers.0.self_attn.o_proj" not in names and "lm_head" not in names
    assert type(attn.o_proj) is RowParallelLinear and model.lm_head is head
    assert isinstance(attn.q_proj, QuantizedLinear) and "model.layers.1.self_attn.o_proj" in names
