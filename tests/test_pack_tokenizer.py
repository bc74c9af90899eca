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


def test_a_copyable_tokenizer_gives_a_word_or_number_the_same_ids_wherever_it_stands():
    """Spaces and digits are tokens of their own: the name in a question, a SQL string and an
    answer, or an order number after a space and after '=', are the same ids; text still round-trips."""
    texts = ["What did globex spend? customer='globex' globex spent 1075.25 order 17 id=17"] * 40 + TEXT
    tok = train_bpe(texts, vocab_size=400, copyable=True)
    ids = lambda s: tok.encode(s).ids  # noqa: E731
    for word in ("globex", "1075.25", "17"):
        alone = ids(word)
        for context in (f"What did {word} spend?", f"customer='{word}'", f'"{word} spent"', f"id={word}"):
            whole = ids(context)
            assert any(whole[i : i + len(alone)] == alone for i in range(len(whole))), (word, context)
    assert all(len(tok.id_to_token(i)) == 1 for i in ids("1075"))
    for text in TEXT[:2] + ["unseen:  Ωμέγα\tß 0042"]:
        assert tok.decode(ids(text)) == text


@pytest.mark.parametrize("copyable", [False, True])
def test_a_served_prompt_that_forces_a_tool_call_starts_the_trained_conversations_tokens(copyable):
    """Serving renders the conversation so far and appends the opening tag, then the grammar
    writes the JSON and stops: the prompt's ids must be the start of the ids SFT trained on, and
    the JSON must end at a token boundary before the closing tag (no `>{"` or `"}}</` merges)."""
    import random

    from lmfoundry.data.sample_chats import conversation
    from lmfoundry.model.chat_template import TOOL_CALL_CLOSE, ChatTemplate

    template, rng = ChatTemplate(), random.Random(0)
    chats = [conversation(rng, i) for i in range(200)]
    texts = [template.render_conversation(c["messages"], c.get("tools", ()))[0] for c in chats]
    tok = train_bpe(texts, 512, copyable=copyable)
    for chat, text in [(c, t) for c, t in zip(chats, texts, strict=True) if "tools" in c][:10]:
        asked = next(i for i, m in enumerate(chat["messages"]) if m.get("tool_calls"))
        prompt = template.render(chat["messages"][:asked], chat["tools"], force_tool_call=True)
        trained, served = tok.encode(text), tok.encode(prompt)
        assert trained.ids[: len(served.ids)] == served.ids, (served.tokens[-3:], trained.tokens[len(served.ids) - 3 :])
        close = text.index(TOOL_CALL_CLOSE)
        assert any(start == close for start, _ in trained.offsets), "the closing tag starts inside a token"


def test_pack_trains_a_copyable_tokenizer_when_asked(ray_local, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from lmfoundry.data.pack import PackConfig, run_pack

    docs = tmp_path / "docs"
    docs.mkdir()
    texts = [f"Compute {a} * {a + 1}.\n{a} * {a + 1} = {a * (a + 1)}" for a in range(10, 90)]
    pq.write_table(pa.table({"id": [str(i) for i in range(len(texts))], "text": texts}), docs / "part-0.parquet")
    for copyable in (False, True):
        out = tmp_path / f"packed-{copyable}"
        run_pack(PackConfig(input=str(docs), output=str(out), vocab_size=300, seq_len=16, copyable_tokens=copyable))
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        digits_alone = all(len(tok.id_to_token(i)) == 1 for i in tok.encode("4567").ids)
        assert digits_alone == copyable
