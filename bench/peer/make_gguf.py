"""Write a random-weight GGUF of a benchmark MoE shape for llama.cpp, directly in quantized form, tensor by tensor.

It extends the peer kit's writer (.peer/make_gguf.py: Mixtral as llama.cpp arch `llama` with experts) to Qwen3-MoE
(arch `qwen3moe`: per-head q/k RMSNorm, 128 experts, expert_feed_forward_length) and GPT-OSS-20B as shipped (arch
`gpt-oss`, llama.cpp's LLM_ARCH_OPENAI_MOE: MXFP4 experts, q/k/v/o, router and expert biases, attention sinks, a
post-attention RMSNorm in place of ffn_norm, sliding window 128 on even layers, YaRN rope) and writes the GGUF v3
file itself, so it needs numpy only (no gguf-py). Tensors and metadata follow llama.cpp's loaders
(src/models/llama.cpp, qwen3moe.cpp, openai-moe.cpp); shapes are listed in ggml order (ne0, the row length, first).

Types: experts --experts-type (default the shape's: Q4_0, MXFP4 for gpt-oss), attention/embeddings/output Q8_0,
norms, router, biases and sinks F32. Quantized blocks hold random codes with a scale sized so a row dotted with a
unit-RMS input gives a unit-RMS output (zero mean weights, finite activations through every layer): a random-sign
fp16 scale for Q4_0/Q8_0, an E8M0 exponent for MXFP4 (one of two neighbouring powers of two, drawn so the mean
square is right). The tokenizer is a minimal SentencePiece-style vocabulary (<unk>, <s>, </s>, 256 byte tokens,
dummy pieces), for gpt-oss too (its loader asks nothing of the tokenizer): llama-bench feeds token ids, never text.
CHUNK_ELEMS weights are generated at a time, so RAM stays ~150 MB whatever the model size.

    python bench/peer/make_gguf.py --dims qwen3 -o /tmp/qwen3.gguf            # full depth, 16.8 GiB (mixtral 25.2)
    python bench/peer/make_gguf.py --dims gpt-oss-20b -o /tmp/gpt-oss-20b.gguf  # MXFP4 experts, 11.3 GiB
    python bench/peer/make_gguf.py --dims tiny-mixtral --layers 2 -o /tmp/t.gguf
"""

from __future__ import annotations

import argparse
import math
import os
import struct
import sys
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Dims:
    """A model shape as llama.cpp sees it (hidden D, heads of head_dim, experts of expert_ffn, ...)."""

    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    expert_ffn: int
    experts: int
    top_k: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    dense_ffn: int  # feed_forward_length (the expert FFN for `llama` arch, the dense FFN of the family otherwise)
    experts_type: str = "q4_0"  # the experts' default type (--experts-type)
    sliding_window: int = 0  # attention.sliding_window (gpt-oss: on even layers, llama.cpp's pattern 2)
    yarn_factor: float = 0.0  # rope.scaling.type yarn with this factor (0: no rope scaling keys)
    yarn_orig_ctx: int = 0  # rope.scaling.original_context_length


SHAPES = {  # bench/hybrid.py's mixtral, qwen3, qwen3-235b and gpt-oss-120b shapes (tests/bench/test_peer_gguf.py
    # checks they agree; its deepseek and deepseek-v3 shapes have no GGUF here: llama.cpp's deepseek2 arch, MLA, is not
    # written), GPT-OSS-20B (openai/gpt-oss-20b's config.json, MXFP4 experts as shipped) and tiny local ones
    "mixtral": Dims("llama", 32, 4096, 32, 8, 128, 14336, 8, 2, 32000, 32768, 1e6, 1e-5, 14336),
    "qwen3": Dims("qwen3moe", 48, 2048, 32, 4, 128, 768, 128, 8, 151936, 40960, 1e6, 1e-6, 6144),
    "qwen3-235b": Dims("qwen3moe", 94, 4096, 64, 4, 128, 1536, 128, 8, 151936, 40960, 1e6, 1e-6, 12288),
    "gpt-oss-120b": Dims("gpt-oss", 36, 2880, 64, 8, 64, 2880, 128, 4, 201088, 131072, 150000.0, 1e-5, 2880,
                         experts_type="mxfp4", sliding_window=128, yarn_factor=32.0, yarn_orig_ctx=4096),
    "gpt-oss-20b": Dims("gpt-oss", 24, 2880, 64, 8, 64, 2880, 32, 4, 201088, 131072, 150000.0, 1e-5, 2880,
                        experts_type="mxfp4", sliding_window=128, yarn_factor=32.0, yarn_orig_ctx=4096),
    "tiny-mixtral": Dims("llama", 2, 256, 4, 2, 64, 512, 8, 2, 1000, 4096, 1e6, 1e-5, 512),
    "tiny-qwen3": Dims("qwen3moe", 2, 256, 4, 2, 64, 128, 8, 2, 1000, 4096, 1e6, 1e-6, 384),
    "tiny-gpt-oss": Dims("gpt-oss", 2, 256, 8, 2, 64, 384, 8, 4, 1000, 4096, 150000.0, 1e-5, 384,
                         experts_type="mxfp4", sliding_window=128, yarn_factor=32.0, yarn_orig_ctx=128),
}


@dataclass(frozen=True)
class GGMLType:
    """A ggml tensor type: id, elements and bytes per block, RMS of a random block's integer codes."""

    id: int
    block: int
    block_bytes: int
    code_rms: float


KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # ggml-common.h: twice the E2M1 values
TYPES = {
    "f32": GGMLType(0, 1, 4, 0.0),
    "q4_0": GGMLType(2, 32, 18, math.sqrt(sum(k * k for k in range(-8, 8)) / 16)),  # w = d * (nibble - 8)
    "q8_0": GGMLType(8, 32, 34, math.sqrt(sum(k * k for k in range(-128, 128)) / 256)),  # w = d * int8
    # ggml's block_mxfp4: one E8M0 byte e, then 16 bytes of 4-bit E2M1 codes (value j in the low nibble of byte j,
    # value j + 16 in its high nibble); w = KVALUES_MXFP4[code] * 2^(e - 128)
    "mxfp4": GGMLType(39, 32, 17, math.sqrt(sum(k * k for k in KVALUES_MXFP4) / 16)),
}
FILE_TYPE = {"q4_0": 2, "q8_0": 7, "mxfp4": 38}  # llama_ftype: MOSTLY_Q4_0, MOSTLY_Q8_0, MOSTLY_MXFP4_MOE (the
# experts' type names the file)
ALIGNMENT = 32  # GGUF's default general.alignment
CHUNK_ELEMS = 1 << 24  # weights generated per write (~9 MiB of Q4_0)

# GGUF value types
UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file: name, ggml shape (ne0 first), type name, and how its values are drawn."""

    name: str
    shape: tuple[int, ...]
    type: str
    ones: bool = False  # norm weights: all 1 (an RMSNorm that leaves its input's scale alone)
    std: float | None = None  # weight RMS; default 1/sqrt(row length)

    @property
    def nbytes(self) -> int:
        t = TYPES[self.type]
        assert self.shape[0] % t.block == 0, (self.name, self.shape, self.type)
        return math.prod(self.shape) // t.block * t.block_bytes

    @property
    def weight_std(self) -> float:
        return self.std if self.std is not None else 1 / math.sqrt(self.shape[0])


def is_expert(name: str) -> bool:
    """The routed experts' tensors (`-ot exps=CPU` and --n-cpu-moe move these)."""
    return "_exps." in name


BIAS_STD = 0.02  # gpt-oss's biases: small, random


def tensors(d: Dims, layers: int, experts_type: str = "q4_0", dense_type: str = "q8_0") -> list[Tensor]:
    """The file's tensors in llama.cpp's names, as its loader for d.arch creates them."""
    if d.arch == "gpt-oss":
        return gpt_oss_tensors(d, layers, experts_type, dense_type)
    D, F, X, hd = d.hidden, d.expert_ffn, d.experts, d.head_dim
    out = [Tensor("token_embd.weight", (D, d.vocab), dense_type, std=1.0)]
    for i in range(layers):
        p = f"blk.{i}."
        out += [Tensor(p + "attn_norm.weight", (D,), "f32", ones=True),
                Tensor(p + "attn_q.weight", (D, d.heads * hd), dense_type),
                Tensor(p + "attn_k.weight", (D, d.kv_heads * hd), dense_type),
                Tensor(p + "attn_v.weight", (D, d.kv_heads * hd), dense_type),
                Tensor(p + "attn_output.weight", (d.heads * hd, D), dense_type)]
        if d.arch == "qwen3moe":
            out += [Tensor(p + "attn_q_norm.weight", (hd,), "f32", ones=True),
                    Tensor(p + "attn_k_norm.weight", (hd,), "f32", ones=True)]
        out += [Tensor(p + "ffn_norm.weight", (D,), "f32", ones=True),
                Tensor(p + "ffn_gate_inp.weight", (D, X), "f32"),
                Tensor(p + "ffn_gate_exps.weight", (D, F, X), experts_type),
                Tensor(p + "ffn_up_exps.weight", (D, F, X), experts_type),
                Tensor(p + "ffn_down_exps.weight", (F, D, X), experts_type)]
    return out + [Tensor("output_norm.weight", (D,), "f32", ones=True),
                  Tensor("output.weight", (D, d.vocab), dense_type)]


def gpt_oss_tensors(d: Dims, layers: int, experts_type: str, dense_type: str) -> list[Tensor]:
    """llama.cpp's gpt-oss loader (src/models/openai-moe.cpp: every tensor required, the q/k/v biases optional but
    shipped, so written): no ffn_norm but post_attention_norm, attention sinks (one logit per head), biases on the
    attention projections, the router and each expert's three matrices."""
    D, F, X, hd = d.hidden, d.expert_ffn, d.experts, d.head_dim
    Q, KV = d.heads * hd, d.kv_heads * hd
    out = [Tensor("token_embd.weight", (D, d.vocab), dense_type, std=1.0),
           Tensor("output_norm.weight", (D,), "f32", ones=True),
           Tensor("output.weight", (D, d.vocab), dense_type)]
    for i in range(layers):
        p = f"blk.{i}."
        out += [Tensor(p + "attn_norm.weight", (D,), "f32", ones=True),
                Tensor(p + "post_attention_norm.weight", (D,), "f32", ones=True),
                Tensor(p + "attn_q.weight", (D, Q), dense_type),
                Tensor(p + "attn_k.weight", (D, KV), dense_type),
                Tensor(p + "attn_v.weight", (D, KV), dense_type),
                Tensor(p + "attn_q.bias", (Q,), "f32", std=BIAS_STD),
                Tensor(p + "attn_k.bias", (KV,), "f32", std=BIAS_STD),
                Tensor(p + "attn_v.bias", (KV,), "f32", std=BIAS_STD),
                Tensor(p + "attn_output.weight", (Q, D), dense_type),
                Tensor(p + "attn_sinks.weight", (d.heads,), "f32", std=1.0),
                Tensor(p + "ffn_gate_inp.weight", (D, X), "f32"),
                Tensor(p + "ffn_gate_exps.weight", (D, F, X), experts_type),
                Tensor(p + "ffn_down_exps.weight", (F, D, X), experts_type),
                Tensor(p + "ffn_up_exps.weight", (D, F, X), experts_type),
                Tensor(p + "attn_output.bias", (D,), "f32", std=BIAS_STD),
                Tensor(p + "ffn_gate_inp.bias", (X,), "f32", std=BIAS_STD),
                Tensor(p + "ffn_gate_exps.bias", (F, X), "f32", std=BIAS_STD),
                Tensor(p + "ffn_down_exps.bias", (D, X), "f32", std=BIAS_STD),
                Tensor(p + "ffn_up_exps.bias", (F, X), "f32", std=BIAS_STD)]
    return out


def metadata(d: Dims, layers: int, experts_type: str, name: str) -> list[tuple[str, int, object]]:
    """(key, GGUF value type, value) of the hyperparameters llama.cpp reads for d.arch, then the vocabulary."""
    a = d.arch
    kv = [("general.architecture", STRING, a), ("general.name", STRING, name),
          ("general.file_type", UINT32, FILE_TYPE[experts_type]), ("general.quantization_version", UINT32, 2),
          (f"{a}.vocab_size", UINT32, d.vocab), (f"{a}.context_length", UINT32, d.context),
          (f"{a}.embedding_length", UINT32, d.hidden), (f"{a}.block_count", UINT32, layers),
          (f"{a}.feed_forward_length", UINT32, d.dense_ffn), (f"{a}.attention.head_count", UINT32, d.heads),
          (f"{a}.attention.head_count_kv", UINT32, d.kv_heads), (f"{a}.attention.key_length", UINT32, d.head_dim),
          (f"{a}.attention.value_length", UINT32, d.head_dim), (f"{a}.rope.dimension_count", UINT32, d.head_dim),
          (f"{a}.rope.freq_base", FLOAT32, d.rope_theta), (f"{a}.attention.layer_norm_rms_epsilon", FLOAT32, d.rms_eps),
          (f"{a}.expert_count", UINT32, d.experts), (f"{a}.expert_used_count", UINT32, d.top_k)]
    if a in ("qwen3moe", "gpt-oss"):
        kv.append((f"{a}.expert_feed_forward_length", UINT32, d.expert_ffn))
    if d.sliding_window:
        kv.append((f"{a}.attention.sliding_window", UINT32, d.sliding_window))
    if d.yarn_factor:  # as convert_hf_to_gguf writes gpt-oss's rope_scaling (beta_fast 32, beta_slow 1)
        kv += [(f"{a}.rope.scaling.type", STRING, "yarn"), (f"{a}.rope.scaling.factor", FLOAT32, d.yarn_factor),
               (f"{a}.rope.scaling.original_context_length", UINT32, d.yarn_orig_ctx),
               (f"{a}.rope.scaling.yarn_beta_fast", FLOAT32, 32.0),
               (f"{a}.rope.scaling.yarn_beta_slow", FLOAT32, 1.0)]
    return kv + vocabulary(d.vocab)


def vocabulary(n: int) -> list[tuple[str, int, object]]:
    """A minimal SentencePiece ("llama") vocabulary of n tokens: <unk>, <s>, </s>, the 256 byte tokens, dummies."""
    assert n >= 3 + 256, n
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [f"\u2581tok{k}" for k in range(n - len(pieces))]
    kinds = [2, 3, 3] + [6] * 256 + [1] * (n - 259)  # llama_token_type: UNKNOWN, CONTROL, BYTE, NORMAL
    scores = [0.0] * 259 + [-float(k) for k in range(n - 259)]
    return [("tokenizer.ggml.model", STRING, "llama"), ("tokenizer.ggml.tokens", ARRAY, (STRING, pieces)),
            ("tokenizer.ggml.scores", ARRAY, (FLOAT32, scores)), ("tokenizer.ggml.token_type", ARRAY, (INT32, kinds)),
            ("tokenizer.ggml.bos_token_id", UINT32, 1), ("tokenizer.ggml.eos_token_id", UINT32, 2),
            ("tokenizer.ggml.unknown_token_id", UINT32, 0), ("tokenizer.ggml.add_bos_token", BOOL, True),
            ("tokenizer.ggml.add_eos_token", BOOL, False)]


def pack_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def pack_value(vtype: int, value) -> bytes:
    """A GGUF value of a type (an ARRAY value is (element type, list))."""
    if vtype == STRING:
        return pack_string(value)
    if vtype == ARRAY:
        etype, items = value
        head = struct.pack("<IQ", etype, len(items))
        if etype == STRING:
            return head + b"".join(map(pack_string, items))
        return head + np.asarray(items, dtype={FLOAT32: "<f4", INT32: "<i4", UINT32: "<u4"}[etype]).tobytes()
    return struct.pack({UINT32: "<I", INT32: "<i", FLOAT32: "<f", BOOL: "<?"}[vtype], value)


def padded(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def header(kv: list[tuple[str, int, object]], specs: list[Tensor]) -> bytes:
    """Magic, version 3, counts, metadata, tensor infos (offsets into the aligned data section), padding."""
    parts = [b"GGUF", struct.pack("<IQQ", 3, len(specs), len(kv))]
    parts += [pack_string(k) + struct.pack("<I", t) + pack_value(t, v) for k, t, v in kv]
    offset = 0
    for s in specs:
        parts.append(pack_string(s.name) + struct.pack(f"<I{len(s.shape)}QIQ", len(s.shape), *s.shape,
                                                       TYPES[s.type].id, offset))
        offset += padded(s.nbytes)
    raw = b"".join(parts)
    return raw + bytes(padded(len(raw)) - len(raw))


def chunks(s: Tensor, rng: np.random.Generator):
    """Arrays whose bytes, one after another, are the tensor's data."""
    n, t = math.prod(s.shape), TYPES[s.type]
    if s.ones:
        yield np.ones(n, dtype="<f4")
        return
    if s.type == "f32":
        for start in range(0, n, CHUNK_ELEMS):
            yield rng.standard_normal(min(CHUNK_ELEMS, n - start), dtype=np.float32) * np.float32(s.weight_std)
        return
    blocks, per = n // t.block, CHUNK_ELEMS // t.block
    if s.type == "mxfp4":
        # codes uniform over the 16 (symmetric: zero mean); exponent f or f + 1 with f = floor(log2(target scale)),
        # f + 1 with probability p so that the mean of the squared scale is target^2: (1 - p) 4^f + p 4^(f+1)
        target = s.weight_std / t.code_rms
        f = math.floor(math.log2(target))
        p = (target * target / 4.0 ** f - 1) / 3
        assert 0 < 128 + f < 254, (s.name, target)
        for start in range(0, blocks, per):
            m = min(per, blocks - start)
            buf = np.frombuffer(rng.bytes(m * t.block_bytes), dtype=np.uint8).reshape(m, t.block_bytes).copy()
            buf[:, 0] = 128 + f + (rng.random(m) < p)
            yield buf
        return
    for start in range(0, blocks, per):
        m = min(per, blocks - start)
        buf = np.frombuffer(rng.bytes(m * t.block_bytes), dtype=np.uint8).reshape(m, t.block_bytes).copy()
        scale = rng.uniform(0.5, 1.5, m).astype(np.float32) * np.float32(s.weight_std / t.code_rms)
        scale *= np.where(rng.integers(0, 2, m, dtype=np.uint8), np.float32(-1), np.float32(1))  # zero-mean weights
        buf[:, :2] = scale.astype("<f2").view(np.uint8).reshape(m, 2)
        yield buf


def file_size(kv, specs: list[Tensor]) -> int:
    """Bytes of the file write() makes: header plus each tensor padded to the alignment."""
    return len(header(kv, specs)) + sum(padded(s.nbytes) for s in specs)


def plan(shape: str, layers: int | None = None, experts_type: str | None = None):
    """(metadata, tensors) of a shape at `layers` layers (default: its full depth), experts of `experts_type`
    (default: the shape's)."""
    d = SHAPES[shape]
    layers = d.layers if layers is None else layers
    experts_type = experts_type or d.experts_type
    kv = metadata(d, layers, experts_type, f"random-{shape}-{layers}L-{experts_type}")
    return kv, tensors(d, layers, experts_type)


def write(path: str, kv, specs: list[Tensor], seed: int = 1234, progress=None) -> int:
    """Write the GGUF to `path` (through `path`.part, renamed when complete); returns its size."""
    rng = np.random.Generator(np.random.SFC64(seed))
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(header(kv, specs))
        for i, s in enumerate(specs):
            for c in chunks(s, rng):
                c.tofile(f)
            f.write(bytes(padded(s.nbytes) - s.nbytes))
            if progress:
                progress(i + 1, len(specs), f.tell())
    os.replace(tmp, path)
    return os.path.getsize(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", required=True, help="GGUF file to write")
    ap.add_argument("--dims", choices=sorted(SHAPES), default="mixtral")
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's full depth")
    ap.add_argument("--experts-type", choices=sorted(FILE_TYPE), default=None,
                    help="default: the shape's (mxfp4 for gpt-oss, q4_0 otherwise)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    experts_type = args.experts_type or SHAPES[args.dims].experts_type
    kv, specs = plan(args.dims, args.layers, experts_type)
    expected = file_size(kv, specs)
    print(f"[make_gguf] {args.dims} ({SHAPES[args.dims].arch}) {args.layers or SHAPES[args.dims].layers} layers, "
          f"{experts_type} experts, {len(specs)} tensors, {expected / 2**30:.2f} GiB -> {args.out}", flush=True)
    t0 = time.time()
    last = [t0]

    def progress(done: int, total: int, at: int) -> None:
        if time.time() - last[0] > 15 or done == total:
            last[0] = time.time()
            print(f"[make_gguf] {done}/{total} tensors, {at / 2**30:.2f} GiB, {time.time() - t0:.0f}s", flush=True)

    size = write(args.out, kv, specs, args.seed, progress)
    assert size == expected, (size, expected)
    dt = time.time() - t0
    print(f"[make_gguf] wrote {size / 2**30:.2f} GiB in {dt:.1f}s ({size / 2**20 / max(dt, 1e-9):.0f} MiB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
