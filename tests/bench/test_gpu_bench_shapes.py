"""bench/hybrid.py's GPU path on the big shapes' tiny stand-ins (skipped without a CUDA GPU): the random store (4-bit
HQQ, or GPT-OSS's MXFP4 as shipped), the dense model on the GPU, the resident MXFP4 layers drawn there, the first
MoE layer's experts on the CPU: greedy decode runs as a CUDA graph with finite logits, and the CPU layer's block
output equals the resident module's over the same store tensors."""

import sys
from pathlib import Path

import pytest
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "bench")]
import hybrid  # noqa: E402
from offload import dense_model, model_spec, random_resident_mxfp4, random_store  # noqa: E402

from moeserve.engine.generate import iterate  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.hybrid.placement import HybridPlacement  # noqa: E402
from moeserve.hybrid.setup import enable_hybrid  # noqa: E402
from moeserve.quant.mxfp4 import stored_experts  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("name", hybrid.BIG)
def test_stand_in_decodes_on_the_gpu_with_cpu_experts(name):
    spec = model_spec(hybrid.shape_at(hybrid.stand_in(hybrid.SHAPES[name][0]), 4))
    store = random_store(spec, 2, CUDA, torch.bfloat16, hybrid.BITS, 32, high=False)
    moe = spec.moe.layer_indices()
    bits = 16 if store.mxfp4 else hybrid.BITS
    placement = HybridPlacement.choose(moe, n_cpu_moe=2, bits=bits, threads=2)
    model = dense_model(spec, CUDA, torch.bfloat16)
    if store.mxfp4:
        random_resident_mxfp4(model, moe[2:], CUDA, torch.bfloat16)
    runtime = enable_hybrid(model, store, placement, warm=True)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    steps = list(iterate(model, [[5, 9, 200, 7, 11]], params, cuda_graph=True))
    assert len(steps) == 6
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 9, 200, 7]], device=CUDA))).all()
    assert runtime.totals().cpu_pairs > 0
    runtime.close()


def test_mxfp4_cpu_layer_equals_the_resident_module_on_the_gpu():
    """The GPT-OSS stand-in's first MoE layer on the CPU (packed MXFP4 through the native kernel) against an
    Mxfp4Experts on the GPU over the same blocks, scales and biases (the Triton MXFP4 kernels): the block outputs
    agree to bf16 rounding."""
    spec = model_spec(hybrid.shape_at(hybrid.stand_in(hybrid.SHAPES["gpt-oss-120b"][0]), 2))
    store = random_store(spec, 1, CUDA, torch.bfloat16, hybrid.BITS, 32)
    tokens = torch.randint(0, spec.vocab_size, (1, 6), device=CUDA)
    outputs = []
    for on_cpu in (True, False):
        model = dense_model(spec, CUDA, torch.bfloat16)
        if not on_cpu:
            for i in spec.moe.layer_indices():
                with torch.device(CUDA):
                    experts = stored_experts(spec, spec.moe.num_experts)
                for e in range(spec.moe.num_experts):
                    parts = store.host_parts(i, e, low=False)
                    for leaf, t in zip(("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                                        "down_proj_scales", "gate_up_proj_bias", "down_proj_bias"), parts):
                        getattr(experts, leaf).data[e] = t.to(CUDA)
                model.model.layers[i].mlp.experts = experts.to(torch.bfloat16)
        placement = HybridPlacement.choose(spec.moe.layer_indices(), n_cpu_moe=2 if on_cpu else 0, bits=16)
        runtime = enable_hybrid(model, store, placement)
        captured = {}
        block = model.model.layers[0].mlp
        hook = block.register_forward_hook(lambda _, args, out: captured.__setitem__("y", out))
        with torch.no_grad():
            model(tokens)
        hook.remove()
        outputs.append(captured["y"].float())
        runtime.close()
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-2, rtol=2e-2)
    assert outputs[1].abs().mean() > 0
