"""The one-token MoE layer in three launches (kernels/triton/one_token.py) against float64 experts and against the
multi-launch path (router, lowbit_experts, gather_combine): 4-bit, 3-bit with compensators, GPT-OSS's biases and
clamped SwiGLU with its router bias; CUDA-core and TMA kernels, split K, partial output blocks. On a CPU in the
Triton interpreter (tests/conftest.py) at tiny sizes; the CUDA-graph test needs a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from checks import DEVICE, quantized_experts, quantized_experts_as_float64  # noqa: E402
from moeserve.kernels.triton.configs import ExpertsConfig, LowbitConfig  # noqa: E402

E, K_TOP, D, F = 4, 2, 64, 96


def router_of(bias: bool, normalize: bool, dim: int, dtype: torch.dtype):
    from moeserve.kernels.triton.topk_router import SoftmaxTopK

    w = torch.randn(E, dim, device=DEVICE, dtype=dtype) * dim ** -0.5  # logits of order one
    b = torch.randn(E, device=DEVICE, dtype=dtype) if bias else None
    return SoftmaxTopK(w, b, K_TOP, normalize, torch.float32)


def reference_route(x: torch.Tensor, router) -> tuple[torch.Tensor, torch.Tensor]:
    """TopKRouter's torch path in float64: (ids [1, k], weights [1, k])."""
    from moeserve.model.router import softmax_topk

    logits = torch.nn.functional.linear(x.double(), router.weight.double(),
                                        None if router.bias is None else router.bias.double())
    logits = logits.to(x.dtype).double()  # rounded as the kernel's (and F.linear's) output
    ids, weights = softmax_topk(logits, router.k, router.normalize)
    return ids, weights.double()


def experts_with(bits: int, ranks: list[int], gptoss: bool):
    ex = quantized_experts(E, D, F, bits, ranks)
    if gptoss:
        from moeserve.spec import ClampedSwiGLU

        ex.act = ClampedSwiGLU(alpha=1.702, limit=0.4)
        for m in (*ex.gate_up, *ex.down):
            m.bias = torch.nn.Parameter(torch.randn(m.out_features, device=DEVICE) * 0.5, requires_grad=False)
    return ex


CASES = {  # name: (bits, ranks, GPT-OSS, gate_up config, down config[, x dtype])
    "4bit": (4, [0] * E, False, dict(BLOCK_N=32, BLOCK_K=64, SUB=2), dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2)),
    "4bit_wide_blocks": (4, [0] * E, False, dict(BLOCK_N=64, BLOCK_K=32), dict(BLOCK_N=32, BLOCK_K=32)),
    "3bit_lr": (3, [8, 0, 20, 4], False, dict(BLOCK_N=64, BLOCK_K=64, PAIRED=1, SUB=2),
                dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3)),
    "4bit_gptoss": (4, [0, 8, 0, 0], True, dict(BLOCK_N=32, BLOCK_K=64), dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2)),
    "3bit_bf16": (3, [0] * E, False, dict(BLOCK_N=32, BLOCK_K=64), dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2),
                  torch.bfloat16),  # h prepared as fp16 pairs scaled per step (HALF)
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_token_layer_matches_float64_and_the_multi_launch_path(poisoned_outputs, case):
    """Fresh random weights, token and router; every buffer the kernels write starts as NaN (check_layer). Partial
    output blocks (F = 96), gate_up blocks narrower than down's steps (counted arrivals) and wider (whole steps)."""
    bits, ranks, gptoss, gu, dn, *dtype = CASES[case]
    dtype = dtype[0] if dtype else torch.float32
    check_layer(experts_with(bits, ranks, gptoss), router_of(gptoss, gptoss or case == "3bit_lr", D, dtype),
                ExpertsConfig(LowbitConfig(**{"num_warps": 4, **gu}), LowbitConfig(**{"num_warps": 4, **dn})),
                torch.randn(1, D, device=DEVICE, dtype=dtype))


@pytest.mark.parametrize("bits,rank,ffn,dtype", [(4, 0, 1024, torch.bfloat16), (3, 16, 512, torch.float32)])
def test_one_token_layer_by_tma(poisoned_outputs, bits, rank, ffn, dtype):
    """Experts of group 64 with TMA configs (the GPU's one-token kernels): gate_up by TMA prepares h for down by TMA,
    down's partial sums (two K slices at ffn = 1024) combined by the last program of each output block."""
    from checks import quantized
    from moeserve.kernels.triton.lowbit.launch import tma_one_token
    from moeserve.quant.qlinear import QuantizedExperts

    dim = 512
    ranks = (rank, 0, rank // 2, rank)
    ex = QuantizedExperts([quantized(2 * ffn, dim, bits, 64, r) for r in ranks],
                          [quantized(dim, ffn, bits, 64, r) for r in ranks])
    tma = dict(BLOCK_N=128, BLOCK_K=512, num_warps=4, num_stages=2, TMA=1)
    config = ExpertsConfig(LowbitConfig(**tma), LowbitConfig(**{**tma, "SPLIT_K": 2}))
    ids = torch.tensor([[0, 1]], device=DEVICE)
    assert tma_one_token(config.gate_up, ex.stacked(dtype)[0], ids, torch.device(DEVICE))
    assert tma_one_token(config.down, ex.stacked(dtype)[1], ids, torch.device(DEVICE))
    check_layer(ex, router_of(False, True, dim, dtype), config, torch.randn(1, dim, device=DEVICE, dtype=dtype))


def check_layer(ex, router, config: ExpertsConfig, x: torch.Tensor) -> None:
    """The layer's output equals float64 experts combined with float64 router weights, and the multi-launch path's
    output; a second call gives the same (the arrival counters were left zero)."""
    from moeserve.kernels.triton.lowbit import lowbit_experts
    from moeserve.kernels.triton.one_token import lowbit_one_token
    from moeserve.kernels.triton.routing_table import gather_combine

    stacks = ex.stacked(x.dtype)
    out, ids, weights = lowbit_one_token(x, router, *stacks, act=ex.act, config=config)
    ref_ids, ref_w = reference_route(x, router)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2  # bf16 logits: the fp32 sum and the float64 one may round apart
    torch.testing.assert_close(weights.double(), ref_w, atol=tol, rtol=tol)
    dense = quantized_experts_as_float64(ex)
    rows = torch.stack([dense.expert_ffn(int(e), x.double())[0] for e in ref_ids[0]])  # [k, D]
    ref = (ref_w[0][:, None] * rows).sum(0, keepdim=True)  # [1, D]
    assert not out.isnan().any()
    y = lowbit_experts(x, *stacks, ids, config, act=ex.act)  # the multi-launch path, slot order [k, D]
    multi = gather_combine(y, None, weights, K_TOP, x.dtype)
    if x.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out, multi, atol=1e-5, rtol=1e-5)
    else:  # h rounds to bf16 between the projections and its prepared fp16 pairs share a scale per step; the output
        # rounds to bf16 (the multi-launch path reads the same prepared h: equal up to that rounding)
        assert (out.double() - ref).norm() / ref.norm() < 2e-2
        torch.testing.assert_close(out.float(), multi.float(), atol=2 ** -7 * multi.abs().max().item(), rtol=2 ** -7)
    again, _, _ = lowbit_one_token(x, router, *stacks, act=ex.act, config=config)  # the counters were left zero
    assert torch.equal(again, out)


@pytest.mark.parametrize("dtype,config", [(torch.bfloat16, None), (torch.float32, "BLOCK_N=64,BLOCK_K=64")])
def test_one_token_mxfp4_layer_matches_float64_and_the_multi_launch_path(poisoned_outputs, dtype, config):
    """GPT-OSS-like MXFP4 experts (biases, clamped SwiGLU) and router (bias, top-k then softmax): the three-launch
    layer against float64 experts with float64 router weights (h rounded to x's dtype, as the kernels keep it) and
    against mxfp4_experts + combine. D = 96 (3 groups), F = 64; the one-token default config (fp16 pairs) and fp32 x
    in output blocks of 64 (a partial last block)."""
    from moeserve.kernels.routing import build_routing_table, combine
    from moeserve.kernels.triton.mxfp4 import Mxfp4Config, Mxfp4Weights, mxfp4_experts
    from moeserve.kernels.triton.one_token import mxfp4_one_token
    from moeserve.kernels.triton.topk_router import SoftmaxTopK
    from moeserve.model.experts import glu
    from moeserve.quant.mxfp4 import dequantize, quantize
    from moeserve.spec import ClampedSwiGLU

    e, k, dim, ffn = 4, 2, 96, 64
    act = ClampedSwiGLU(alpha=1.702, limit=1.5)
    weights = []
    for n, kk in ((2 * ffn, dim), (dim, ffn)):
        blocks, scales = quantize(torch.randn(e, n, kk) * kk ** -0.5 * 2)
        weights.append(Mxfp4Weights(blocks.to(DEVICE), scales.to(DEVICE), (torch.randn(e, n) * 0.5).to(DEVICE)))
    gate_up, down = weights
    cfg = None if config is None else Mxfp4Config(**{a: int(b) for a, b in (kv.split("=") for kv in config.split(","))})
    router = SoftmaxTopK(torch.randn(e, dim, device=DEVICE, dtype=dtype), torch.randn(e, device=DEVICE, dtype=dtype),
                         k, True, dtype)
    x = (torch.randn(1, dim, device=DEVICE) * 2).to(dtype)
    out, ids, w = mxfp4_one_token(x, router, gate_up, down, act, cfg)
    ref_ids, ref_w = reference_route(x, router)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    wg, wd = (dequantize(p.blocks.cpu(), p.scales.cpu(), torch.float64) for p in (gate_up, down))
    ref = torch.zeros(1, dim, dtype=torch.float64)
    for j, ex in enumerate(ref_ids[0].tolist()):
        h = glu(x.cpu().double() @ wg[ex].T + gate_up.bias[ex].cpu().double(), act).to(dtype).double()
        ref += w[0, j].double().cpu() * (h @ wd[ex].T + down.bias[ex].cpu().double())
    assert not out.isnan().any()
    got = out.double().cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:  # h's and out's 16 bits
        assert (got - ref).norm() / ref.norm() < 1e-2
    table = build_routing_table(ids, w, e)
    multi = combine(mxfp4_experts(x, gate_up, down, table, act, cfg, token_ids=table.token_ids), table, 1, x.dtype)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # bf16: the two combines round the weighted rows apart
    torch.testing.assert_close(out.float(), multi.float(), atol=tol * multi.abs().max().item(), rtol=tol)
    again, _, _ = mxfp4_one_token(x, router, gate_up, down, act, cfg)
    assert torch.equal(again, out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", ["4bit", "3bit_r32", "mxfp4"])
def test_one_token_layer_replays_in_a_cuda_graph(kind):
    """bf16 experts as the GPU runs them (low-bit of group 64 with their default configs; MXFP4 with biases, the
    clamped SwiGLU and a biased router): replayed in a CUDA graph on fresh tokens the layer matches the multi-launch
    path, replay after replay (the arrival counters go back to zero), and is deterministic."""
    from checks import quantized
    from moeserve.kernels.routing import build_routing_table, combine
    from moeserve.kernels.triton.lowbit import lowbit_experts
    from moeserve.kernels.triton.mxfp4 import Mxfp4Weights, mxfp4_experts
    from moeserve.kernels.triton.one_token import lowbit_one_token, mxfp4_one_token
    from moeserve.kernels.triton.routing_table import gather_combine
    from moeserve.kernels.triton.topk_router import SoftmaxTopK
    from moeserve.quant.mxfp4 import quantize
    from moeserve.quant.qlinear import QuantizedExperts
    from moeserve.spec import ClampedSwiGLU

    e, k, dim, ffn = 8, 2, 1024, 2048
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    router = SoftmaxTopK(torch.randn(e, dim, **bf16) / 32, torch.randn(e, **bf16) if kind == "mxfp4" else None, k,
                         True, torch.bfloat16)
    if kind == "mxfp4":
        act = ClampedSwiGLU(alpha=1.702, limit=7.0)
        weights = []
        for n, kk in ((2 * ffn, dim), (dim, ffn)):
            blocks, scales = quantize(torch.randn(e, n, kk) * kk ** -0.5 * 2)
            weights.append(Mxfp4Weights(blocks.cuda(), scales.cuda(), torch.randn(e, n, device="cuda") * 0.5))

        def layer(v):
            return mxfp4_one_token(v, router, *weights, act)

        def multi(v, ids, w):
            table = build_routing_table(ids, w, e)
            return combine(mxfp4_experts(v, *weights, table, act, token_ids=table.token_ids), table, 1, v.dtype)
    else:
        bits, rank = (4, 0) if kind == "4bit" else (3, 32)
        ex = QuantizedExperts([quantized(2 * ffn, dim, bits, 64, rank) for _ in range(e)],
                              [quantized(dim, ffn, bits, 64, rank) for _ in range(e)])
        stacks = ex.stacked(torch.bfloat16)

        def layer(v):
            return lowbit_one_token(v, router, *stacks)

        def multi(v, ids, w):
            return gather_combine(lowbit_experts(v, *stacks, ids), None, w, k, v.dtype)
    x = torch.randn(1, dim, **bf16)
    layer(x)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, ids, weights_out = layer(x)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        first = out.clone()
        graph.replay()
        assert torch.equal(out, first)
        ref = multi(x, ids, weights_out)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2 * ref.abs().max().item(), rtol=2e-2)


def test_one_token_path_is_opt_in(monkeypatch):
    from moeserve.kernels.triton.one_token import ONE_TOKEN_ENV, one_token_enabled

    monkeypatch.delenv(ONE_TOKEN_ENV, raising=False)
    assert not one_token_enabled()
    monkeypatch.setenv(ONE_TOKEN_ENV, "1")
    assert one_token_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the model's one-token path runs on CUDA")
@pytest.mark.parametrize("bias", [False, True])
def test_model_one_token_path_matches_route_then_experts(monkeypatch, bias):
    """The MoE block's hooks on a GPU: TopKRouter.one_token_router + QuantizedExperts.one_token equal the router
    followed by the experts' forward (the multi-launch path), and the env switch turns the hook off."""
    from checks import quantized
    from moeserve.kernels.triton.one_token import ONE_TOKEN_ENV
    from moeserve.model.router import TopKRouter
    from moeserve.quant.qlinear import QuantizedExperts

    monkeypatch.setenv(ONE_TOKEN_ENV, "1")
    e, dim, ffn = 8, 1024, 2048
    ex = QuantizedExperts([quantized(2 * ffn, dim, 4, 64, 0) for _ in range(e)],
                          [quantized(dim, ffn, 4, 64, 0) for _ in range(e)])
    router = TopKRouter(dim, e, 2, True, False, bias=bias).cuda().to(torch.bfloat16)
    with torch.no_grad():
        router.weight.normal_(0, dim ** -0.5)
        if bias:
            router.bias.normal_()
        x = torch.randn(1, dim, device="cuda", dtype=torch.bfloat16)
        spec = router.one_token_router(x)
        assert spec is not None and (spec.bias is not None) == bias
        got = ex.one_token(x, spec)
        ids, weights, _ = router(x)
        ref = ex(x, ids, weights).float()
        torch.testing.assert_close(got.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
        monkeypatch.setenv(ONE_TOKEN_ENV, "0")
        assert router.one_token_router(x) is None
