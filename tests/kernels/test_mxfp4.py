"""The MXFP4 fused MoE (kernels/triton/mxfp4: E2M1 decoded in registers, biases, clamped SwiGLU or silu) against
float64 experts of the same dequantized weights. On a CPU the kernels run in the Triton interpreter
(TRITON_INTERPRET=1, tests/conftest.py) at tiny sizes; on a GPU, compiled, plus the model path and a CUDA graph."""

import pytest
import torch

pytest.importorskip("triton")

from checks import DEVICE, routing_ids  # noqa: E402
from moeserve.kernels.routing import build_routing_table  # noqa: E402
from moeserve.kernels.triton.mxfp4 import Mxfp4Config, Mxfp4Weights, default_config, mxfp4_experts  # noqa: E402
from moeserve.model.experts import glu  # noqa: E402
from moeserve.quant.mxfp4 import dequantize, quantize  # noqa: E402
from moeserve.spec import ClampedSwiGLU  # noqa: E402


def experts(E, D, F, bias, seed=0):
    """(gate_up, down) Mxfp4Weights on DEVICE, from random weights of outputs of order one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for N, K in ((2 * F, D), (D, F)):
        blocks, scales = quantize(torch.randn(E, N, K, generator=g) * K ** -0.5 * 2)
        b = torch.randn(E, N, generator=g) * 0.5 if bias else None
        out.append(Mxfp4Weights(blocks.to(DEVICE), scales.to(DEVICE), None if b is None else b.to(DEVICE)))
    return out


def reference(x_sorted, gate_up, down, table, act):
    """float64: each expert-sorted row through its expert's dequantized weights; the activation h rounded to x's
    dtype, as the kernel stores it between its two launches."""
    E = gate_up.blocks.shape[0]
    wg, wd = (dequantize(w.blocks.cpu(), w.scales.cpu(), torch.float64) for w in (gate_up, down))
    expert_of = torch.repeat_interleave(torch.arange(E), table.counts.cpu())
    out = torch.empty(x_sorted.shape, dtype=torch.float64)
    for r, e in enumerate(expert_of.tolist()):
        h = x_sorted[r].cpu().double() @ wg[e].T + (gate_up.bias[e].cpu().double() if gate_up.bias is not None else 0)
        y = glu(h[None], act)[0].to(x_sorted.dtype).double() @ wd[e].T
        out[r] = y + (down.bias[e].cpu().double() if down.bias is not None else 0)
    return out


@pytest.mark.parametrize("T,routing,config", [
    (1, "random", None),  # the one-token default: GEMV programs
    (5, "two_experts", Mxfp4Config(BLOCK_N=32, BLOCK_K=64, BLOCK_M=2)),  # rows of one expert in chunks of 2
    (17, "one_expert", Mxfp4Config(BLOCK_N=64, BLOCK_K=128, BLOCK_M=16)),  # tensor-core tiles, 17 rows in 2 tiles
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", [ClampedSwiGLU(alpha=1.702, limit=1.5), None], ids=["clamped", "silu"])
def test_mxfp4_fused_moe_matches_float64_experts(poisoned_outputs, T, routing, config, dtype, act):
    """D = 96 with BLOCK_K 128/256: the last step half past the row's end; F = 64 rows in blocks of 32/64."""
    E, k, D, F = 4, 2, 96, 64
    gate_up, down = experts(E, D, F, bias=act is not None)
    ids = routing_ids(T, E, k, routing)
    table = build_routing_table(ids.to(DEVICE), torch.rand(T, k, device=DEVICE), E)
    x_sorted = torch.randn(T, D, device=DEVICE)[table.token_ids].to(dtype)
    got = mxfp4_experts(x_sorted, gate_up, down, table, act, config)
    want = reference(x_sorted, gate_up, down, table, act)
    assert got.dtype == torch.float32 and not got.isnan().any()
    got = got.double().cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # h's bf16 may differ from the reference's by an ulp (2^-8; Triton's interpreter truncates where GPUs round)
        assert (got - want).norm() / want.norm() < 1e-2 and (got - want).abs().max() < 2 ** -5 * want.abs().max()


def test_default_configs_by_tokens_and_dtype():
    assert default_config(1, torch.bfloat16) == Mxfp4Config()
    assert default_config(16, torch.bfloat16).use_dot(torch.bfloat16)
    assert not default_config(16, torch.float32).use_dot(torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mxfp4_model_path_and_cuda_graph(tmp_path):
    """A GPT-OSS-like layer on the GPU: Mxfp4Experts take the Triton path (graph-safe) and agree with the
    dequantize-per-expert loop; the block replays as a CUDA graph with the eager output."""
    from moeserve.kernels.routing import combine
    from moeserve.model.experts import LoopedExperts
    from moeserve.model.paths import GRAPH_SAFE
    from moeserve.quant.mxfp4 import Mxfp4Experts

    E, D, F, k = 8, 256, 128, 4
    ex = Mxfp4Experts(E, D, F, bias=True, act=ClampedSwiGLU()).cuda()
    gate_up, down = experts(E, D, F, bias=True)
    ex.gate_up_proj_blocks, ex.gate_up_proj_scales = gate_up.blocks, gate_up.scales
    ex.down_proj_blocks, ex.down_proj_scales = down.blocks, down.scales
    ex.gate_up_proj_bias = torch.nn.Parameter(gate_up.bias.bfloat16(), requires_grad=False)
    ex.down_proj_bias = torch.nn.Parameter(down.bias.bfloat16(), requires_grad=False)
    for T in (1, 16):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).cuda()
        w = torch.softmax(torch.randn(T, k, device="cuda"), -1).bfloat16()
        assert ex.kernel_path(x, T) == "mxfp4_triton" and "mxfp4_triton" in GRAPH_SAFE
        with torch.no_grad():
            got = ex(x, ids, w)
            table = build_routing_table(ids, w, E)
            ref = combine(LoopedExperts.run_sorted(ex, x[table.token_ids], table), table, T, x.dtype)
            torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                ex(x, ids, w)  # warm-up (compiles) off the capture
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                out = ex(x, ids, w)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, got)
