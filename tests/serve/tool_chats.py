"""Tiny random checkpoints of the DeepSeek-V3, GLM-4.5, Llama-4 and GPT-OSS families that chat as their families do:
a byte-level BPE tokenizer with the family's chat and tool-call tokens and a chat template of our own writing,
built as the family's published template is (system, user, assistant turns with their calls, tool results, the
tools shown). GLM-4.5's and GPT-OSS's markers are special tokens, as in their published tokenizers (serve shows
them: HFTokenizer.show)."""

import random
from pathlib import Path

from hf_models import build_hf_model, random_words, save_tokenizer

DEEPSEEK_V3_LIKE = r"""
{%- set ns = namespace(system='') %}
{%- for m in messages if m.role == 'system' %}{%- set ns.system = ns.system + m.content %}{%- endfor %}
{{- '<｜begin▁of▁sentence｜>' + ns.system }}
{%- if tools %}
{{- '\n\n## Tools\nYou have access to the following tools:\n' }}
{%- for tool in tools %}
{{- '\n### ' + tool.function.name + '\nDescription: ' + (tool.function.description or '') + '\n\nParameters: ' + (tool.function.parameters | tojson) + '\n' }}
{%- endfor %}
{{- '\nCall them as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}{{- '<｜User｜>' + m.content }}
{%- elif m.role == 'assistant' and m.content is none %}
{{- '<｜Assistant｜><｜tool▁calls▁begin｜>' }}
{%- for call in m.tool_calls %}
{%- if not loop.first %}{{- '\n' }}{%- endif %}
{{- '<｜tool▁call▁begin｜>' + call.type + '<｜tool▁sep｜>' + call.function.name + '\n```json\n' + call.function.arguments + '\n```<｜tool▁call▁end｜>' }}
{%- endfor %}
{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
{%- elif m.role == 'assistant' %}{{- '<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<｜tool▁outputs▁begin｜>' }}{%- else %}{{- '\n' }}{%- endif %}
{{- '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}
"""

GLM_LIKE = r"""
{{- '[gMASK]<sop>' }}
{%- if tools %}
{{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' }}
{%- for tool in tools %}{{- (tool | tojson) + '\n' }}{%- endfor %}
{{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{{- '<|system|>\n' + m.content }}
{%- elif m.role == 'user' %}{{- '<|user|>\n' + m.content }}
{%- elif m.role == 'assistant' %}
{{- '<|assistant|>\n<think>' + (m.reasoning_content or '') + '</think>' }}
{%- if m.content %}{{- '\n' + m.content }}{%- endif %}
{%- for call in m.tool_calls or [] %}
{{- '\n<tool_call>' + call.function.name + '\n' }}
{%- for k, v in call.function.arguments.items() %}
{{- '<arg_key>' + k + '</arg_key>\n<arg_value>' + (v if v is string else v | tojson) + '</arg_value>\n' }}
{%- endfor %}
{{- '</tool_call>' }}
{%- endfor %}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|observation|>' }}{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '\n<think></think>' }}{%- endif %}
{%- endif %}
"""

LLAMA4_LIKE = r"""
{{- '<|begin_of_text|>' }}
{%- set ns = namespace(shown=false) %}
{%- for m in messages %}
{%- if m.role == 'system' %}{{- '<|header_start|>system<|header_end|>\n\n' + m.content + '<|eot|>' }}
{%- elif m.role == 'user' %}
{{- '<|header_start|>user<|header_end|>\n\n' }}
{%- if tools and not ns.shown %}
{%- set ns.shown = true %}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n' }}
{%- for tool in tools %}{{- (tool | tojson(indent=4)) + '\n\n' }}{%- endfor %}
{%- endif %}
{{- m.content + '<|eot|>' }}
{%- elif m.role == 'assistant' %}
{{- '<|header_start|>assistant<|header_end|>\n\n' }}
{%- if m.tool_calls %}
{%- for call in m.tool_calls %}{{- '{"name": "' + call.function.name + '", "parameters": ' + (call.function.arguments | tojson) + '}' }}{%- endfor %}
{%- else %}{{- m.content }}{%- endif %}
{{- '<|eot|>' }}
{%- elif m.role == 'tool' %}{{- '<|header_start|>ipython<|header_end|>\n\n' + m.content + '<|eot|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|header_start|>assistant<|header_end|>\n\n' }}{%- endif %}
"""

HARMONY_LIKE = r"""
{{- '<|start|>system<|message|>You are a tiny model.\nReasoning: low\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif %}
{{- '<|end|>' }}
{%- set ns = namespace(developer='', call='') %}
{%- if messages[0].role in ('system', 'developer') %}{%- set ns.developer = messages[0].content %}{%- endif %}
{%- if ns.developer or tools %}
{{- '<|start|>developer<|message|>' }}
{%- if ns.developer %}{{- '# Instructions\n\n' + ns.developer + '\n\n' }}{%- endif %}
{%- if tools %}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' }}
{%- for tool in tools %}
{{- '// ' + (tool.function.description or '') + '\ntype ' + tool.function.name + ' = (_: ' + (tool.function.parameters | tojson) + ') => any;\n\n' }}
{%- endfor %}
{{- '} // namespace functions' }}
{%- endif %}
{{- '<|end|>' }}
{%- endif %}
{%- for m in messages if m.role not in ('system', 'developer') %}
{%- if m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}
{%- elif m.role == 'assistant' and m.tool_calls %}
{%- set ns.call = m.tool_calls[0].function.name %}
{{- '<|start|>assistant to=functions.' + ns.call + '<|channel|>commentary json<|message|>' + (m.tool_calls[0].function.arguments | tojson) + '<|call|>' }}
{%- elif m.role == 'assistant' %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}
{%- elif m.role == 'tool' %}{{- '<|start|>functions.' + ns.call + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""


# family -> (hf_models family, template, plain added tokens, special added tokens, EOS tokens)
FAMILIES = {
    "deepseek_v3": ("deepseek_v3", DEEPSEEK_V3_LIKE,
                    ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                     "<｜tool▁output▁end｜>"],
                    ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
                    ["<｜end▁of▁sentence｜>"]),
    "glm4_moe": ("glm4_moe", GLM_LIKE, [],
                 ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
                  "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                  "<tool_response>", "</tool_response>"],
                 ["<|user|>", "<|observation|>"]),
    "llama4": ("llama4", LLAMA4_LIKE, [],
               ["<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>", "<|python_start|>",
                "<|python_end|>"],
               ["<|eot|>", "<|eom|>"]),
    "gpt_oss": ("gpt_oss", HARMONY_LIKE, [],
                ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>"],
                ["<|return|>", "<|call|>"]),
}


def save_family_chat_model(family: str, path: Path, seed: int = 0) -> Path:
    """The checkpoint of `family` (a FAMILIES key): tokenizer.json, tokenizer_config.json, chat_template.jinja,
    config.json and weights."""
    from tokenizers import AddedToken, Tokenizer

    hf_family, template, plain, special, eos = FAMILIES[family]
    rng = random.Random(seed)
    text = random_words(rng, 400) + ' {"name": "x", "parameters": {"city": "Paris", "days": 3}} [1, 2.5, true]'
    save_tokenizer(path, text, tokenizer_config={"eos_token": eos[0]})
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(template.strip())
    vocab = (tok.get_vocab_size() + 15) // 16 * 16
    eos_ids = [tok.token_to_id(t) for t in eos]
    model = build_hf_model(hf_family, seed=seed, vocab_size=vocab, max_position_embeddings=2048, bos_token_id=None,
                           eos_token_id=eos_ids, pad_token_id=2)
    model.save_pretrained(path)
    return path
