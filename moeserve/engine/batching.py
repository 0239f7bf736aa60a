"""Continuous batching: requests join and leave the running batch between decode steps (Orca, vLLM, llama-server).

`ContinuousBatch` owns a model, a SlotKVCache of `slots` rows of `context` tokens and a SlotDecoder. One caller
(one thread) queues requests with add(), drops them with cancel() and calls step(). A step decodes one token for
every running request, then prefills one chunk of the requests that hold a row but have not read their whole
prompt (left-padded rows of at most `prefill_tokens` token slots in all), so running streams keep flowing while
new prompts are read. A request that finishes or is cancelled frees its row at once; the next waiting request
(first come, first served) takes it.

Prefix reuse: a row keeps the KV of the tokens it read after its request ends. A request takes the free row whose
tokens share the longest prefix with its prompt (else the row free the longest), and before each prefill pass a
prompt's next tokens are copied from any row that holds them (another request's, running or done: a shared system
prompt, earlier turns, the other choices of an `n > 1` request) instead of computed: a device copy of those columns
(KVCache rows are the model's own entries, so every placement and CUDA graphs keep working). A request whose prompt
shares at least PREFIX_MIN tokens beyond its own with a prompt still being read waits for that read rather than
repeat it. At least the prompt's last token is always computed (its logits start the output). `Request.reused` counts
the prompt tokens that were not computed. With prefix_reuse off every prompt is computed whole (a baseline for
bench/prefix_cache.py).

Each request samples with its own SamplingParams and generator (a seed gives the tokens `generate` gives that
prompt alone), ends on its own EOS, stop strings and limits, and reports every token through `on_update`. The work
of one request in a step (drawing its token, its logprobs, detokenizing, stop checks, its update) that raises fails
that request alone: it ends with finish reason "error" and the exception. A forward pass that raises is shared by
its rows: step() raises, and the caller drops the requests (drop_active).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moeserve.engine.constraints import TokenConstraint, constrain
from moeserve.engine.cuda_graph import SlotDecoder, padded_sizes
from moeserve.engine.params import SamplingParams
from moeserve.engine.sampling import sample_next
from moeserve.engine.sequence import (Generation, TextStream, append_token, check_request, limit_reason,
                                      token_limits)
from moeserve.model.kv_cache import SlotKVCache

DEFAULT_PREFILL_TOKENS = 512
PREFIX_MIN = 16  # shared tokens worth waiting for another prompt's read (below: read them alongside)
FAILED = -1  # the token of a request whose sampling raised (under torchrun: what rank 0 sends for it)


@dataclass(frozen=True)
class StepShape:
    """What one step computed: a decode step of `decode` rows, then a prefill pass of `prefill_rows` rows of
    `prefill_width` token slots (0, 0: none)."""

    decode: int = 0
    prefill_rows: int = 0
    prefill_width: int = 0

    def __str__(self) -> str:
        parts = [f"decode {self.decode} rows"] if self.decode else []
        if self.prefill_rows:
            parts.append(f"prefill {self.prefill_rows} x {self.prefill_width} tokens")
        return ", ".join(parts) or "nothing"


@dataclass
class TokenLogprob:
    token: int
    logprob: float  # natural log of the model's probability (before temperature and filters)
    top: list[tuple[int, float]]  # the most likely tokens and their logprobs, best first (top_logprobs of them)


@dataclass
class Update:
    """What one step did for a request: text that became final, the tokens it added (EOS is not added), their
    logprobs (when asked) and, on its last update, why it finished: eos, stop, length, context, or error (its own
    work in the step raised `error`)."""
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    error: Exception | None = None


@dataclass
class WarmUp:
    """What ContinuousBatch.warm_up ran: the decode batch sizes, those that replay CUDA graphs, prefill passes."""
    decode_sizes: list[int]
    graphed_sizes: list[int]
    prefill_passes: int


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to limit."""
    return [1 << i for i in range(max(limit, 1).bit_length())]


def prefill_widths(limit: int) -> list[int]:
    """The token counts up to `limit` whose passes compile every kernel variant a prompt chunk can meet: per power
    of two p, p (a tuned bucket's first count, divisible by 16 from 16), p - 1 (a bucket's last, not divisible) and
    p + p / 2 (mid-bucket and divisible: the next power of two of rows per tile with the bucket's config). Triton
    compiles a kernel per tile shape and per divisibility of its sizes by 16; launch configs go by power-of-two
    token buckets."""
    return sorted({w for p in powers_of_two(limit) for w in (p, p - 1, p + p // 2) if 1 <= w <= limit})


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_update: Callable[[Request, Update], None]
    top_logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the k most likely
    tag: object = None  # the caller's own (the server keeps its job here)
    constraint: TokenConstraint | None = None  # a grammar its tokens must follow (engine/constraints.py)
    gen: Generation = field(init=False)
    stream: TextStream | None = field(init=False, default=None)
    generator: torch.Generator | None = field(init=False, default=None)
    limit: int = field(init=False, default=0)  # tokens it may add (max_new_tokens or what the context leaves)
    slot: int | None = field(init=False, default=None)  # its cache row while it holds one
    cached: int = field(init=False, default=0)  # tokens in its cache row (prompt first, then generated)
    sampled: int = field(init=False, default=0)  # tokens sampled so far (EOS included)
    last_token: int = field(init=False, default=0)  # the token the next decode step feeds
    reused: int = field(init=False, default=0)  # prompt tokens whose KV came from another row or was already in its own

    @property
    def prefilled(self) -> bool:
        return self.cached >= len(self.prompt_ids)

    def held(self) -> list[int]:
        """The tokens whose KV its row holds, in order (the prompt, then the tokens fed back)."""
        return (self.prompt_ids + self.gen.token_ids)[:self.cached]

    def shares(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` its row holds (held() compared without building it)."""
        n = min(shared_prefix(self.prompt_ids, tokens), self.cached)
        if n < len(self.prompt_ids) or n == self.cached:
            return n
        return n + shared_prefix(self.gen.token_ids[:self.cached - n], tokens[n:])


class ContinuousBatch:
    def __init__(self, model, tokenizer, slots: int, context: int, prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                 eos_ids=None, cuda_graph: bool = True, prefix_reuse: bool = True):
        """slots: requests decoded together; context: tokens per request (prompt + output); prefill_tokens: token
        slots (rows x padded chunk length) one prefill pass may compute; cuda_graph: replay decode steps as CUDA
        graphs (one per padded batch size) where the model allows it; prefix_reuse: copy the KV of prompt tokens
        another row holds instead of computing it."""
        self.model, self.tokenizer, self.context, self.prefill_tokens = model, tokenizer, context, prefill_tokens
        self.prefix_reuse = prefix_reuse
        self.eos = set(model.spec.eos_token_ids if eos_ids is None else eos_ids)
        self.kv = SlotKVCache(model.spec, slots, context, model.device, model.dtype)
        self.decoder = SlotDecoder(model, self.kv, graph=cuda_graph and model.device.type == "cuda")
        self.free = list(range(slots))  # free rows, the one free the longest first
        self.kept: list[list[int]] = [[] for _ in range(slots)]  # per free row: the tokens whose KV it still holds
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # holding a row, in order of arrival
        # the tokens a sampling drew -> the tokens to keep (serving under torchrun: rank 0's, serve/mirror.py)
        self.sync_tokens: Callable[[list[int]], list[int]] | None = None
        self.last_step = StepShape()  # what the last step() computed

    @property
    def slots(self) -> int:
        return self.kv.slots

    def warm_up(self, on_cpu: bool = False) -> WarmUp:
        """Run, before any request, the shapes serving will meet, so that no request waits for them: a decode step
        at every padded batch size (captured as a CUDA graph where the decoder uses graphs), a prefill pass of one
        row at each prefill_widths() token count, and one of two rows of one token (the masked one-token attention
        a prompt's last chunk can take). Only on a GPU: a CPU has nothing to compile or capture (on_cpu: run it
        anyway, for tests). The rows written hold no request; a request's prefill overwrites its row from
        position 0."""
        if (self.model.device.type != "cuda" and not on_cpu) or self.active:
            return WarmUp([], [], 0)
        rows = list(range(self.slots))
        with torch.inference_mode():
            sizes = padded_sizes(self.slots)
            for size in sizes:
                self.decoder([0] * size, [0] * size, rows[:size])
            passes = [(1, w) for w in prefill_widths(min(self.prefill_tokens, self.context - 1))]
            passes += [(2, 1)] if self.slots > 1 else []
            for rows_used, width in passes:
                self.kv.use(rows[:rows_used], width)
                tokens = torch.zeros(rows_used, width, dtype=torch.long, device=self.model.device)  # [B, W]
                positions = torch.arange(width, device=self.model.device)[None].expand(rows_used, width)  # [B, W]
                self.model(tokens, positions, kv=self.kv, valid=torch.ones_like(tokens, dtype=torch.bool),
                           last_only=True)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return WarmUp(sizes, self.decoder.graphed_sizes(), len(passes))

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise MoeserveError for a request this batch cannot run (empty, too long, ids outside the vocabulary)."""
        check_request(self.model.spec, [prompt_ids], params, self.tokenizer, context=self.context)

    def add(self, request: Request) -> None:
        """Queue a request (check() it first); it takes a free row at the next step."""
        request.gen = Generation(prompt_ids=list(request.prompt_ids))
        if self.tokenizer is not None:
            request.stream = TextStream(self.tokenizer.decode, request.params.stop)
        if request.params.seed is not None:
            request.generator = torch.Generator().manual_seed(request.params.seed)
        request.limit = token_limits(self.model.spec, [request.prompt_ids], request.params, self.context)[0]
        self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """Drop a request wherever it is (waiting, prefilling or decoding); its row is free for the next step."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.active:
            self._release(request)

    def drop_active(self) -> list[Request]:
        """Release every request holding a row (after a failed step) and return them."""
        dropped = list(self.active)
        for r in dropped:
            self._release(r)
            self.kept[self.free[-1]] = []  # a failed pass may have left its rows half written
        return dropped

    def step(self) -> bool:
        """One decode step for the running requests and one prefill chunk; False when there was nothing to do."""
        while self.free and self.waiting:
            self._admit(self.waiting.popleft())
        decoding = [r for r in self.active if r.prefilled]
        prefilling = [r for r in self.active if not r.prefilled]
        with torch.inference_mode():
            if decoding:
                self.model.before_step()
                logits = self.decoder([r.last_token for r in decoding], [r.cached for r in decoding],
                                      [r.slot for r in decoding])  # [B, V]
                for r in decoding:
                    r.cached += 1
                self._sample(decoding, logits)
            rows, width = self._prefill(prefilling) if prefilling else (0, 0)
        self.last_step = StepShape(len(decoding), rows, width)
        return bool(decoding or prefilling)

    def _admit(self, r: Request) -> None:
        """Give r the free row whose kept tokens share the longest prefix with its prompt (else the one free the
        longest); the shared tokens count as read."""
        shared = [shared_prefix(self.kept[row], r.prompt_ids) if self.prefix_reuse else 0 for row in self.free]
        best = max(range(len(self.free)), key=lambda i: (shared[i], -i))
        r.slot = self.free.pop(best)
        r.cached = r.reused = min(shared[best], len(r.prompt_ids) - 1)
        self.kept[r.slot] = []
        self.active.append(r)

    def _reuse(self, r: Request, reading: list[Request]) -> bool:
        """Copy into r's row the next tokens of its prompt that another row holds (the most of them); False when r
        should wait instead: a prompt in `reading` (still being read, ahead of r) shares PREFIX_MIN more of them."""
        if not self.prefix_reuse:
            return True
        want = len(r.prompt_ids) - 1  # its last token is computed: its logits start the output
        found = [(q.shares(r.prompt_ids), q.slot) for q in self.active if q is not r and q.slot is not None]
        found += [(shared_prefix(self.kept[row], r.prompt_ids), row) for row in self.free]
        best, src = max(found, default=(0, None))
        best = min(best, want)
        if best > r.cached:
            self.kv.copy_columns(src, r.slot, r.cached, best)
            r.reused += best - r.cached
            r.cached = best
        ahead = max((shared_prefix(q.prompt_ids, r.prompt_ids) for q in reading), default=0)
        return min(ahead, want) < r.cached + PREFIX_MIN

    def _prefill(self, requests: list[Request]) -> tuple[int, int]:
        """Read the next chunk of the prompts of `requests` (as many as fit prefill_tokens, the first always; each
        first takes what other rows hold, or waits for a prompt ahead of it that will); those whose prompt is then
        complete sample their first token. -> the pass's (rows, padded width)."""
        chunks: list[tuple[Request, int]] = []
        width = 0
        ready = [r for i, r in enumerate(requests) if self._reuse(r, requests[:i])]
        for r in ready:
            n = min(len(r.prompt_ids) - r.cached, self.prefill_tokens)
            if chunks and (len(chunks) + 1) * max(width, n) > self.prefill_tokens:
                break
            chunks.append((r, n))
            width = max(width, n)
        if not chunks:  # every prompt waits for one ahead of it: nothing to compute this step
            return 0, 0
        tokens = torch.zeros(len(chunks), width, dtype=torch.long)  # [B, W], left-padded
        positions = torch.zeros(len(chunks), width, dtype=torch.long)
        valid = torch.zeros(len(chunks), width, dtype=torch.bool)
        for i, (r, n) in enumerate(chunks):
            tokens[i, width - n:] = torch.tensor(r.prompt_ids[r.cached:r.cached + n])
            positions[i] = r.cached  # pads take the first position: their queries see what it sees
            positions[i, width - n:] = torch.arange(r.cached, r.cached + n)
            valid[i, width - n:] = True
        self.kv.use([r.slot for r, _ in chunks], max(r.cached + n for r, n in chunks))
        device = self.model.device
        logits = self.model(tokens.to(device), positions.to(device), kv=self.kv, valid=valid.to(device),
                            last_only=True)[:, -1]  # [B, V]
        for r, n in chunks:
            r.cached += n
        done = [i for i, (r, _) in enumerate(chunks) if r.prefilled]
        if done:
            self._sample([chunks[i][0] for i in done], logits[done])
        return len(chunks), width

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> None:
        """Each request's next token from its row of logits [B, V], with its own sampling parameters; a request
        whose own part raises (its token, logprobs, text, stop checks, update) fails alone (_fail). Greedy rows
        without logprobs or a grammar take the argmax of the logits as they are (the same token in any float dtype);
        the others read float32 logits."""
        if not all(r.params.greedy and r.top_logprobs is None and r.constraint is None for r in requests):
            logits = logits.float()
        errors: dict[int, Exception] = {}
        tokens = self._draw(requests, logits, errors)
        if self.sync_tokens is not None:  # rank 0's: a request it failed fails on every rank
            tokens = self.sync_tokens(tokens)
        want = [i for i, r in enumerate(requests) if r.top_logprobs is not None]
        logp = dict(zip(want, torch.log_softmax(logits[want], dim=-1).cpu())) if want else {}  # i -> [V]
        for i, r in enumerate(requests):
            try:
                if tokens[i] == FAILED:
                    raise errors.get(i, RuntimeError("this request's sampling failed on rank 0"))
                self._record(r, tokens[i], self._logprob(r, tokens[i], logp.get(i)))
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                self._fail(r, e)

    def _draw(self, requests: list[Request], logits: torch.Tensor, errors: dict[int, Exception]) -> list[int]:
        """The sampled token of each request (greedy rows in one argmax), FAILED where its sampling raised (the
        exception in errors, by index). A request with a constraint draws from the tokens it allows (its row of
        the masked rows), and its constraint accepts the token drawn."""
        tokens = [FAILED] * len(requests)
        bound = [i for i, r in enumerate(requests) if r.constraint is not None]
        masked = constrain(logits, bound, [requests[i].constraint for i in bound], errors) if bound else None
        rows = {i: masked[j:j + 1] for j, i in enumerate(bound)}  # index -> its masked logits [1, V]
        plain = [i for i, r in enumerate(requests) if r.params.greedy and i not in rows]
        held = [j for j, i in enumerate(bound) if requests[i].params.greedy and i not in errors]
        everyone = len(plain) == len(requests)  # no row indexing (a copy) when every row is plain greedy
        for picked, picks in ((plain, logits if everyone else logits[plain]),
                              ([bound[j] for j in held], masked[held] if held else None)):
            if picked:
                for i, t in zip(picked, picks.argmax(-1).tolist()):
                    tokens[i] = t
        for i, r in enumerate(requests):
            if i in errors:
                continue
            try:
                if not r.params.greedy:
                    tokens[i] = int(sample_next(rows.get(i, logits[i:i + 1]), r.params, r.generator))
                if r.constraint is not None:
                    r.constraint.accept(tokens[i])
            except Exception as e:  # noqa: BLE001 - reported by _sample, for this request only
                errors[i], tokens[i] = e, FAILED
        return tokens

    @staticmethod
    def _logprob(r: Request, token: int, logp: torch.Tensor | None) -> TokenLogprob | None:
        """The token's logprob and the request's top_logprobs most likely tokens, from its log-softmax row [V]."""
        if logp is None:
            return None
        top = torch.topk(logp, r.top_logprobs) if r.top_logprobs else None
        return TokenLogprob(token, float(logp[token]),
                            list(zip(top.indices.tolist(), top.values.tolist())) if top else [])

    def _record(self, r: Request, token: int, logprob: TokenLogprob | None) -> None:
        r.sampled += 1
        r.last_token = token
        last = limit_reason(r.params, r.limit) if r.sampled == r.limit else None
        before, texts = len(r.gen.token_ids), []
        append_token(r.gen, r.stream, token, self.eos, r.params, last=last, on_text=lambda _, t: texts.append(t),
                     index=0)
        added = r.gen.token_ids[before:]
        if r.gen.finish_reason is not None:
            self._release(r)
        r.on_update(r, Update("".join(texts), added, [logprob] if logprob and added else [], r.gen.finish_reason))

    def _fail(self, r: Request, error: Exception) -> None:
        """End a request whose own work in a step raised: free its row, report the error as its last update."""
        if r in self.active:
            self._release(r)
        r.on_update(r, Update("", [], [], "error", error))

    def _release(self, r: Request) -> None:
        self.active.remove(r)
        self.free.append(r.slot)
        self.kept[r.slot] = r.held()
        r.slot = None


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two lists share, in time of that count: windows that double in size are compared
    (slice comparisons run in C) until one differs, then that window is halved down to the first difference."""
    n, lo, width = min(len(a), len(b)), 0, 16
    while lo < n and a[lo:lo + width] == b[lo:lo + width]:
        lo, width = lo + width, 2 * width
    if lo >= n:
        return n
    hi = min(n, lo + width)  # a[lo:hi] != b[lo:hi]: the first difference is in there
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo if a[lo] != b[lo] else hi
