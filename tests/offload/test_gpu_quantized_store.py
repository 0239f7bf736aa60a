"""moeserve quantized checkpoints (HQQ, MiLo with compensators) in the host-resident placements with the model on a
GPU: the CPU's experts, the GPU cache slots, the prompt streamer's ring and HOBBIT's offload slots compute the
checkpoint's experts as the resident QuantizedExperts do (fp32: logits within kernel rounding); skipped without a
GPU."""

import pytest
import torch

import moeserve
from hf_models import build_hf_model
from moeserve.cli import main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CHECKPOINTS = {"hqq4": ["--bits", "4", "--group", "8", "--method", "hqq"],
               "milo3": ["--bits", "3", "--group", "8", "--method", "milo", "--ranks", "experts=uniform:4",
                         "--skip", "attention"],
               "milo3-int3": ["--bits", "3", "--group", "8", "--method", "milo", "--ranks", "experts=uniform:4",
                              "--compensator-bits", "3", "--skip", "attention"]}
PLACEMENTS = {"cpu_moe": {"cpu_moe": True},
              "n_cpu_moe_cache": {"n_cpu_moe": 1, "gpu_cache_experts": 3},
              "offload": {"offload": "{store}", "high_slots": 4, "all_high": True},
              "offload_mixed": {"offload": "{store}", "high_slots": 2, "low_slots": 2},
              "planned": {"gpu_memory": "2GiB"}}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """name -> (quantized checkpoint of a tiny Mixtral, its expert store from offload-prepare)."""
    out = {}
    src = tmp_path_factory.mktemp("float")
    build_hf_model("mixtral", seed=7, num_hidden_layers=2, num_local_experts=4).save_pretrained(src)
    for name, flags in CHECKPOINTS.items():
        root = tmp_path_factory.mktemp(name)
        assert main(["quantize", "--model", str(src), "--out", str(root / "q"), *flags]) == 0
        assert main(["offload-prepare", "--model", str(root / "q"), "--out", str(root / "store")]) == 0
        out[name] = root / "q", root / "store"
    return out


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_gpu_quantized_checkpoint_placements_fp32_equal_resident(quantized, name, placement):
    """Decode-sized and prompt-sized passes (40 tokens: the streamer's ring) give the resident model's logits."""
    path, store = quantized[name]
    options = {k: str(store) if v == "{store}" else v for k, v in PLACEMENTS[placement].items()}
    resident = moeserve.LLM(path, device="cuda", dtype="float32").model
    llm = moeserve.LLM(path, device="cuda", dtype="float32", **options)
    for shape in ((3, 6), (1, 40), (1, 1)):
        tokens = torch.randint(3, 97, shape, device="cuda")
        with torch.no_grad():
            want = resident(tokens)
            for _ in range(3):  # later passes run admitted experts in slots
                torch.testing.assert_close(llm.model(tokens), want, atol=2e-3, rtol=2e-3)
