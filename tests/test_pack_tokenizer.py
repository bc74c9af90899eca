"""The shared tokenizer facts: special tokens and bytes per token."""

import pytest

from lmfoundry.data.tokenizer import train_bpe
from lmfoundry.model.tokenizer import EOS, eos_id, token_byte_lengths

TEXT = ["naïve café — 東京 ✓ emoji 🙂", "def f(x):\n    return x\n"] * 30


def test_token_byte_lengths_sum_to_the_utf8_length_of_any_text():
    tok = train_bpe(TEXT, vocab_size=300)
    lengths = token_byte_lengths(tok)
    for text in TEXT[:2] + ["unseen: Ωμέγα ß"]:
        ids = tok.encode(text).ids
        assert sum(lengths[i] for i in ids) == len(text.encode("utf-8"))
    assert lengths[eos_id(tok)] == 0 and tok.id_to_token(eos_id(tok)) == EOS


def test_vocab_too_small_for_byte_level_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 259"):
        train_bpe(TEXT, vocab_size=100)
