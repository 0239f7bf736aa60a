"""CUDA paths (grouped GEMM experts, bf16 generation); skipped without a GPU."""

import copy

import pytest
import torch

import moeserve
from checks import assert_same_top_k, expert_loop_fp64, routing_ids, torch_rms_norm
from moeserve.model.experts import grouped_mm_available
from moeserve.model.moe import MoEBlock
from moeserve.spec import ModelSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_block(E, k, D, F, device="cuda"):
    spec = ModelSpec.of(family="mixtral", vocab_size=8, hidden_size=D, num_layers=1, num_heads=1, num_kv_heads=1,
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


@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("T,routing", [(300, "random"), (77, "one_expert"), (513, "random")])
@pytest.mark.parametrize("E,k,D,F", [(8, 2, 1024, 1536), (64, 6, 512, 192)])
def test_row_tile_experts_compiled_match_fp64(T, routing, E, k, D, F, tma):
    """The prefill tile kernels compiled in bf16 at tile sizes the tuner picks (128-row tiles, wgmma), through
    pointers and TMA descriptors: partial tiles, experts without rows, all tokens on one expert."""
    from moeserve.kernels.routing import build_routing_table
    from moeserve.kernels.triton.configs import ExpertsConfig, FusedMoEConfig
    from moeserve.kernels.triton.fused_moe import fused_experts

    block = random_block(E, k, D, F)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    table = build_routing_table(routing_ids(T, E, k, routing).cuda(), torch.rand(T, k, device="cuda"), E)
    cfg = {"gate_up": dict(schedule="tiles", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4,
                           TMA=tma),
           "down": dict(schedule="tiles", BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, TMA=tma)}
    x_sorted = x[table.token_ids]
    with torch.no_grad():
        out = fused_experts(x_sorted, block.experts.gate_up_proj, block.experts.down_proj, table,
                            ExpertsConfig.of(cfg, FusedMoEConfig)).double()
        ref = expert_loop_fp64(block.experts, x_sorted, table)
    assert (out - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("T", [1, 16, 64, 65])  # 65: past the fused router's limit, torch's kernels
@pytest.mark.parametrize("E,k,D,family", [(8, 2, 4096, "mixtral"), (64, 6, 2048, "qwen3_moe")])
def test_router_on_cuda_matches_torch(T, E, k, D, family):
    """TopKRouter on CUDA in inference (the one-launch Triton router up to MAX_TOKENS) vs F.linear + softmax_topk:
    logits within one bf16 rounding, the same experts, weights in the dtype the family asks for. The logits' atol:
    the two fp32 sums run in different orders, and a logit near zero (about 1 in 4096 at E=64 T=64) can land a few
    bf16 steps apart (up to 2e-6 seen on an H100; without it a quarter of those draws failed)."""
    from moeserve.model.router import TopKRouter, softmax_topk

    router = TopKRouter(D, E, k, normalize=family == "qwen3_moe", weights_fp32=family == "mixtral")
    with torch.no_grad():
        router.weight.normal_(0, D ** -0.5)
    router = router.to("cuda", torch.bfloat16)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ids, weights, logits = router(x)
    ref_logits = torch.nn.functional.linear(x, router.weight)
    torch.testing.assert_close(logits.float(), ref_logits.float(), atol=1e-5, rtol=2 ** -7)
    ref_ids, ref_weights = softmax_topk(logits, k, router.normalize)  # the torch router on these logits
    assert_same_top_k(ids, ref_ids, logits)
    assert weights.dtype == (torch.float32 if router.weights_fp32 else torch.bfloat16)
    torch.testing.assert_close(weights.float(), ref_weights, atol=0, rtol=1e-5 if router.weights_fp32 else 2 ** -8)


@pytest.mark.parametrize("S", [1, 7])
def test_norm_and_rotary_on_cuda_match_torch(S):
    """The decode layer's RMSNorm and rotary (one Triton launch each, taken by RMSNorm / apply_rotary on CUDA) vs
    the torch expressions on CUDA in bf16, Mixtral shapes: rotary bit for bit; the norm at most one bf16 step apart
    (its fp32 sum runs in another order) and nearly always equal."""
    from moeserve.model.layers import RMSNorm, apply_rotary

    norm = RMSNorm(4096, 1e-5)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
    norm = norm.to("cuda", torch.bfloat16)
    x = torch.randn(2, S, 4096, device="cuda", dtype=torch.bfloat16) * 3
    with torch.no_grad():
        got = norm(x)
    ref = torch_rms_norm(x, norm.weight, 1e-5)
    torch.testing.assert_close(got, ref, atol=0, rtol=2 ** -7)
    assert (got == ref).float().mean() > 0.99
    q = torch.randn(2, S, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # [B, H, S, Dh] view
    angle = torch.rand(2, S, 64, device="cuda") * 1000
    cos, sin = (torch.cat((f(angle), f(angle)), -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    c, s = cos[:, None], sin[:, None]
    ref = q * c + torch.cat((-q[..., 64:], q[..., :64]), dim=-1) * s  # apply_rotary's torch expression
    assert torch.equal(apply_rotary(q, cos, sin), ref)
    h = torch.randn_like(x)
    with torch.no_grad():
        normed, total = norm.added(x, h)
    assert torch.equal(total, x + h) and torch.equal(normed, norm(x + h))


def test_kernels_without_backward_step_aside_under_autograd():
    """Norm, rotary and router on CUDA with gradients wanted: torch's ops run (the Triton kernels have no backward),
    so the gradients reach x and the weights."""
    from moeserve.model.layers import RMSNorm, apply_rotary
    from moeserve.model.router import TopKRouter

    norm = RMSNorm(64, 1e-5).cuda()
    x = torch.randn(3, 64, device="cuda", requires_grad=True)
    norm(x).square().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    q = torch.randn(1, 2, 3, 16, device="cuda", requires_grad=True)
    cos, sin = torch.rand(1, 3, 16, device="cuda"), torch.rand(1, 3, 16, device="cuda")
    apply_rotary(q, cos, sin).square().sum().backward()
    assert q.grad is not None
    router = TopKRouter(64, 8, 2, normalize=False, weights_fp32=True).cuda()
    with torch.no_grad():
        router.weight.normal_(0, 0.1)
    _, weights, logits = router(x.detach())
    (weights.sum() + logits.square().sum()).backward()
    assert router.weight.grad is not None


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
    from moeserve.engine.params import SamplingParams

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


# ---- CUDA-graph decode --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph_models(hf_checkpoints):
    """The demo and tiny random Mixtral, DeepSeek-V3 (MLA: the latent cache, absorbed decode; grouped routing),
    GLM-4.5 (partial rotary), GPT-OSS and Llama-4 (chunked masks, NoPE temperature, deinterleaved rotary, the scaled
    expert input), bf16 on the GPU (16-bit: the sync-free expert kernels)."""
    from moeserve.cli import DEMO_DIR

    return {"demo": moeserve.load_model(DEMO_DIR, device="cuda", dtype=torch.bfloat16),
            **{f"tiny_{fam}": moeserve.load_model(hf_checkpoints[fam][1], device="cuda", dtype=torch.bfloat16)
               for fam in GRAPH_FAMILIES}}


GRAPH_FAMILIES = ("mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "llama4")


@pytest.mark.parametrize("name", ["demo", *(f"tiny_{fam}" for fam in GRAPH_FAMILIES)])
def test_cuda_graph_steps_match_eager_static_and_dynamic(name, graph_models):
    """Teacher-forced decode of prompts in rows of a slot cache (one sequence leaving after step 4) three ways: the
    dynamic forward, the static step eagerly, and the static step replayed as a graph. The graph computes what the
    eager static step computes; static vs dynamic differ only by bf16 rounding (attention over more slots)."""
    from checks import slot_decode
    from moeserve.engine.cuda_graph import SlotDecoder, graph_safe

    model = graph_models[name]
    assert graph_safe(model, 3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (11, 5, 2)]
    steps = torch.randint(3, 90, (12, 3), generator=g)  # [N, B]
    runs = [slot_decode(model, lambda kv: SlotDecoder(model, kv, graph=graph, static=static), prompts, steps, (1, 4))
            for graph, static in ((False, False), (False, True), (True, True))]
    dynamic, eager_out, graph_out = (r.nan_to_num() for r in runs)  # [N, B, V] each
    scale = dynamic.abs().max()
    graph_vs_eager = (graph_out - eager_out).abs().max() / scale
    static_vs_dynamic = (eager_out - dynamic).abs()
    print(f"\n{name}: graph vs eager static max {graph_vs_eager:.2e}; static vs dynamic median "
          f"{static_vs_dynamic.median() / scale:.2e}, max {static_vs_dynamic.max() / scale:.2e} (of max |logit|)")
    assert graph_vs_eager <= 2.0 ** -8
    assert static_vs_dynamic.median() <= 2.0 ** -8 * scale
    assert static_vs_dynamic.mean() <= 2.0 ** -6 * scale


@pytest.mark.parametrize("name", ["demo", *(f"tiny_{fam}" for fam in GRAPH_FAMILIES)])
def test_generate_with_cuda_graph_matches_eager_greedy(name, graph_models):
    """Greedy tokens with and without the graph; bf16 rounding may flip a near-tie late, so the first 16 tokens
    must agree and the shared prefix is reported."""
    from moeserve.engine.generate import generate
    from moeserve.engine.params import SamplingParams

    model = graph_models[name]
    prompts = [[72, 65, 77, 76, 69, 84, 46, 32, 84, 79], [75, 73, 78, 71, 46]]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    graph = [r.token_ids for r in generate(model, prompts, params)]
    eager = [r.token_ids for r in generate(model, prompts, params, cuda_graph=False)]
    shared = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(graph, eager)]
    print(f"\n{name}: greedy tokens shared by graph and eager decode: {shared} of 48")
    assert min(shared) >= 16


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", ["demo", *(f"tiny_{fam}" for fam in GRAPH_FAMILIES)])
def test_decode_attention_kernel_matches_sdpa(name, static, graph_models, monkeypatch):
    """Decode steps over a slot cache (rows out of order, prompts of different lengths): with the decode attention
    kernel (rows read in place) and with SDPA over gathered rows (the kernel switched off), the logits agree to
    bf16 rounding; static: the padded all-columns step with its additive mask, dynamic: the columns in use."""
    from moeserve.engine.cuda_graph import SlotDecoder
    from moeserve.model.kv_cache import SlotKVCache
    from moeserve.model.layers import Attention

    model = graph_models[name]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (9, 4, 13)]
    steps = torch.randint(3, 90, (10, 3), generator=g).tolist()
    rows = [3, 0, 4]

    def run() -> torch.Tensor:
        kv = SlotKVCache(model.spec, 5, 48, "cuda", torch.bfloat16)
        decoder = SlotDecoder(model, kv, graph=False, static=static)
        out = []
        with torch.inference_mode():
            for r, p in zip(rows, prompts):
                kv.use([r], len(p))
                ids = torch.tensor([p], device="cuda")
                positions = torch.arange(len(p), device="cuda")[None]
                model(ids, positions, kv=kv, valid=torch.ones_like(ids, dtype=torch.bool), last_only=True)
            pos = [len(p) for p in prompts]
            for tokens in steps:
                out.append(decoder(tokens, pos, rows).float().clone())
                pos = [x + 1 for x in pos]
        return torch.stack(out)  # [steps, B, V]

    kernel = run()
    monkeypatch.setattr(Attention, "decode_kernel", lambda self, q, v, mask: False)
    sdpa = run()
    scale = sdpa.abs().max()
    diff = (kernel - sdpa).abs()
    print(f"\n{name}: kernel vs SDPA median {diff.median() / scale:.2e}, max {diff.max() / scale:.2e} (of max |logit|)")
    assert diff.median() <= 2.0 ** -8 * scale and diff.mean() <= 2.0 ** -6 * scale


def _random_quantized(N, K, bits, rank=0):
    from moeserve.quant import hqq, milo
    from moeserve.quant.qlinear import QuantizedLinear

    qw = hqq.quantize_hqq(torch.randn(N, K, device="cuda") * K ** -0.5, bits, 64)  # on the GPU: the CPU takes minutes
    comp = (milo.compensator_to_buffers(torch.randn(N, rank, device="cuda") * 0.05,
                                        torch.randn(rank, K, device="cuda") * 0.05, 16) if rank else None)
    return QuantizedLinear.from_quantized(qw, comp, rank, 16).cuda()


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("N,K,rank", [(1000, 4160, 0), (4096, 1024, 16), (640, 14336, 0)])
def test_lowbit_linear_compiled_matches_fp32(bits, N, K, rank):
    """The compiled Triton low-bit kernel (GEMV at 1 row, tensor-core tiles above, split-K) in bf16."""
    layer = _random_quantized(N, K, bits, rank)
    w = layer.weight(torch.float32)
    uv = layer.compensator(torch.float32)
    for M in (1, 3, 17, 64):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.T + ((x.float() @ uv[1].T) @ uv[0].T if uv else 0)
        y = layer(x)
        assert y.dtype == torch.bfloat16 and not y.isnan().any()
        assert ((y.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("M,N,K", [(1, 256, 4096), (2, 256, 14336), (6, 2048, 1408), (8, 300, 4100)])
def test_skinny_linear_compiled_matches_float64(M, N, K):
    """The compensators' x V^T (all experts' V at rank 32) for decode-sized rows, compiled, in bf16."""
    from moeserve.kernels.triton.skinny import skinny_linear

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    ref = x.double() @ w.double().T
    got = skinny_linear(x, w)
    assert ((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_decode_projections_in_one_launch_match_the_layers(rows, bias, monkeypatch):
    """Mixtral's q, k and v (and a Qwen-style biased twin) for one token (and two, with the row limit raised) in
    one skinny launch, and o_proj alone: the layers' outputs up to bf16 rounding (both sum in fp32, in different
    orders)."""
    import moeserve.kernels.triton.skinny as skinny
    from moeserve.model.layers import linears

    monkeypatch.setattr(skinny, "DENSE_ROWS", rows)

    torch.manual_seed(rows + 2 * bias)
    mods = [torch.nn.Linear(4096, n, bias=bias, device="cuda", dtype=torch.bfloat16) for n in (4096, 1024, 1024)]
    o = torch.nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, 1, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = linears(x, *mods) + linears(x, o)
        for y, m in zip(got, mods + [o]):
            ref = x.double() @ m.weight.double().T + (m.bias.double() if m.bias is not None else 0)
            assert y.shape == (rows, 1, m.out_features) and y.dtype == torch.bfloat16
            assert (y.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()


@pytest.mark.parametrize("config", [dict(BLOCK_N=32, BLOCK_K=512, num_warps=4, SPLIT_K=1, SUB=4),
                                    dict(BLOCK_N=32, BLOCK_K=512, num_warps=4, SPLIT_K=7, SUB=4, AHEAD=2),
                                    dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, SPLIT_K=2, SUB=2, BLOCK_M=4),
                                    dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, SPLIT_K=1, BLOCK_M=8),
                                    dict(BLOCK_N=32, BLOCK_K=512, num_warps=4, SPLIT_K=3, SUB=4, PIPE=3),
                                    dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, SPLIT_K=1, SUB=2, BLOCK_M=4, PIPE=4),
                                    dict(BLOCK_N=32, BLOCK_K=1024, num_warps=4, SPLIT_K=2, SUB=4),
                                    dict(BLOCK_N=32, BLOCK_K=512, num_warps=4, SPLIT_K=1, SUB=2, AHEAD=2)])
@pytest.mark.parametrize("bits", [3, 4])
def test_lowbit_cuda_core_tiles_compiled(config, bits):
    """The swept CUDA-core configs (sub-tiles, two steps ahead, rows of x per tile; the last two load 3-bit words
    as 8-byte pairs) compiled, at odd shapes."""
    from moeserve.kernels.triton.configs import LowbitConfig
    from moeserve.kernels.triton.lowbit import lowbit_linear

    layer = _random_quantized(1000, 4160, bits)
    w = layer.weight(torch.float32)
    for M in (1, 3, 8, 13):
        x = torch.randn(M, 4160, device="cuda", dtype=torch.bfloat16)
        y = lowbit_linear(x, layer.qweight, layer.scale, layer.zero, bits, 64, 4160, config=LowbitConfig.of(config))
        ref = x.float() @ w.T
        assert not y.isnan().any() and ((y.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("T", [1, 4, 64])
def test_lowbit_fused_moe_compiled_matches_the_loop(bits, T):
    """QuantizedExperts on CUDA (stacked Triton low-bit MoE, ranks 0/8/16 padded), in slot order and on expert-sorted
    rows, vs the per-expert dequantized loop."""
    from moeserve.kernels.routing import build_routing_table, combine
    from moeserve.model.experts import LoopedExperts, swiglu
    from moeserve.quant.qlinear import QuantizedExperts

    E, k, D, F = 8, 2, 1024, 1536
    ranks = [0, 8, 16, 0, 0, 8, 0, 16]
    ex = QuantizedExperts([_random_quantized(2 * F, D, bits, r) for r in ranks],
                          [_random_quantized(D, F, bits, r) for r in ranks])
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).cuda()
    w = torch.rand(T, k, device="cuda")
    got = ex(x, ids, w).float()

    def dense(m, rows):  # dequantized weight + compensator in float32
        uv = m.compensator(torch.float32)
        return rows @ m.weight(torch.float32).T + (rows @ uv[1].T) @ uv[0].T if uv else rows @ m.weight().T

    class Reference(LoopedExperts):
        num_experts = E

        def expert_ffn(self, e, rows):
            return dense(ex.down[e], swiglu(dense(ex.gate_up[e], rows)))

    table = build_routing_table(ids, w, E)
    ref = combine(Reference().run_sorted(x.float()[table.token_ids], table), table, T, torch.float32)
    got_sorted = combine(ex.run_sorted(x[table.token_ids], table), table, T, torch.float32)  # expert-parallel's call
    for out in (got, got_sorted):  # slot order (forward: no table), expert-sorted rows
        assert not out.isnan().any()
        assert ((out - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("T,routing", [(16, "random"), (37, "one_expert"), (64, "two_experts")])
def test_lowbit_fused_moe_pipelined_dot_tiles_compiled(bits, T, routing):
    """The MoE's pipelined tensor-core tiles (PIPE: dequantize-then-dot with steps of words, scale/zero and x in
    flight), gate_up plain and PAIRED, down whole and split-K, on expert-sorted rows with skewed routings (experts
    with no rows, a row count no tile divides) and compensators on some experts, vs the dequantized float32 loop."""
    from moeserve.kernels.routing import build_routing_table
    from moeserve.kernels.triton.configs import ExpertsConfig, LowbitConfig
    from moeserve.kernels.triton.lowbit import lowbit_experts
    from moeserve.model.experts import swiglu
    from moeserve.quant.qlinear import QuantizedExperts

    E, k, D, F = 8, 2, 1024, 1472  # F: 23 groups, not a multiple of a 256-input step
    ranks = [0, 8, 0, 16, 0, 0, 0, 0]
    ex = QuantizedExperts([_random_quantized(2 * F, D, bits, r) for r in ranks],
                          [_random_quantized(D, F, bits, r) for r in ranks])
    ids = routing_ids(T, E, k, routing).cuda()
    table = build_routing_table(ids, torch.rand(T, k, device="cuda"), E)
    x_sorted = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)[table.token_ids]

    def dense(m, rows):  # dequantized weight + compensator in float32
        uv = m.compensator(torch.float32)
        return rows @ m.weight(torch.float32).T + ((rows @ uv[1].T) @ uv[0].T if uv else 0)

    ref = torch.cat([dense(ex.down[e], swiglu(dense(ex.gate_up[e], rows)))
                     for e, rows in enumerate(x_sorted.float().split(table.counts.tolist()))])
    for bn, bk, warps, pipe, paired, split in [(64, 256, 4, 3, 0, 1), (128, 256, 8, 3, 1, 4), (32, 256, 4, 4, 1, 2)]:
        cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=3, PIPE=pipe)
        got = lowbit_experts(x_sorted, *ex.stacked(x_sorted.dtype), table, ExpertsConfig.of(
            {"gate_up": {**cfg, "SPLIT_K": 1, "PAIRED": paired}, "down": {**cfg, "SPLIT_K": split}}, LowbitConfig))
        assert not got.isnan().any(), cfg
        assert ((got.float() - ref).norm() / ref.norm()) < 2e-2, cfg


def _dense_float32(layer):
    """A QuantizedLinear's weight with its compensator folded in: W + U V, float32."""
    uv = layer.compensator(torch.float32)
    return layer.weight(torch.float32) + (0 if uv is None else uv[0] @ uv[1])


def _stacked(layers, rank):
    """E QuantizedLinears -> one StackedLowbit (bf16 compensators zero-padded to `rank`, as QuantizedExperts does)."""
    from moeserve.kernels.triton.lowbit import StackedLowbit

    first = layers[0]
    p = StackedLowbit(*(torch.stack([getattr(m, n) for m in layers]) for n in ("qweight", "scale", "zero")),
                      bits=first.bits, group=first.group, in_features=first.in_features)
    if rank:
        uvs = [m.compensator(torch.bfloat16) for m in layers]
        p.u = torch.stack([torch.zeros(first.out_features, rank, dtype=torch.bfloat16, device="cuda") if uv is None
                           else uv[0] for uv in uvs])  # [E, N, r]
        p.v = torch.cat([torch.zeros(rank, first.in_features, dtype=torch.bfloat16, device="cuda") if uv is None
                         else uv[1] for uv in uvs])  # [E * r, K]
    return p


@pytest.mark.parametrize("bits,rank", [(2, 0), (3, 0), (4, 0), (8, 0), (3, 32), (4, 32)])
def test_lowbit_one_token_tma_compiled(bits, rank):
    """The one-token gate_up and down by TMA (Hopper) at several tiles, pipeline depths and K splits, F not a
    multiple of gate_up's row blocks and the last expert chosen, against float32 dequantized experts (3 bits: a
    block per plane; rank: rank-32 compensators on all but expert 2, added before the weight stream)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    from moeserve.kernels.triton.configs import LowbitConfig
    from moeserve.kernels.triton.lowbit.launch import launch_down_tma, launch_gate_up, tma_one_token
    from moeserve.kernels.triton.lowbit.layout import values_per_column
    from moeserve.model.experts import swiglu

    E, D, F = 8, 4096, 1000
    ranks = [0 if e == 2 else rank for e in range(E)]
    layers = [_random_quantized(2 * F, D, bits, ranks[e]) for e in range(E)]
    downs = [_random_quantized(D, 1024, bits, ranks[e]) for e in range(E)]
    gate_up, down = _stacked(layers, rank), _stacked(downs, rank)
    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[E - 1, 2]], device="cuda")
    ref = torch.stack([swiglu(x.float() @ _dense_float32(layers[int(e)]).T)[0] for e in ids[0]])  # [2, F]
    vpc = values_per_column(bits)
    for bn, bk, warps, stages in [(8, 1024, 4, 3), (16, 512, 4, 2), (32, 512, 8, 3), (8, min(256 * vpc, D), 4, 2)]:
        cfg = LowbitConfig.of(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SPLIT_K=1, TMA=1))
        assert tma_one_token(cfg, gate_up, ids, x.device)
        assert not tma_one_token(cfg.replace(BLOCK_K=512 * vpc), gate_up, ids, x.device)  # 512-word boxes
        h = torch.full((2, F), float("nan"), device="cuda", dtype=torch.bfloat16)
        launch_gate_up(x, gate_up, h, ids, cfg)
        assert not h.isnan().any(), cfg
        assert ((h.float() - ref).norm() / ref.norm()) < 1e-2, cfg
    h = torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16)
    ref = torch.stack([h[j].float() @ _dense_float32(downs[int(e)]).T for j, e in enumerate(ids[0])])  # [2, D]
    big = (64, 1024, 8, 3, 1) if bits < 8 else (16, 1024, 8, 2, 1)  # 64 x 256 8-bit words x 3 stages: over 228 KB
    for bn, bk, warps, stages, split in [(32, 512, 4, 3, 2), (16, 512, 4, 2, 1), big]:
        cfg = LowbitConfig.of(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SPLIT_K=split, TMA=1))
        assert tma_one_token(cfg, down, ids, x.device)
        y = torch.full((2, D), float("nan"), device="cuda")
        launch_down_tma(h, down, y, ids, cfg)
        assert not y.isnan().any(), cfg
        assert ((y - ref).norm() / ref.norm()) < 1e-2, cfg


@pytest.mark.parametrize("bits,D,F", [(4, 1024, 1536), (3, 4096, 14336)])
def test_router_prepares_the_experts_input_in_a_quantized_block(bits, D, F):
    """A one-token quantized MoE block has the router's launch prepare x for gate_up (CUDA-core tiles at 1024 x 1536,
    the tuned TMA ones at Mixtral's shape): the block gives what the router and the experts give run apart."""
    from moeserve.quant.qlinear import QuantizedExperts

    E, k = 8, 2
    block = random_block(E, k, D, F)
    block.experts = QuantizedExperts([_random_quantized(2 * F, D, bits) for _ in range(E)],
                                     [_random_quantized(D, F, bits) for _ in range(E)])
    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        assert block._prepared_input(x) is not None
        got = block(x)
        ids, weights, _ = block.gate(x)
        ref = block.experts(x, ids, weights)  # gate_up prepares x itself
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-3)  # split-K fp32 atomics: any order


@pytest.mark.parametrize("bits", [3, 4])
def test_dependent_launches_in_a_cuda_graph_match_plain_launches(bits, monkeypatch):
    """A one-token quantized MoE block (its Triton kernels launched dependent on Hopper: each may start before the
    previous one ends) replayed from a CUDA graph on fresh inputs gives what plain eager launches give."""
    from moeserve.kernels.triton.pdl import ENV, pdl_enabled
    from moeserve.quant.qlinear import QuantizedExperts

    E, k, D, F = 8, 2, 1024, 1536
    ranks = [0, 8, 16, 0, 0, 8, 0, 16]
    block = random_block(E, k, D, F)
    block.experts = QuantizedExperts([_random_quantized(2 * F, D, bits, r) for r in ranks],
                                     [_random_quantized(D, F, bits, r) for r in ranks])
    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        block(x)  # compile and stack outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(x)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            monkeypatch.setenv(ENV, "0")
            assert not pdl_enabled(x.device)
            ref = block(x.clone())
            monkeypatch.delenv(ENV)
            torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=1e-2)


def test_quantized_model_decodes_through_a_cuda_graph(tmp_path):
    """A 4-bit HQQ demo: its experts (the low-bit fused MoE) are sync-free, so generate captures the step;
    graph and eager greedy tokens agree (bf16 rounding may flip a late near-tie)."""
    from moeserve.cli import DEMO_DIR, main
    from moeserve.engine.cuda_graph import graph_safe
    from moeserve.engine.generate import generate
    from moeserve.engine.params import SamplingParams

    assert main(["quantize", "--model", str(DEMO_DIR), "--out", str(tmp_path / "q4"), "--bits", "4",
                 "--method", "hqq"]) == 0
    model = moeserve.load_model(tmp_path / "q4", device="cuda", dtype=torch.bfloat16)
    assert graph_safe(model, 2)
    prompts = [[72, 65, 77, 76, 69, 84, 46, 32], [75, 73, 78, 71, 46]]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    graph = [r.token_ids for r in generate(model, prompts, params)]
    eager = [r.token_ids for r in generate(model, prompts, params, cuda_graph=False)]
    shared = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(graph, eager)]
    assert min(shared) >= 8, shared
