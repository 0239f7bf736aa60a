"""HF tokenizers encode as transformers' AutoTokenizer does: the special tokens come from the tokenizer (its
post-processor, as transformers applies it), never from config.json's bos_token_id."""

import random

import pytest
from tokenizers import processors

from hf_models import random_words, save_tokenizer
from moeserve.tokenizer import ByteTokenizer, load_tokenizer

BOS, EOS, ENDOFTEXT = 0, 1, 2  # ids of <s>, </s>, <|endoftext|> in save_tokenizer's tokenizers
LLAMA_CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": None}


def bos_template():
    return processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])


def bos_eos_template():
    return processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> $B </s>",
                                         special_tokens=[("<s>", BOS), ("</s>", EOS)])


def eos_template():
    return processors.TemplateProcessing(single="$A <|endoftext|>", pair="$A $B <|endoftext|>",
                                         special_tokens=[("<|endoftext|>", ENDOFTEXT)])


# family setup -> (post-processor, tokenizer_config.json, config.json, (ids before the text, ids after it))
SETUPS = {
    "mixtral: BOS template, add_bos_token true": (
        bos_template, dict(LLAMA_CONFIG, tokenizer_class="LlamaTokenizer", add_bos_token=True, add_eos_token=False),
        dict(model_type="mixtral", bos_token_id=BOS), ([BOS], [])),
    "deepseek: BOS template, add_bos_token false (the template decides)": (
        bos_template, dict(LLAMA_CONFIG, tokenizer_class="LlamaTokenizerFast", add_bos_token=False),
        dict(model_type="deepseek_v3", bos_token_id=BOS), ([BOS], [])),
    "qwen: byte-level post-processor, config.json names a BOS": (
        lambda: processors.ByteLevel(trim_offsets=False),
        {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>"},
        dict(model_type="qwen3_moe", bos_token_id=ENDOFTEXT), ([], [])),
    "qwen: no tokenizer_class": (
        lambda: processors.ByteLevel(trim_offsets=False), {"bos_token": None, "eos_token": "<|endoftext|>"},
        dict(model_type="qwen2_moe", bos_token_id=ENDOFTEXT), ([], [])),
    "gpt-oss: no post-processor, add_bos_token true": (
        lambda: None, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "add_bos_token": True},
        dict(model_type="gpt_oss", bos_token_id=BOS), ([], [])),
    "olmoe: GPT-NeoX class over an EOS template": (
        eos_template, {"tokenizer_class": "GPTNeoXTokenizer", "eos_token": "<|endoftext|>", "add_eos_token": False},
        dict(model_type="olmoe", bos_token_id=None), ([], [])),
    "olmoe: no tokenizer_class": (
        eos_template, {"eos_token": "<|endoftext|>"}, dict(model_type="olmoe"), ([], [])),
    "granite: BOS and EOS template": (
        bos_eos_template, dict(LLAMA_CONFIG, tokenizer_class="GPT2Tokenizer"),
        dict(model_type="granitemoe", bos_token_id=BOS), ([BOS], [EOS])),
}


@pytest.mark.parametrize("setup", SETUPS)
def test_encode_matches_transformers_auto_tokenizer(setup, tmp_path):
    from transformers import AutoTokenizer

    post_processor, tokenizer_config, config, (before, after) = SETUPS[setup]
    rng = random.Random(setup)
    path = save_tokenizer(tmp_path, random_words(rng, 60), post_processor(), tokenizer_config, **config)
    text = random_words(rng, 12)
    ours, hf = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    plain = hf(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text) == hf(text)["input_ids"] == before + plain + after
    assert ours.encode(text, add_special_tokens=False) == plain


def test_saved_truncation_is_off_as_in_transformers(tmp_path):
    from transformers import AutoTokenizer

    rng = random.Random(1)
    path = save_tokenizer(tmp_path, random_words(rng, 60), bos_template(), LLAMA_CONFIG, truncation=4,
                          model_type="mixtral")
    text = random_words(rng, 12)
    ids = load_tokenizer(path).encode(text)
    assert ids == AutoTokenizer.from_pretrained(path)(text)["input_ids"] and len(ids) > 4


def test_byte_tokenizer_keeps_its_bos():
    assert ByteTokenizer().encode("hé") == [256, *"hé".encode()]
    assert ByteTokenizer().encode("hé", add_special_tokens=False) == list("hé".encode())
