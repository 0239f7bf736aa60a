"""The low-bit fused MoE (kernels/triton/lowbit/: lowbit_experts) against float64 experts: expert-sorted rows and slot
order, CUDA-core and tensor-core tiles, one token by TMA, x prepared by another launch. On a CPU they run in the
Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) at tiny sizes; on a GPU, compiled."""

import pytest
import torch

pytest.importorskip("triton")

from checks import (DEVICE, quantized, quantized_experts, quantized_experts_as_float64,  # noqa: E402
                    routing_ids)
from moeserve.kernels import triton_interpreting  # noqa: E402
from moeserve.kernels.routing import build_routing_table  # noqa: E402
from moeserve.kernels.triton.configs import ExpertsConfig, LowbitConfig  # noqa: E402


@pytest.mark.parametrize("bits,T,routing,cuda_rows", [(4, 1, "random", 1), (3, 1, "random", 1), (3, 3, "random", 1),
                                                       (4, 2, "one_expert", 1),
                                                       (2, 17, "one_expert", 1), (4, 17, "one_expert", 1),
                                                       (3, 5, "two_experts", 1), (4, 9, "one_expert", 4),
                                                       (3, 5, "two_experts", 2), (4, 80, "one_expert", 1)])
@pytest.mark.parametrize("order", ["sorted", "slots"])
def test_lowbit_fused_moe_matches_the_loop(poisoned_outputs, bits, T, routing, cuda_rows, order):
    """cuda_rows > 1: CUDA-core tiles of that many rows of x for T > 1 (chunks when an expert has more; T = 80: an
    expert's rows in two passes of a tensor-core tile, which holds at most DOT_MAX_ROWS). order: rows
    expert-sorted through a routing table, or in slot order found from the expert ids in-kernel (T * k <= E: a
    program per slot, T = 2 with experts shared between tokens)."""
    from moeserve.kernels.triton.configs import lowbit_moe_config
    from moeserve.kernels.triton.lowbit import lowbit_experts
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
    config = ExpertsConfig(config.gate_up.replace(BLOCK_N=64 if bits == 3 else 32, SUB=2,
                                                  PAIRED=int(bits == 3 or T in (1, 9)), **rows),
                           config.down.replace(BLOCK_N=16, SPLIT_K=2, **rows))
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


@pytest.mark.parametrize("T,tile", [(1, {}), (3, {"BLOCK_M": 2}), (20, {"PAIRED": 1}), (20, {"PIPE": 3})])
def test_lowbit_fused_moe_adds_biases_and_the_clamped_swiglu(poisoned_outputs, T, tile):
    """GPT-OSS's experts quantized (moeserve quantize): each expert's gate/up and down biases and the clamped SwiGLU
    in the kernels' epilogues (down's bias by its first K slice of two), one token in slot order (the kernels that
    prepare x themselves: the TMA path adds no biases), CUDA-core and tensor-core tiles, against float64."""
    from moeserve.kernels.triton.lowbit import lowbit_experts
    from moeserve.model.experts import LoopedExperts
    from moeserve.spec import ClampedSwiGLU

    E, k, D, F = 4, 2, 64, 96
    ex = quantized_experts(E, D, F, 4, [0, 8, 0, 0])
    ex.act = ClampedSwiGLU(alpha=1.702, limit=0.4)  # bites: the sums reach past +-0.4
    for m in (*ex.gate_up, *ex.down):
        m.bias = torch.nn.Parameter(torch.randn(m.out_features, device=DEVICE) * 0.5, requires_grad=False)
    ids = routing_ids(T, E, k, "random" if T < 20 else "one_expert").to(DEVICE)
    table = build_routing_table(ids, torch.rand(T, k, device=DEVICE), E)
    x = torch.randn(T, D, device=DEVICE)
    cfg = dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, SUB=2, **tile)
    config = ExpertsConfig.of({"gate_up": {**cfg, "SPLIT_K": 1}, "down": {**cfg, "BLOCK_N": 16, "SPLIT_K": 2}},
                              LowbitConfig)
    ref = LoopedExperts.run_sorted(quantized_experts_as_float64(ex), x[table.token_ids].double(), table)  # [T*k, D]
    if T == 1:
        got = lowbit_experts(x, *ex.stacked(x.dtype), ids, config, act=ex.act)  # slot order: sorted row r is slot
        ref = torch.empty_like(ref).index_copy_(0, torch.argsort(ids.reshape(-1), stable=True), ref)  # order[r]
    else:
        got = lowbit_experts(x[table.token_ids], *ex.stacked(x.dtype), table, config, act=ex.act)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)
    plain = quantized_experts_as_float64(ex)
    plain.act = None
    assert not torch.allclose(LoopedExperts.run_sorted(plain, x[table.token_ids].double(), table).sort(0).values,
                              ref.sort(0).values, atol=1e-2)  # the clamps did bite


@pytest.mark.parametrize("bits,rows", [(4, {"BLOCK_M": 2, "PAIRED": 1}), (4, {}), (3, {"PAIRED": 1}),
                                       (3, {"PIPE": 3, "PAIRED": 1})])
def test_lowbit_fused_moe_in_bf16_takes_16_bit_paths(poisoned_outputs, bits, rows):
    """The MoE kernels on bf16 rows: gate_up and down on fp16 pairs on CUDA cores (chunks of 2 rows on one expert),
    or on 16-bit codes on tensor cores (the 5 rows in one tile of 16), or (PIPE) on dequantized tiles with steps
    pipelined (down's K = 96: its last step half past the end)."""
    from moeserve.kernels.triton.lowbit import lowbit_experts
    from moeserve.model.experts import LoopedExperts

    E, k, D, F, T = 4, 2, 64, 96, 5
    ex = quantized_experts(E, D, F, bits, ranks=[0, 8, 0, 0])
    table = build_routing_table(routing_ids(T, E, k, "one_expert").to(DEVICE), torch.rand(T, k, device=DEVICE), E)
    x_sorted = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)[table.token_ids]

    def run(tile: dict) -> torch.Tensor:
        cfg = dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, SUB=2, **tile)
        return lowbit_experts(x_sorted, *ex.stacked(x_sorted.dtype), table, ExpertsConfig.of(
            {"gate_up": {**cfg, "SPLIT_K": 1}, "down": {**cfg, "BLOCK_N": 16, "SPLIT_K": 2}}, LowbitConfig))

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
    from moeserve.kernels.triton.lowbit import lowbit_experts, prepare_x, x_preparation
    from moeserve.kernels.triton.lowbit.launch import tma_one_token
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
    config = ExpertsConfig.of(config, LowbitConfig)
    assert tma_one_token(config.gate_up, gate_up, ids.to(DEVICE), x.device) == gate_up_tma
    assert tma_one_token(config.down, down, ids.to(DEVICE), x.device) == (F >= 512)
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
