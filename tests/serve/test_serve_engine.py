"""Continuous batching in process: requests that join, leave and share steps get what they get alone."""

from pathlib import Path

import pytest
import torch

import moeserve
from moeserve.engine.batching import PREFIX_MIN, ContinuousBatch, Request
from moeserve.engine.cuda_graph import SlotDecoder, padded_batch
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.errors import MoeserveError
from moeserve.tokenizer import load_tokenizer
from single_thread import one_thread  # noqa: F401 - autouse fixture

MAX_STEPS = 2000  # every stepping loop below ends well before this


@pytest.fixture(scope="module")
def demo():
    return moeserve.load_model(moeserve.DEMO_MODEL, dtype=torch.float32), load_tokenizer(moeserve.DEMO_MODEL)


def run(batch: ContinuousBatch, requests: list[Request], arrivals: dict[int, list[Request]] | None = None) -> dict:
    """Step until every request is done; requests of arrivals[n] are added before step n. -> {request: updates}"""
    updates = {id(r): [] for r in requests}
    for r in requests:
        r.on_update = lambda req, u: updates[id(req)].append(u)
    arrivals = arrivals or {0: requests}
    for n in range(MAX_STEPS):
        for r in arrivals.get(n, []):
            batch.add(r)
        if not batch.step() and n > max(arrivals):
            return updates
    raise AssertionError("the batch did not finish")


def assert_alone(model, tok, requests, updates, alone=None):
    """Each request's updates add up to what generate() gives its prompt alone (alone: those results, if known)."""
    for n, r in enumerate(requests):
        solo = alone[n] if alone else generate(model, [r.prompt_ids], r.params, tokenizer=tok)[0]
        got = updates[id(r)]
        assert [t for u in got for t in u.token_ids] == solo.token_ids
        assert "".join(u.text for u in got) == solo.text
        assert got[-1].finish_reason == solo.finish_reason and all(u.finish_reason is None for u in got[:-1])


@pytest.fixture(scope="module")
def mixed_requests(demo):
    """12 prompts of 0 to 88 characters (+ BOS), greedy and seeded sampling, some with a stop string, and what
    each gets alone."""
    model, tok = demo
    text = (Path(moeserve.DEMO_MODEL) / "heldout.txt").read_text()
    prompts = [tok.encode(text[97 * i: 97 * i + 8 * i]) for i in range(12)]
    params = [SamplingParams(max_new_tokens=4 + 2 * i, temperature=0.0 if i % 3 else 0.9, seed=i, ignore_eos=True,
                             stop=("\n\n",) if i % 4 == 1 else ()) for i in range(12)]
    return prompts, params, [generate(model, [p], sp, tokenizer=tok)[0] for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-padded"])
def test_joining_and_leaving_requests_get_their_solo_tokens(demo, mixed_requests, static):
    """12 requests, 5 slots, 32-token prefill chunks, half arriving mid-run: each request's tokens, text and finish
    reason equal generate() on its prompt alone. `static` decodes through the padded step a CUDA graph captures
    (spare row, all columns), eagerly."""
    model, tok = demo
    prompts, params, alone = mixed_requests
    batch = ContinuousBatch(model, tok, slots=5, context=128, prefill_tokens=32)
    if static:
        batch.decoder = SlotDecoder(model, batch.kv, graph=False, static=True)
    requests = [Request(p, sp, None) for p, sp in zip(prompts, params)]
    updates = run(batch, requests, {0: requests[:6], 3: requests[6:9], 7: requests[9:]})
    assert_alone(model, tok, requests, updates, alone)
    assert sorted(batch.free) == list(range(5)) and not batch.active and not batch.waiting


@pytest.mark.parametrize("family,static", [("mixtral_sliding", False), ("qwen3_moe", False), ("deepseek_v3", False),
                                           ("deepseek_v3", True), ("llama4", False), ("llama4", True)])
def test_per_slot_positions_with_sliding_window_and_qk_norm(hf_checkpoints, family, static):
    """Masks from per-row positions: a sliding window of 5 tokens over prompts read in 3-token chunks; MLA's latent
    cache in slots, eager and through the padded static step; Llama-4's attention chunks and temperature."""
    model = moeserve.load_model(hf_checkpoints[family][1], dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (9, 2, 13, 4)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    batch = ContinuousBatch(model, None, slots=3, context=40, prefill_tokens=6)
    if static:
        batch.decoder = SlotDecoder(model, batch.kv, graph=False, static=True)
    requests = [Request(p, params, None) for p in prompts]
    updates = run(batch, requests, {0: requests[:3], 2: requests[3:]})
    assert_alone(model, None, requests, updates)


def test_prompts_sharing_a_prefix_read_it_once(demo):
    """Prompts sharing a 60-character system text, three of them identical (an n = 3 request), in 3 rows with
    32-token prefill chunks: a prompt waits for the read of the one ahead of it, then copies the shared columns from
    its row (running, or done and kept), computing what is left when that is under PREFIX_MIN tokens; the fourth
    identical one takes the row its twin left. Each request still
    gets what it gets alone (greedy and seeded), and the shared tokens are computed once."""
    model, tok = demo
    text = (Path(moeserve.DEMO_MODEL) / "heldout.txt").read_text()
    tails = ("KING. Speak", "QUEEN. Go", "KING. Speak", "KING. Speak", text[500:530])
    prompts = [tok.encode(text[:60] + tail) for tail in tails]
    params = [SamplingParams(max_new_tokens=10, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(5)]
    batch = ContinuousBatch(model, tok, slots=3, context=128, prefill_tokens=32)
    requests = [Request(p, sp, None) for p, sp in zip(prompts, params)]
    updates = run(batch, requests, {0: requests[:4], 5: requests[4:]})
    assert_alone(model, tok, requests, updates)
    system = len(tok.encode(text[:60]))
    assert requests[0].reused == 0 and requests[1].reused >= system - 1
    assert requests[2].reused > len(prompts[0]) - 1 - PREFIX_MIN  # the rest is read alongside, not waited for
    assert requests[3].reused == len(prompts[0]) - 1  # its twin's kept row: only the last token is computed
    assert requests[4].reused >= system - 1  # text[500:] follows the system text too: the kept rows hold it


def test_without_prefix_reuse_every_prompt_is_computed_whole(demo):
    """prefix_reuse off (serve --no-prefix-reuse): identical prompts, running and kept, are each read whole, and get
    what they get alone."""
    model, tok = demo
    text = (Path(moeserve.DEMO_MODEL) / "heldout.txt").read_text()
    batch = ContinuousBatch(model, tok, slots=2, context=128, prefill_tokens=32, prefix_reuse=False)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    requests = [Request(tok.encode(text[:70]), params, None) for _ in range(3)]
    updates = run(batch, requests, {0: requests[:2], 8: requests[2:]})
    assert_alone(model, tok, requests, updates)
    assert [r.reused for r in requests] == [0, 0, 0]


def test_a_kept_row_taken_by_another_prompt_is_overwritten(demo):
    """A row's kept tokens are reused only as far as they match: a prompt differing after a few tokens reads the
    rest into that row, and gets what it gets alone."""
    model, tok = demo
    batch = ContinuousBatch(model, tok, slots=1, context=96, prefill_tokens=16)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    requests = [Request(tok.encode(t), params, None) for t in ("KING. Speak to me of the war", "KING. Go away now")]
    updates = run(batch, requests, {0: requests[:1], 12: requests[1:]})
    assert_alone(model, tok, requests, updates)
    assert requests[1].reused == len(tok.encode("KING. ")) and batch.kept[0][:requests[1].reused + 2] == \
        requests[1].prompt_ids[:requests[1].reused + 2]


def test_cancel_frees_the_slot_for_the_next_request(demo):
    model, tok = demo
    batch = ContinuousBatch(model, tok, slots=1, context=64)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    first, second = Request(tok.encode("KING."), params, None), Request(tok.encode("QUEEN."), params, None)
    seen = {id(first): [], id(second): []}
    for r in (first, second):
        r.on_update = lambda req, u: seen[id(req)].append(u)
        batch.add(r)
    for _ in range(3):
        batch.step()
    assert first.slot == 0 and second.slot is None and len(seen[id(first)]) == 3
    batch.cancel(first)
    assert batch.free == [0]
    for _ in range(MAX_STEPS):
        if not batch.step():
            break
    assert len(seen[id(first)]) == 3 and seen[id(second)][-1].finish_reason == "length"
    solo = generate(model, [second.prompt_ids], params)[0]
    assert [t for u in seen[id(second)] for t in u.token_ids] == solo.token_ids


def test_context_limit_logprobs_and_checks(demo):
    model, tok = demo
    batch = ContinuousBatch(model, tok, slots=2, context=20)
    prompt = tok.encode("To be, or not")  # 14 tokens: 6 left in a 20-token slot
    r = Request(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True), None, top_logprobs=3)
    updates = run(batch, [r])[id(r)]
    assert len(updates) == 6 and updates[-1].finish_reason == "context"
    for u in updates:
        (lp,) = u.logprobs
        assert lp.token == u.token_ids[0] and len(lp.top) == 3 and lp.top[0][0] == lp.token  # greedy: the best
        assert lp.logprob == pytest.approx(lp.top[0][1]) and all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    with pytest.raises(MoeserveError, match="context of 20"):
        batch.check(tok.encode("x" * 19), SamplingParams())
    with pytest.raises(MoeserveError, match="vocabulary"):
        batch.check([300], SamplingParams())


def test_padded_batch_sizes():
    assert [padded_batch(b, 12) for b in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "segments"])
def test_graph_replays_read_their_static_buffers(demo, mixed_requests, monkeypatch, cut):
    """The CUDA-graph path's plumbing, on the CPU: a stand-in `capture` records each piece and replays it eagerly
    from the same static buffers, so every replay must see the inputs copied into them (rows, positions, tokens
    of a changing batch, padded to 1, 2, 4 or 5 rows). `cut`: the step in segments between the MoE layers whose
    experts read the routing on the host (on the CPU every MoE layer's loop does: the hybrid and offload case on a
    GPU), the host running those experts between replays; else one graph per size. The server's warm-up captures
    every size first and its prefill passes write rows that requests then take."""
    from moeserve.engine import cuda_graph

    class Replay:
        def __init__(self, step, out):
            self.step, self.out = step, out

        def replay(self):
            fresh = self.step()
            for buf, x in zip(self.out if isinstance(self.out, tuple) else (self.out,),
                              fresh if isinstance(fresh, tuple) else (fresh,)):
                if isinstance(buf, torch.Tensor):
                    buf.copy_(x)
                else:  # the router's output: (expert ids, weights, mix or None)
                    for b, y in zip(buf, x):
                        if b is not None:
                            b.copy_(y)

    def capture(step, warmup, device, pool=None):
        out = step()
        return Replay(step, out), out

    monkeypatch.setattr(cuda_graph, "capture", capture)
    if not cut:
        monkeypatch.setattr(cuda_graph, "host_layers", lambda model, batch: [])
    model, tok = demo
    prompts, params, alone = mixed_requests
    batch = ContinuousBatch(model, tok, slots=5, context=128, prefill_tokens=32)
    batch.decoder = SlotDecoder(model, batch.kv, graph=True)
    batch.decoder.pool = "shared"  # no CUDA memory pool on the CPU
    warm = batch.warm_up(on_cpu=True)
    assert warm.decode_sizes == warm.graphed_sizes == [1, 2, 4, 5]
    assert batch.decoder.cut_sizes() == ([1, 2, 4, 5] if cut else [])
    assert warm.prefill_passes == 14  # one row of 1, 2, 3, 4, 6, 7, 8, 12, 15, 16, 24, 31, 32 tokens; two of 1
    requests = [Request(p, sp, None) for p, sp in zip(prompts, params)]
    updates = run(batch, requests, {0: requests[:6], 3: requests[6:9], 7: requests[9:]})
    assert_alone(model, tok, requests, updates, alone)


def test_a_failed_capture_runs_the_pieces_eagerly(demo, mixed_requests, monkeypatch):
    from moeserve.engine import cuda_graph

    def capture(step, warmup, device, pool=None):
        step()
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graph, "capture", capture)
    model, tok = demo
    prompts, params, alone = mixed_requests
    batch = ContinuousBatch(model, tok, slots=5, context=128, prefill_tokens=32)
    batch.decoder = SlotDecoder(model, batch.kv, graph=True)
    batch.decoder.pool = "shared"
    requests = [Request(p, sp, None) for p, sp in zip(prompts, params)]
    with pytest.warns(UserWarning, match="capture of the decode step failed"):
        updates = run(batch, requests, {0: requests[:6], 3: requests[6:9], 7: requests[9:]})
    assert_alone(model, tok, requests, updates, alone)
    assert batch.decoder.runners and not batch.decoder.graphed_sizes()
    assert not any(runner.use_graph for runner in batch.decoder.runners.values())


def test_shared_prefix_matches_a_plain_scan():
    from moeserve.engine.batching import shared_prefix

    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        common, la, lb = (int(x) for x in torch.randint(0, 200, (3,), generator=g))
        base = torch.randint(0, 3, (common,), generator=g).tolist()
        a = base + torch.randint(0, 3, (la,), generator=g).tolist()
        b = base[:int(torch.randint(0, common + 1, (1,), generator=g))] if la % 3 == 0 else \
            base + torch.randint(0, 3, (lb,), generator=g).tolist()
        plain = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert shared_prefix(a, b) == plain == shared_prefix(b, a)
