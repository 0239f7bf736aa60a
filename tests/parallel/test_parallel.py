"""Expert, tensor and vocab parallelism on torch.distributed (gloo, CPU, spawned ranks) against the
single-process model, float and quantized (`moeserve quantize`, --dense-bits). One spawn per world size runs all
cases (tests/parallel_worker.py)."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
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
        ("quantized", "q4", 1, 2), ("quantized", "q4", 2, 1),  # EP: own experts read; TP: low-bit dense slices
        ("quantized", "q3", 2, 1),  # 3-bit word planes and compensators sliced, float experts beside them
        ("quantized", "wide", 1, 2, 8), ("quantized", "wide", 2, 1, 8),  # --dense-bits 8, the head too
        ("static_step",),  # the static decode step (GPUs' default) agrees on dispatch per layer
        ("bad_checkpoint",)],
    4: [("layer", "random"), ("layer", "one_expert"),
        ("model", ["mixtral", "qwen2_moe"], 1, 4, 128), ("model", ["mixtral"], 1, 4, 0),
        ("model", ["qwen2_moe"], 2, 2, 128),  # coordinated TP x EP
        ("model", ["prmoe", "pyramid"], 1, 4, 128), ("model", ["prmoe"], 1, 4, 0),  # 2 experts: 2 copies
        ("model", ["gpt_oss_mxfp4"], 1, 4, 128),  # two of its 8 experts a rank
        ("model", ["gpt_oss_mxfp4_wide"], 2, 2, 128),  # TP x EP
        ("quantized", "mixtral_q4", 2, 2),  # TP x EP over a moeserve quantized checkpoint
        ("hierarchical",), ("bad_checkpoint",)],
}

# A Qwen2-MoE-shaped model (q/k/v biases, a shared expert, a dense FFN layer) wide enough that every TP slice of
# 2 keeps whole packing units and groups of up to 64: hidden, heads x head dim, dense and shared FFN 128 (64 a rank).
WIDE = dict(model_type="qwen2_moe", vocab_size=97, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=3, shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[1],
            norm_topk_prob=False, rms_norm_eps=1e-6, max_position_embeddings=128, rope_theta=10000.0,
            tie_word_embeddings=False)


def write_wide_checkpoint(path):
    """WIDE's model with random weights (as hf_models draws them), in moeserve's names: no transformers model."""
    import moeserve
    from moeserve.model.transformer import MoETransformer
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(WIDE))
    torch.manual_seed(0)
    model = MoETransformer(moeserve.ModelSpec.from_dir(path))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.08 + (1.0 if p.ndim == 1 else 0.0))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors",
              metadata={"format": "pt"})


def quantized_paths(root, mixtral) -> dict[str, str]:
    """wide: WIDE's float model; q4: it with every linear layer 4-bit RTN; q3: its dense FFN layer 3-bit with MiLo
    compensators at 3 bits (one MiLo round: the default 20 take seconds here), the rest left float; mixtral_q4:
    `mixtral` 4-bit RTN."""
    from moeserve.quant import milo
    from moeserve.compress import QuantConfig, quantize_checkpoint

    write_wide_checkpoint(root / "wide")
    rtn = QuantConfig(bits=4, group=16, method="rtn")
    quantize_checkpoint(root / "wide", root / "q4", rtn, progress=False)
    quantize_checkpoint(mixtral, root / "mixtral_q4", rtn, progress=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(milo, "fit", functools.partial(milo.fit, iters=1))
        quantize_checkpoint(root / "wide", root / "q3",
                            QuantConfig(bits=3, group=32, ranks="dense_ffn=4", compensator_bits=3,
                                        skip=("attention", "shared_expert", "expert")), progress=False)
    return {name: str(root / name) for name in ("wide", "q4", "q3", "mixtral_q4")}


@pytest.fixture(scope="module")
def checkpoint_paths(hf_checkpoints, tmp_path_factory):
    """family -> checkpoint directory, plus `missing_expert`: mixtral without the last expert of layer 0, and
    `fused_tied`: qwen3_moe in fused-expert names with the head tied to the embedding (no lm_head stored);
    `gpt_oss_mxfp4`: the tiny GPT-OSS with its experts in MXFP4 (hf_models.write_mxfp4_pair), `gpt_oss_mxfp4_wide`
    another with an FFN of 64 (tensor-parallel slices of whole blocks);
    `prmoe` (top-1 + residual MLP) and `pyramid` (top-2): PR-MoE checkpoints with layers of 2, 4 and 8 experts;
    the quantized checkpoints of quantized_paths."""
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
    return {**paths, **quantized_paths(tmp_path_factory.mktemp("quantized"), paths["mixtral"])}


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


def _torchrun(argv: list[str], nproc: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "moeserve", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})})


def expert_and_dense_bytes(path) -> tuple[int, int]:
    """Bytes of the checkpoint's routed-expert tensors and of the rest, from its safetensors headers."""
    from moeserve.checkpoint import validate_safetensors

    sizes = {"experts": 0, "dense": 0}
    for file in Path(path).glob("*.safetensors"):
        for name, meta in validate_safetensors(file).items():
            if name != "__metadata__":
                start, end = meta["data_offsets"]
                sizes["experts" if ".experts." in name else "dense"] += end - start
    return sizes["experts"], sizes["dense"]


def test_cli_generate_under_torchrun_matches_single_process(byte_model_dir, capsys):
    """Same text as one process; each rank logs its start-up (MOESERVE_LOG=info): it read its half of the routed
    experts and the dense part whole, not the checkpoint."""
    from moeserve.cli import main

    argv = ["generate", "--model", str(byte_model_dir), "--greedy", "--max-new-tokens", "8", "Words, words"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    proc = _torchrun([*argv, "--ep", "2"], env={"MOESERVE_LOG": "info"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == single.strip().splitlines()[-1]  # rank 0 prints, same text
    experts, dense = expert_and_dense_bytes(byte_model_dir)
    reads = re.findall(r"rank (\d) of 2 read .*\((\d+) bytes, \d+% of the checkpoint's .*\) in [\d.]+ s",
                       proc.stderr)
    assert sorted((int(r), int(n)) for r, n in reads) == [(0, experts // 2 + dense), (1, experts // 2 + dense)], (
        proc.stderr[-2000:])


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


def test_cli_bench_under_torchrun_reports_once(byte_model_dir):
    proc = _torchrun(["bench", "--model", str(byte_model_dir), "-p", "16", "-n", "4", "-r", "1", "--json", "--ep", "2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)  # rank 0 alone prints
    assert [r["test"] for r in report["results"]] == ["pp16", "tg4"] and "--ep 2" in report["placement"]


def test_cli_bad_layout_under_torchrun_is_one_line_per_rank(byte_model_dir):
    """Each rank that reports says why in one line, before anything loads. The ranks check at once, but the first to
    exit makes torchrun stop the others, which may not have printed yet: one or two lines."""
    proc = _torchrun(["generate", "--model", str(byte_model_dir), "--tp", "3", "x"])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("moeserve: error:")]
    assert 1 <= len(errors) <= 2, proc.stderr[-2000:]
    assert all(e == "moeserve: error: --tp 3 x --ep 1 must equal the number of ranks (2)" for e in errors)


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


def test_a_tp_slice_that_cuts_a_group_is_refused_by_name():
    """Inputs 0..31 of a layer quantized in groups of 64 (--dense-bits 8's) would cut each group in half; rows are
    always exact."""
    from moeserve.parallel.tensor_parallel import Slicer
    from moeserve.quant import hqq
    from moeserve.quant.qlinear import QuantizedLinear

    q = QuantizedLinear.from_quantized(hqq.quantize_rtn(torch.randn(32, 64), 8, 64))
    with pytest.raises(MoeserveError, match=r"tensor-parallel size 2 cannot slice the low-bit layer "
                                            r"model\.layers\.0\.self_attn\.o_proj exactly: values 0\.\.31 cut a "
                                            r"group of 64"):
        Slicer(rank=0, size=2).linear(q, "model.layers.0.self_attn.o_proj")
    part = Slicer(rank=1, size=2).linear(q, "model.layers.0.self_attn.q_proj")
    torch.testing.assert_close(part.weight(), q.weight()[16:], rtol=0, atol=0)
