"""PR-MoE (moeserve's PRMoEForCausalLM): the config reader, and the forward pass against a plain PyTorch
reference written here from the paper's description (pyramid of expert counts, residual MoE layers)."""

import json

import pytest
import torch
import torch.nn.functional as F

import moeserve
from moeserve.errors import MoeserveError
from moeserve.spec import ModelSpec
from prmoe_models import save_prmoe_model, tiny_arch


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, pos, theta=10000.0):
    """Rotate-half rope: x [B, H, S, Dh], pos [S]."""
    Dh = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)  # [Dh/2]
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1).to(x.dtype)  # [S, Dh]
    x1, x2 = x.chunk(2, dim=-1)
    return x * ang.cos() + torch.cat((-x2, x1), dim=-1) * ang.sin()


def swiglu_ffn(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def reference_logits(state: dict, cfg: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The PR-MoE forward in float64 from the checkpoint's tensors: each MoE layer routes top-k of its own
    experts (softmax over them, renormalised for k > 1) and, when residual, returns
    c0 * experts + c1 * MLP with c = softmax(coefficient(x))."""
    sd = {k: v.double() for k, v in state.items()}
    H, Hkv, Dh, eps, k = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                          cfg["rms_norm_eps"], cfg["num_experts_per_tok"])
    B, S = tokens.shape
    x = sd["model.embed_tokens.weight"][tokens]  # [B, S, D]
    pos = torch.arange(S, dtype=torch.float64)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    for i, E in enumerate(cfg["num_experts_per_layer"]):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"], eps)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(B, S, H, Dh).transpose(1, 2)
        kk = (h @ sd[p + "self_attn.k_proj.weight"].T).view(B, S, Hkv, Dh).transpose(1, 2)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(B, S, Hkv, Dh).transpose(1, 2)
        q, kk = rotate(q, pos), rotate(kk, pos)
        kk, v = kk.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)  # [B, H, S, Dh]
        att = (q @ kk.transpose(-1, -2) / Dh ** 0.5).masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(B, S, H * Dh) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"], eps).reshape(B * S, -1)  # [T, D]
        if E == 0:
            out = swiglu_ffn(h, *(sd[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
        else:
            probs = (h @ sd[p + "mlp.gate.weight"].T).softmax(-1)  # [T, E]
            w, ids = probs.topk(k, dim=-1)
            if k > 1:
                w = w / w.sum(-1, keepdim=True)
            gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]  # [E, 2F, D], [E, D, F]
            F_ = down.shape[-1]
            out = torch.zeros_like(h)
            for t in range(h.shape[0]):
                for j in range(k):
                    e = ids[t, j]
                    out[t] += w[t, j] * swiglu_ffn(h[t], gate_up[e, :F_], gate_up[e, F_:], down[e])
            if cfg["residual"]:
                mlp = swiglu_ffn(h, *(sd[p + f"mlp.shared_expert.{n}_proj.weight"] for n in ("gate", "up", "down")))
                c = (h @ sd[p + "mlp.coefficient.weight"].T + sd[p + "mlp.coefficient.bias"]).softmax(-1)  # [T, 2]
                out = c[:, :1] * out + c[:, 1:] * mlp
        x = x + out.view(B, S, -1)
    return rms(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("experts,top_k,residual", [((2, 4, 8), 1, True), ((4, 0, 8), 2, True),
                                                    ((2, 2, 4), 2, False)])
def test_prmoe_forward_equals_reference(tmp_path, experts, top_k, residual):
    path = save_prmoe_model(tmp_path / "m", tiny_arch(experts, top_k, residual), seed=sum(experts) + top_k)
    cfg = json.loads((path / "config.json").read_text())
    model = moeserve.load_model(path, device="cpu", dtype=torch.float32)
    state = {k: v.float() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 258, (2, 11), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = model(tokens)
    ref = reference_logits(state, cfg, tokens)
    assert (ours.double() - ref).abs().max() < 1e-4
    assert ref.std() > 0.1  # a model whose layers all matter, not a constant


def test_prmoe_spec_reads_the_pyramid_and_counts_parameters(tmp_path):
    arch = tiny_arch((2, 0, 8), top_k=1, residual=True)
    spec = ModelSpec.from_hf_config(arch.hf_config(64))
    assert spec.family == "prmoe" and spec.moe.layers == (True, False, True) and spec.moe.experts_at(2) == 8
    assert spec.moe.num_experts == 8 and not spec.moe.norm_topk_prob and spec.moe.shared_expert_ffn == arch.expert_ffn
    model = moeserve.load_model(save_prmoe_model(tmp_path / "m", arch), device="cpu")
    assert sum(p.numel() for p in model.parameters()) == spec.parameter_counts()["total"]


@pytest.mark.parametrize("change,message", [({"num_experts_per_layer": [2, 4]}, "must list 3"),
                                            ({"num_experts_per_layer": [1, 4, 8], "num_experts_per_tok": 2},
                                             "at least top-2"),
                                            ({"num_experts_per_layer": [0, 0, 0]}, "needs an MoE layer")])
def test_prmoe_config_errors_name_the_field(change, message):
    cfg = {**tiny_arch().hf_config(64), **change}
    with pytest.raises(MoeserveError, match=message):
        ModelSpec.from_hf_config(cfg)


def test_prmoe_offloaded_and_hybrid_generate_as_resident(tmp_path, capsys):
    """Layers of 2, 4 and 8 experts through the expert store: offloaded at full precision (--all-high, a cache
    smaller than a layer, prefetching across layers of other sizes) and computed on the CPU (--cpu-moe) give the
    resident model's greedy text."""
    from moeserve.cli import main

    path = save_prmoe_model(tmp_path / "m", tiny_arch((2, 4, 8), 1, True), seed=11)
    store = tmp_path / "experts"
    assert main(["offload-prepare", "--model", str(path), "--out", str(store), "--group", "8"]) == 0
    gen = ["generate", "--model", str(path), "--greedy", "--max-new-tokens", "12", "--device", "cpu", "KING."]
    outputs = []
    for extra in ([], ["--offload", str(store), "--high-slots", "3", "--all-high"], ["--cpu-moe"]):
        capsys.readouterr()
        assert main(gen + extra) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) > len("KING.")
