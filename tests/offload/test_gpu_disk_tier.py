"""The disk tier with the model on a GPU: the CPU layers' experts read through a page-locked RAM cache smaller than
the store, computed on the worker thread; the same logits and greedy tokens as the run over the mapped store (fp32)
and the same text from the command line. Skipped without a GPU."""

import pytest
import torch

import moeserve
from moeserve.cli import main
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.hybrid.placement import HybridPlacement
from moeserve.hybrid.setup import enable_hybrid, store_layers
from moeserve.offload.disk_cache import slot_bytes
from moeserve.offload.store import ExpertStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def store_dir(byte_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_disk") / "store"
    ExpertStore.build(byte_model_dir, out, low_bits=4, group=32, progress=False)
    return out


def gpu_run(path, store, placement, disk_budget=None):
    stored = set(store_layers(placement))
    model = moeserve.load_model(path, device="cuda", dtype="float32",
                                routed_experts=[i for i in placement.moe_layers if i not in stored])
    return model, enable_hybrid(model, store, placement, disk_budget=disk_budget)


@pytest.mark.parametrize("bits", [16, 4])
def test_gpu_disk_tier_equals_the_mapped_run(byte_model_dir, store_dir, bits):
    store = ExpertStore.open(store_dir)
    layers = store.meta["layers"]
    placement = HybridPlacement.choose(layers, cpu_moe=True, bits=bits, threads=4, num_experts=4)
    cap = slot_bytes(store, (bits < 16,)) * 4 * len(layers) * 2 // 3
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 250, (2, 7), generator=g).cuda()
    prompts = [torch.randint(3, 250, (9,), generator=g).tolist()]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    model, _ = gpu_run(byte_model_dir, store, placement)
    logits, expected = model(tokens), [r.token_ids for r in generate(model, prompts, params)]
    capped, runtime = gpu_run(byte_model_dir, store, placement, cap)
    assert not runtime.worker.inline and runtime.link is None and runtime.disk.arena.is_pinned()
    torch.testing.assert_close(capped(tokens), logits, atol=1e-4, rtol=1e-4)
    assert [r.token_ids for r in generate(capped, prompts, params)] == expected
    st = runtime.summary()
    assert st["disk_bytes_read"] > 0 and st["disk_held_bytes"] <= cap
    runtime.close()


def test_gpu_cli_generate_with_a_ram_cap(capsys, byte_model_dir, store_dir):
    base = ["generate", "--model", str(byte_model_dir), "--greedy", "--max-new-tokens", "6", "--ignore-eos",
            "--device", "cuda", "--dtype", "float32", "HAM", "--cpu-moe", "--offload", str(store_dir)]
    assert main(base) == 0
    expected = capsys.readouterr().out
    cap = slot_bytes(ExpertStore.open(store_dir), (False,)) * 4 * 2 * 2 // 3
    assert main(base + ["--cpu-memory", f"{cap}B"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected and "[disk tier:" in captured.err
