"""`moeserve chat` (stdin-driven, as a user types) and `generate --chat`: the checkpoint's template, the
conversation kept across turns, /reset and /exit, the oldest turns dropped when the context is full."""

import io
import json
import shutil

import pytest
import torch

import moeserve
from moeserve.cli import main
from moeserve.cli.chat import fit
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.serve.chat_template import ChatTemplate
from moeserve.tokenizer import load_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(params=["fallback", "chatml"])
def chat_model(request, byte_model_dir, tmp_path):
    """The byte model with no template (the plain speaker layout) or with a ChatML-style one; a context of 512 (its
    random weights read any position) so that the conversations below fit whole."""
    shutil.copytree(byte_model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    if request.param == "chatml":
        (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return tmp_path / "m"


def answers(model, conversations: list[list[dict]]) -> list[str]:
    """Each conversation's greedy answer (8 tokens) through the template, as the command should give it."""
    template, tok = ChatTemplate.from_dir(model), load_tokenizer(model)
    m = moeserve.load_model(model, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=8)
    return [generate(m, [template.encode(c, tok)], params, tokenizer=tok)[0].text for c in conversations]


def user(text):
    return {"role": "user", "content": text}


def test_chat_keeps_the_conversation_until_reset_and_exit(chat_model, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Speak.\n/reset\n\nSpeak.\nAgain.\n/exit\nnever read\n"))
    assert main(["chat", "--model", str(chat_model), "--greedy", "--max-new-tokens", "8", "--system", "Be brief."]) == 0
    out = capsys.readouterr().out
    system = [{"role": "system", "content": "Be brief."}]
    (first,) = answers(chat_model, [system + [user("Speak.")]])
    (second,) = answers(chat_model, [system + [user("Speak."), {"role": "assistant", "content": first}, user("Again.")]])
    assert out == f"{first}\n{first}\n{second}\n"


@pytest.mark.parametrize("chat_model", ["chatml"], indirect=True)
def test_generate_chat_is_one_turn(chat_model, capsys):
    assert main(["generate", "--chat", "--system", "Be brief.", "--model", str(chat_model), "--greedy",
                 "--max-new-tokens", "8", "Speak."]) == 0
    (want,) = answers(chat_model, [[{"role": "system", "content": "Be brief."}, user("Speak.")]])
    assert capsys.readouterr().out == want + "\n"
    assert main(["generate", "--system", "x", "--model", str(chat_model), "Hi"]) == 2  # --system needs --chat


def test_the_oldest_turns_go_when_the_context_is_full(byte_model_dir):
    template, tok = ChatTemplate.from_dir(byte_model_dir), load_tokenizer(byte_model_dir)
    messages = [{"role": "system", "content": "S"}, user("a" * 20), {"role": "assistant", "content": "b" * 20},
                user("c" * 20)]
    whole = len(template.encode(messages, tok))
    assert fit(template, tok, list(messages), 1, whole) == template.encode(messages, tok)
    kept = list(messages)
    ids = fit(template, tok, kept, 1, whole - 1)  # the first exchange goes, the system message stays
    assert kept == [messages[0], messages[3]] and ids == template.encode(kept, tok)
    assert fit(template, tok, [messages[0], user("d" * 500)], 1, 100) is None  # the last message alone is too long
