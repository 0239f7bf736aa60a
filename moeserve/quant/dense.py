"""The dense part's linear layers at 8 bits (`--dense-bits 8`): which layers and the HQQ
QuantizedLinear that replaces each (plan/footprint.py counts their bytes).

Converted: the attention projections (q/k/v/o, or MLA's q_a/q_b/kv_a/kv_b/o), the shared experts' and dense FFN
layers' gate/up/down, and the LM head when it is not tied to the embeddings (a tied head would add an 8-bit copy
beside the table it shares). Left as they are: the embedding table (a lookup reads one row per token), norms, routers,
the shared-expert gate and PR-MoE's mix (few bytes, and routing decisions are sensitive), a layer whose inputs a group
of DENSE_GROUP does not divide, and any module that is not a plain nn.Linear (a tensor-parallel slice, an already
quantized layer): only `type(m) is nn.Linear` is replaced.

HQQ at 8 bits with groups of 64 keeps 8 + 2 x 16 / 64 = 8.5 bits per weight (llama.cpp's Q8_0 keeps 8.5 too), about
half of bf16; the weights round to a step of (max - min) / 255 of their group.
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.quant import hqq
from moeserve.quant.qlinear import QuantizedLinear
from moeserve.quant.ranks import TensorInfo

DENSE_GROUP = 64  # inputs per scale/zero group of an 8-bit dense layer


def mlp_linears(prefix: str, kind: str, layer: int, D: int, F: int) -> list[TensorInfo]:
    """gate/up [F, D] and down [D, F] of a SwiGLU FFN whose module is `prefix`."""
    return [TensorInfo(f"{prefix}.gate_proj", kind, layer, None, (F, D)),
            TensorInfo(f"{prefix}.up_proj", kind, layer, None, (F, D)),
            TensorInfo(f"{prefix}.down_proj", kind, layer, None, (D, F))]


def layer_linears(spec, i: int) -> list[TensorInfo]:
    """The dense linear weights of decoder layer i, named by their modules: its attention projections, then its dense
    FFN (a dense layer) or shared expert (an MoE layer that has one)."""
    out = [TensorInfo(f"model.layers.{i}.self_attn.{proj}", "attention", i, None, (out_features, in_features))
           for proj, out_features, in_features, _ in spec.attention_projections()]
    mlp = f"model.layers.{i}.mlp"
    if not spec.moe.layers[i]:
        return out + mlp_linears(mlp, "dense_ffn", i, spec.hidden_size, spec.moe.dense_ffn)
    if spec.moe.shared_expert_ffn:
        out += mlp_linears(f"{mlp}.shared_expert", "shared_expert", i, spec.hidden_size, spec.moe.shared_expert_ffn)
    return out


def dense_linears(spec) -> list[TensorInfo]:
    """The linear layers `--dense-bits 8` converts (see the module docstring): every layer's, then an untied LM head
    (kind "lm_head", layer num_layers), those whose inputs DENSE_GROUP divides."""
    out = [t for i in range(spec.num_layers) for t in layer_linears(spec, i)]
    if not spec.tie_word_embeddings:
        out.append(TensorInfo("lm_head", "lm_head", spec.num_layers, None, (spec.vocab_size, spec.hidden_size)))
    return [t for t in out if t.shape[1] % DENSE_GROUP == 0]


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, bits: int, group: int) -> QuantizedLinear:
    """weight [out, in] (any float dtype) -> an HQQ QuantizedLinear on weight's device (quantized there: a GPU takes
    milliseconds per matrix), with bias as it is given."""
    return QuantizedLinear.from_quantized(hqq.quantize_hqq(weight.detach().float(), bits, group), bias=bias)


def plain_linear(model: nn.Module, name: str) -> nn.Linear | None:
    """The module `name` when it is a plain nn.Linear (not a subclass: tensor-parallel layers do more than
    x W^T + b), else None (another module, or no module of that name)."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    return module if type(module) is nn.Linear else None


def convertible(model: nn.Module) -> list[str]:
    """The names of the model's dense linear layers (dense_linears of its spec) that are plain nn.Linear modules."""
    return [t.name for t in dense_linears(model.spec) if plain_linear(model, t.name) is not None]


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def quantize_dense(model: nn.Module, bits: int = 8, group: int = DENSE_GROUP) -> list[str]:
    """Replace a loaded model's convertible dense linear layers by B-bit HQQ QuantizedLinear on their device (the
    bias kept in its dtype); returns the names replaced. The loader does this as it reads (loader.load_model with
    dense_bits), so that only one float layer is on the device at a time."""
    names = convertible(model)
    for name in names:
        linear = model.get_submodule(name)
        bias = None if linear.bias is None else linear.bias.detach()
        replace_module(model, name, quantize_linear(linear.weight, bias, bits, group))
    return names
