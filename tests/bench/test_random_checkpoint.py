"""bench/random_checkpoint.py --bits 16: a checkpoint as the shape ships, here GPT-OSS's MXFP4 experts (the moeserve
side of the GPT-OSS-20B peer comparison, bench/peer): packed uint8 blocks and scales that load and run in every
placement alike."""

import sys
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from random_checkpoint import MXFP4_SCALE, random_quantized_checkpoint  # noqa: E402

import moeserve  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402


def test_gpt_oss_shape_ships_mxfp4_experts_that_run_on_the_cpu_too(tmp_path):
    made = random_quantized_checkpoint("tiny-gpt-oss", 2, 16, tmp_path / "m")
    assert made["bits"] == 16 and made["bytes"] > 0
    with safe_open(str(tmp_path / "m" / "model-layer000.safetensors"), "pt") as f:
        blocks = [f.get_tensor(n) for n in f.keys() if n.endswith("_blocks")]
        scales = [f.get_tensor(n) for n in f.keys() if n.endswith("_scales")]
    assert blocks and all(b.dtype == torch.uint8 and b.float().std() > 50 for b in blocks)  # random codes
    assert scales and all(bool((s == MXFP4_SCALE).all()) for s in scales)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 70, 3], [44, 2]]
    resident = moeserve.LLM(tmp_path / "m")
    assert resident.model.spec.moe.experts_mxfp4
    expected = [g.token_ids for g in resident.generate(prompts, params)]
    hybrid = moeserve.LLM(tmp_path / "m", n_cpu_moe=1)
    assert [g.token_ids for g in hybrid.generate(prompts, params)] == expected
