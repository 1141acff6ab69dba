"""Tiny HF models and a character-level HF tokenizer, built locally (no downloaded weights).

Used by the CPU `*_tiny` tasks: `build_tokenizer()` gives a real HF fast tokenizer with one token
per character and `build_model(tokenizer)` a randomly initialised `Qwen2ForCausalLM`. Both
round-trip through `save_pretrained` / `from_pretrained` (and `AutoTokenizer` /
`AutoModelForCausalLM`), so the rest of the stack treats them like a downloaded model.

Why the tokenizer is a `Qwen2Tokenizer`: for a checkpoint whose config says `model_type: qwen2`,
transformers 5 `AutoTokenizer` always instantiates `Qwen2Tokenizer` and rebuilds its byte-level
BPE pipeline from the saved vocab and merges, ignoring any other pipeline in tokenizer.json. We
therefore build exactly that pipeline: byte-level BPE with **no merges**, whose vocabulary holds
the byte-level symbol of each character of `CHARSET`. Every character is one token, and loading
through `AutoTokenizer` gives the identical tokenizer.

Conventions the trainer relies on (they are Qwen's):
- no special tokens are added by `tokenizer(text)` (no BOS), so prompt, response and injected tool
  text can be encoded piecewise and concatenated;
- `<|eos|>` ends a response (the SFT warm start appends it; generation stops on it);
  `<|pad|>` pads; `padding_side` defaults to "left" (generation);
- characters outside `CHARSET` have no token and are dropped (no unk in Qwen2's BPE): all task
  text is ASCII within `CHARSET` (tested in tests/experiments/test_pretrain.py).
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
    """A character-level HF fast tokenizer over `charset` (+ pad/bos/eos/unk specials).

    Vocabulary: specials get ids 0..3, then the byte-level symbol of each distinct character in
    `charset` order (space is "\u0120", newline "\u010a", as in GPT-2/Qwen), so the same charset
    always gives the same ids. `decode(encode(s)) == s` for any `s` over the charset.
    """
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
    """A randomly initialised `Qwen2ForCausalLM` sized for CPU (~0.4M parameters by default).

    `intermediate` defaults to 4 * hidden. `seed`, when given, seeds the initialisation with a
    local generator state (the global torch RNG is restored afterwards).
    """
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
