"""Expert parallelism on torch.distributed (gloo, CPU, spawned ranks) against the single-process model."""

import pytest
import torch.multiprocessing as mp

import parallel_worker
from moeserve.errors import MoeserveError
from moeserve.parallel.groups import RankGrid, check_experts


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("routing", ["random", "one_expert"])
def test_expert_parallel_layer_matches_full_layer(world, routing, tmp_path):
    mp.spawn(parallel_worker.layer_case, args=(world, str(tmp_path / "rdv"), routing), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_model_matches_single_process(hf_checkpoints, world, tmp_path):
    _, path = hf_checkpoints["mixtral"]
    mp.spawn(parallel_worker.model_case, args=(world, str(tmp_path / "rdv"), str(path)), nprocs=world, join=True)


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


def test_cli_generate_under_torchrun_matches_single_process(byte_model_dir, capsys):
    import subprocess
    import sys

    from moeserve.cli import main

    argv = ["generate", "--model", str(byte_model_dir), "--greedy", "--max-new-tokens", "8", "Words, words"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "moeserve", *argv, "--ep", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == single.strip().splitlines()[-1]  # rank 0 prints, same text


def test_cli_ep_without_torchrun_is_a_clear_error(byte_model_dir, capsys, monkeypatch):
    from moeserve.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["generate", "--model", str(byte_model_dir), "--ep", "2", "x"]) == 2
    assert "torchrun" in capsys.readouterr().err


@pytest.mark.parametrize("world,tp,ep", [(2, 2, 1), (4, 2, 1), (4, 2, 2)])  # (4, 2, 2): TP groups x EP
def test_tensor_parallel_matches_single_process(hf_checkpoints, world, tp, ep, tmp_path):
    paths = [str(hf_checkpoints[f][1]) for f in ("mixtral", "qwen2_moe", "qwen3_moe")]  # + shared expert, dense, qk-norm
    mp.spawn(parallel_worker.tp_case, args=(world, str(tmp_path / "rdv"), paths, tp, ep), nprocs=world, join=True)


def test_tensor_parallel_rejects_what_it_cannot_slice(hf_checkpoints):
    import moeserve
    from moeserve.parallel.tensor_parallel import check_tensor_parallel

    check_tensor_parallel(moeserve.ModelSpec.from_dir(hf_checkpoints["mixtral"][1]), 2)
    with pytest.raises(MoeserveError, match="KV heads 2"):
        check_tensor_parallel(moeserve.ModelSpec.from_dir(hf_checkpoints["mixtral"][1]), 4)
    with pytest.raises(MoeserveError, match="all heads"):
        check_tensor_parallel(moeserve.ModelSpec.from_dir(hf_checkpoints["olmoe"][1]), 2)


def test_hierarchical_all_to_all_simulated_2x2(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["mixtral"]
    mp.spawn(parallel_worker.hierarchical_case, args=(4, str(tmp_path / "rdv"), str(path)), nprocs=4, join=True)
