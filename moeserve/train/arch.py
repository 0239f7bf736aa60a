"""Architectures the trainer builds, as data: one ArchConfig describes a standard MoE, a Pyramid-MoE, a
Residual-MoE or a PR-MoE (DeepSpeed-MoE, Rajbhandari et al. 2022), at the demo's width or a wider one.

  standard  every layer the same number of experts, top-k routing (the demo model is `moe-8`)
  pyramid   fewer experts in the early layers, more in the last ones
  residual  every MoE layer adds a dense MLP to one chosen expert, mixed by a learned 2-way softmax
  prmoe     both
  wide      a standard MoE with Mixtral-like matrices (hidden 1024, expert FFN 2048, 12 layers), over a BPE
            tokenizer, trained on Python source and Shakespeare (corpus.py)

A standard MoE is written as an HF Mixtral checkpoint (transformers loads it too); the others as moeserve's own
`PRMoEForCausalLM` (config.json with `num_experts_per_layer` and `residual`; spec.py reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moeserve.errors import MoeserveError

QUICK_BPE_VOCAB = 320  # --quick's BPE: the 256 byte symbols, the 2 special tokens and a few merges
AUX_LOSS_COEF = 0.02  # the load-balancing loss weight the trainer uses (config.json's router_aux_loss_coef)


@dataclass(frozen=True)
class ArchConfig:
    experts: tuple[int, ...] = (8,) * 6  # routed experts per layer (the depth is its length)
    top_k: int = 2
    residual: bool = False  # a dense MLP beside the experts of every MoE layer (Residual-MoE)
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    expert_ffn: int = 128  # FFN width of each expert (and of the residual MLP)
    vocab_size: int = 258  # bytes + BOS + EOS (moeserve.tokenizer.ByteTokenizer)
    bos_token_id: int = 256
    eos_token_id: int = 257
    rms_norm_eps: float = 1e-5
    bpe_vocab: int = 0  # > 0: a BPE tokenizer of this many tokens fitted on the code corpus (corpus.py); 0: bytes

    @property
    def standard(self) -> bool:
        """Every layer alike and no residual MLP: an ordinary Mixtral."""
        return len(set(self.experts)) == 1 and not self.residual

    def at_depth(self, layers: int) -> "ArchConfig":
        """The same model with `layers` layers: a Mixture-of-Students student drops the first (fewest-expert)
        layers of the pyramid, so its last layers keep the teacher's expert counts."""
        if not 1 <= layers <= len(self.experts):
            raise MoeserveError(f"a student of depth {layers} needs 1 to {len(self.experts)} layers")
        return replace(self, experts=self.experts[len(self.experts) - layers:])

    def wider(self, factor: int) -> "ArchConfig":
        """factor x the hidden size, head size and expert FFN: about factor^2 x the parameters."""
        return replace(self, hidden_size=self.hidden_size * factor, head_dim=self.head_dim * factor,
                       expert_ffn=self.expert_ffn * factor)

    def with_bpe(self) -> "ArchConfig":
        """The architecture over its BPE tokenizer's ids: BOS 0, EOS 1 (corpus.fit_bpe)."""
        return replace(self, vocab_size=self.bpe_vocab, bos_token_id=0, eos_token_id=1) if self.bpe_vocab else self

    def hf_config(self, context: int) -> dict:
        """The config.json of this architecture with a context of `context` tokens (the training window)."""
        common = {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": len(self.experts),
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.expert_ffn, "num_experts_per_tok": self.top_k,
            "max_position_embeddings": context, "rope_theta": 10000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rms_norm_eps": self.rms_norm_eps,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": None,
            "tie_word_embeddings": False, "hidden_act": "silu", "router_aux_loss_coef": AUX_LOSS_COEF,
            "dtype": "bfloat16",
        }
        if self.standard:
            return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
                    "num_local_experts": self.experts[0], "sliding_window": None, "attention_dropout": 0.0,
                    "initializer_range": 0.02, "router_jitter_noise": 0.0, "output_router_logits": False,
                    "use_cache": True}
        return {"architectures": ["PRMoEForCausalLM"], "model_type": "prmoe", **common,
                "num_experts_per_layer": list(self.experts), "residual": self.residual,
                "norm_topk_prob": self.top_k > 1}


DEMO = ArchConfig()  # the demo model: 6 layers of 8 experts, top-2
# The wide model (bench/quality.py's second model): matrices 1024 and 2048 wide, 12 layers of 8 experts top-2, about
# 0.65B parameters (0.2B active), trained on code and Shakespeare with an 8192-token BPE (corpus.py).
WIDE = ArchConfig(experts=(8,) * 12, hidden_size=1024, num_heads=16, num_kv_heads=4, head_dim=64, expert_ffn=2048,
                  bpe_vocab=8192)
# name -> the architecture at the demo's width: the paper's comparisons at the demo model's depth. Residual layers
# route top-1 (one expert + the MLP: the compute of top-2), as in the paper.
ARCHITECTURES = {
    "moe-8": DEMO,
    "moe-16": replace(DEMO, experts=(16,) * 6),
    "pyramid": replace(DEMO, experts=(4, 4, 4, 4, 8, 8)),
    "residual": replace(DEMO, top_k=1, residual=True),
    "prmoe": replace(DEMO, experts=(4, 4, 4, 4, 8, 8), top_k=1, residual=True),
    "wide": WIDE,  # its own width, not the demo's
}
SCALES = {"demo": 1, "4x": 2}  # width factor: 2x the width is about 4x the parameters


def architecture(name: str, scale: str = "demo", quick: bool = False) -> ArchConfig:
    """A named architecture at a scale; quick: a width a CPU trains in seconds (tests)."""
    if name not in ARCHITECTURES:
        raise MoeserveError(f"unknown architecture {name!r}; choose one of: {', '.join(ARCHITECTURES)}")
    if scale not in SCALES:
        raise MoeserveError(f"unknown scale {scale!r}; choose one of: {', '.join(SCALES)}")
    arch = ARCHITECTURES[name].wider(SCALES[scale])
    if quick:
        arch = replace(arch, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, expert_ffn=32,
                       experts=tuple(max(e // 2, 2) for e in (arch.experts[0], arch.experts[-1])),  # 2 layers
                       bpe_vocab=min(arch.bpe_vocab, QUICK_BPE_VOCAB))
    return arch.with_bpe()
