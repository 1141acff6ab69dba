"""Tiny HF models and a character-level HF tokenizer, built locally (no downloaded weights), for the CPU
`*_tiny` tasks: `build_tokenizer()` (one token per character) and `build_model(tokenizer)` (a randomly
initialised `Qwen2ForCausalLM`) round-trip through `save_pretrained` / `AutoTokenizer` /
`AutoModelForCausalLM`, so the rest of the stack treats them like a downloaded model.

Why a `Qwen2Tokenizer`: for a `model_type: qwen2` checkpoint, transformers 5 `AutoTokenizer` always builds
`Qwen2Tokenizer`'s byte-level BPE from the saved vocab and merges, ignoring any other tokenizer.json
pipeline; so this is that pipeline with **no merges**, over the byte-level symbol of each `CHARSET` character.

Qwen's conventions, which the trainer relies on: `tokenizer(text)` adds no special tokens (so prompt,
response and tool text encode piecewise); `<|eos|>` ends a response, `<|pad|>` pads, padding is on the
left; characters outside `CHARSET` are dropped (all task text is within it: tests/experiments/test_pretrain.py).
"""

from __future__ import annotations

import string

import torch
from tokenizers import pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order

# Digits, letters, ASCII punctuation (covers + - = , \ { } < > / ? . and the Search-R1 tags),
# space and newline: enough for math_tiny and search_tiny. Order fixes the vocabulary ids.
CHARSET = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_tokenizer(charset: str = CHARSET) -> PreTrainedTokenizerFast:
    """A character-level HF fast tokenizer over `charset`: specials get ids 0..3, then the byte-level symbol of
    each distinct character in `charset` order, so the same charset always gives the same ids."""
    if not charset:
        raise ValueError("charset must be a non-empty string of characters")
    to_bytelevel = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(charset):  # distinct, order-preserving
        for symbol in "".join(piece for piece, _ in to_bytelevel.pre_tokenize_str(ch)):
            vocab.setdefault(symbol, len(vocab))  # a non-ASCII char adds one symbol per byte
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    intermediate: int | None = None,
    max_positions: int = 1024,
    tie_embeddings: bool = True,
    seed: int | None = None,
) -> Qwen2ForCausalLM:
    """A randomly initialised `Qwen2ForCausalLM` sized for CPU (~0.4M parameters by default); `seed` seeds the
    initialisation without touching the global torch RNG."""
    for name, value in (("hidden", hidden), ("layers", layers), ("heads", heads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if seed is None:
        return Qwen2ForCausalLM(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)
