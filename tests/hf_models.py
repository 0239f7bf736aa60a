"""Tiny random HF models, one per supported family, with configs that exercise each family's quirks; and tiny
byte-vocabulary Mixtrals of any depth and width (save_byte_model)."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


FAMILIES = ["mixtral", "mixtral_sliding", "qwen2_moe", "qwen3_moe", "olmoe"]  # + sliding window, rope scaling

def family_configs():
    """family -> (config class name, kwargs)."""
    return {
        "mixtral": ("MixtralConfig", dict(COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                          rope_theta=10000.0)),
        "mixtral_sliding": ("MixtralConfig", dict(COMMON, intermediate_size=48, num_local_experts=4,
                                                  num_experts_per_tok=2, sliding_window=5,
                                                  rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 5000.0})),
        "qwen2_moe": ("Qwen2MoeConfig", dict(COMMON, intermediate_size=80, moe_intermediate_size=32, num_experts=8,
                                              num_experts_per_tok=3, shared_expert_intermediate_size=56,
                                              decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON, head_dim=24, intermediate_size=80, moe_intermediate_size=32,
                                              num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2,
                                              mlp_only_layers=[], norm_topk_prob=True)),
        "olmoe": ("OlmoeConfig", dict(COMMON, intermediate_size=40, num_experts=8, num_experts_per_tok=2,
                                      norm_topk_prob=False, clip_qkv=0.6)),
    }


def build_hf_model(family: str, seed: int = 0, dtype=torch.float32):
    import transformers

    cls_name, kw = family_configs()[family]
    config = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # HF inits some weights (router, norms) to constants: randomise everything
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.08 + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()


def save_byte_model(path: Path, layers: int = 2, hidden: int = 32, ffn: int = 32, seed: int = 0) -> Path:
    """A tiny random Mixtral (4 experts, top-2) with the demo's byte vocabulary, tokenizer and a held-out text;
    models of one shape and another seed have the same safetensors headers but other weights."""
    import transformers

    from moeserve.tokenizer import ByteTokenizer

    cfg = transformers.MixtralConfig(vocab_size=258, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=ffn,
                                     num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                                     bos_token_id=256, eos_token_id=257)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    ByteTokenizer().save(path)
    (path / "heldout.txt").write_text("Words, words, words. " * 20)
    return path
