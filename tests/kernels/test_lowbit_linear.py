"""The low-bit dense matmul (kernels/triton/lowbit/: lowbit_linear) against float64: CUDA-core GEMV and tensor-core
tiles, fp16 pairs and 16-bit codes, split-K, compensators. On a CPU they run in the Triton interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py) at tiny sizes; on a GPU, compiled."""

import pytest
import torch

pytest.importorskip("triton")

from checks import DEVICE, quantized, reference  # noqa: E402
from moeserve.kernels import triton_interpreting  # noqa: E402
from moeserve.kernels.triton.configs import LowbitConfig  # noqa: E402


SPLIT = dict(BLOCK_N=16, BLOCK_K=64, num_warps=4, SPLIT_K=3)  # fp32 atomics over 3 K slices


WHOLE = dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, SPLIT_K=1)


# a whole group per thread of one warp (3 bits: a plane's two words of a group as one 8-byte vector): 16 rows per
# sub-tile x 2 groups per step; K = 320: 3 steps, the last clamped
WIDE = dict(BLOCK_N=32, BLOCK_K=128, num_warps=1, SUB=2, SPLIT_K=1)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("N,K,group,config", [(40, 96, 32, SPLIT), (70, 48, 16, WHOLE),  # K=48: padded rows
                                               (33, 320, 64, SPLIT), (33, 320, 64, WHOLE),
                                               (40, 96, 32, {**SPLIT, "AHEAD": 2}),  # two steps of loads ahead
                                               (70, 96, 32, {**SPLIT, "BLOCK_N": 32, "SUB": 2}),  # interleaved rows
                                               (33, 320, 64, {**WHOLE, "BLOCK_N": 64, "SUB": 4, "AHEAD": 2}),
                                               (70, 96, 32, {**SPLIT, "BLOCK_N": 32, "SUB": 2, "BLOCK_M": 4}),
                                               (33, 320, 64, {**WHOLE, "BLOCK_M": 8}),  # CUDA cores, rows of x
                                               (70, 96, 32, {**SPLIT, "BLOCK_N": 32, "SUB": 2, "PIPE": 3}),
                                               (33, 320, 64, {**WHOLE, "BLOCK_M": 2, "PIPE": 4}),  # cp.async
                                               (33, 320, 64, WIDE)])
def test_lowbit_linear_matches_float64(poisoned_outputs, bits, N, K, group, config):
    from moeserve.kernels.triton.lowbit import lowbit_linear, supported

    if not supported(bits, group):
        pytest.skip("3-bit groups hold whole 32-value units")
    layer = quantized(N, K, bits, group)
    for M in (1, 3, 16, 17):  # 1 (or a config's BLOCK_M rows): CUDA cores; more: tensor-core tiles of 16 / 32 rows
        x = torch.randn(M, K, device=DEVICE)
        y = lowbit_linear(x, layer.qweight, layer.scale, layer.zero, bits, group, K, config=LowbitConfig.of(config))
        assert not y.isnan().any()
        torch.testing.assert_close(y.double(), reference(layer, x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("comp_bits", [16, 8, 3])
@pytest.mark.parametrize("M", [1, 5])
def test_lowbit_linear_fuses_the_compensator(poisoned_outputs, comp_bits, M):
    from moeserve.kernels.triton.lowbit import lowbit_linear

    layer = quantized(48, 128, 3, 64, rank=40, comp_bits=comp_bits)  # rank 40: two BLOCK_R chunks, one masked
    x = torch.randn(M, 128, device=DEVICE)
    y = lowbit_linear(x, layer.qweight, layer.scale, layer.zero, 3, 64, 128, lowrank=layer.compensator(x.dtype),
                      config=LowbitConfig.of(SPLIT))
    assert not y.isnan().any()
    torch.testing.assert_close(y.double(), reference(layer, x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("problem,call", [
    ("bits", lambda l, x: (x, l.qweight, l.scale, l.zero, 5, 64, 128)),
    ("group", lambda l, x: (x, l.qweight, l.scale, l.zero, 4, 48, 128)),
    ("dtype", lambda l, x: (x.to(torch.float64), l.qweight, l.scale, l.zero, 4, 64, 128)),
    ("features", lambda l, x: (x[:, :96], l.qweight, l.scale, l.zero, 4, 64, 128)),
    ("qweight", lambda l, x: (x, l.qweight[:, :-1], l.scale, l.zero, 4, 64, 128)),
    ("scale", lambda l, x: (x, l.qweight, l.scale.float(), l.zero, 4, 64, 128)),
])
def test_lowbit_linear_rejects_what_it_cannot_run(problem, call):
    from moeserve.kernels.triton.lowbit import lowbit_linear

    layer = quantized(16, 128, 4, 64)
    with pytest.raises(ValueError):
        lowbit_linear(*call(layer, torch.randn(2, 128, device=DEVICE)))
    with pytest.raises(ValueError, match="group"):
        lowbit_linear(torch.randn(2, 128, device=DEVICE), quantized(16, 128, 3, 16).qweight, *[None] * 2, 3, 16, 128)


PAIR_CONFIGS = [SPLIT, {**WHOLE, "BLOCK_N": 32, "SUB": 2, "AHEAD": 2},
                {**SPLIT, "BLOCK_N": 32, "SUB": 2, "BLOCK_M": 4, "PIPE": 3}, WIDE]


@pytest.mark.parametrize("bits,config", [(4, PAIR_CONFIGS[0]), (4, PAIR_CONFIGS[1]), (4, PAIR_CONFIGS[2]),
                                         (3, PAIR_CONFIGS[0]), (3, PAIR_CONFIGS[1]), (3, PAIR_CONFIGS[2]),
                                         (3, PAIR_CONFIGS[3]),
                                         (2, PAIR_CONFIGS[0]), (8, PAIR_CONFIGS[2])])
def test_lowbit_linear_fp16_pairs_match_float64(poisoned_outputs, bits, config):
    """16-bit activations on CUDA cores take the fp16-pair path: error at bf16's rounding level, at any magnitude
    of x (each step is scaled by a power of two), also with one huge input among small ones in a step."""
    from moeserve.kernels.triton.lowbit import lowbit_linear

    layer = quantized(70, 320, bits, 64)
    for dtype, magnitude in ((torch.bfloat16, 1.0), (torch.float16, 1e-3), (torch.bfloat16, 3e4)):
        x = (torch.randn(3 if "BLOCK_M" in config else 1, 320, device=DEVICE) * magnitude).to(dtype)
        if magnitude > 1:
            x[:, 7] = 3e6  # 100x the rest: the small inputs of its step keep ~8 significant bits after scaling
        ref = reference(layer, x)
        ys = []
        for half, tol in ((1, 5e-3), (0, 1e-5)):
            ys.append(lowbit_linear(x, layer.qweight, layer.scale, layer.zero, bits, 64, 320,
                                    config=LowbitConfig.of({**config, "HALF": half})))
            assert ys[-1].dtype == dtype and not ys[-1].isnan().any() and not ys[-1].isinf().any()
            err = float((ys[-1].double() - ref).norm() / ref.norm())
            # + the output's own rounding: Triton's interpreter truncates to bf16 (an rms ~2^-7.8, not 2^-9)
            rounding = 2 ** -7 if dtype == torch.bfloat16 and triton_interpreting() else 2 ** -8
            assert err < tol + rounding, (dtype, magnitude, half, err)
        assert not torch.equal(*ys)  # the pair path ran: its fp16 sums round differently


@pytest.mark.parametrize("bits,dtype", [(4, torch.bfloat16), (2, torch.bfloat16), (3, torch.bfloat16),
                                        (4, torch.float16), (3, torch.float16), (8, torch.float16),
                                        (8, torch.bfloat16)])
def test_lowbit_linear_tensor_core_codes_match_float64(poisoned_outputs, bits, dtype):
    """16-bit rows on tensor cores: the dot on the exact codes 2^bits + q with scale/zero per group after it rounds
    once (the output), the dequantize-then-dot paths twice (each weight to x's dtype, then the output): error within
    2^-8 per bf16 rounding (the interpreter truncates, so both sat at one rounding's bound in 15 draws); bf16 cannot
    hold 8-bit codes, so 8-bit bf16 decodes. PIPE: the pipelined dequantize-then-dot loop over steps of two groups
    (K = 320: the last step half past the end), the same sums as the register-prefetch loop."""
    from moeserve.kernels.triton.lowbit import lowbit_linear
    from moeserve.kernels.triton.lowbit.layout import pair_codes

    layer = quantized(70, 320, bits, 64)
    x = (torch.randn(17, 320, device=DEVICE) * 3).to(dtype)
    ref = reference(layer, x)
    codes = pair_codes(bits, dtype, use_dot=True)
    ys = []
    for half, pipe in ((1, 0), (0, 0), (1, 3)):  # PIPE takes the dequantize path whatever HALF says
        ys.append(lowbit_linear(x, layer.qweight, layer.scale, layer.zero, bits, 64, 320,
                                config=LowbitConfig.of({**SPLIT, "BLOCK_K": 128, "HALF": half, "PIPE": pipe})))
        assert ys[-1].dtype == dtype and not ys[-1].isnan().any()
        err = float((ys[-1].double() - ref).norm() / ref.norm())
        roundings = 1 if half and codes and not pipe else 2
        assert err < roundings * 2 ** -8, (half, pipe, err)
    assert torch.equal(ys[0], ys[1]) != codes  # the codes path ran where it applies
    if triton_interpreting():  # programs run in order there, so the split-K atomics add in the same order too
        assert torch.equal(ys[1], ys[2])  # the same sums in the same order


def test_pipelined_tensor_core_config_needs_whole_groups():
    from moeserve.kernels.triton.lowbit.launch import tile_constexprs

    with pytest.raises(ValueError, match="multiple of the group"):
        tile_constexprs(LowbitConfig.of({**SPLIT, "BLOCK_K": 96, "PIPE": 3}), 4, 64, 16, torch.bfloat16, False)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("N,K,group", [(70, 48, 16), (33, 320, 64), (130, 256, 32)])  # K=48: padded rows
def test_lowbit_dequantize_matches_unpack(bits, N, K, group):
    """The one-pass dequantized weight (for calls of many rows) equals pack.unpack + hqq.dequantize exactly."""
    from moeserve.kernels.pack import padded_length, unpack
    from moeserve.kernels.triton.lowbit import lowbit_dequantize
    from moeserve.quant.hqq import QuantizedWeight, dequantize

    layer = quantized(N, K, bits, group)
    codes = unpack(layer.qweight, bits, padded_length(K))[:, :K]
    want = dequantize(QuantizedWeight(codes=codes, scale=layer.scale, zero=layer.zero, bits=bits, group=group,
                                      shape=(N, K)), torch.float32)
    got = lowbit_dequantize(layer.qweight, layer.scale, layer.zero, bits, group, K, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), want.cpu())
    got = lowbit_dequantize(layer.qweight, layer.scale, layer.zero, bits, group, K, torch.bfloat16).cpu().float()
    if DEVICE == "cuda":  # rounded to nearest as torch does; the interpreter truncates to bf16 (one unit off)
        assert torch.equal(got, want.cpu().to(torch.bfloat16).float())
    else:
        torch.testing.assert_close(got, want.cpu(), rtol=2 ** -7, atol=0)
    with pytest.raises(ValueError, match="reads"):
        lowbit_dequantize(layer.qweight, layer.scale, layer.zero, 3, group, K, torch.float32)


@pytest.mark.parametrize("bits", [3, 4])
def test_lowbit_linear_past_64_rows(bits):
    """A prompt's rows (up to TRITON_MAX_ROWS) in blocks of 64 with the stored/default config, against float64."""
    from moeserve.kernels.triton.lowbit import lowbit_linear

    layer = quantized(40, 128, bits, 32)
    x = torch.randn(150, 128, device=DEVICE)
    y = lowbit_linear(x, layer.qweight, layer.scale, layer.zero, bits, 32, 128)
    torch.testing.assert_close(y.double(), reference(layer, x), atol=1e-3, rtol=1e-3)
