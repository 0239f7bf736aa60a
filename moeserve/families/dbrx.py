"""DBRX (DbrxForCausalLM): its own config names (d_model, attn_config, ffn_config), LayerNorms without bias (eps
1e-5), clip_qkv on the fused qkv, softmax top-k with the top weights divided by their p-norm (p = 1: renormalised;
None: as they are; other p refused). Checkpoints hold a fused Wqkv and fused expert tensors, split on reading."""

from __future__ import annotations

from dataclasses import replace

from moeserve.errors import MoeserveError
from moeserve.families.common import Family, common_fields, heads
from moeserve.layouts import Rule, rows, same
from moeserve.spec_parts import AttentionSpec, MoESpec


def read(cfg: dict) -> dict:
    attn, ffn = cfg.get("attn_config") or {}, cfg.get("ffn_config") or {}
    p = ffn.get("moe_normalize_expert_weights", 1)
    if p not in (None, 1):
        raise MoeserveError(f"DBRX ffn_config.moe_normalize_expert_weights {p!r} is not supported (1 or null)")
    flat = dict(cfg, hidden_size=cfg["d_model"], num_attention_heads=cfg["n_heads"], num_hidden_layers=cfg["n_layers"],
                num_key_value_heads=attn.get("kv_n_heads", 1), max_position_embeddings=cfg.get("max_seq_len", 2048),
                hidden_act=(ffn.get("ffn_act_fn") or {}).get("name", "silu"), rms_norm_eps=1e-5,
                rope_theta=attn.get("rope_theta", 10000.0))
    c = common_fields(flat, "dbrx")
    L = c["num_layers"]
    c["norm"] = replace(c["norm"], kind="layer_no_bias")
    return dict(**c, attention=AttentionSpec(**heads(flat), clip_qkv=attn.get("clip_qkv"),
                                             sliding_windows=(None,) * L),
                moe=MoESpec(num_experts=ffn["moe_num_experts"], top_k=ffn["moe_top_k"],
                            expert_ffn=ffn["ffn_hidden_size"], norm_topk_prob=p is not None,
                            router_weights_fp32=False, layers=(True,) * L))


def layout(spec) -> list[Rule]:
    """The stored tensors of a DBRX checkpoint (spec: its ModelSpec) as moeserve's."""
    import torch  # on use: the families are read by `import moeserve`, which stays torch-free

    E, F, D = spec.moe.num_experts, spec.moe.expert_ffn, spec.hidden_size
    a = spec.attention
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    block, layer = r"^transformer\.blocks\.(\d+)\.", r"model.layers.\1."
    return [
        (r"^transformer\.wte\.weight$", [("model.embed_tokens.weight", (), same)]),
        (r"^transformer\.norm_f\.weight$", [("model.norm.weight", (), same)]),
        (block + r"norm_attn_norm\.norm_1\.weight$", [(layer + "input_layernorm.weight", (), same)]),
        (block + r"norm_attn_norm\.norm_2\.weight$", [(layer + "post_attention_layernorm.weight", (), same)]),
        (block + r"norm_attn_norm\.attn\.Wqkv\.weight$",  # [q + 2 kv, D]
         [(layer + "self_attn.q_proj.weight", (), rows(0, q)),
          (layer + "self_attn.k_proj.weight", (), rows(q, q + kv)),
          (layer + "self_attn.v_proj.weight", (), rows(q + kv, q + 2 * kv))]),
        (block + r"norm_attn_norm\.attn\.out_proj\.weight$", [(layer + "self_attn.o_proj.weight", (), same)]),
        (block + r"ffn\.router\.layer\.weight$", [(layer + "mlp.gate.weight", (), same)]),
        # w1 (gate) and v1 (up) [E*F, D] -> [E, 2F, D]; w2 [E*F, D] is each expert's down weight transposed
        (block + r"ffn\.experts\.mlp\.w1$",
         [(layer + "mlp.experts.gate_up_proj", (r"transformer.blocks.\1.ffn.experts.mlp.v1",),
           lambda w1, v1: torch.cat([w1.view(E, F, D), v1.view(E, F, D)], 1))]),
        (block + r"ffn\.experts\.mlp\.w2$",
         [(layer + "mlp.experts.down_proj", (), lambda w2: w2.view(E, F, D).transpose(1, 2).contiguous())]),
    ]


FAMILIES = (Family("dbrx", ("DbrxForCausalLM",), read, layout=layout),)
