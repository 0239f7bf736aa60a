"""PR-MoE on a CUDA GPU: bf16 logits near the fp32 CPU ones, and greedy decode through a CUDA graph equal to the
eager decode (top-1 routers, layers of 2, 4 and 8 experts, residual mixes). Skipped without a GPU."""

import pytest
import torch

import moeserve
from moeserve.engine.cuda_graph import graph_safe
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.train.arch import ArchConfig
from prmoe_models import save_prmoe_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("top_k,residual", [(1, True), (2, False)])
def test_prmoe_bf16_on_cuda_matches_cpu_and_its_cuda_graph(tmp_path, top_k, residual):
    arch = ArchConfig(experts=(2, 4, 8), top_k=top_k, residual=residual, hidden_size=64, num_heads=4, num_kv_heads=2,
                      head_dim=16, expert_ffn=64)  # the sizes the GPU kernels tile
    path = save_prmoe_model(tmp_path / "m", arch, seed=3)
    cpu = moeserve.load_model(path, device="cpu", dtype=torch.float32)
    gpu = moeserve.load_model(path, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, 258, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref, out = cpu(tokens), gpu(tokens.cuda()).float().cpu()
    close = (out - ref).abs().amax(-1) < 0.05 * ref.abs().amax()  # [2, 9] per position
    assert close.float().mean() >= 0.8, close  # a near-tie top-k may route a position differently in bf16
    assert graph_safe(gpu, 1)
    prompts = [tokens[0].tolist(), tokens[1, :5].tolist()]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    graphed = [g.token_ids for g in generate(gpu, prompts, params, cuda_graph=True)]
    assert graphed == [g.token_ids for g in generate(gpu, prompts, params, cuda_graph=False)]
