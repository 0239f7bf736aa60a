"""The CLI: each command works, and every bad input gives one line on stderr and a non-zero exit."""

import json
import math
import subprocess
import sys

import pytest

from moeserve.cli import main


def run_cli(capsys, *argv):
    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_prompt_and_continuation(capsys, byte_model_dir):
    code, out, err = run_cli(capsys, "generate", "--model", byte_model_dir, "Hello", "--max-new-tokens", 8,
                             "--seed", 1, "--ignore-eos")
    assert code == 0 and out.startswith("Hello") and "tokens/s" in err


def test_generate_batch_greedy_is_deterministic(capsys, byte_model_dir):
    args = ("generate", "--model", byte_model_dir, "ab", "cde", "--greedy", "--max-new-tokens", 6)
    first = run_cli(capsys, *args)[1]
    assert first == run_cli(capsys, *args)[1] and first.count("--- [") == 2


def test_info_table_and_json(capsys, byte_model_dir):
    code, out, _ = run_cli(capsys, "info", "--model", byte_model_dir)
    assert code == 0 and "mixtral" in out and "parameters: experts" in out
    code, out, _ = run_cli(capsys, "info", "--model", byte_model_dir, "--json")
    info = json.loads(out)
    assert info["parameters"]["total"] == info["parameters"]["dense"] + info["parameters"]["experts"]


def test_eval_ppl_reports_a_plausible_perplexity(capsys, byte_model_dir):
    code, out, _ = run_cli(capsys, "eval", "ppl", "--model", byte_model_dir, "--window", 32)
    result = json.loads(out)
    assert code == 0 and result["tokens"] > 300
    assert 50 < result["perplexity"] < 1000  # random model over a 258-token vocabulary: near-uniform


def test_eval_ppl_equals_transformers_where_config_names_a_bos_the_tokenizer_never_adds(capsys, tmp_path):
    """Qwen3-MoE's setup: config.json's bos_token_id is <|endoftext|>, its tokenizer adds no BOS, so the text's ids
    are AutoTokenizer's alone. Peaked weights (std 0.3) over text the model sampled: a perplexity far below the
    vocabulary, which one extra BOS (a target, and every window shifted off its sample) moves far past 1e-4."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer

    from hf_models import build_hf_model

    model = build_hf_model("qwen3_moe", seed=7)  # vocabulary 97, bos_token_id 1
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    model.save_pretrained(tmp_path)
    words = ["<unk>", "<|endoftext|>", "<|im_end|>"] + [f"w{i}" for i in range(3, model.config.vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(words[:3])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                "bos_token": None, "eos_token": "<|im_end|>"}))
    # three windows of 32 words, each sampled afresh as `eval ppl --window 32` reads it: without context
    sample = model.generate(torch.randint(3, len(words), (3, 1)), do_sample=True, top_k=0, min_new_tokens=31,
                            max_new_tokens=31, suppress_tokens=[0, 1, 2], eos_token_id=None, pad_token_id=0)
    (tmp_path / "text.txt").write_text(" ".join(words[i] for i in sample.flatten().tolist()))
    ids = AutoTokenizer.from_pretrained(tmp_path)((tmp_path / "text.txt").read_text())["input_ids"]
    assert ids == sample.flatten().tolist()

    code, out, _ = run_cli(capsys, "eval", "ppl", "--model", tmp_path, "--text", tmp_path / "text.txt",
                           "--window", 32, "--device", "cpu")
    result = json.loads(out)
    ppl, tokens = hf_perplexity(model, ids, 32)
    assert code == 0 and result["tokens"] == tokens and ppl < len(words) / 4
    assert result["perplexity"] == pytest.approx(ppl, rel=1e-4)


def hf_perplexity(model, ids: list[int], window: int) -> tuple[float, int]:
    """transformers' perplexity as `eval ppl` computes it: mean next-token NLL over non-overlapping windows, each
    without context."""
    import torch

    nll, count = 0.0, 0
    with torch.no_grad():
        for w in (torch.tensor(ids[s:s + window]) for s in range(0, len(ids) - 1, window)):
            if len(w) > 1:
                logits = model(w[None]).logits[0, :-1].float()  # [S-1, V]
                nll += torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum").item()
                count += len(w) - 1
    return math.exp(nll / count), count


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "{tmp}/missing", "x"], "does not exist"),
    (["generate", "--model", "{tmp}", "x"], "no config.json"),
    (["generate", "--model", "{model}", "--top-p", "0", "x"], "top_p"),
    (["generate", "--model", "{model}", "--temperature", "-1", "x"], "temperature"),
    (["generate", "--model", "{model}", "--max-new-tokens", "0", "x"], "max_new_tokens"),
    (["generate", "--model", "{model}", "--dtype", "int3", "x"], "unknown dtype"),
    (["generate", "--model", "{model}", "--device", "tpu", "x"], "device"),
    (["generate", "--model", "{model}", "x" * 100], "context"),
    (["eval", "ppl", "--model", "{model}", "--text", "{tmp}/none.txt"], "not found"),
])
def test_bad_input_gives_one_line_error(capsys, tmp_path, byte_model_dir, argv, message):
    argv = [a.format(tmp=tmp_path, model=byte_model_dir) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip() and "loading weights" not in line]
    assert len(lines) == 1 and lines[0].startswith("moeserve: error:") and message in lines[0]
    assert "Traceback" not in err and out == ""


def test_subprocess_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moeserve", "info", "--model", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "does not exist" in proc.stderr


def test_help_everywhere():
    for argv in (["--help"], ["generate", "--help"], ["info", "--help"], ["eval", "ppl", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0


def test_generate_help_names_the_default_prompt_for_every_model(capsys):
    """The default prompt is the demo's kind of text and is also what any other --model gets: the help says both."""
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "With no PROMPT the model continues 'HAMLET. To be, or not to be'" in text
    assert "any other --model gets the same default" in text
    assert "(default 'HAMLET. To be, or not to be' for the demo and for any other --model alike)" in text


def test_stop_escapes_as_the_shell_passes_them(capsys):
    """`--stop "\\n\\n"` in a shell passes backslash-n twice: it must stop at a blank line, not never."""
    code, out, _ = run_cli(capsys, "generate", "ROMEO.", "--greedy", "--stop", r"\n\n", "--no-stream",
                           "--max-new-tokens", 300)
    header, text = out.split("\n", 1)
    assert code == 0 and header == "--- [0] (stop)" and "\n\n" not in text
