"""What every stage needs to know about the model's tokenizer: its special tokens and how many
bytes of text each token stands for. (Training it is curation's job: data/tokenizer.py.)"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, pre_tokenizers

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]


def eos_id(tok: Tokenizer) -> int:
    token_id = tok.token_to_id(EOS)
    if token_id is None:
        raise ValueError(f"tokenizer has no {EOS} token; it was not trained by lmfoundry")
    return token_id


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """Bytes of UTF-8 text behind each token id (0 for special tokens). In a byte-level BPE every
    character of a token's string stands for exactly one byte."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    special = set(SPECIAL_TOKENS)
    lengths = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    for token, token_id in tok.get_vocab().items():
        if token in special:
            continue
        if not set(token) <= alphabet:
            raise ValueError(f"token {token!r} is not byte-level; bits per byte needs a byte-level BPE")
        lengths[token_id] = len(token)
    return lengths
