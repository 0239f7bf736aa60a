"""Grammar libraries for constrained decoding, side by side: llguidance vs xgrammar on one JSON schema.

For a vocabulary of `--vocab` tokens (the demo's 258 byte tokens, or a synthetic byte-level vocabulary of word
pieces the size of Qwen's, 151k) it reports each library's tokenizer-info build time, grammar compile time and
per-token mask time while a greedy walk through a valid document consumes tokens (one matcher, and `--batch`
matchers filled one after another as the engine's _draw fills them). Then the engine's own cost: what
engine/constraints.py's `constrain` adds to a decode step of `--rows` rows (fill, unpack on `--device`, mask) with 1
and `--batch` constrained requests, the chosen library's. Run:
    python bench/structured_mask.py --vocab 258 --vocab 151000 --batch 16 [--device cuda]
The figures go to bench/results/structured_mask-<device>-<date>.json. The 151k vocabulary is synthetic (random word
pieces): a real tokenizer's may favour either library's precomputation differently.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import result_record, write_result  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}}, "kind": {"enum": ["a", "b", "c"]},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}},
    "required": ["name", "age", "score", "tags", "kind", "inner"], "additionalProperties": False}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "score": 9.5, "tags": ["math", "engines"], "kind": "b",
                  "inner": {"ok": True, "n": 7}})


def vocabulary(size: int) -> list[bytes]:
    """256 byte tokens, then word pieces (with and without a leading space), digits and punctuation runs, then EOS."""
    rng = random.Random(0)
    tokens, seen = [bytes([i]) for i in range(256)], set()
    alphabet = string.ascii_lowercase + string.ascii_uppercase + string.digits + "_\"{}[]:,. -"
    while len(tokens) < size - 1:
        n = rng.choice([2, 2, 3, 3, 4, 4, 5, 6, 7, 8, 10])
        piece = (" " if rng.random() < 0.4 else "") + "".join(rng.choice(alphabet) for _ in range(n))
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece.encode())
    return tokens + [b"<eos>"]


def greedy_ids(tokens: list[bytes], text: bytes) -> list[int]:
    """Longest-match tokenization (good enough to walk a document)."""
    index = {t: i for i, t in enumerate(tokens[:-1])}
    longest = max(len(t) for t in index)
    out, i = [], 0
    while i < len(text):
        for n in range(min(longest, len(text) - i), 0, -1):
            if text[i:i + n] in index:
                out.append(index[text[i:i + n]])
                i += n
                break
    return out


def bench_llguidance(tokens, ids, batch):
    import llguidance
    import llguidance.torch as llt

    eos = len(tokens) - 1
    t0 = time.perf_counter()

    class Wrapped:
        eos_token_id, bos_token_id, special_token_ids = eos, None, [eos]

        def __init__(self):
            self.tokens = tokens

        def __call__(self, s):
            return greedy_ids(tokens, s if isinstance(s, bytes) else s.encode())

    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()))
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(batch)]
    t2 = time.perf_counter()
    mask = llt.allocate_token_bitmask(batch, len(tokens))
    one, many = [], []
    for t in ids:
        s = time.perf_counter()
        llt.fill_next_token_bitmask(matchers[0], mask, 0)
        one.append(time.perf_counter() - s)
        s = time.perf_counter()
        for b in range(1, batch):
            llt.fill_next_token_bitmask(matchers[b], mask, b)
        many.append(time.perf_counter() - s + one[-1])
        for m in matchers:
            assert m.consume_token(t), m.get_error()
    return t1 - t0, (t2 - t1) / batch, one, many


def bench_xgrammar(tokens, ids, batch):
    import xgrammar as xgr

    eos = len(tokens) - 1
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.RAW, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), strict_mode=True)
    t2 = time.perf_counter()
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    mask = xgr.allocate_token_bitmask(batch, len(tokens))
    one, many = [], []
    for t in ids:
        s = time.perf_counter()
        matchers[0].fill_next_token_bitmask(mask, 0)
        one.append(time.perf_counter() - s)
        s = time.perf_counter()
        for b in range(1, batch):
            matchers[b].fill_next_token_bitmask(mask, b)
        many.append(time.perf_counter() - s + one[-1])
        for m in matchers:
            assert m.accept_token(t)
    return t1 - t0, t2 - t1, one, many


class Vocab:
    """A tokenizer as engine/constraints.py's Grammars reads it."""

    def __init__(self, tokens):
        self.tokens, self.vocab_size = tokens, len(tokens)

    def vocab_bytes(self):
        return [b"" if t == b"<eos>" else t for t in self.tokens]


def bench_engine(tokens, ids, batch, rows, device):
    """Per decode step: constrain() over logits [rows, V] with n constrained rows, n = 1 and `batch`."""
    from moeserve.engine.constraints import Grammars, constrain

    grammars = Grammars(Vocab(tokens), len(tokens), {len(tokens) - 1})
    logits = torch.randn(rows, len(tokens), device=device)
    out = {}
    for n in (1, batch):
        constraints = [grammars.json_schema(SCHEMA) for _ in range(n)]
        times = []
        for t in ids:
            if device == "cuda":
                torch.cuda.synchronize()
            s = time.perf_counter()
            constrain(logits, list(range(n)), constraints, {})
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - s)
            for c in constraints:
                c.accept(t)
        out[n] = sorted(times)[len(times) // 2] * 1e6
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, action="append")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rows", type=int, default=64, help="decode rows of the step the engine's cost is measured in")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(1)
    record = result_record("structured_mask", {"vocab": args.vocab or [258, 151000], "batch": args.batch,
                                               "rows": args.rows, "schema": SCHEMA}, args.device)
    record["results"] = []
    for size in args.vocab or [258, 151000]:
        tokens = vocabulary(size)
        ids = greedy_ids(tokens, DOC.encode())
        for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            setup, compile_s, one, many = fn(tokens, ids, args.batch)
            med = lambda xs: sorted(xs)[len(xs) // 2] * 1e6  # noqa: E731
            record["results"].append({"vocab": size, "library": name, "tokenizer_info_ms": setup * 1e3,
                                      "compile_ms": compile_s * 1e3, "mask_us_1": med(one),
                                      f"mask_us_{args.batch}": med(many)})
            print(f"vocab {size:>6} {name:<10} tokenizer info {setup * 1e3:7.1f} ms  compile {compile_s * 1e3:7.1f} ms"
                  f"  mask/token: 1 request {med(one):7.1f} us (max {max(one) * 1e6:7.0f}),"
                  f" {args.batch} requests {med(many):8.1f} us per step ({len(ids)} tokens)")
        cost = bench_engine(tokens, ids, args.batch, args.rows, args.device)
        record["results"].append({"vocab": size, "engine_constrain_us": cost, "rows": args.rows})
        print(f"vocab {size:>6} engine constrain() in a {args.rows}-row step on {args.device}: "
              + ", ".join(f"{n} constrained {us:7.1f} us" for n, us in cost.items()))

    print(f"wrote {write_result(record)}")


if __name__ == "__main__":
    main()
