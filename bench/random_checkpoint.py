"""A random checkpoint of a real model's shape on disk, for benches that start `moeserve` processes (serve).

`write_random_checkpoint` writes an HF-style MixtralForCausalLM directory: config.json with the shape's dimensions
and the demo's byte tokenizer (vocabulary 258 instead of 32000: random weights produce random tokens, and every id
must decode), one safetensors file per layer of random bf16 weights (std 0.02, norms 1, the head's non-ASCII rows
zero: random_tensor) under moeserve's tensor names. `random_quantized_checkpoint` then writes the HQQ copy that
`moeserve quantize` would, and deletes the bf16 one.

    python bench/random_checkpoint.py --out /tmp/mixtral8 --layers 8 --bits 4   # ~6.5 GB 4-bit, ~23 GB on the way
    python bench/random_checkpoint.py --out /tmp/gpt-oss-20b --shape gpt-oss-20b --layers 24 --bits 16  # MXFP4, ~13 GB
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]  # the repo
from moeserve.checkpoint import save_safetensors_atomic  # noqa: E402
from moeserve.cli import DEMO_DIR  # noqa: E402
from moeserve.loader import meta_model  # noqa: E402
from moeserve.compress import QuantConfig, quantize_checkpoint  # noqa: E402
from moeserve.tokenizer import BYTE_TOKENIZER_FILE  # noqa: E402

MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 4096, "tie_word_embeddings": False, "sliding_window": None,
                "hidden_act": "silu"}
TINY = {**MIXTRAL_8X7B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}  # for smoke runs and tests
# GPT-OSS-20B as shipped: MXFP4 experts (kept packed), biases, sinks, sliding/full layers (bench/peer's gpt-oss-20b)
GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
               "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
               "num_local_experts": 32, "num_experts_per_tok": 4, "rms_norm_eps": 1e-5, "sliding_window": 128,
               "rope_theta": 150000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
               "attention_bias": True, "swiglu_limit": 7.0,
               "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "original_max_position_embeddings": 4096, "truncate": False},
               "quantization_config": {"quant_method": "mxfp4"}, "vocab_size": 201088}
TINY_GPT_OSS = {**GPT_OSS_20B, "vocab_size": 258, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8, "sliding_window": 8}
MXFP4_SCALE = 120  # E8M0 exponent byte: 2^-7 x E2M1 codes (RMS 2.9 for uniform codes) ~ the float tensors' STD
SHAPES = {"mixtral": MIXTRAL_8X7B, "tiny": TINY, "gpt-oss-20b": GPT_OSS_20B, "tiny-gpt-oss": TINY_GPT_OSS}
STD = 0.02


def shape_config(shape: str, layers: int) -> dict:
    """config.json of `shape` with `layers` layers and the demo's byte tokenizer's ids (BOS/EOS as the demo's); the
    demo's vocabulary too unless the shape names its own (GPT-OSS: the head's bytes as the peer's GGUF has them; its
    rows past ASCII are zero, so greedy text still decodes)."""
    demo = json.loads((DEMO_DIR / "config.json").read_text())
    keep = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    return {**{k: demo[k] for k in keep}, **SHAPES[shape], "num_hidden_layers": layers, "dtype": "bfloat16"}


def layer_of(name: str) -> int | None:
    """The layer index in a tensor name (model.layers.{i}.…), or None."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


ASCII = 128  # byte tokens below this decode to one character each


def random_tensor(name: str, shape: torch.Size, gen: torch.Generator, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Norm weights 1, everything else N(0, STD^2), in bf16 on the CPU; the head's rows of the tokens from ASCII on
    (bytes >= 0x80, BOS, EOS) zero: their logits are 0 while some ASCII byte's is above 0, so greedy text is ASCII,
    each token one character, and a streamed chunk carries one token (a lone byte >= 0x80 would be held back as an
    incomplete character and sent with the next, halving the chunks a client times). MXFP4 experts (uint8): random
    codes, every block's scale MXFP4_SCALE."""
    if dtype == torch.uint8:
        if name.endswith("_scales"):
            return torch.full(shape, MXFP4_SCALE, dtype=torch.uint8)
        return torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8).cpu()
    if "norm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    t = torch.randn(shape, generator=gen, device=device) * STD
    if name == "lm_head.weight":
        t[ASCII:] = 0
    return t.to(torch.bfloat16).cpu()


def write_random_checkpoint(config: dict, out: Path, seed: int = 0, device: torch.device | None = None) -> int:
    """Write config, tokenizer and random bf16 weights to `out` (one file per layer); returns the bytes written."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(DEMO_DIR / BYTE_TOKENIZER_FILE, out / BYTE_TOKENIZER_FILE)
    groups: dict[int | None, list[tuple[str, torch.Size, torch.dtype]]] = {}
    for name, t in meta_model(out).state_dict().items():
        groups.setdefault(layer_of(name), []).append((name, t.shape, t.dtype))
    gen = torch.Generator(device).manual_seed(seed)
    total = 0
    for layer, tensors in groups.items():
        state = {name: random_tensor(name, shape, gen, device, dtype) for name, shape, dtype in tensors}
        total += sum(t.numel() * t.element_size() for t in state.values())
        save_safetensors_atomic(state, out / f"model-{'rest' if layer is None else f'layer{layer:03d}'}.safetensors")
    return total


def random_quantized_checkpoint(shape: str, layers: int, bits: int, out: Path, seed: int = 0, group: int = 64) -> dict:
    """A random `shape` checkpoint of `layers` layers, HQQ-quantized to `bits` at `out` (bf16 copy removed); bits 16:
    as the shape ships (bf16, or GPT-OSS's MXFP4 experts), not quantized. -> what was written and how long it took."""
    t0 = time.perf_counter()
    if bits == 16:
        written = write_random_checkpoint(shape_config(shape, layers), out, seed)
        return {"shape": shape, "layers": layers, "bits": bits, "bytes": written,
                "write_s": round(time.perf_counter() - t0, 1)}
    src = out.with_name(out.name + ".bf16")
    written = write_random_checkpoint(shape_config(shape, layers), src, seed)
    t1 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    quantize_checkpoint(src, out, QuantConfig(bits=bits, group=group, method="hqq"), force=True, device=device,
                        progress=False)
    shutil.copy(src / BYTE_TOKENIZER_FILE, out / BYTE_TOKENIZER_FILE)
    shutil.rmtree(src)
    return {"shape": shape, "layers": layers, "bits": bits, "group": group, "bf16_bytes": written,
            "quantized_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
            "write_s": round(t1 - t0, 1), "quantize_s": round(time.perf_counter() - t1, 1)}


def add_random_checkpoint_args(ap, what: str = "serve") -> None:
    """The options of a bench that can run on a random checkpoint it writes (bench/serve.py, bench/batching.py)."""
    ap.add_argument("--random-shape", default=None, choices=list(SHAPES),
                    help=f"{what} a random checkpoint of this shape instead (bench/random_checkpoint.py writes it)")
    ap.add_argument("--random-layers", type=int, default=8, help="layers of the random checkpoint (default 8)")
    ap.add_argument("--random-bits", type=int, default=4,
                    help="HQQ bits of the random checkpoint (default 4; 16: as the shape ships, e.g. GPT-OSS's MXFP4)")
    ap.add_argument("--work", default=None, help="where the random checkpoint goes (default: a temporary folder)")


def write_requested(args, work: str) -> dict | None:
    """The random checkpoint args ask for (--random-shape), written to `work`/model and set as args.model; None
    when none is asked for."""
    if not args.random_shape:
        return None
    bits = "as shipped" if args.random_bits == 16 else f"HQQ {args.random_bits}-bit"
    print(f"writing a random {args.random_layers}-layer {args.random_shape} checkpoint, {bits} ...", flush=True)
    made = random_quantized_checkpoint(args.random_shape, args.random_layers, args.random_bits, Path(work) / "model",
                                       args.seed)
    args.model = str(Path(work) / "model")
    print(json.dumps(made), flush=True)
    return made


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--shape", default="mixtral", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=8, help="layers (default 8; Mixtral-8x7B has 32)")
    ap.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 8, 16),
                    help="HQQ bits (default 4); 16: as the shape ships (bf16, GPT-OSS's MXFP4 experts), not quantized")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(json.dumps(random_quantized_checkpoint(args.shape, args.layers, args.bits, Path(args.out), args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
