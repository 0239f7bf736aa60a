"""The bf16/fp16 Triton fused-MoE kernels (kernels/triton/fused_moe.py, swiglu.py) against the plain-PyTorch expert
loop. On a CPU they run in the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) at tiny sizes; on a
GPU, compiled."""

import pytest
import torch

pytest.importorskip("triton")

from checks import DEVICE, expert_loop_fp64, routing_ids  # noqa: E402
from moeserve.kernels.routing import build_routing_table  # noqa: E402
from moeserve.kernels.triton.configs import ExpertsConfig, FusedMoEConfig  # noqa: E402
from moeserve.kernels.triton.fused_moe import fused_experts  # noqa: E402
from moeserve.model.experts import ResidentExperts  # noqa: E402


SMALL = {"gate_up": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4),
         "down": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4)}


def experts(E, D, F):
    ex = ResidentExperts(E, D, F)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, D ** -0.5)
        ex.down_proj.normal_(0, F ** -0.5)
    return ex.to(DEVICE)


@pytest.mark.parametrize("T,routing", [(1, "random"), (5, "random"), (19, "random"), (37, "one_expert"),
                                       (6, "two_experts")])
@pytest.mark.parametrize("E,k,D,F", [(4, 2, 64, 48), (6, 3, 40, 72)])  # 40, 72: not multiples of the blocks
def test_fused_experts_match_the_loop(poisoned_outputs, T, routing, E, k, D, F):
    ex = experts(E, D, F)
    x = torch.randn(T, D, device=DEVICE)
    ids = routing_ids(T, E, k, routing)
    table = build_routing_table(ids.to(DEVICE), torch.rand(T, k, device=DEVICE), E)
    x_sorted = x[table.token_ids]
    got = fused_experts(x_sorted, ex.gate_up_proj.data, ex.down_proj.data, table,
                        ExpertsConfig.of(SMALL, FusedMoEConfig))
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
    config = {"pointers": TILES, "mixed": {**TILES, "down": SMALL["down"]},
              "tma": {p: {**c, "TMA": 1} for p, c in TILES.items()}}[variant]
    got = fused_experts(x_sorted, ex.gate_up_proj.data, ex.down_proj.data, table,
                        ExpertsConfig.of(config, FusedMoEConfig))
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), expert_loop_fp64(ex, x_sorted, table), atol=1e-4, rtol=1e-4)


def test_fused_experts_row_tiles_reject_uneven_blocks():
    ex = experts(4, 40, 48)  # BLOCK_K 16 does not divide D = 40
    table = build_routing_table(torch.tensor([[0, 1]], device=DEVICE), torch.rand(1, 2, device=DEVICE), 4)
    with pytest.raises(ValueError, match="gate_up tile config needs a BLOCK_K that divides its 40 inputs"):
        fused_experts(torch.randn(2, 40, device=DEVICE), ex.gate_up_proj.data, ex.down_proj.data, table,
                      ExpertsConfig.of(TILES, FusedMoEConfig))


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
