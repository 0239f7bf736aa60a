"""`moeserve eval ppl`: perplexity of the model, as the placement options place it, on a text file."""

from __future__ import annotations

import json

from moeserve.cli.common import load, prepare, read_text
from moeserve.config import RunConfig
from moeserve.errors import MoeserveError
from moeserve.evaluate import perplexity
from moeserve.spec import ModelSpec
from moeserve.tokenizer import load_tokenizer


def run(args) -> int:
    if args.window < 2 or args.batch_size < 1 or args.max_tokens < 0:
        raise MoeserveError("--window must be >= 2, --batch-size >= 1 and --max-tokens >= 0")
    config = RunConfig.from_args(args, "eval ppl")  # validated by cli.main
    spec, tok = ModelSpec.from_dir(config.model), load_tokenizer(config.model)
    text_path, text = read_text(args.text, args.model, "--text")
    ids = tok.encode(text)
    run = load(prepare(config, spec, args.batch_size, min(args.window, spec.max_position_embeddings)))
    model = run.model
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    if len(ids) < 2:
        raise MoeserveError(f"{text_path} is too short to evaluate")
    result = perplexity(model, ids, args.window, args.batch_size)
    print(json.dumps({"model": args.model, "text": str(text_path), "tokens": result["tokens"],
                      "window": result["window"], "perplexity": round(result["perplexity"], 4),
                      "bits_per_token": round(result["bits_per_token"], 4),
                      "dtype": str(model.dtype).removeprefix("torch."), "device": model.device.type}))
    return 0
