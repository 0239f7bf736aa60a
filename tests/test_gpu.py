"""CUDA paths (grouped GEMM experts, bf16 generation); skipped without a GPU."""

import copy

import pytest
import torch

import moeserve
from moeserve.model.experts import grouped_mm_available
from moeserve.model.moe import MoEBlock
from moeserve.spec import ModelSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_block(E, k, D, F, device="cuda"):
    spec = ModelSpec(family="mixtral", vocab_size=8, hidden_size=D, num_layers=1, num_heads=1, num_kv_heads=1,
                     head_dim=D, max_position_embeddings=8, num_experts=E, top_k=k, expert_ffn=F, moe_layers=(True,))
    block = MoEBlock(spec)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * D ** -0.5)
    return block.to(device, torch.bfloat16).eval()


@pytest.mark.parametrize("T", [1, 7, 64, 333])
@pytest.mark.parametrize("E,k,D,F", [(8, 2, 1024, 1536), (64, 6, 512, 176)])
def test_grouped_experts_match_fp64_reference(T, E, k, D, F):
    block = random_block(E, k, D, F)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    if not grouped_mm_available(x, D, F):
        pytest.skip("torch._grouped_mm needs sm90+")
    with torch.no_grad():
        out = block(x).double()
        ids, w, _ = block.gate(x)
        ref = torch.zeros_like(out)
        gu, dn = block.experts.gate_up_proj.double(), block.experts.down_proj.double()
        for t in range(T):
            for j in range(k):
                e = int(ids[t, j])
                g, u = (gu[e] @ x[t].double()).chunk(2)
                ref[t] += float(w[t, j]) * (dn[e] @ (torch.nn.functional.silu(g) * u))
    rel = (out - ref).norm() / ref.norm()
    assert rel < 1e-2, rel


def test_all_tokens_to_one_expert_and_empty_experts():
    """Skewed routing: every token picks expert 3 first; most experts get no tokens at all."""
    from moeserve.kernels.routing import build_routing_table, combine
    from moeserve.model.experts import LoopedExperts

    block = random_block(8, 2, 256, 512)
    x = torch.randn(50, 256, device="cuda", dtype=torch.bfloat16)
    x[:, 0] = x[:, 0].abs() + 1
    with torch.no_grad():
        block.gate.weight[3, 0] = 100.0
        ids, w, _ = block.gate(x)
        assert (ids[:, 0] == 3).all()
        out = block.experts(x, ids, w)
        table = build_routing_table(ids, w, 8)
        ref = combine(LoopedExperts.run_sorted(block.experts, x[table.token_ids], table), table, 50, x.dtype)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


def test_generation_on_gpu_matches_cpu_fp32(byte_model_dir):
    from moeserve.engine.generate import generate
    from moeserve.engine.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = [[256, 72, 105], [256, 84, 111, 32, 98, 101]]
    gpu = generate(moeserve.load_model(byte_model_dir, device="cuda", dtype=torch.float32), prompts, params)
    cpu = generate(moeserve.load_model(byte_model_dir, device="cpu", dtype=torch.float32), prompts, params)
    assert [g.token_ids for g in gpu] == [c.token_ids for c in cpu]


def test_quantize_and_run_quantized_linear_on_cuda():
    from moeserve.quant import hqq, milo
    from moeserve.quant.qlinear import QuantizedLinear

    W = torch.randn(512, 1024) * 0.02
    quantize = lambda M: hqq.quantize_hqq(M, 3, 64)  # noqa: E731
    q_cpu, bufs_cpu, e_cpu = milo.fit(W, 16, quantize, 3, iters=5)
    q_gpu, bufs_gpu, e_gpu = milo.fit(W.cuda(), 16, quantize, 3, iters=5)
    assert abs(e_gpu[-1] - e_cpu[-1]) < 0.02 * e_cpu[-1]  # same algorithm, different float rounding
    layer = QuantizedLinear.from_quantized(q_gpu, bufs_gpu, 16, 3).cuda()
    ref = copy.deepcopy(layer).cpu()
    x = torch.randn(9, 1024)
    torch.testing.assert_close(layer(x.cuda()).cpu(), ref(x), atol=1e-4, rtol=1e-4)
    assert layer(x.cuda().bfloat16()).dtype == torch.bfloat16
