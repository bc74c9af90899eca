"""Byte-level BPE tokenizer training with Hugging Face `tokenizers`.

Byte-level means every string round-trips: no unknown token, whatever the language or bytes.
The special tokens are the document separator and the chat-template markers used in serving.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from lmfoundry.model.chat_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from lmfoundry.model.tokenizer import SPECIAL_TOKENS

# A tool call's tags are pre-tokens of their own. A served prompt that forces a tool call ends
# with the opening tag, and the tool-call grammar ends the JSON before the closing tag: a merge
# across either boundary (`>{"`, `"}}</`) would train the model on tokens that serving never
# lets it see or write.
TOOL_CALL_TAGS = pre_tokenizers.Split(
    Regex("|".join(re.escape(tag) for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE))), behavior="isolated"
)


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2, copyable: bool = False) -> Tokenizer:
    """`copyable`: a word is the same tokens wherever it stands. Spaces are tokens of their own (no
    merged " word" tokens) and digits are split one by one (as Llama's and DeepSeek's tokenizers
    split them), so "globex" in a question, in a SQL string and in an answer, or 17 in "order 17"
    and in "id=17", are the same ids: a small model can copy them. It costs more tokens per text."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
            f"{256 + len(SPECIAL_TOKENS)} (256 bytes and the special tokens)"
        )
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if copyable:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                TOOL_CALL_TAGS,
                pre_tokenizers.Split(" ", behavior="isolated"),
                pre_tokenizers.Digits(individual_digits=True),
                byte_level,
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([TOOL_CALL_TAGS, byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_nonempty(texts), trainer=trainer)
    return tok


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    for t in texts:
        if t:
            yield t
