"""Triton fused-MoE kernels against the plain-PyTorch expert loop. On a CPU they run in the Triton
interpreter (TRITON_INTERPRET=1, set by conftest) at tiny sizes; on a GPU, compiled."""

import math

import pytest
import torch

pytest.importorskip("triton")

from checks import assert_same_top_k, expert_loop_fp64, routing_ids, torch_rms_norm  # noqa: E402
from moeserve.kernels import triton_interpreting  # noqa: E402
from moeserve.kernels.routing import build_routing_table  # noqa: E402
from moeserve.kernels.triton.fused_moe import fused_experts  # noqa: E402
from moeserve.model.experts import ResidentExperts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = {"gate_up": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4),
         "down": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4)}


def experts(E, D, F):
    ex = ResidentExperts(E, D, F)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, D ** -0.5)
        ex.down_proj.normal_(0, F ** -0.5)
    return ex.to(DEVICE)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every buffer the kernels write starts as NaN, so a row they skip cannot pass as right."""
    real = torch.empty

    def poisoned(*a, **k):
        t = real(*a, **k)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("T,routing", [(1, "random"), (5, "random"), (19, "random"), (37, "one_expert"),
                                       (6, "two_experts")])
@pytest.mark.parametrize("E,k,D,F", [(4, 2, 64, 48), (6, 3, 40, 72)])  # 40, 72: not multiples of the blocks
def test_fused_experts_match_the_loop(poisoned_outputs, T, routing, E, k, D, F):
    ex = experts(E, D, F)
    x = torch.randn(T, D, device=DEVICE)
    ids = routing_ids(T, E, k, routing)
    table = build_routing_table(ids.to(DEVICE), torch.rand(T, k, device=DEVICE), E)
    x_sorted = x[table.token_ids]
    got = fused_experts(x_sorted, ex.gate_up_proj.data, ex.down_proj.data, table, SMALL)
    ref = expert_loop_fp64(ex, x_sorted, table)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


TILES = {"gate_up": dict(schedule="tiles", BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=4),
         "down": dict(schedule="tiles", BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)}


@pytest.mark.parametrize("T,routing", [(1, "random"), (9, "random"), (23, "random"), (37, "one_expert"),
                                       (6, "two_experts")])
@pytest.mark.parametrize("E,k,D,F", [(4, 2, 64, 48), (6, 3, 48, 80)])  # 48, 80: output blocks cut short
@pytest.mark.parametrize("variant", ["pointers", "tma", "mixed"])
def test_fused_experts_row_tiles_match_the_loop(poisoned_outputs, T, routing, E, k, D, F, variant):
    """The prefill schedule: row tiles of one expert each, found from the counts; partial tiles, experts with no
    rows, all rows on one expert, a grid larger than the tiles; operands through pointers or TMA descriptors;
    mixed: tiled gate_up, decode-schedule down."""
    ex = experts(E, D, F)
    x = torch.randn(T, D, device=DEVICE)
    table = build_routing_table(routing_ids(T, E, k, routing).to(DEVICE), torch.rand(T, k, device=DEVICE), E)
    x_sorted = x[table.token_ids]
    got = fused_experts(x_sorted, ex.gate_up_proj.data, ex.down_proj.data, table,
                        {"pointers": TILES, "mixed": {**TILES, "down": SMALL["down"]},
                         "tma": {p: {**c, "TMA": 1} for p, c in TILES.items()}}[variant])
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), expert_loop_fp64(ex, x_sorted, table), atol=1e-4, rtol=1e-4)


def test_fused_experts_row_tiles_reject_uneven_blocks():
    ex = experts(4, 40, 48)  # BLOCK_K 16 does not divide D = 40
    table = build_routing_table(torch.tensor([[0, 1]], device=DEVICE), torch.rand(1, 2, device=DEVICE), 4)
    with pytest.raises(ValueError, match="gate_up tile config needs a BLOCK_K that divides its 40 inputs"):
        fused_experts(torch.randn(2, 40, device=DEVICE), ex.gate_up_proj.data, ex.down_proj.data, table, TILES)


def quantized(N, K, bits, group, rank=0, comp_bits=16):
    """A random QuantizedLinear (HQQ codes, and a random rank-r compensator at comp_bits) on DEVICE."""
    from moeserve.quant import hqq, milo
    from moeserve.quant.qlinear import QuantizedLinear

    qw = hqq.quantize_hqq(torch.randn(N, K) * K ** -0.5, bits, group)  # outputs of order 1
    comp = milo.compensator_to_buffers(torch.randn(N, rank) * 0.1, torch.randn(rank, K) * 0.1, comp_bits) if rank else None
    return QuantizedLinear.from_quantized(qw, comp, rank, comp_bits).to(DEVICE)


def reference(layer, x):
    """float64: x dequant(W)^T + (x V^T) U^T."""
    y = x.double() @ layer.weight(torch.float64).T
    uv = layer.compensator(torch.float64)
    return y if uv is None else y + (x.double() @ uv[1].T) @ uv[0].T


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
    from moeserve.kernels.triton.lowbit_linear import lowbit_linear, supported

    if not supported(bits, group):
        pytest.skip("3-bit groups hold whole 32-value units")
    layer = quantized(N, K, bits, group)
    for M in (1, 3, 16, 17):  # 1 (or a config's BLOCK_M rows): CUDA cores; more: tensor-core tiles of 16 / 32 rows
        x = torch.randn(M, K, device=DEVICE)
        y = lowbit_linear(x, layer.qweight, layer.scale, layer.zero, bits, group, K, config=config)
        assert not y.isnan().any()
        torch.testing.assert_close(y.double(), reference(layer, x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("comp_bits", [16, 8, 3])
@pytest.mark.parametrize("M", [1, 5])
def test_lowbit_linear_fuses_the_compensator(poisoned_outputs, comp_bits, M):
    from moeserve.kernels.triton.lowbit_linear import lowbit_linear

    layer = quantized(48, 128, 3, 64, rank=40, comp_bits=comp_bits)  # rank 40: two BLOCK_R chunks, one masked
    x = torch.randn(M, 128, device=DEVICE)
    y = lowbit_linear(x, layer.qweight, layer.scale, layer.zero, 3, 64, 128, lowrank=layer.compensator(x.dtype),
                      config=SPLIT)
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
    from moeserve.kernels.triton.lowbit_linear import lowbit_linear

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
    from moeserve.kernels.triton.lowbit_linear import lowbit_linear

    layer = quantized(70, 320, bits, 64)
    for dtype, magnitude in ((torch.bfloat16, 1.0), (torch.float16, 1e-3), (torch.bfloat16, 3e4)):
        x = (torch.randn(3 if "BLOCK_M" in config else 1, 320, device=DEVICE) * magnitude).to(dtype)
        if magnitude > 1:
            x[:, 7] = 3e6  # 100x the rest: the small inputs of its step keep ~8 significant bits after scaling
        ref = reference(layer, x)
        ys = []
        for half, tol in ((1, 5e-3), (0, 1e-5)):
            ys.append(lowbit_linear(x, layer.qweight, layer.scale, layer.zero, bits, 64, 320,
                                    config={**config, "HALF": half}))
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
    from moeserve.kernels.triton.lowbit_linear import lowbit_linear, pair_codes

    layer = quantized(70, 320, bits, 64)
    x = (torch.randn(17, 320, device=DEVICE) * 3).to(dtype)
    ref = reference(layer, x)
    codes = pair_codes(bits, dtype, use_dot=True)
    ys = []
    for half, pipe in ((1, 0), (0, 0), (1, 3)):  # PIPE takes the dequantize path whatever HALF says
        ys.append(lowbit_linear(x, layer.qweight, layer.scale, layer.zero, bits, 64, 320,
                                config={**SPLIT, "BLOCK_K": 128, "HALF": half, "PIPE": pipe}))
        assert ys[-1].dtype == dtype and not ys[-1].isnan().any()
        err = float((ys[-1].double() - ref).norm() / ref.norm())
        roundings = 1 if half and codes and not pipe else 2
        assert err < roundings * 2 ** -8, (half, pipe, err)
    assert torch.equal(ys[0], ys[1]) != codes  # the codes path ran where it applies
    if triton_interpreting():  # programs run in order there, so the split-K atomics add in the same order too
        assert torch.equal(ys[1], ys[2])  # the same sums in the same order


def test_pipelined_tensor_core_config_needs_whole_groups():
    from moeserve.kernels.triton.lowbit_linear import tile_constexprs

    with pytest.raises(ValueError, match="multiple of the group"):
        tile_constexprs({**SPLIT, "BLOCK_K": 96, "PIPE": 3}, 4, 64, 16, torch.bfloat16, False)


def quantized_experts(E, D, F, bits, ranks):
    from moeserve.quant.qlinear import QuantizedExperts

    return QuantizedExperts([quantized(2 * F, D, bits, 32, r) for r in ranks],
                            [quantized(D, F, bits, 32, r) for r in ranks])


@pytest.mark.parametrize("bits,T,routing,cuda_rows", [(4, 1, "random", 1), (3, 1, "random", 1), (3, 3, "random", 1),
                                                       (4, 2, "one_expert", 1),
                                                       (2, 17, "one_expert", 1), (4, 17, "one_expert", 1),
                                                       (3, 5, "two_experts", 1), (4, 9, "one_expert", 4),
                                                       (3, 5, "two_experts", 2)])
@pytest.mark.parametrize("order", ["sorted", "slots"])
def test_lowbit_fused_moe_matches_the_loop(poisoned_outputs, bits, T, routing, cuda_rows, order):
    """cuda_rows > 1: CUDA-core tiles of that many rows of x for T > 1 (chunks when an expert has more). order: rows
    expert-sorted through a routing table, or in slot order found from the expert ids in-kernel (T * k <= E: a
    program per slot, T = 2 with experts shared between tokens)."""
    from moeserve.kernels.triton.configs import lowbit_moe_config
    from moeserve.kernels.triton.fused_moe_lowbit import lowbit_experts
    from moeserve.model.experts import LoopedExperts

    E, k, D, F = 4, 2, 64, 96
    ex = quantized_experts(E, D, F, bits, ranks=[0, 8, 0, 20] if T != 3 else [0] * E)  # padded ranks, or none
    ids = routing_ids(T, E, k, routing)
    table = build_routing_table(ids.to(DEVICE), torch.rand(T, k, device=DEVICE), E)
    x = torch.randn(T, D, device=DEVICE)
    x_sorted = x[table.token_ids]
    config = lowbit_moe_config("cpu", bits, E, D, F, T)
    rows = {"BLOCK_M": cuda_rows} if cuda_rows > 1 else {}
    # two interleaved sub-tiles; 64 gate rows (and their up rows, in one pipeline) per program: a partial last block
    config = {"gate_up": {**config["gate_up"], "BLOCK_N": 64 if bits == 3 else 32, "SUB": 2,
                          "PAIRED": int(bits == 3 or T in (1, 9)), **rows},
              "down": {**config["down"], "BLOCK_N": 16, "SPLIT_K": 2, **rows}}
    ex64 = quantized_experts_as_float64(ex)
    ref = LoopedExperts.run_sorted(ex64, x_sorted.double(), table)
    if order == "slots":
        got = lowbit_experts(x, *ex.stacked(x.dtype), ids.to(DEVICE), config)
        order = torch.argsort(ids.reshape(-1), stable=True).to(DEVICE)  # sorted row r is slot order[r]
        ref = torch.empty_like(ref).index_copy_(0, order, ref)  # [T*k, D] in slot order
    else:
        got = lowbit_experts(x_sorted, *ex.stacked(x_sorted.dtype), table, config)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits,rows", [(4, {"BLOCK_M": 2, "PAIRED": 1}), (4, {}), (3, {"PAIRED": 1}),
                                       (3, {"PIPE": 3, "PAIRED": 1})])
def test_lowbit_fused_moe_in_bf16_takes_16_bit_paths(poisoned_outputs, bits, rows):
    """The MoE kernels on bf16 rows: gate_up and down on fp16 pairs on CUDA cores (chunks of 2 rows on one expert),
    or on 16-bit codes on tensor cores (the 5 rows in one tile of 16), or (PIPE) on dequantized tiles with steps
    pipelined (down's K = 96: its last step half past the end)."""
    from moeserve.kernels.triton.fused_moe_lowbit import lowbit_experts
    from moeserve.model.experts import LoopedExperts

    E, k, D, F, T = 4, 2, 64, 96, 5
    ex = quantized_experts(E, D, F, bits, ranks=[0, 8, 0, 0])
    table = build_routing_table(routing_ids(T, E, k, "one_expert").to(DEVICE), torch.rand(T, k, device=DEVICE), E)
    x_sorted = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)[table.token_ids]

    def run(tile: dict) -> torch.Tensor:
        cfg = dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, SUB=2, **tile)
        return lowbit_experts(x_sorted, *ex.stacked(x_sorted.dtype), table,
                              {"gate_up": {**cfg, "SPLIT_K": 1}, "down": {**cfg, "BLOCK_N": 16, "SPLIT_K": 2}})

    got = run(rows)
    ref = LoopedExperts.run_sorted(quantized_experts_as_float64(ex), x_sorted.double(), table)
    assert not got.isnan().any()
    # two bf16-level layers (Triton 3.9's interpreter truncates to bf16: a -0.3% bias per rounding; GPUs round to
    # nearest); dequantized tiles (PIPE) round each weight to bf16 too
    assert float((got.double() - ref.detach()).norm() / ref.detach().norm()) < (1.6e-2 if "PIPE" in rows else 1e-2)
    if "PIPE" in rows and triton_interpreting():  # programs run in order: the unpipelined dequantizing loop's sums
        assert torch.equal(got, run({**rows, "PIPE": 0, "HALF": 0}))


@pytest.mark.parametrize("bits,dtype,F,D,BK,rank,gate_up_tma", [(4, torch.float32, 192, 1024, 512, 0, True),
                                                                (2, torch.bfloat16, 192, 1024, 512, 0, True),
                                                                (8, torch.bfloat16, 192, 1024, 512, 0, True),
                                                                (4, torch.bfloat16, 1024, 1024, 512, 0, True),
                                                                (4, torch.bfloat16, 1024, 1024, 512, 0, False),
                                                                (2, torch.float32, 1536, 1024, 512, 0, True),
                                                                (3, torch.float32, 192, 1024, 512, 0, True),
                                                                (3, torch.bfloat16, 1024, 1536, 1024, 0, True),
                                                                (3, torch.float32, 1024, 1024, 512, 16, True),
                                                                (4, torch.float32, 192, 1024, 512, 8, True)])
def test_lowbit_fused_moe_one_token_tma(poisoned_outputs, bits, dtype, F, D, BK, rank, gate_up_tma):
    """One token, config TMA: words and scale/zero by TMA descriptors (3 bits: one block per plane), two row blocks
    per program loaded as one box (gate and up rows: 3-D) and split, against the float64 experts. F = 192: gate_up
    only (a partial last row block of 128, whose rows past F come zero-filled); F = 1024: down
    too, its 2 steps split in two (fp32 atomics), after gate_up by TMA or (gate_up_tma off) on CUDA cores; F = 1536:
    down's steps of 1024, the last half full. x prepared apart (x_preparation, as the router's launch does) gives
    the same.
    D = 1536 in steps of 1024: gate_up's last step is half past the row (at 3 bits its plane blocks run into the
    next plane and past the row). rank: compensators of ranks rank, 0, rank / 2, rank on the four experts
    (zero-padded to one rank), added before the weight stream. x's groups of 64 span 10^-3..10^3 (the fp16 pairs of
    a step share one scale). bf16: h rounds to bf16 between the projections and x's small groups lose bits to the
    step's shared fp16 scale, up to about 1e-2 of the norm over random draws (0.0100029 seen once), so 2e-2;
    a misplaced block or plane errs by O(1)."""
    from moeserve.kernels.triton.fused_moe_lowbit import lowbit_experts, tma_one_token, x_preparation
    from moeserve.kernels.triton.lowbit_linear import prepare_x
    from moeserve.model.experts import LoopedExperts
    from moeserve.quant.qlinear import QuantizedExperts

    E, k = 4, 2
    ranks = (rank, 0, rank // 2, rank)
    ex = QuantizedExperts([quantized(2 * F, D, bits, 64, ranks[e]) for e in range(E)],
                          [quantized(D, F, bits, 64, ranks[e]) for e in range(E)])
    ids = torch.stack([torch.randperm(E)[:k]])  # [1, k]
    ids[0, 0] = E - 1  # the last expert's rows end the stacked weights
    spread = 10.0 ** torch.randint(-3, 4, (D // 64,)).repeat_interleave(64)  # [D] one power of ten per group
    x = (torch.randn(1, D) * spread).to(DEVICE, dtype)
    gate_up, down = ex.stacked(dtype)
    tma = dict(BLOCK_N=128, BLOCK_K=BK, num_warps=4, num_stages=2, TMA=1)
    config = {"gate_up": {**tma, "SPLIT_K": 1} if gate_up_tma else dict(BLOCK_N=64, BLOCK_K=512, num_warps=4, SUB=2,
                                                                         SPLIT_K=1),
              "down": ({**tma, "BLOCK_K": 1024 if F % 1024 else 512, "SPLIT_K": 2} if F >= 512
                       else dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, SUB=2, SPLIT_K=1))}
    assert tma_one_token(config["gate_up"], gate_up, ids.to(DEVICE), x.device) == gate_up_tma
    assert tma_one_token(config["down"], down, ids.to(DEVICE), x.device) == (F >= 512)
    got = lowbit_experts(x, gate_up, down, ids.to(DEVICE), config)  # [k, D] in slot order
    prep = x_preparation(x, gate_up, down, k, config)  # x prepared by another launch (the router's) gives the same
    prepared = prepare_x(x, prep.bits, prep.block_k, prep.half)
    assert torch.equal(got, lowbit_experts(x, gate_up, down, ids.to(DEVICE), config, prepared_x=prepared))
    with pytest.raises(ValueError, match="prepared as"):  # prepared for other steps: refused, not misread
        lowbit_experts(x, gate_up, down, ids.to(DEVICE), config, prepared_x=prepare_x(x, bits, 2 * prep.block_k,
                                                                                       prep.half))
    table = build_routing_table(ids.to(DEVICE), torch.rand(1, k, device=DEVICE), E)
    ref = LoopedExperts.run_sorted(quantized_experts_as_float64(ex), x[table.token_ids].double(), table)
    order = torch.argsort(ids.reshape(-1), stable=True).to(DEVICE)  # sorted row r is slot order[r]
    ref = torch.empty_like(ref).index_copy_(0, order, ref)
    assert not got.isnan().any()
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err


def quantized_experts_as_float64(ex):
    """The same experts as float64 dense FFNs (expert_ffn of a float64 ResidentExperts)."""
    dense = ResidentExperts(ex.num_experts, ex.gate_up[0].in_features, ex.down[0].in_features).double().to(DEVICE)
    with torch.no_grad():
        for e in range(ex.num_experts):
            dense.gate_up_proj[e] = reference(ex.gate_up[e], torch.eye(dense.gate_up_proj.shape[2], device=DEVICE)).T
            dense.down_proj[e] = reference(ex.down[e], torch.eye(dense.down_proj.shape[2], device=DEVICE)).T
    return dense


@pytest.mark.parametrize("T,k,E,block", [(1, 2, 8, 64), (37, 3, 9, 16), (40, 6, 64, 32), (5, 2, 3, 64),
                                         (300, 2, 8, 64), (70, 6, 128, 32)])  # past RANK_MAX_SLOTS: counting
@pytest.mark.parametrize("counting", [False, True])
def test_one_launch_routing_table_equals_the_sort(T, k, E, block, counting):
    """Ranks by comparison or by counting (several programs, several chunks) give the stable sort's table
    exactly."""
    from moeserve.kernels.routing import sorted_table
    from moeserve.kernels.triton.routing_table import table_tensors

    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(DEVICE)  # [T, k]
    if T > 5:
        ids[: T // 2, 0] = E - 1  # a crowded expert
    w = torch.rand(T, k, device=DEVICE)
    got = table_tensors(ids, w, E, block=block, chunk=block, count_chunk=block if counting else None)
    ref = sorted_table(ids, w, E)
    for name in ("token_ids", "weights", "counts", "offsets"):
        assert torch.equal(got[name], getattr(ref, name)), name
    order = torch.argsort(ids.reshape(-1), stable=True)
    assert torch.equal(got["slot_of"][order].long(), torch.arange(T * k, device=DEVICE))  # the inverse permutation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_combine_equals_the_scatter(dtype):
    """Each token's rows gathered and weighted equal the float64 scatter, from expert-sorted rows and from the same rows
    in slot order; a weight-0 slot's NaN row adds nothing."""
    from moeserve.kernels.routing import RoutingTable, combine
    from moeserve.kernels.triton.routing_table import gather_combine, table_tensors

    T, k, E, D = 9, 3, 5, 40  # D: not a multiple of the block
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(DEVICE)
    w = torch.rand(T, k, device=DEVICE)
    w[4, 1] = 0.0
    fields = table_tensors(ids, w, E)
    rows = torch.randn(T * k, D, device=DEVICE)
    rows[fields["slot_of"][4 * k + 1]] = math.nan
    got = combine(rows, RoutingTable(**fields, num_tokens=T), T, dtype)
    in_slot_order = gather_combine(rows[fields["slot_of"].long()], None, w, k, dtype)
    ref = torch.zeros(T, D, dtype=torch.float64, device=DEVICE)
    for t in range(T):
        for j in range(k):
            if w[t, j] != 0:
                ref[t] += w[t, j].double() * rows[fields["slot_of"][t * k + j]].double()
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
    assert torch.equal(in_slot_order, got)


@pytest.mark.parametrize("n,F", [(1, 96), (7, 1500), (0, 64)])  # 1500: a partial column block; 0 rows: no launch
def test_fused_swiglu_matches_float64(poisoned_outputs, n, F):
    from moeserve.kernels.triton.swiglu import fused_swiglu

    h = torch.randn(n, 2 * F, device=DEVICE) * 3
    gate, up = h.double().chunk(2, dim=-1)
    out = fused_swiglu(h)
    assert out.shape == (n, F) and out.dtype == h.dtype
    torch.testing.assert_close(out.double(), torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="2F"):
        fused_swiglu(h[:, 1:])


@pytest.mark.parametrize("M,N,K,block_n", [(1, 7, 33, 1), (3, 20, 100, 2), (8, 5, 64, 4), (2, 9, 1500, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_matches_float64(poisoned_outputs, M, N, K, block_n, dtype):
    """Few rows of x times a wide W: N and K not multiples of the blocks (1500: a partial last K block)."""
    from moeserve.kernels.triton.skinny import skinny_linear

    x, w = torch.randn(M, K, device=DEVICE, dtype=dtype), torch.randn(N, K, device=DEVICE, dtype=dtype)
    got = skinny_linear(x, w, block_n)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, atol=1e-4 * K ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("M,sizes,K,block_n,bias", [(1, (8, 4, 4), 40, 2, False), (2, (6, 3, 5), 100, 4, True),
                                                    (1, (16, 8), 2100, 8, True), (2, (7,), 33, 2, False)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_skinny_linears_side_by_side_match_float64(poisoned_outputs, M, sizes, K, block_n, bias, out_dtype):
    """Up to three weights in one launch (decode's q, k and v): outputs side by side, biases added, a block size
    that does not divide every weight's rows (5, 3, 7: halved to what does), a partial last K block (2100)."""
    from moeserve.kernels.triton.skinny import skinny_linears

    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    ws = [torch.randn(n, K, device=DEVICE, dtype=torch.bfloat16) for n in sizes]
    bs = [torch.randn(n, device=DEVICE, dtype=torch.bfloat16) for n in sizes] if bias else None
    got = skinny_linears(x, ws, bs, out_dtype=out_dtype, block_n=block_n, stages=4)
    ref = torch.cat([x.double() @ w.double().T + (bs[i].double() if bias else 0) for i, w in enumerate(ws)], dim=1)
    assert got.shape == (M, sum(sizes)) and got.dtype == out_dtype
    tol = 1e-4 * K ** 0.5 if out_dtype == torch.float32 else 2 ** -7 * ref.abs().max().item()
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=1e-5 if out_dtype == torch.float32 else 2 ** -7)


@pytest.mark.parametrize("x_shape,w_shape,dtypes,match", [((9, 16), (4, 16), None, "1..8"),
                                                          ((2, 16), (4, 15), None, r"w \[N, K\]"),
                                                          ((2, 16), (4, 16), (torch.float32, torch.float16), "dtype")])
def test_skinny_linear_rejects_what_it_cannot_run(x_shape, w_shape, dtypes, match):
    from moeserve.kernels.triton.skinny import skinny_linear

    dx, dw = dtypes or (torch.float32, torch.float32)
    with pytest.raises(ValueError, match=match):
        skinny_linear(torch.randn(x_shape, dtype=dx), torch.randn(w_shape, dtype=dw))


@pytest.mark.parametrize("M,E,r,ids", [(1, 8, 4, (5, 2)), (2, 6, 8, (0, 3, 5)), (1, 4, 2, (3,))])
def test_skinny_linear_computes_only_the_listed_groups(poisoned_outputs, M, E, r, ids):
    """One token's compensator inputs x V^T for its experts only: the listed experts' r columns as the full product,
    the others left unwritten (NaN here: no program wrote them)."""
    from moeserve.kernels.triton.skinny import skinny_linear

    x, v = torch.randn(M, 40, device=DEVICE), torch.randn(E * r, 40, device=DEVICE)
    got = skinny_linear(x, v, block_n=4, groups=(torch.tensor(ids, device=DEVICE), r))
    cols = torch.cat([torch.arange(e * r, (e + 1) * r) for e in ids]).to(DEVICE)
    torch.testing.assert_close(got[:, cols].double(), x.double() @ v[cols].double().T, atol=1e-5, rtol=1e-5)
    rest = torch.ones(E * r, dtype=torch.bool, device=DEVICE)
    rest[cols] = False
    assert got[:, rest].isnan().all()
    with pytest.raises(ValueError, match="groups"):
        skinny_linear(x, v, groups=(torch.tensor(ids, device=DEVICE), 3 * r + 1))


def test_linears_take_one_launch_only_for_plain_layers_and_few_rows():
    """Decode's projections go through one skinny launch only where that is exactly x W^T + b and measured faster:
    one row,
    plain nn.Linear (a subclass, e.g. tensor parallel's row-parallel layer, or a hooked layer does more), one dtype,
    biases on all or none, no autograd."""
    from moeserve.model.layers import skinny_serves

    class Closing(torch.nn.Linear):
        pass

    q, k = torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 4, bias=False)
    x = torch.randn(1, 1, 16)
    with torch.no_grad():
        assert skinny_serves(x, (q, k)) and skinny_serves(torch.randn(1, 16), (q,))
        assert not skinny_serves(torch.randn(2, 1, 16), (q,))
        assert not skinny_serves(x, (q, Closing(16, 4, bias=False)))
        assert not skinny_serves(x, (q, torch.nn.Linear(16, 4)))  # bias on one only
        assert not skinny_serves(x.bfloat16(), (q, k))
        assert not skinny_serves(x, (q, k, q, k))
        handle = k.register_forward_hook(lambda *a: None)
        assert not skinny_serves(x, (q, k))
        handle.remove()
    assert not skinny_serves(x, (q, k))  # autograd would record through the weights


def test_skinny_linears_reject_what_they_cannot_run():
    from moeserve.kernels.triton.skinny import skinny_linears

    x, w = torch.randn(1, 16), torch.randn(4, 16)
    with pytest.raises(ValueError, match="1..3 weights"):
        skinny_linears(x, [w] * 4)
    with pytest.raises(ValueError, match="one bias"):
        skinny_linears(x, [w, w], [torch.randn(4)])


@pytest.mark.parametrize("T,E,k,D,normalize,weights_fp32", [(1, 8, 2, 64, True, True), (5, 60, 6, 40, False, False),
                                                            (3, 64, 8, 200, True, False), (2, 3, 3, 16, True, True)])
def test_fused_router_matches_softmax_topk(poisoned_outputs, T, E, k, D, normalize, weights_fp32):
    """One launch (E, D not powers of two, several D steps, k = E) gives the experts, weights and logits of the torch
    router; the returned weights come in the dtype TopKRouter hands on."""
    from moeserve.kernels.triton.topk_router import fused_router
    from moeserve.model.router import softmax_topk

    x = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(E, D, device=DEVICE, dtype=torch.bfloat16) * D ** -0.5
    ids, weights, logits = fused_router(x, weight, k, normalize, torch.float32 if weights_fp32 else x.dtype)
    ref_logits = (x.double() @ weight.double().T).to(x.dtype)  # exact sum, rounded as F.linear's output is
    assert logits.dtype == x.dtype and weights.dtype == (torch.float32 if weights_fp32 else x.dtype)
    torch.testing.assert_close(logits, ref_logits, atol=0, rtol=2 ** -7)  # one bf16 rounding step at most
    ref_ids, ref_weights = softmax_topk(logits, k, normalize)  # the torch router on these logits
    assert_same_top_k(ids, ref_ids, logits)
    rtol = 1e-6 if weights_fp32 else 2 ** -7  # bf16 weights: the fp32 value rounded once (one ulp)
    torch.testing.assert_close(weights.float(), ref_weights, atol=0, rtol=rtol)
    with pytest.raises(ValueError, match="top-"):
        fused_router(x, weight, E + 1, normalize, torch.float32)


@pytest.mark.parametrize("T,E,k,D,bits,block_k,half", [(1, 8, 2, 256, 3, 128, True), (3, 60, 6, 320, 4, 64, False),
                                                       (2, 5, 2, 96, 2, 64, True), (1, 16, 4, 192, 8, 128, True)])
def test_fused_router_prepares_x_as_prepare_x(poisoned_outputs, T, E, k, D, bits, block_k, half):
    """The router's launch with prepared: more programs write x prepared for the experts' CUDA-core kernels, exactly
    what prepare_x writes (a last step past the row at D = 320 and 96), and the routing is the same."""
    from moeserve.kernels.triton.lowbit_linear import Preparation, prepare_x
    from moeserve.kernels.triton.topk_router import fused_router

    x = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(E, D, device=DEVICE, dtype=torch.bfloat16) * D ** -0.5
    prep = Preparation(bits, block_k, half)
    xw = prep.buffer(T, D, x.device)
    got = fused_router(x, weight, k, True, torch.float32, (prep, xw))
    assert torch.equal(xw, prepare_x(x, bits, block_k, half))
    for a, b in zip(got, fused_router(x, weight, k, True, torch.float32)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows,D", [(1, 64), (5, 48)])  # 48: a masked tail of the block
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_matches_the_torch_expression(poisoned_outputs, rows, D, dtype):
    """Equal to the torch expression up to its fp32 sum's order (one step of the output's rounding), at any scale
    of x; bf16 only against float64, as the interpreter truncates fp32 -> bf16."""
    from moeserve.kernels.triton.norm_rotary import rms_norm

    x = (torch.randn(rows, 3, D, device=DEVICE) * 10 ** torch.empty(rows, 3, 1, device=DEVICE).uniform_(-3, 3))
    x, weight = x.to(dtype), (1 + torch.randn(D, device=DEVICE) * 0.1).to(dtype)
    got = rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype and not got.isnan().any()
    if dtype == torch.bfloat16:
        x64 = x.double()
        ref = weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(got.double(), ref, atol=0, rtol=2 ** -6)
    else:
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got, torch_rms_norm(x, weight, 1e-6), atol=0, rtol=4 * eps)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[1:], 1e-6)
    assert rms_norm(x[:0], weight, 1e-6).shape == (0, 3, D)  # no rows: no launch


@pytest.mark.parametrize("rows,D", [(1, 64), (3, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_adds_the_residual_first(poisoned_outputs, rows, D, dtype):
    """rms_norm(x, w, residual=h) = (norm(x + h), x + h): the sum exactly as torch adds (rounded once to x's dtype),
    the norm of that sum as the plain kernel computes it."""
    from moeserve.kernels.triton.norm_rotary import rms_norm

    x, h = (torch.randn(rows, 2, D, device=DEVICE, dtype=dtype) * 4 for _ in range(2))
    weight = (1 + torch.randn(D, device=DEVICE) * 0.1).to(dtype)
    normed, total = rms_norm(x, weight, 1e-6, residual=h)
    assert torch.equal(total, x + h)
    torch.testing.assert_close(normed, rms_norm(x + h, weight, 1e-6), atol=0, rtol=0)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, weight, 1e-6, residual=h[:, :1])


@pytest.mark.parametrize("B,S,H,Dh", [(1, 1, 4, 16), (2, 3, 5, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_matches_apply_rotary_bitwise(poisoned_outputs, B, S, H, Dh, dtype):
    """The fused rotary on a transposed view (as Attention.qkv passes it) rounds where torch does: equal bits (bf16
    on a GPU: tests/test_gpu.py; the interpreter truncates to bf16)."""
    from moeserve.kernels.triton.norm_rotary import rotary
    from moeserve.model.layers import apply_rotary

    x = torch.randn(B, S, H, Dh, device=DEVICE).to(dtype).transpose(1, 2)  # [B, H, S, Dh], strided
    angle = torch.rand(B, S, Dh // 2, device=DEVICE) * 100
    cos, sin = (torch.cat((f(angle), f(angle)), -1).to(dtype) for f in (torch.cos, torch.sin))
    got = rotary(x, cos, sin)
    ref = apply_rotary(x.cpu(), cos.cpu(), sin.cpu())  # the torch expression
    assert got.shape == (B, H, S, Dh) and got.is_contiguous()
    assert torch.equal(got.cpu(), ref)
    with pytest.raises(ValueError, match="power-of-two"):
        rotary(x[..., :12], cos[..., :12], sin[..., :12])
    assert rotary(x[:, :0], cos, sin).shape == (B, 0, S, Dh)  # no heads: no launch


@pytest.mark.parametrize("B,H,Hkv,Dh", [(1, 4, 2, 16), (2, 6, 3, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_into_cache_matches_rotary_and_the_cache_writes(poisoned_outputs, B, H, Hkv, Dh, dtype):
    """One decode token: q rotated as apply_rotary does, k rotated and v copied into the caches at the slot the
    device tensor holds, every other slot untouched; qkv rows strided (a view of wider rows)."""
    from moeserve.model.layers import apply_rotary
    from moeserve.kernels.triton.norm_rotary import rotary_into_cache

    N = (H + 2 * Hkv) * Dh
    qkv = torch.randn(B, 1, N + 8, device=DEVICE).to(dtype)[..., :N]  # [B, 1, N], rows of stride N + 8
    angle = torch.rand(B, 1, Dh // 2, device=DEVICE) * 100
    cos, sin = (torch.cat((f(angle), f(angle)), -1).to(dtype) for f in (torch.cos, torch.sin))
    keys, values = (torch.randn(B, Hkv, 5, Dh, device=DEVICE).to(dtype) for _ in range(2))
    old_k, old_v = keys.clone(), values.clone()
    q = rotary_into_cache(qkv, cos, sin, H, keys, values, torch.tensor([3], device=DEVICE))
    heads = qkv.cpu().view(B, 1, H + 2 * Hkv, Dh).transpose(1, 2)  # [B, heads, 1, Dh]
    assert torch.equal(q.cpu(), apply_rotary(heads[:, :H], cos.cpu(), sin.cpu()))
    assert torch.equal(keys[:, :, 3].cpu(), apply_rotary(heads[:, H:H + Hkv], cos.cpu(), sin.cpu())[:, :, 0])
    assert torch.equal(values[:, :, 3].cpu(), heads[:, H + Hkv:, 0])
    others = [0, 1, 2, 4]
    assert torch.equal(keys[:, :, others], old_k[:, :, others])
    assert torch.equal(values[:, :, others], old_v[:, :, others])
    with pytest.raises(ValueError, match="rotary_into_cache"):
        rotary_into_cache(qkv, cos, sin, H + 1, keys, values, torch.tensor([3], device=DEVICE))


def test_dependent_launch_stays_off_where_it_cannot_run(monkeypatch):
    """PDL needs CUDA on Hopper or later, compiled kernels and no MOESERVE_PDL=0: elsewhere the kernels get PDL=False
    and no launch option (griddepcontrol does not exist before sm_90)."""
    from moeserve.kernels.triton.pdl import ENV, dependent_launch, pdl_enabled

    assert dependent_launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(ENV, "0")
    assert dependent_launch(torch.device("cuda", 0)) == {"PDL": False}


def test_lowbit_moe_configs_with_compensators_prefer_their_own_entries(tmp_path, monkeypatch):
    """Tuned `_lr` entries serve experts with compensators; without one, the plain entry does; a run that tunes one
    key keeps the others."""
    from moeserve.kernels.triton import configs

    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.device_table.cache_clear()
    plain = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4}, "down": {"BLOCK_N": 32, "BLOCK_K": 512,
                                                                                  "num_warps": 4, "SPLIT_K": 2}}
    lowrank = {"gate_up": {**plain["gate_up"], "SUB": 4}, "down": {**plain["down"], "BLOCK_N": 16}}
    try:
        configs.write_sections("Test GPU", {"lowbit_moe": {configs.lowbit_moe_key(3, 8, 64, 96): {"1": plain}}})
        assert configs.lowbit_moe_config("Test GPU", 3, 8, 64, 96, 1, 2, True) == plain  # no _lr entry yet
        configs.write_sections("Test GPU", {"lowbit_moe": {configs.lowbit_moe_key(3, 8, 64, 96, True): {"1": lowrank}}})
        assert configs.lowbit_moe_config("Test GPU", 3, 8, 64, 96, 1, 2, True) == lowrank
        assert configs.lowbit_moe_config("Test GPU", 3, 8, 64, 96, 1, 2, False) == plain
        assert configs.lowbit_moe_config("Test GPU", 4, 8, 64, 96, 1, 2, True) != lowrank  # other widths: defaults
    finally:
        monkeypatch.undo()
        for cached in (configs.device_table, configs.lowbit_config, configs.lowbit_moe_config):
            cached.cache_clear()
