"""Expert parallelism on torch.distributed (gloo, CPU, spawned ranks) against the single-process model."""

import socket

import pytest
import torch.multiprocessing as mp

import parallel_worker
from moeserve.errors import MoeserveError
from moeserve.parallel.groups import RankGrid, check_experts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("routing", ["random", "one_expert"])
def test_expert_parallel_layer_matches_full_layer(world, routing):
    mp.spawn(parallel_worker.layer_case, args=(world, free_port(), routing), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_model_matches_single_process(hf_checkpoints, world):
    _, path = hf_checkpoints["mixtral"]
    mp.spawn(parallel_worker.model_case, args=(world, free_port(), str(path)), nprocs=world, join=True)


def test_rank_grid_layout():
    grid = RankGrid(world=8, tp=2)
    assert grid.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.ep_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]  # same TP rank: coordinated all-to-all
    assert RankGrid(world=8, tp=2, ep=2).ep_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert RankGrid(world=4).ep_groups() == [[0, 1, 2, 3]]
    with pytest.raises(MoeserveError, match="not divisible"):
        RankGrid(world=6, tp=4)
    with pytest.raises(MoeserveError, match="must divide"):
        RankGrid(world=8, tp=2, ep=3)
    with pytest.raises(MoeserveError, match="cannot be split"):
        check_experts(8, 3)
