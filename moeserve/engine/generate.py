"""`generate`: prompts run to completion on the engine loop that serves requests (engine/batching.ContinuousBatch),
with streaming and stop rules.

The prompts join one ContinuousBatch of as many rows as prompts. Its first step reads every prompt in one
left-padded pass and samples each first token; each later step decodes one token for every running sequence (on a
GPU one CUDA graph per padded batch size, cut at the layers whose experts read the routing on the host). A sequence
that finishes leaves the batch. Positions count a sequence's own tokens, so each gets exactly the tokens it would get
alone; with a seed, each prompt samples from its own generator seeded with it (the tokens it gets alone, or as a
server request with that seed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from moeserve.engine.batching import ContinuousBatch, Request, Update
from moeserve.engine.params import SamplingParams
from moeserve.engine.sequence import Generation, check_request, token_limits


def generate(model, prompts: list[list[int]], params: SamplingParams, tokenizer=None, eos_ids=None,
             on_text: Callable[[int, str], None] | None = None, cuda_graph: bool = True) -> list[Generation]:
    """Run to completion; `on_text(seq_index, new_text)` streams text as it becomes final.

    cuda_graph: replay decode steps as CUDA graphs where the model allows it (see engine/cuda_graph.py)."""
    results = None
    for results, _ in iterate(model, prompts, params, tokenizer, eos_ids, on_text, cuda_graph):
        pass
    return results


def iterate(model, prompts: list[list[int]], params: SamplingParams, tokenizer=None, eos_ids=None,
            on_text: Callable[[int, str], None] | None = None,
            cuda_graph: bool = True) -> Iterator[tuple[list[Generation], list[int | None]]]:
    """Check the request now (errors before any output), then yield per step (generations, the token each sequence
    added in it, None where none: finished, or its EOS)."""
    check_request(model.spec, prompts, params, tokenizer)
    return _steps(model, prompts, params, tokenizer, eos_ids, on_text, cuda_graph)


def _steps(model, prompts, params, tokenizer, eos_ids, on_text, cuda_graph):
    limits = token_limits(model.spec, prompts, params)
    batch = ContinuousBatch(model, tokenizer, slots=len(prompts),
                            context=max(len(p) + n for p, n in zip(prompts, limits)),
                            prefill_tokens=len(prompts) * max(map(len, prompts)), eos_ids=eos_ids,
                            cuda_graph=cuda_graph)
    added: list[int | None] = [None] * len(prompts)
    failed: list[Exception] = []

    def on_update(request: Request, update: Update) -> None:
        index = request.tag
        added[index] = update.token_ids[-1] if update.token_ids else None
        if update.error is not None:
            failed.append(update.error)
        elif on_text is not None and update.text:
            on_text(index, update.text)

    requests = [Request(p, params, on_update, tag=i) for i, p in enumerate(prompts)]
    for r in requests:
        batch.add(r)
    gens = [r.gen for r in requests]
    while batch.step():
        if failed:  # a sequence's own work raised (e.g. on_text): generate has no other request to keep serving
            batch.drop_active()
            raise failed[0]
        yield gens, list(added)
        added[:] = [None] * len(prompts)
