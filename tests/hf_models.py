"""Tiny random HF models, one per supported family, with configs that exercise each family's quirks; and tiny
byte-vocabulary Mixtrals of any depth and width (save_byte_model)."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


FAMILIES = ["mixtral", "mixtral_sliding", "qwen2_moe", "qwen3_moe", "olmoe",  # + sliding window, rope scaling
            "deepseek_v2_lite", "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_qk_norm", "phimoe",
            "granitemoe", "granitemoeshared", "dbrx", "gpt_oss", "llama4"]
# families whose transformers generation of a left-padded batch differs from that of each prompt alone, and why:
# the greedy reference for them is each prompt alone (moeserve's batches give what each prompt gives alone)
UNPADDED_REFERENCE = {"llama4": "transformers' attention temperature of the NoPE layers counts left pads as positions"}
# MLA shapes (heads = KV heads: transformers repeats MLA's keys by num_attention_heads / num_key_value_heads)
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
           intermediate_size=80, moe_intermediate_size=24, n_shared_experts=2, first_k_dense_replace=1)
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707}
GLM = dict(intermediate_size=80, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=3,
           n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, first_k_dense_replace=1,
           attention_bias=True, partial_rotary_factor=0.5, rope_theta=10000.0)

def longrope(original: int, head_dim: int = 16) -> dict:
    """LongRoPE parameters with short and long factors that differ (Phi-3.5-MoE's kind)."""
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
            "short_factor": [1.0 + 0.05 * i for i in range(head_dim // 2)],
            "long_factor": [1.5 + 0.6 * i for i in range(head_dim // 2)], "short_mscale": 1.1, "long_mscale": 1.25}


# Phi-MoE: biases everywhere, a loose sparsemixer eps (several experts compete), LongRoPE whose original context
# the generic tests stay within (tests/model/test_families.py crosses it)
PHIMOE = dict(COMMON, intermediate_size=40, num_local_experts=8, num_experts_per_tok=2, attention_bias=True,
              lm_head_bias=True, router_jitter_noise=0.3, rope_parameters=longrope(64))

# Granite: every muP multiplier away from 1 (the attention one also away from head_dim^-0.5 = 0.25)
GRANITE = dict(COMMON, intermediate_size=40, num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=3.0,
               attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.5)

# DBRX: top-4 of 16, GQA, a clip_qkv small enough that q/k/v values are clipped (tests/model/test_families.py)
DBRX = dict(vocab_size=97, d_model=64, n_heads=4, n_layers=3, max_seq_len=256, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=24, moe_num_experts=16, moe_top_k=4, moe_normalize_expert_weights=1.0))

# GPT-OSS (more in tests/model/test_gpt_oss.py): sliding window 8 on layers 0 and 2, a swiglu_limit the gates and
# ups cross, YaRN past a small original context; hidden and FFN sizes multiples of 32 (MXFP4 blocks)
GPT_OSS = dict(COMMON, num_hidden_layers=4, head_dim=16, intermediate_size=32, num_local_experts=8,
               num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0})


# Llama-4: MoE layers 1 and 3 (dense 0 and 2), NoPE layer 3 (no_rope_layer_interval 4), chunks of 6 positions on
# the rope layers (the tests run 17 and more), qk-norm, a temperature floor_scale of 3 (it changes every 3
# positions) and attn_scale 0.5, llama3 rope scaling whose original context (32) turns the low frequencies
LLAMA4 = dict(COMMON, num_hidden_layers=4, head_dim=16, intermediate_size=32, intermediate_size_mlp=48,
              num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=6,
              use_qk_norm=True, attn_temperature_tuning=True, floor_scale=3, attn_scale=0.5,
              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32})


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
        # no q LoRA, softmax greedy top-k, unnormalised
        "deepseek_v2_lite": ("DeepseekV2Config", dict(COMMON, **MLA, q_lora_rank=None, n_routed_experts=8,
                                                      num_experts_per_tok=2, topk_method="greedy",
                                                      norm_topk_prob=False)),
        # q LoRA, group-limited greedy, YaRN (mscale on the softmax scale), attention biases
        "deepseek_v2": ("DeepseekV2Config", dict(COMMON, **MLA, q_lora_rank=24, n_routed_experts=8,
                                                 num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4,
                                                 topk_group=2, routed_scaling_factor=2.0, attention_bias=True,
                                                 rope_parameters=YARN)),
        # noaux_tc with a correction bias, routed scaling, a dense first layer, interleaved rope
        "deepseek_v3": ("DeepseekV3Config", dict(COMMON, **MLA, q_lora_rank=24, n_routed_experts=16,
                                                 num_experts_per_tok=4, n_group=4, topk_group=2,
                                                 routed_scaling_factor=2.5, norm_topk_prob=True)),
        "glm4_moe": ("Glm4MoeConfig", dict(COMMON, **GLM, use_qk_norm=False)),
        "glm4_moe_qk_norm": ("Glm4MoeConfig", dict(COMMON, **GLM, use_qk_norm=True)),
        "phimoe": ("PhimoeConfig", PHIMOE),
        "granitemoe": ("GraniteMoeConfig", dict(GRANITE, attention_bias=True)),
        "granitemoeshared": ("GraniteMoeSharedConfig", dict(GRANITE, shared_intermediate_size=24)),
        "dbrx": ("DbrxConfig", DBRX),
        "gpt_oss": ("GptOssConfig", GPT_OSS),
        "llama4": ("Llama4TextConfig", LLAMA4),
    }


def build_hf_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny random HF model of `family` (config entries replaced by `overrides`)."""
    import transformers

    cls_name, kw = family_configs()[family]
    return random_hf_model(getattr(transformers, cls_name)(**{**kw, **overrides}), seed, dtype)


def random_hf_model(config, seed: int = 0, dtype=torch.float32):
    """A random HF model of `config`, every weight drawn (none of HF's constant inits)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # HF inits some weights (router, norms) to constants: randomise everything
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.08 + (1.0 if p.ndim == 1 else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts win
                b.copy_(torch.randn_like(b) * 0.3)
    return model.eval()


def write_mxfp4_pair(src: Path, packed: Path, twin: Path) -> None:
    """From the GPT-OSS checkpoint src: `packed`, its experts in the layout GPT-OSS ships (`*_blocks`
    [E, out, in/32, 16] + `*_scales` [E, out, in/32], out = gate/up interleaved, config quant_method mxfp4), and `twin`,
    a float checkpoint holding their dequantized values; the other tensors as in src."""
    import json

    from safetensors.torch import load_file, save_file

    from moeserve.quant.mxfp4 import dequantize, quantize

    quantized, floats = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stored [E, in, out]
            blocks, scales = quantize(t.transpose(1, 2))
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            floats[name] = dequantize(blocks, scales).transpose(1, 2).contiguous()
        else:
            quantized[name] = floats[name] = t
    cfg = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "mxfp4",
             "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                        "lm_head"]}
    for out, tensors, extra in ((packed, quantized, {"quantization_config": quant}), (twin, floats, {})):
        save_file(tensors, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps({**cfg, **extra}))


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


TOKENIZER_SPECIALS = ["<s>", "</s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0-4 of save_tokenizer's


def random_words(rng, n: int) -> str:
    """n random lowercase words, space-separated (text every byte-level tokenizer class splits alike)."""
    return " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(1, 7))) for _ in range(n))


def save_tokenizer(path: Path, text: str, post_processor=None, tokenizer_config: dict | None = None,
                   truncation: int | None = None, **config) -> Path:
    """A byte-level BPE tokenizer.json trained on `text` (TOKENIZER_SPECIALS as special tokens, ids 0-4) with
    `post_processor` (None: none) and a saved truncation to `truncation` tokens, beside `tokenizer_config` as
    tokenizer_config.json and `config` as config.json."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=TOKENIZER_SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = post_processor
    if truncation is not None:
        tok.enable_truncation(truncation)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config or {}))
    (path / "config.json").write_text(json.dumps(config))
    return path
