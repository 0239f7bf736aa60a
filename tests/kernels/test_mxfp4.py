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


# every kernel family at tiny shapes (D 96 = 3 groups, F 64): CUDA-core programs of 1, 2, 8 rows on fp16 pairs and 4
# rows in fp32, tensor-core tiles of 16 and 32 rows; steps of 64..256 inputs, the last one past the row's end
FAMILIES = {
    "gemv_1row": Mxfp4Config(),  # the one-token default: one step of 256 inputs
    "gemv_2rows": Mxfp4Config(BLOCK_K=64, BLOCK_M=2, num_stages=2),
    "gemv_8rows": Mxfp4Config(BLOCK_N=64, BLOCK_K=64, BLOCK_M=8),
    "gemv_fp32": Mxfp4Config(BLOCK_K=64, BLOCK_M=4, HALF=False),
    "dot_16rows": Mxfp4Config(BLOCK_N=64, BLOCK_K=64, BLOCK_M=16),
    "dot_32rows": Mxfp4Config(BLOCK_N=32, BLOCK_K=128, BLOCK_M=32),
}
ROUTING = {1: "random", 3: "two_experts", 16: "one_expert", 17: "one_expert"}  # T -> how its tokens pick experts
CLAMPED = ClampedSwiGLU(alpha=1.702, limit=1.5)


def run_case(T, config, dtype, act, bias, gather, seed=0):
    """(the kernels' expert outputs, the float64 reference) on fresh random inputs: E 4 experts, top-2. gather: the
    kernels read the tokens through the table's token ids, else the sorted rows."""
    E, k, D, F = 4, 2, 96, 64
    torch.manual_seed(seed)
    gate_up, down = experts(E, D, F, bias=bias, seed=seed)
    ids = routing_ids(T, E, k, ROUTING[T])
    table = build_routing_table(ids.to(DEVICE), torch.rand(T, k, device=DEVICE), E)
    x = (torch.randn(T, D, device=DEVICE) * 2).to(dtype)
    x_sorted = x[table.token_ids]
    if gather:
        got = mxfp4_experts(x, gate_up, down, table, act, config, token_ids=table.token_ids)
    else:
        got = mxfp4_experts(x_sorted, gate_up, down, table, act, config)
    assert got.dtype == torch.float32 and got.shape == (T * k, D) and not got.isnan().any()
    return got.double().cpu(), reference(x_sorted, gate_up, down, table, act)


def assert_matches(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # h's 16 bits may differ from the reference's by an ulp (the interpreter truncates where GPUs round)
        assert (got - want).norm() / want.norm() < 1e-2 and (got - want).abs().max() < 2 ** -5 * want.abs().max()


@pytest.mark.parametrize("family,T", [(f, T) for f in FAMILIES for T in (1, 3, 16) if (f, T) != ("gemv_1row", 16)]
                         + [("dot_16rows", 17)])  # 17 rows of one expert: two tensor-core tiles
@pytest.mark.parametrize("act,bias,gather", [(CLAMPED, True, True), (None, False, False)],
                         ids=["clamped_bias_gather", "silu_sorted"])
def test_mxfp4_families_match_float64_experts(poisoned_outputs, family, T, act, bias, gather):
    """bf16 x through every family and token count, with biases and the clamped SwiGLU and without either; the rows
    gathered by the kernels from the tokens, or sorted already."""
    assert_matches(*run_case(T, FAMILIES[family], torch.bfloat16, act, bias, gather), torch.bfloat16)


@pytest.mark.parametrize("family,T", [("gemv_2rows", 3), ("gemv_fp32", 3), ("dot_16rows", 16), ("dot_32rows", 3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_mxfp4_other_dtypes_match_float64_experts(poisoned_outputs, family, T, dtype):
    """fp16 x (fp16 pairs and tiles) and float32 x (CUDA cores in fp32 whatever the config)."""
    assert_matches(*run_case(T, FAMILIES[family], dtype, CLAMPED, True, gather=True, seed=1), dtype)


def test_default_configs_by_tokens_and_dtype():
    assert default_config(1, torch.bfloat16).gemv_rows() == 1 and default_config(1, torch.bfloat16).BLOCK_K == 512
    assert default_config(4, torch.bfloat16).gemv_rows() == 2 and default_config(4, torch.bfloat16).half(torch.bfloat16)
    assert default_config(16, torch.bfloat16).use_dot(torch.bfloat16)
    assert not default_config(16, torch.float32).use_dot(torch.float32)
    assert not Mxfp4Config().half(torch.float32)


@pytest.mark.parametrize("bad", [dict(BLOCK_N=16), dict(BLOCK_K=48), dict(BLOCK_M=12), dict(num_stages=0)])
def test_config_checks(bad):
    with pytest.raises(ValueError):
        Mxfp4Config(**bad)


def test_mxfp4_experts_module_kernels_match_its_loop(poisoned_outputs):
    """Mxfp4Experts' Triton body (its buffers as Mxfp4Weights, its kernel_config, the tokens gathered by the kernels)
    against its own per-expert loop, combined; on a CPU in the interpreter, so fp32."""
    from moeserve.kernels.routing import combine
    from moeserve.model.experts import LoopedExperts
    from moeserve.quant.mxfp4 import Mxfp4Experts

    E, D, F, k, T = 4, 64, 64, 2, 3
    ex = Mxfp4Experts(E, D, F, bias=True, act=CLAMPED).to(DEVICE)
    gate_up, down = experts(E, D, F, bias=True, seed=2)
    ex.gate_up_proj_blocks, ex.gate_up_proj_scales = gate_up.blocks, gate_up.scales
    ex.down_proj_blocks, ex.down_proj_scales = down.blocks, down.scales
    ex.gate_up_proj_bias = torch.nn.Parameter(gate_up.bias, requires_grad=False)
    ex.down_proj_bias = torch.nn.Parameter(down.bias, requires_grad=False)
    ex.kernel_config = Mxfp4Config(BLOCK_K=64, BLOCK_M=2)
    x = torch.randn(T, D, device=DEVICE)
    table = build_routing_table(routing_ids(T, E, k, "random").to(DEVICE), torch.rand(T, k, device=DEVICE), E)
    with torch.no_grad():
        got = combine(ex.triton_experts(x, table, table.token_ids), table, T, x.dtype)
        want = combine(LoopedExperts.run_sorted(ex, x[table.token_ids], table), table, T, x.dtype)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mxfp4_model_path_and_cuda_graph(tmp_path):
    """A GPT-OSS-like layer on the GPU: Mxfp4Experts take the Triton path (graph-safe; the default config of one
    token, a few, 16) and agree with float64 experts of its weights, combined; the call replays as a CUDA graph with
    the eager output. (The per-expert bf16 loop is no reference here: it rounds gate/up to bf16 before the
    activation, and differs from both by more than the kernels' own error.)"""
    from moeserve.model.paths import GRAPH_SAFE
    from moeserve.quant.mxfp4 import Mxfp4Experts

    E, D, F, k = 8, 256, 128, 4
    ex = Mxfp4Experts(E, D, F, bias=True, act=ClampedSwiGLU()).cuda()
    gate_up, down = experts(E, D, F, bias=True)
    ex.gate_up_proj_blocks, ex.gate_up_proj_scales = gate_up.blocks, gate_up.scales
    ex.down_proj_blocks, ex.down_proj_scales = down.blocks, down.scales
    ex.gate_up_proj_bias = torch.nn.Parameter(gate_up.bias.bfloat16(), requires_grad=False)
    ex.down_proj_bias = torch.nn.Parameter(down.bias.bfloat16(), requires_grad=False)
    weights = (Mxfp4Weights(gate_up.blocks, gate_up.scales, ex.gate_up_proj_bias),
               Mxfp4Weights(down.blocks, down.scales, ex.down_proj_bias))
    for T in (1, 3, 16):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).cuda()
        w = torch.softmax(torch.randn(T, k, device="cuda"), -1).bfloat16()
        assert ex.kernel_path(x, T) == "mxfp4_triton" and "mxfp4_triton" in GRAPH_SAFE
        with torch.no_grad():
            got = ex(x, ids, w)
            table = build_routing_table(ids, w, E)
            rows = reference(x[table.token_ids], *weights, table, ex.act)  # [T*k, D] float64
            want = torch.zeros(T, D, dtype=torch.float64).index_add_(
                0, table.token_ids.cpu(), rows * table.weights.cpu().double()[:, None])
            assert_matches(got.double().cpu(), want, torch.bfloat16)
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
