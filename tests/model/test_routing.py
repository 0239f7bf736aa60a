"""Routing table, combine and the MoE block against plain float64 loops."""

import torch

from moeserve.kernels.routing import build_routing_table, combine
from moeserve.model.moe import MoEBlock
from moeserve.model.router import softmax_topk
from moeserve.spec import ModelSpec


def test_routing_table_groups_by_expert_stably():
    T, k, E = 37, 3, 9
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])  # [T, k] distinct per token
    weights = torch.rand(T, k)
    table = build_routing_table(ids, weights, E)
    assert table.counts.tolist() == torch.bincount(ids.flatten(), minlength=E).tolist()
    assert table.offsets.tolist() == torch.cumsum(table.counts, 0).tolist()
    start = 0
    for e, n in enumerate(table.counts.tolist()):
        tokens = table.token_ids[start:start + n].tolist()
        assert tokens == sorted(tokens)  # stable: token order kept inside an expert
        assert all(e in ids[t].tolist() for t in tokens)
        for t, w in zip(tokens, table.weights[start:start + n].tolist()):
            assert w == weights[t][ids[t].tolist().index(e)].item()
        start += n


def test_combine_equals_weighted_scatter_loop():
    T, k, E, D = 20, 2, 5, 6
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k, dtype=torch.float64)
    table = build_routing_table(ids, weights, E)
    rows = torch.randn(T * k, D, dtype=torch.float64)
    ref = torch.zeros(T, D, dtype=torch.float64)
    for i in range(T * k):
        ref[table.token_ids[i]] += table.weights[i] * rows[i]
    assert torch.allclose(combine(rows, table, T, torch.float64), ref)


def test_moe_block_matches_float64_per_token_loop():
    spec = ModelSpec.of(family="qwen2_moe", vocab_size=8, hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1,
                     head_dim=16, max_position_embeddings=8, num_experts=6, top_k=3, expert_ffn=12,
                     norm_topk_prob=False, moe_layers=(True,), shared_expert_ffn=10, shared_expert_gate=True)
    block = MoEBlock(spec).double()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    with torch.no_grad():
        out = block(x).reshape(-1, 16)
    silu = torch.nn.functional.silu
    flat = x.reshape(-1, 16)
    ids, w = softmax_topk(flat @ block.gate.weight.T, 3, normalize=False)
    gu, dn = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    se = block.shared_expert
    for t in range(flat.shape[0]):
        ref = sum(w[t, j] * (dn[e] @ (silu(gu[e, :12] @ flat[t]) * (gu[e, 12:] @ flat[t])))
                  for j, e in enumerate(ids[t].tolist()))
        shared = se.down_proj.weight @ (silu(se.gate_proj.weight @ flat[t]) * (se.up_proj.weight @ flat[t]))
        ref = ref + torch.sigmoid(block.shared_expert_gate.weight @ flat[t]) * shared
        assert torch.allclose(out[t], ref.detach(), atol=1e-12)
