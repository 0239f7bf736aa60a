"""Expert, tensor and vocab parallelism on torch.distributed (gloo, CPU, spawned ranks) against the
single-process model. One spawn per world size runs all cases (tests/parallel_worker.py)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch.multiprocessing as mp

import parallel_worker
from moeserve.errors import MoeserveError
from moeserve.parallel.groups import RankGrid, check_experts, expert_share, split_range

MODEL_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]  # + shared expert (overlapped), dense layers, qk-norm
CASES = {
    2: [("layer", "random"), ("layer", "one_expert"),
        ("model", ["mixtral"], 1, 2, 128), ("model", ["mixtral"], 1, 2, 0),  # EP: static / dynamic dispatch
        ("model", ["prmoe", "pyramid"], 1, 2, 128), ("model", ["prmoe"], 1, 2, 0),  # layers of 2, 4, 8 experts
        ("model", [*MODEL_FAMILIES, "olmoe", "fused_tied"], 2, 1, 128),  # TP: vocab-parallel, heads, expert
        # slicing, OLMoE's qk-norm over all heads (sharded) and clip_qkv
        ("model", ["deepseek_v3", "deepseek_v2_lite", "glm4_moe"], 2, 1, 128),  # MLA heads, partial rotary
        ("model", ["deepseek_v3"], 1, 2, 128),  # EP with grouped routing and a shared expert
        ("model", ["phimoe"], 2, 1, 128), ("model", ["phimoe"], 1, 2, 128),  # biases (head too), LayerNorm, LongRoPE
        ("model", ["granitemoeshared", "dbrx"], 2, 1, 128),  # muP, shared MLP; DBRX's fused tensors split on reading
        ("model", ["granitemoeshared", "dbrx"], 1, 2, 128),
        ("model", ["llama4"], 2, 1, 128), ("model", ["llama4"], 1, 2, 128),  # NoPE, chunks, experts' scaled input
        ("model", ["gpt_oss", "gpt_oss_mxfp4"], 1, 2, 128),  # biases, clamped SwiGLU, sinks; MXFP4 blocks
        ("model", ["gpt_oss_mxfp4"], 1, 2, 0),
        ("model", ["gpt_oss", "gpt_oss_mxfp4_wide"], 2, 1, 128),  # TP: sinks by head, down's bias once, F slices
        ("bad_checkpoint",)],
    4: [("layer", "random"), ("layer", "one_expert"),
        ("model", ["mixtral", "qwen2_moe"], 1, 4, 128), ("model", ["mixtral"], 1, 4, 0),
        ("model", ["qwen2_moe"], 2, 2, 128),  # coordinated TP x EP
        ("model", ["prmoe", "pyramid"], 1, 4, 128), ("model", ["prmoe"], 1, 4, 0),  # 2 experts: 2 copies
        ("model", ["gpt_oss_mxfp4"], 1, 4, 128),  # two of its 8 experts a rank
        ("model", ["gpt_oss_mxfp4_wide"], 2, 2, 128),  # TP x EP
        ("hierarchical",), ("bad_checkpoint",)],
}


@pytest.fixture(scope="module")
def checkpoint_paths(hf_checkpoints, tmp_path_factory):
    """family -> checkpoint directory, plus `missing_expert`: mixtral without the last expert of layer 0, and
    `fused_tied`: qwen3_moe in fused-expert names with the head tied to the embedding (no lm_head stored);
    `gpt_oss_mxfp4`: the tiny GPT-OSS with its experts in MXFP4 (hf_models.write_mxfp4_pair), `gpt_oss_mxfp4_wide`
    another with an FFN of 64 (tensor-parallel slices of whole blocks);
    `prmoe` (top-1 + residual MLP) and `pyramid` (top-2): PR-MoE checkpoints with layers of 2, 4 and 8 experts."""
    import moeserve
    from hf_models import build_hf_model, write_mxfp4_pair
    from prmoe_models import save_prmoe_model, tiny_arch
    from safetensors.torch import load_file, save_file

    paths = {fam: str(path) for fam, (_, path) in hf_checkpoints.items()}
    broken = tmp_path_factory.mktemp("missing_expert")
    shutil.copy(hf_checkpoints["mixtral"][1] / "config.json", broken)
    state = load_file(hf_checkpoints["mixtral"][1] / "model.safetensors")
    del state["model.layers.0.block_sparse_moe.experts.7.w1.weight"]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    paths["missing_expert"] = str(broken)
    fused = tmp_path_factory.mktemp("fused_tied")
    config = json.loads((hf_checkpoints["qwen3_moe"][1] / "config.json").read_text())
    (fused / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    state = moeserve.load_model(hf_checkpoints["qwen3_moe"][1]).state_dict()
    del state["lm_head.weight"]
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    paths["fused_tied"] = str(fused)
    packed = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write_mxfp4_pair(hf_checkpoints["gpt_oss"][1], packed, tmp_path_factory.mktemp("gpt_oss_twin"))
    paths["gpt_oss_mxfp4"] = str(packed)
    wide = tmp_path_factory.mktemp("gpt_oss_wide")  # FFN 64: two TP slices of whole MXFP4 blocks
    build_hf_model("gpt_oss", seed=9, intermediate_size=64).save_pretrained(wide)
    wide_packed = tmp_path_factory.mktemp("gpt_oss_mxfp4_wide")
    write_mxfp4_pair(wide, wide_packed, tmp_path_factory.mktemp("gpt_oss_wide_twin"))
    paths["gpt_oss_mxfp4_wide"] = str(wide_packed)
    paths["prmoe"] = str(save_prmoe_model(tmp_path_factory.mktemp("prmoe"), tiny_arch((2, 4, 8), 1, True), seed=5))
    paths["pyramid"] = str(save_prmoe_model(tmp_path_factory.mktemp("pyramid"), tiny_arch((2, 4, 8), 2, False), seed=6))
    return paths


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_matches_single_process(world, checkpoint_paths, tmp_path):
    mp.spawn(parallel_worker.suite, args=(world, str(tmp_path / "rdv"), CASES[world], checkpoint_paths),
             nprocs=world, join=True)


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
    with pytest.raises(MoeserveError, match="cannot be spread"):
        check_experts(8, 3)
    with pytest.raises(MoeserveError, match="use --tp"):
        check_experts(6, 4)  # neither divides the other
    assert check_experts(8, 16) == 1  # more EP ranks than experts: the layer is held twice
    assert [expert_share(2, 4, r) for r in range(4)] == [(range(0, 1), 0), (range(1, 2), 0), (range(0, 1), 2),
                                                        (range(1, 2), 2)]
    assert expert_share(8, 4, 3) == (range(6, 8), 0)
    assert [split_range(97, r, 4) for r in range(4)] == [range(0, 25), range(25, 49), range(49, 73), range(73, 97)]


def test_dispatch_layouts():
    """Once-per-rank rows and the static layout, on a hand-made routing (no communication)."""
    import torch

    from moeserve.parallel.dispatch import dynamic_rows, rows_sent, static_rows

    ids = torch.tensor([[0, 1], [3, 2], [1, 3]])  # 2 ranks x 2 experts: token 0 -> rank 0 only, 1 -> 1, 2 -> both
    w = torch.tensor([[0.5, 0.5], [0.7, 0.3], [0.6, 0.4]])
    rows = dynamic_rows(ids, w, per_rank=2, ranks=2)
    assert rows.token.tolist() == [0, 2, 1, 2] and rows.counts.tolist() == [2, 2]
    assert rows.local_ids.tolist() == [[0, 1], [1, -1], [1, 0], [-1, 1]]
    x = torch.arange(6.0).view(3, 2)
    send, sids, sw = static_rows(x, ids, w, per_rank=2, ranks=2, capacity=4)
    assert send.shape == (8, 2) and torch.equal(send[4:7], x) and not send[3].any()
    assert sids.tolist() == [[0, 1], [-1, -1], [1, -1], [-1, -1], [-1, -1], [1, 0], [-1, 1], [-1, -1]]
    assert rows_sent(ids, per_rank=2, ranks=2, rank=0) == {"per_rank": 2, "per_expert": 3}
    # a 2-expert layer over 4 ranks: a rank of the second copy (ranks 2, 3) sends only within it
    copy = dynamic_rows(torch.tensor([[0], [1], [1]]), torch.ones(3, 1), per_rank=1, ranks=4, base=2)
    assert copy.counts.tolist() == [0, 0, 1, 2] and copy.local_ids.tolist() == [[0], [0], [0]]


def _torchrun(argv: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "moeserve", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def test_cli_generate_under_torchrun_matches_single_process(byte_model_dir, capsys):
    from moeserve.cli import main

    argv = ["generate", "--model", str(byte_model_dir), "--greedy", "--max-new-tokens", "8", "Words, words"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    proc = _torchrun([*argv, "--ep", "2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == single.strip().splitlines()[-1]  # rank 0 prints, same text


def test_cli_eval_ppl_under_torchrun_matches_single_process(byte_model_dir, capsys):
    from moeserve.cli import main

    argv = ["eval", "ppl", "--model", str(byte_model_dir), "--window", "32", "--max-tokens", "200"]
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    proc = _torchrun([*argv, "--tp", "2"])  # vocab-parallel head: the loss sees all logits
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1  # rank 0 prints
    assert json.loads(lines[0])["perplexity"] == pytest.approx(single["perplexity"], rel=1e-5)


def test_cli_bad_layout_under_torchrun_is_one_line_per_rank(byte_model_dir):
    proc = _torchrun(["generate", "--model", str(byte_model_dir), "--tp", "3", "x"])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("moeserve: error:")]
    assert len(errors) == 2 and "must equal the number of ranks" in errors[0], proc.stderr[-2000:]


def test_cli_ep_without_torchrun_is_a_clear_error(byte_model_dir, capsys, monkeypatch):
    from moeserve.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["generate", "--model", str(byte_model_dir), "--ep", "2", "x"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_tensor_parallel_rejects_what_it_cannot_slice(hf_checkpoints):
    import moeserve
    from moeserve.parallel.tensor_parallel import check_tensor_parallel

    check_tensor_parallel(moeserve.ModelSpec.from_dir(hf_checkpoints["mixtral"][1]), 2)
    with pytest.raises(MoeserveError, match="KV heads 2"):
        check_tensor_parallel(moeserve.ModelSpec.from_dir(hf_checkpoints["mixtral"][1]), 4)
    check_tensor_parallel(moeserve.ModelSpec.from_dir(hf_checkpoints["olmoe"][1]), 2)  # sharded qk-norm


def test_tp_index_says_what_a_rank_keeps():
    """The one rule for slicing and sharded reads: opening projections by output rows, closing ones by input
    columns (their bias whole), vocabulary rows unevenly, everything else replicated."""
    from moeserve.parallel.tensor_parallel import tp_index

    def index(name, shape, rank=1, size=2):
        return tp_index(f"model.layers.0.{name}", shape, rank, size)

    assert index("self_attn.k_proj.bias", (8,)) == (slice(4, 8),)
    assert index("mlp.shared_expert.up_proj.weight", (6, 3)) == (slice(3, 6),)
    assert index("self_attn.o_proj.weight", (3, 8)) == (slice(None), slice(4, 8))
    assert index("mlp.down_proj.weight", (3, 6), rank=0) == (slice(None), slice(0, 3))
    assert index("self_attn.o_proj.bias", (3,)) is None
    replicated = ("mlp.gate.weight", "mlp.shared_expert_gate.weight", "self_attn.q_norm.weight", "norm.weight")
    for name in replicated:
        assert index(name, (4,)) is None
    assert [tp_index("lm_head.weight", (97, 3), r, 4) for r in (0, 3)] == [(slice(0, 25),), (slice(73, 97),)]
    assert tp_index("model.embed_tokens.weight", (97, 3), 1, 2) == (slice(49, 97),)


def test_tensor_parallel_refuses_to_cut_mxfp4_blocks(checkpoint_paths):
    """The tiny MXFP4 GPT-OSS has 32 FFN rows an expert: two TP slices would cut its blocks of 32."""
    import moeserve
    from moeserve.parallel.tensor_parallel import check_tensor_parallel

    with pytest.raises(MoeserveError, match="would cut MXFP4 blocks"):
        check_tensor_parallel(moeserve.ModelSpec.from_dir(checkpoint_paths["gpt_oss_mxfp4"]), 2)
    check_tensor_parallel(moeserve.ModelSpec.from_dir(checkpoint_paths["gpt_oss_mxfp4_wide"]), 2)


def test_a_quantized_checkpoint_is_refused_by_name(hf_checkpoints, tmp_path):
    """Ranks read float tensors shard-wise: a moeserve-quantized checkpoint gets one line, before any group."""
    from moeserve.parallel.loading import load_parallel_model
    from moeserve.quant.compress import QuantConfig, quantize_checkpoint

    quantize_checkpoint(hf_checkpoints["mixtral"][1], tmp_path / "q", QuantConfig(bits=4, group=16, method="rtn"),
                        progress=False)
    with pytest.raises(MoeserveError, match="quantized checkpoint.*--ep/--tp needs the original"):
        load_parallel_model(tmp_path / "q", 0, 2, ep=2)
