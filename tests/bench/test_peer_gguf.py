"""bench/peer/make_gguf.py writes GGUFs llama.cpp's loaders accept: read back with a reader of our own (GGUF v3, a
few lines), a tiny `qwen3moe`, `llama` (Mixtral) and `gpt-oss` (MXFP4 experts) file carry the architecture, the
hyperparameters llama.cpp reads, and the tensor names, ggml shapes and types of its loaders; the benchmark shapes agree
with bench/hybrid.py's (and GPT-OSS-20B with its config.json)."""

import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH / "peer"), str(BENCH)]
import make_gguf  # noqa: E402

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
TYPE_NAMES = {0: "f32", 2: "q4_0", 8: "q8_0", 39: "mxfp4"}
BLOCK = {0: (1, 4), 2: (32, 18), 8: (32, 34), 39: (32, 17)}  # ggml type -> (elements, bytes) per block


class Reader:
    """Sequential little-endian reads from a file's bytes."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.at += n
        return self.data[self.at - n:self.at].decode()

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, n = self.take("<I"), self.take("<Q")
            return [self.value(etype) for _ in range(n)]
        return self.take(SCALARS[vtype])


def read_gguf(path: Path) -> tuple[dict, dict, bytes, int]:
    """(metadata, {name: (shape, type name, offset)}, file bytes, data section start)."""
    r = Reader(path.read_bytes())
    assert r.data[:4] == b"GGUF"
    r.at = 4
    assert r.take("<I") == 3
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    kv = {}
    for _ in range(n_kv):
        key = r.string()
        kv[key] = r.value(r.take("<I"))
    tensors = {}
    for _ in range(n_tensors):
        name = r.string()
        shape = tuple(r.take("<Q") for _ in range(r.take("<I")))
        tensors[name] = (shape, TYPE_NAMES[r.take("<I")], r.take("<Q"))
    align = kv.get("general.alignment", 32)
    return kv, tensors, r.data, -(-r.at // align) * align


def expected_tensors(d, layers: int) -> dict:
    """name -> (ggml shape, type) as llama.cpp's loaders create them (src/models/llama.cpp, qwen3moe.cpp)."""
    D, F, X, hd = d.hidden, d.expert_ffn, d.experts, d.head_dim
    out = {"token_embd.weight": ((D, d.vocab), "q8_0"), "output_norm.weight": ((D,), "f32"),
           "output.weight": ((D, d.vocab), "q8_0")}
    for i in range(layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": ((D,), "f32"), p + "attn_q.weight": ((D, d.heads * hd), "q8_0"),
                    p + "attn_k.weight": ((D, d.kv_heads * hd), "q8_0"),
                    p + "attn_v.weight": ((D, d.kv_heads * hd), "q8_0"),
                    p + "attn_output.weight": ((d.heads * hd, D), "q8_0"), p + "ffn_norm.weight": ((D,), "f32"),
                    p + "ffn_gate_inp.weight": ((D, X), "f32"), p + "ffn_gate_exps.weight": ((D, F, X), "q4_0"),
                    p + "ffn_up_exps.weight": ((D, F, X), "q4_0"), p + "ffn_down_exps.weight": ((F, D, X), "q4_0")})
        if d.arch == "qwen3moe":
            out.update({p + "attn_q_norm.weight": ((hd,), "f32"), p + "attn_k_norm.weight": ((hd,), "f32")})
    return out


def dequantize_q4_0(raw: bytes) -> np.ndarray:
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 18)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    q = blocks[:, 2:]
    codes = np.concatenate([q & 0x0F, q >> 4], axis=1).astype(np.float32) - 8  # ggml: low nibbles first
    return (d * codes).ravel()


@pytest.mark.parametrize("shape", ["tiny-qwen3", "tiny-mixtral"])
def test_tiny_gguf_reads_back_as_llama_cpp_expects(tmp_path, shape):
    d, layers = make_gguf.SHAPES[shape], 2
    path = tmp_path / f"{shape}.gguf"
    assert make_gguf.main(["--dims", shape, "--layers", str(layers), "-o", str(path)]) == 0
    kv, tensors, data, start = read_gguf(path)

    a = d.arch
    assert kv["general.architecture"] == a == {"tiny-qwen3": "qwen3moe", "tiny-mixtral": "llama"}[shape]
    assert kv["general.file_type"] == 2  # MOSTLY_Q4_0
    want = {"block_count": layers, "embedding_length": d.hidden, "attention.head_count": d.heads,
            "attention.head_count_kv": d.kv_heads, "attention.key_length": d.head_dim,
            "attention.value_length": d.head_dim, "rope.dimension_count": d.head_dim, "expert_count": d.experts,
            "expert_used_count": d.top_k, "vocab_size": d.vocab, "context_length": d.context}
    if a == "qwen3moe":
        want["expert_feed_forward_length"] = d.expert_ffn
    else:  # llama arch: the experts' FFN is feed_forward_length
        want["feed_forward_length"] = d.expert_ffn
    assert {k: kv[f"{a}.{k}"] for k in want} == want
    assert kv[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(d.rms_eps)
    assert kv["tokenizer.ggml.model"] == "llama" and len(kv["tokenizer.ggml.tokens"]) == d.vocab
    assert len(kv["tokenizer.ggml.scores"]) == len(kv["tokenizer.ggml.token_type"]) == d.vocab
    assert kv["tokenizer.ggml.tokens"][:3] == ["<unk>", "<s>", "</s>"]

    assert {n: t[:2] for n, t in tensors.items()} == expected_tensors(d, layers)
    end = start
    for name, (shape_, kind, offset) in tensors.items():
        assert offset % 32 == 0
        elems, nbytes = BLOCK[{v: k for k, v in TYPE_NAMES.items()}[kind]]
        end = max(end, start + offset + math.prod(shape_) // elems * nbytes)
    assert len(data) == -(-end // 32) * 32 == make_gguf.file_size(*make_gguf.plan(shape, layers))

    _, _, offset = tensors["blk.0.ffn_down_exps.weight"]
    shape_ = tensors["blk.0.ffn_down_exps.weight"][0]
    w = dequantize_q4_0(data[start + offset:start + offset + math.prod(shape_) // 32 * 18])
    assert np.isfinite(w).all() and abs(w.mean()) < 0.1 * w.std()
    assert w.std() == pytest.approx(1 / math.sqrt(d.expert_ffn), rel=0.2)  # unit-RMS rows in, unit-RMS out
    _, _, offset = tensors["blk.0.ffn_norm.weight"]
    assert (np.frombuffer(data, "<f4", d.hidden, start + offset) == 1).all()


def gpt_oss_tensors(d, layers: int) -> dict:
    """name -> (ggml shape, type) as llama.cpp's gpt-oss loader creates them (src/models/openai-moe.cpp)."""
    D, F, X, Q, KV = d.hidden, d.expert_ffn, d.experts, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = {"token_embd.weight": ((D, d.vocab), "q8_0"), "output_norm.weight": ((D,), "f32"),
           "output.weight": ((D, d.vocab), "q8_0")}
    for i in range(layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": ((D,), "f32"), p + "post_attention_norm.weight": ((D,), "f32"),
                    p + "attn_q.weight": ((D, Q), "q8_0"), p + "attn_k.weight": ((D, KV), "q8_0"),
                    p + "attn_v.weight": ((D, KV), "q8_0"), p + "attn_q.bias": ((Q,), "f32"),
                    p + "attn_k.bias": ((KV,), "f32"), p + "attn_v.bias": ((KV,), "f32"),
                    p + "attn_output.weight": ((Q, D), "q8_0"), p + "attn_output.bias": ((D,), "f32"),
                    p + "attn_sinks.weight": ((d.heads,), "f32"), p + "ffn_gate_inp.weight": ((D, X), "f32"),
                    p + "ffn_gate_inp.bias": ((X,), "f32"), p + "ffn_gate_exps.weight": ((D, F, X), "mxfp4"),
                    p + "ffn_up_exps.weight": ((D, F, X), "mxfp4"), p + "ffn_down_exps.weight": ((F, D, X), "mxfp4"),
                    p + "ffn_gate_exps.bias": ((F, X), "f32"), p + "ffn_up_exps.bias": ((F, X), "f32"),
                    p + "ffn_down_exps.bias": ((D, X), "f32")})
    return out


def dequantize_mxfp4(raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(weights, E8M0 exponents) of ggml's block_mxfp4 blocks: e, then 16 bytes of codes, low nibbles first."""
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 17)
    kvalues = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)  # ggml-common.h
    q = blocks[:, 1:]
    codes = np.concatenate([kvalues[q & 0x0F], kvalues[q >> 4]], axis=1)
    return (codes * np.ldexp(np.float32(1), blocks[:, :1].astype(np.int32) - 128)).ravel(), blocks[:, 0]


def test_tiny_gpt_oss_gguf_reads_back_as_llama_cpp_expects(tmp_path):
    d, layers = make_gguf.SHAPES["tiny-gpt-oss"], 2
    path = tmp_path / "tiny-gpt-oss.gguf"
    assert make_gguf.main(["--dims", "tiny-gpt-oss", "-o", str(path)]) == 0  # experts MXFP4 by default
    kv, tensors, data, start = read_gguf(path)

    a = "gpt-oss"  # llama.cpp's LLM_ARCH_OPENAI_MOE
    assert kv["general.architecture"] == d.arch == a and kv["general.file_type"] == 38  # MOSTLY_MXFP4_MOE
    want = {"block_count": layers, "embedding_length": d.hidden, "attention.head_count": d.heads,
            "attention.head_count_kv": d.kv_heads, "attention.key_length": d.head_dim,
            "attention.value_length": d.head_dim, "expert_count": d.experts, "expert_used_count": d.top_k,
            "expert_feed_forward_length": d.expert_ffn, "context_length": d.context,
            "attention.sliding_window": 128, "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
            "rope.scaling.original_context_length": d.yarn_orig_ctx, "rope.freq_base": 150000.0}
    assert {k: kv[f"{a}.{k}"] for k in want} == want
    assert kv["tokenizer.ggml.model"] == "llama" and len(kv["tokenizer.ggml.tokens"]) == d.vocab

    assert {n: t[:2] for n, t in tensors.items()} == gpt_oss_tensors(d, layers)
    end = start
    for shape_, kind, offset in tensors.values():
        assert offset % 32 == 0
        elems, nbytes = BLOCK[{v: k for k, v in TYPE_NAMES.items()}[kind]]
        end = max(end, start + offset + math.prod(shape_) // elems * nbytes)
    assert len(data) == -(-end // 32) * 32 == make_gguf.file_size(*make_gguf.plan("tiny-gpt-oss"))

    shape_, _, offset = tensors["blk.1.ffn_down_exps.weight"]
    w, e = dequantize_mxfp4(data[start + offset:start + offset + math.prod(shape_) // 32 * 17])
    assert np.isfinite(w).all() and abs(w.mean()) < 0.1 * w.std() and len(set(e.tolist())) == 2
    assert w.std() == pytest.approx(1 / math.sqrt(d.expert_ffn), rel=0.1)  # unit-RMS rows in, unit-RMS out
    shape_, _, offset = tensors["blk.0.ffn_up_exps.bias"]
    bias = np.frombuffer(data, "<f4", math.prod(shape_), start + offset)
    assert 0 < bias.std() < 0.05
    _, _, offset = tensors["blk.0.post_attention_norm.weight"]
    assert (np.frombuffer(data, "<f4", d.hidden, start + offset) == 1).all()


def test_gpt_oss_20b_is_the_shipped_shape():
    """openai/gpt-oss-20b's config.json, MXFP4 experts: 12.1 GB (11.27 GiB) as the published MXFP4 GGUF."""
    d = make_gguf.SHAPES["gpt-oss-20b"]
    assert (d.arch, d.layers, d.hidden, d.heads, d.kv_heads, d.head_dim, d.expert_ffn, d.experts, d.top_k, d.vocab,
            d.context, d.rope_theta, d.sliding_window, d.yarn_factor, d.yarn_orig_ctx, d.experts_type) == (
        "gpt-oss", 24, 2880, 64, 8, 64, 2880, 32, 4, 201088, 131072, 150000.0, 128, 32.0, 4096, "mxfp4")
    kv, specs = make_gguf.plan("gpt-oss-20b")
    assert len(specs) == 3 + 24 * 19 and 12.0e9 < make_gguf.file_size(kv, specs) < 12.2e9


def test_benchmark_shapes_are_bench_hybrid_shapes():
    """The side-by-side covers bench/hybrid.py's mixtral, qwen3, qwen3-235b and gpt-oss-120b shapes (not its deepseek
    ones), with their dims (and gpt-oss-20b's, should bench/hybrid.py get a shape of that name)."""
    import hybrid

    peer = [name for name in make_gguf.SHAPES if name in hybrid.SHAPES]
    assert peer[:4] == ["mixtral", "qwen3", "qwen3-235b", "gpt-oss-120b"]
    assert set(peer) <= {"mixtral", "qwen3", "qwen3-235b", "gpt-oss-120b", "gpt-oss-20b"}
    for name in peer:
        shape, d = hybrid.SHAPES[name][0], make_gguf.SHAPES[name]
        assert (d.layers, d.hidden, d.heads, d.kv_heads, d.head_dim, d.expert_ffn, d.experts, d.top_k, d.vocab) == (
            shape["num_layers"], shape["hidden_size"], shape["num_heads"], shape["num_kv_heads"], shape["head_dim"],
            shape["expert_ffn"], shape["num_experts"], shape["top_k"], shape["vocab_size"])


def test_llama_cpp_budget_rule_matches_recorded_placements():
    """llama.cpp's N with its own bytes (Q8_0 dense: fewer CPU layers) and moeserve's N as bench/hybrid.py's hybrid
    column places them, the streaming ring counted (21 of 32 and 35 of 48 layers on the CPU)."""
    import run

    cfg = run.Config.from_env(16)
    cfg.n_cpu_moe, cfg.pp, cfg.tg = {}, 512, 128
    hybrid = run.import_hybrid()
    got = {s: {c: n for c, (n, _) in run.placements(cfg, hybrid, s).items()} for s in ("mixtral", "qwen3")}
    assert got == {"mixtral": {"hybrid": 19, "hybrid-moeserve": 21}, "qwen3": {"hybrid": 30, "hybrid-moeserve": 35}}
    if "gpt-oss-20b" not in hybrid.SHAPES:  # run.py's own budget, llama.cpp's rule only; the override sets N
        # 8 GiB x 0.95 - 1.79 GiB dense - 0.03 GiB KV = 5.78 GiB: 14 layers' MXFP4 experts at 0.395 GiB resident
        assert {c: n for c, (n, _) in run.placements(cfg, hybrid, "gpt-oss-20b").items()} == {"hybrid": 10}
        cfg.n_cpu_moe = {"gpt-oss-20b": 14}
        assert run.placements(cfg, hybrid, "gpt-oss-20b") == {"hybrid": (14, "PEER_N_CPU_MOE")}
    assert run.gguf_path(cfg, "gpt-oss-20b").name == "gpt-oss-20b-mxfp4.gguf"


def test_fewer_layers_of_a_big_shape(monkeypatch):
    """PEER_LAYERS=shape=N: the GGUF of the first N layers (its own file name), both N at bench/hybrid.py's budget
    for that depth (GPT-OSS-120B's experts MXFP4 in both)."""
    import run

    monkeypatch.setenv("PEER_LAYERS", "qwen3-235b=8,gpt-oss-120b=8")
    cfg = run.Config.from_env(16)
    cfg.n_cpu_moe, cfg.pp, cfg.tg = {}, 512, 128
    hybrid = run.import_hybrid()
    assert run.gguf_path(cfg, "qwen3-235b").name == "qwen3-235b-8L-q4_0.gguf"
    assert run.gguf_path(cfg, "qwen3").name == "qwen3-q4_0.gguf"
    kv, specs = make_gguf.plan("qwen3-235b", cfg.depth("qwen3-235b"))
    assert len({t.name.split(".")[1] for t in specs if t.name.startswith("blk.")}) == 8
    full = hybrid.SHAPES["qwen3-235b"]
    spec, whole = (hybrid.model_spec(s) for s in (hybrid.shape_at(full[0], 8), full[0]))
    assert run.hybrid_budget(cfg, hybrid, "qwen3-235b") == hybrid.budget_at(whole, spec, full[1], 640, 2) < full[1]
    got = {s: {c: n for c, (n, _) in run.placements(cfg, hybrid, s).items()} for s in ("qwen3-235b", "gpt-oss-120b")}
    assert got == {"qwen3-235b": {"hybrid": 4, "hybrid-moeserve": 6}, "gpt-oss-120b": {"hybrid": 4, "hybrid-moeserve": 5}}
    assert "MXFP4" in run.placements(cfg, hybrid, "gpt-oss-120b")["hybrid-moeserve"][1]
