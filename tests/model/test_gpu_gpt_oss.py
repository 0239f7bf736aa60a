"""GPT-OSS on a CUDA GPU in bf16: the float checkpoint (grouped GEMMs with biases), the MXFP4 one (Triton kernels
decoding in registers) and its HQQ 4-bit copy (the fused low-bit MoE with biases) take graph-safe paths, replay
decode steps as CUDA graphs with the eager step's logits, and stay within bf16 rounding of transformers / the float32
CPU model; the MXFP4 one with some layers' experts on the CPU follows the resident model. Skipped without a GPU."""

import pytest
import torch

import moeserve
from hf_models import build_hf_model, write_mxfp4_pair
from checks import slot_decode
from moeserve.engine.cuda_graph import SlotDecoder, graph_safe
from moeserve.engine.generate import generate
from moeserve.engine.sequence import left_padded
from moeserve.engine.params import SamplingParams
from moeserve.model.paths import explain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"float": HF save_pretrained dir, "mxfp4": its MXFP4 copy, "twin": the MXFP4 copy dequantized, "hqq": the
    float one's experts HQQ 4-bit (moeserve quantize)}, and the HF fp32 model."""
    from moeserve.compress import QuantConfig, quantize_checkpoint

    hf = build_hf_model("gpt_oss", seed=7)
    paths = {name: tmp_path_factory.mktemp(f"gpt_oss_{name}") for name in ("float", "mxfp4", "twin")}
    hf.save_pretrained(paths["float"])
    write_mxfp4_pair(paths["float"], paths["mxfp4"], paths["twin"])
    paths["hqq"] = tmp_path_factory.mktemp("gpt_oss_hqq") / "q"
    quantize_checkpoint(paths["float"], paths["hqq"], QuantConfig(bits=4, group=16, method="hqq", ranks="uniform:0",
                                                                  skip=("attention",)), progress=False)
    return paths, hf


@pytest.mark.parametrize("kind,path", [("float", "grouped_mm"), ("mxfp4", "mxfp4_triton"),
                                       ("hqq", ("lowbit_slots", "lowbit_sorted"))])
def test_paths_graph_steps_and_logits(checkpoints, kind, path):
    """Expert paths at 1 and 16 tokens; 12 teacher-forced decode steps across the window: the graph replay equals
    the eager static step (up to bf16 rounding); the prefill's logits are within bf16 rounding of the float32 CPU
    model of the same weights (the twin for MXFP4; for HQQ the quantized checkpoint itself, its biases and clamped
    SwiGLU in the fused low-bit kernels' epilogues)."""
    paths, _ = checkpoints
    model = moeserve.load_model(paths[kind], device="cuda", dtype=torch.bfloat16)
    one, sixteen = path if isinstance(path, tuple) else (path, path)
    for layer in explain(model, (1, 16)):
        assert layer.experts == {1: one, 16: sixteen}
    assert graph_safe(model, 3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (11, 5, 2)]
    steps = torch.randint(3, 90, (12, 3), generator=g)  # [N, B]
    eager, graph = (slot_decode(model, lambda kv: SlotDecoder(model, kv, graph=graph, static=True), prompts, steps)
                    for graph in (False, True))  # [N, B, V] each
    assert (eager - graph).abs().max() <= 2.0 ** -8 * eager.abs().max()
    tokens, valid, positions = (t.cuda() for t in left_padded(prompts, model.spec))  # [B, S] each
    with torch.inference_mode():
        first = model(tokens, positions, valid=valid, last_only=True)
        reference = moeserve.load_model(paths["twin" if kind == "mxfp4" else kind], dtype=torch.float32)
        want = reference(tokens.cpu(), positions.cpu(), valid=valid.cpu(), last_only=True)
    got = first.float().cpu()
    assert ((got - want).norm() / want.norm()) < 2e-2


def test_generate_with_cuda_graph_matches_eager_greedy(checkpoints):
    model = moeserve.load_model(checkpoints[0]["mxfp4"], device="cuda", dtype=torch.bfloat16)
    prompts = [[72, 65, 77, 76, 69, 84, 46, 32, 84, 79], [75, 73, 78, 71, 46]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    graph = [r.token_ids for r in generate(model, prompts, params)]
    eager = [r.token_ids for r in generate(model, prompts, params, cuda_graph=False)]
    assert [g[:12] for g in graph] == [e[:12] for e in eager]


@pytest.mark.parametrize("n_cpu_moe,slots", [(2, 0), (4, 4)])
def test_mxfp4_experts_on_the_cpu_follow_resident(checkpoints, n_cpu_moe, slots):
    """GPT-OSS-120B on one GPU's case, in bf16: the MXFP4 checkpoint with its first MoE layers' experts on the CPU
    (float copies dequantized from the blocks; the other layers MXFP4 resident, Triton), with and without a GPU slot
    cache, a prompt of 40 tokens streamed through the GPU ring: the prompts' last logits within bf16 rounding of the
    resident model's, and greedy decoding starts with the same token."""
    from moeserve.hybrid.placement import HybridPlacement
    from moeserve.hybrid.setup import build_store, enable_hybrid, store_layers

    path = checkpoints[0]["mxfp4"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (40, 7)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    resident = moeserve.load_model(path, device="cuda", dtype=torch.bfloat16)
    placement = HybridPlacement.choose([0, 1, 2, 3], n_cpu_moe=n_cpu_moe, cache_slots=slots, threads=4,
                                       num_experts=8)
    stored = set(store_layers(placement))
    model = moeserve.load_model(path, device="cuda", dtype=torch.bfloat16,
                                routed_experts=[i for i in placement.moe_layers if i not in stored])
    runtime = enable_hybrid(model, build_store(path, placement, model.dtype, model.device, progress=False), placement)
    with torch.inference_mode():
        for prompt in prompts:
            tokens = torch.tensor([prompt], device="cuda")
            want = resident(tokens)[0, -1].float()  # [V]
            torch.testing.assert_close(model(tokens)[0, -1].float(), want, atol=0.03 * want.abs().max().item(),
                                       rtol=0.0)
    first = [[r.token_ids[0] for r in generate(m, prompts, params)] for m in (model, resident)]
    assert first[0] == first[1]
    st = runtime.summary()
    assert st["cpu_pairs"] > 0 and st["streamed_pairs"] > 0 and (st["gpu_pairs"] > 0) == bool(slots)
    runtime.close()
