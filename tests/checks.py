"""Assertions, torch references and shared data of the test modules."""

import torch

GiB = 1 << 30
# H100 80GB + its 16-core host, from BENCHMARKS.md (2026-11-22): plan/hardware.py profile fields
H100 = {"cpu_name": "16-core host", "cpu_cores": 16, "cpu_fp32_flops": 1.4e12, "cpu_bf16_flops": 3.4e12,
        "dram_bandwidth": 79e9, "ram_bytes": 128 * GiB, "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_flops": 774e12,
        "hbm_bandwidth": 2.94e12, "gpu_memory_bytes": 80 * GiB, "h2d_bandwidth": 54.4e9, "d2h_bandwidth": 54.9e9,
        "h2d_pageable_bandwidth": 7.7e9, "h2d_chunk_bandwidth": {"1": 28.9e9, "4": 44.4e9, "16": 50.8e9}}
# Mixtral-8x7B's config.json (the planners need only the shape)
MIXTRAL_CONFIG = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
                  "max_position_embeddings": 32768, "rope_theta": 1e6, "sliding_window": None}
# Qwen3-30B-A3B's shape (48 layers, 128 experts top-8, hidden 2048, expert FFN 768, untied LM head)
QWEN3_30B_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                    "max_position_embeddings": 40960, "rope_theta": 1e6, "tie_word_embeddings": False}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_same_top_k(ids: torch.Tensor, ref_ids: torch.Tensor, logits: torch.Tensor) -> None:
    """ids [T, k] pick experts with exactly the reference's top-k softmax probabilities, best first, each once:
    the same choice up to the order of ties (bf16 logits of 64 experts tie often; torch.topk orders ties freely)."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids))
    assert all(len(set(row)) == len(row) for row in ids.tolist())


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model/layers.py's RMSNorm expression (HF's) in plain torch, on any device: the fused kernel's reference."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def routing_ids(T: int, E: int, k: int, routing: str) -> torch.Tensor:
    """[T, k] expert ids: "random" (k distinct per token), "one_expert" (every token picks expert E - 1) or
    "two_experts" (experts 0 and 2, then 3.., the others get no rows)."""
    if routing == "random":
        return torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    if routing == "one_expert":  # one expert gets every token (more rows than BLOCK_M): chunks loop
        return torch.stack([torch.cat([torch.tensor([E - 1]), torch.randperm(E - 1)[:k - 1]]) for _ in range(T)])
    return torch.tensor([[0, 2] + list(range(3, 3 + k - 2))] * T)  # only two experts used, the others get no rows


def expert_loop_fp64(ex, x_sorted, table):
    """float64 reference: each slot through its own expert."""
    out = torch.empty(x_sorted.shape, dtype=torch.float64, device=x_sorted.device)
    gu, dn = ex.gate_up_proj.double(), ex.down_proj.double()
    expert_of_slot = torch.repeat_interleave(torch.arange(ex.num_experts, device=x_sorted.device), table.counts)
    for s, e in enumerate(expert_of_slot.tolist()):
        g, u = (gu[e] @ x_sorted[s].double()).chunk(2)
        out[s] = dn[e] @ (torch.nn.functional.silu(g) * u)
    return out


def quantized(N, K, bits, group, rank=0, comp_bits=16):
    """A random QuantizedLinear (HQQ codes, and a random rank-r compensator at comp_bits) on DEVICE."""
    from moeserve.quant import hqq, milo
    from moeserve.quant.qlinear import QuantizedLinear

    qw = hqq.quantize_hqq(torch.randn(N, K) * K ** -0.5, bits, group)  # outputs of order 1
    comp = milo.compensator_to_buffers(torch.randn(N, rank) * 0.1, torch.randn(rank, K) * 0.1, comp_bits) if rank else None
    return QuantizedLinear.from_quantized(qw, comp, rank, comp_bits).to(DEVICE)


def reference(layer, x):
    """float64: x dequant(W)^T + (x V^T) U^T."""
    y = x.double() @ layer.weight(torch.float64).T
    uv = layer.compensator(torch.float64)
    return y if uv is None else y + (x.double() @ uv[1].T) @ uv[0].T


def quantized_experts(E, D, F, bits, ranks):
    from moeserve.quant.qlinear import QuantizedExperts

    return QuantizedExperts([quantized(2 * F, D, bits, 32, r) for r in ranks],
                            [quantized(D, F, bits, 32, r) for r in ranks])


def quantized_experts_as_float64(ex):
    """The same experts as float64 dense FFNs (expert_ffn of a float64 ResidentExperts), with their biases and
    activation where they have them (GPT-OSS)."""
    from moeserve.model.experts import ResidentExperts

    bias = ex.gate_up[0].bias is not None
    dense = ResidentExperts(ex.num_experts, ex.gate_up[0].in_features, ex.down[0].in_features, bias,
                            ex.act).double().to(DEVICE)
    with torch.no_grad():
        for e in range(ex.num_experts):
            dense.gate_up_proj[e] = reference(ex.gate_up[e], torch.eye(dense.gate_up_proj.shape[2], device=DEVICE)).T
            dense.down_proj[e] = reference(ex.down[e], torch.eye(dense.down_proj.shape[2], device=DEVICE)).T
            if bias:
                dense.gate_up_proj_bias[e], dense.down_proj_bias[e] = ex.gate_up[e].bias, ex.down[e].bias
    return dense


def slot_decode(model, make_decoder, prompts: list[list[int]], steps: torch.Tensor,
                leave: tuple[int, int] | None = None) -> torch.Tensor:
    """Teacher-forced decode over a SlotKVCache of one row per prompt: the prompts read in one left-padded pass,
    then one step per row of steps [N, B] (token ids) through make_decoder(kv) (a SlotDecoder); sequence leave[0]
    leaves the batch after step leave[1]. -> logits [N, B, V] float32 on the CPU (NaN where a sequence had left)."""
    from moeserve.engine.sequence import left_padded
    from moeserve.model.kv_cache import SlotKVCache

    B, device = len(prompts), model.device
    kv = SlotKVCache(model.spec, B, max(map(len, prompts)) + len(steps), device, model.dtype)
    decoder = make_decoder(kv)
    tokens, valid, positions = (t.to(device) for t in left_padded(prompts, model.spec))  # [B, S] each
    out = torch.full((len(steps), B, model.spec.vocab_size), float("nan"))
    with torch.inference_mode():
        kv.use(list(range(B)), tokens.shape[1])
        model(tokens, positions, kv=kv, valid=valid, last_only=True)
        for i, step in enumerate(steps.tolist()):
            rows = [b for b in range(B) if leave is None or b != leave[0] or i <= leave[1]]
            logits = decoder([step[b] for b in rows], [len(prompts[b]) + i for b in rows], rows)  # [len(rows), V]
            out[i, rows] = logits.float().cpu()
    return out


def assert_logits_match_transformers(model_dir, vocab: int, seed: int | None = None) -> None:
    """A trained checkpoint: moeserve's float32 logits equal transformers' on random tokens [2, 48] < vocab."""
    import pytest

    import moeserve

    transformers = pytest.importorskip("transformers")
    ours = moeserve.load_model(model_dir, device="cpu", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, 48), generator=gen)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() < 1e-4
