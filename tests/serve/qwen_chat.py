"""A tiny Qwen3-MoE checkpoint that chats as Qwen3 does: a byte-level BPE tokenizer with Qwen's chat tokens
(<|im_start|>, <|im_end|> the EOS; <tool_call>, </tool_call>, <think>, </think> as plain added tokens) and a chat
template of our own writing, built as the published Qwen3 template is: tools listed in the system turn inside
<tools></tools> with the Hermes call format, assistant turns with their thinking and <tool_call> blocks, tool
results as <tool_response> blocks in a user turn, and a generation prompt that opens a thinking section unless
enable_thinking is false (then an empty one is written)."""

import json
import random
from pathlib import Path

from hf_models import build_hf_model, random_words, save_tokenizer

QWEN3_LIKE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    " '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    " '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
EOS = 4  # <|im_end|> (hf_models.TOKENIZER_SPECIALS)


def save_qwen_chat_model(path: Path, seed: int = 0) -> Path:
    """The checkpoint: tokenizer.json, tokenizer_config.json, chat_template.jinja, config.json and weights."""
    from tokenizers import AddedToken, Tokenizer

    rng = random.Random(seed)
    text = random_words(rng, 400) + ' {"name": "x", "arguments": {"city": "Paris", "days": 3}} [1, 2.5, true]'
    save_tokenizer(path, text, tokenizer_config={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(QWEN3_LIKE)
    vocab = (tok.get_vocab_size() + 15) // 16 * 16
    model = build_hf_model("qwen3_moe", seed=seed, vocab_size=vocab, max_position_embeddings=2048,
                           bos_token_id=None, eos_token_id=EOS, pad_token_id=2)
    model.save_pretrained(path)
    return path


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city over some days.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "days", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10},
                                                    "top": {"type": "boolean"}},
                   "required": ["query", "top"], "additionalProperties": False}}}


def dumps(x) -> str:
    return json.dumps(x, ensure_ascii=False)
