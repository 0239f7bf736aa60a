"""Chat templates rendered as transformers renders them: the checkpoint's own, with its special tokens."""

import json

import pytest

from moeserve.errors import MoeserveError
from moeserve.serve.chat_template import FALLBACK, ChatTemplate, TemplateError
from moeserve.tokenizer import ByteTokenizer, load_tokenizer

MISTRAL_LIKE = (  # the shape of Mistral's template: alternation enforced with raise_exception, BOS written by it
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"}]


def write_config(path, **entries):
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>",
                                                            **entries}))


def test_checkpoint_template_with_special_tokens_and_raise_exception(tmp_path):
    write_config(tmp_path, chat_template=MISTRAL_LIKE)
    t = ChatTemplate.from_dir(tmp_path)
    assert not t.fallback and t.origin.endswith("tokenizer_config.json")
    assert t.render(MESSAGES) == "<s>[INST] hi [/INST]yo</s>[INST] ok [/INST]"
    with pytest.raises(TemplateError, match="must alternate"):
        t.render(MESSAGES[1:])


def test_template_sources_in_transformers_order(tmp_path):
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert ChatTemplate.from_dir(tmp_path).render(MESSAGES) == "D"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert ChatTemplate.from_dir(tmp_path).render(MESSAGES) == "J"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | tojson }}{{ add_generation_prompt }}")
    assert ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "<é>"}]) == '"<é>"True'


def test_fallback_and_bad_templates(tmp_path):
    t = ChatTemplate.from_dir(tmp_path)
    assert t.fallback and t.template is not None and FALLBACK
    assert t.render(MESSAGES[:1]) == "User.\nhi\n\nAssistant.\n"
    assert t.encode(MESSAGES[:1], ByteTokenizer()) == [256, *b"User.\nhi\n\nAssistant.\n"]  # the fallback adds BOS
    write_config(tmp_path, chat_template="{% for %}")
    with pytest.raises(MoeserveError, match="cannot read the chat template"):
        ChatTemplate.from_dir(tmp_path)


def test_hf_tokenizer_reads_the_templates_special_tokens(tmp_path):
    """The rendered text holds `<s>` as text: the tokenizer maps it to the BOS id, and its post-processor adds no
    second BOS; the ids are transformers' apply_chat_template's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "hi", "yo", "ok"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.add_tokens(["[INST]", "[/INST]"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "bos_token_id": 1}))
    write_config(tmp_path, chat_template=MISTRAL_LIKE, bos_token="<s>")  # transformers reads a dict as AddedToken's
    ids = ChatTemplate.from_dir(tmp_path).encode(MESSAGES, load_tokenizer(tmp_path))
    assert ids == [1, 3, 5, 4, 6, 2, 3, 7, 4]
    assert ids == AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(MESSAGES, return_dict=False)
