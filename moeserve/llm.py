"""`moeserve.LLM`: the command line's run path from Python, with the same placements.

    llm = moeserve.LLM("Qwen3-30B-A3B", gpu_memory="24GiB")        # the planner chooses where the experts live
    llm = moeserve.LLM("gpt-oss-20b", n_cpu_moe=12)                 # or say it, as with --n-cpu-moe 12
    out = llm.generate(["Hello"], SamplingParams(max_new_tokens=32))
    for text in llm.stream("Once upon a time"): print(text, end="")
    answer = llm.chat([{"role": "user", "content": "Hi"}])

Every keyword is a command-line option's name with underscores (`cpu_moe` is --cpu-moe, `high_slots`
--high-slots, `tp` --tp); a run that cannot work raises MoeserveError with the command line's message before any
weight is read. max_batch and context size the KV cache the planner budgets for (as serve's --parallel and
--ctx-size); generate takes any number of prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields

from moeserve import runtime
from moeserve.build import build
from moeserve.config import CacheConfig, HybridConfig, ParallelConfig, RunConfig
from moeserve.demo import DEMO_MODEL
from moeserve.engine.generate import iterate
from moeserve.engine.params import SamplingParams
from moeserve.engine.sequence import Generation
from moeserve.errors import MoeserveError
from moeserve.spec import ModelSpec
from moeserve.tokenizer import has_tokenizer, load_tokenizer

DEFAULT_CONTEXT = 4096  # tokens per sequence the plan budgets for unless the model's context is shorter
PARTS = (ParallelConfig, CacheConfig, HybridConfig)  # the RunConfig parts keyword arguments may set


def run_config(model: str, **options) -> RunConfig:
    """A RunConfig from keyword arguments: RunConfig's own fields, or a field of one of its parts."""
    top = {f.name for f in fields(RunConfig)} - {"parallel", "cache", "hybrid", "command"}
    parts = {kind: {} for kind in PARTS}
    given = {}
    for key, value in options.items():
        kind = next((k for k in PARTS if key in {f.name for f in fields(k)}), None)
        if key in top:
            given[key] = value
        elif kind is not None:
            parts[kind][key] = value
        else:
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}")
    return RunConfig(model=model, parallel=ParallelConfig(**parts[ParallelConfig]),
                     cache=CacheConfig(**parts[CacheConfig]), hybrid=HybridConfig(**parts[HybridConfig]),
                     command="generate", **given)


class LLM:
    """A model loaded as the options place it, ready to generate (one process; under torchrun with tp/ep, one
    rank's part: every rank must make the same calls)."""

    def __init__(self, model: str = DEMO_MODEL, *, max_batch: int = 8, context: int | None = None,
                 progress: bool = False, **options):
        config = run_config(str(model), **options)
        self.tokenizer = load_tokenizer(config.model) if has_tokenizer(config.model) else None  # ids only
        spec = ModelSpec.from_dir(config.model)
        context = min(spec.max_position_embeddings, context or DEFAULT_CONTEXT)
        self.plan = runtime.prepare(config, spec, max_batch, context)
        self.runtime = build(self.plan, progress=progress)
        self.model = self.runtime.model

    @property
    def placement(self) -> str:
        """Where the experts live, in a few words (as `moeserve bench` names it)."""
        return self.runtime.placement_name()

    def _steps(self, prompts: list[str | list[int]], sampling: SamplingParams | None, on_text=None):
        sampling = sampling or SamplingParams()
        if sampling.seed is None and self.runtime.seed is not None:  # ranks must sample alike
            sampling = SamplingParams(**{**vars(sampling), "seed": self.runtime.seed})
        if self.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise MoeserveError(f"{self.plan.config.model} has no tokenizer: give prompts as lists of token ids")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return iterate(self.model, ids, sampling, tokenizer=self.tokenizer, on_text=on_text,
                       cuda_graph=self.plan.config.cuda_graph)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling: SamplingParams | None = None) -> list[Generation]:
        """Every prompt (text, or token ids) to completion, decoded together; one Generation each (token_ids,
        text, finish_reason)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        results = []
        for results, _ in self._steps(prompts, sampling):
            pass
        return results

    def stream(self, prompt: str, sampling: SamplingParams | None = None) -> Iterator[str]:
        """The completion of one prompt as text pieces, each as soon as it is final."""
        pieces: list[str] = []
        for _ in self._steps([prompt], sampling, on_text=lambda _, text: pieces.append(text)):
            yield from pieces
            pieces.clear()
        yield from pieces

    def chat(self, messages: list[dict], sampling: SamplingParams | None = None) -> Generation:
        """The assistant's answer to `messages` ({"role", "content"} dicts), rendered with the checkpoint's chat
        template (as `moeserve serve` renders /v1/chat/completions)."""
        if self.tokenizer is None:
            raise MoeserveError(f"{self.plan.config.model} has no tokenizer to render a chat with")
        try:
            from moeserve.serve.chat_template import ChatTemplate  # needs jinja2 (the serve extra)
        except ImportError:
            raise MoeserveError("LLM.chat needs jinja2: pip install 'moeserve[serve]'") from None
        ids = ChatTemplate.from_dir(self.plan.config.model).encode(messages, self.tokenizer)
        return self.generate([ids], sampling)[0]
