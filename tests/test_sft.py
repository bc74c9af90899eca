"""Supervised fine-tuning's data path without Ray: conversations rendered with the checkpoint's
chat template, the assistant-token masks (the same as TRL's `assistant_only_loss` masks),
deterministic best-fit packing, and bad input named."""

import json

import numpy as np
import pytest
import torch
from sft_chats import write_chats

from lmfoundry.data.tokenizer import train_bpe
from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE, DEFAULT_CHAT_TEMPLATE
from lmfoundry.model.checkpoint import TOKENIZER
from lmfoundry.model.tokenizer import EOS, SPECIAL_TOKENS_FILE, SpecialTokens
from lmfoundry.train.sft_data import (
    PAD_DOC,
    ConversationEncoder,
    best_fit_decreasing,
    prepare,
    read_conversations,
)

# Llama 3's turn format with the assistant's generation marked, as TRL's training templates mark it
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}{% endfor %}"
)


def checkpoint_dir(tmp_path, template=DEFAULT_CHAT_TEMPLATE):
    """A checkpoint's tokenizer and chat template (all that the data path reads)."""
    texts = (tmp_path / "corpus.jsonl").read_text().splitlines() if (tmp_path / "corpus.jsonl").exists() else None
    texts = texts or open(write_chats(tmp_path / "corpus.jsonl", 200, seed=1)).read().splitlines()
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    train_bpe(texts + [DEFAULT_CHAT_TEMPLATE] * 20, 512).save(str(d / TOKENIZER))
    (d / CHAT_TEMPLATE_FILE).write_text(template)
    (d / SPECIAL_TOKENS_FILE).write_text(SpecialTokens(bos=EOS).to_json())  # for {{ bos_token }}
    return d


@pytest.mark.parametrize("template", ["default", "llama3_style"])
def test_assistant_masks_are_trls_assistant_only_loss_masks(tmp_path, template):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    source = DEFAULT_CHAT_TEMPLATE if template == "default" else LLAMA3_STYLE
    ckpt = checkpoint_dir(tmp_path, source)
    chats = write_chats(tmp_path / "chats.jsonl", 24)
    encoder = ConversationEncoder(str(ckpt), seq_len=10_000)
    ours = [encoder.encode(c) for _, c in read_conversations(chats)]

    tok = PreTrainedTokenizerFast(tokenizer_file=str(ckpt / TOKENIZER), eos_token=EOS, pad_token=EOS, bos_token=EOS)
    tok.chat_template = source
    rows = [json.loads(line) for line in open(chats)]
    for row in rows:  # Arrow wants one schema: tools as JSON text, which TRL parses back
        row["tools"] = json.dumps(row.get("tools"))
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        assistant_only_loss=True,
        max_length=None,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    trl = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok).train_dataset
    assert len(trl) == len(ours)
    for theirs, mine in zip(trl, ours):
        assert theirs["input_ids"] == mine.ids
        # TRL turns its assistant masks into labels: -100 wherever the loss does not look
        assert [label != -100 for label in theirs["labels"]] == mine.assistant
    assert all(any(m.assistant) and not all(m.assistant) for m in ours)


def test_packing_is_best_fit_decreasing_deterministic_and_keeps_every_conversation(tmp_path):
    assert best_fit_decreasing([5, 9, 3, 7, 2, 4], 10) == [[1], [3, 2], [0, 5], [4]]
    ckpt = checkpoint_dir(tmp_path)
    chats = write_chats(tmp_path / "chats.jsonl", 64)
    packed, report = prepare(chats, str(ckpt), 256)
    again, _ = prepare(chats, str(ckpt), 256)
    for name in ("tokens", "assistant", "docs"):
        assert getattr(packed, name).tobytes() == getattr(again, name).tobytes()
    assert report["trained"] == report["conversations"] == 64 and report["truncated"] == 0
    encoder = ConversationEncoder(str(ckpt), 256)
    lengths = sorted(len(encoder.encode(c).ids) for _, c in read_conversations(chats))
    # each conversation is one contiguous run of a document id in some row, its padding after it
    found = []
    for docs in packed.docs:
        real = docs[docs != PAD_DOC]
        assert (docs[: len(real)] != PAD_DOC).all()  # padding only at the end
        found += list(np.bincount(real))
    assert sorted(found) == lengths and report["tokens"] == sum(lengths)
    assert report["rows"] < 64 and report["fill"] > 0.8  # several conversations per row


def test_long_conversations_are_cut_and_counted_and_those_without_assistant_are_skipped(tmp_path):
    ckpt = checkpoint_dir(tmp_path)
    long_turn = {"role": "user", "content": "What is 1 + 2? " * 200}
    extra = [
        {"messages": [{"role": "user", "content": "hi"}]},  # no assistant turn
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello " * 300}]},
        {"messages": [long_turn, {"role": "assistant", "content": "3"}]},  # its answer beyond the cut
    ]
    chats = write_chats(tmp_path / "chats.jsonl", 8, extra=extra)
    packed, report = prepare(chats, str(ckpt), 256)
    assert report["conversations"] == 11 and report["trained"] == 9 and report["truncated"] == 2
    assert report["skipped"] == {"no_assistant_turn": 1, "no_assistant_tokens_after_truncation": 1}
    assert packed.tokens.shape[1] == 256


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role: Input should be 'system', 'developer'"),
        ({"messages": []}, "messages: List should have at least 1 item"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages.0.extra: Extra inputs"),
        ({"chat": []}, "messages: Field required"),
    ],
)
def test_bad_conversations_are_named_by_line_and_field(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "ok"}]}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: {message}"):
        read_conversations(str(path))


def test_a_checkpoint_without_a_template_or_generation_markers_is_refused(tmp_path):
    ckpt = checkpoint_dir(tmp_path)
    (ckpt / CHAT_TEMPLATE_FILE).write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="marks no assistant text"):
        ConversationEncoder(str(ckpt), 64)
    (ckpt / CHAT_TEMPLATE_FILE).unlink()
    with pytest.raises(ValueError, match="has no chat template"):
        ConversationEncoder(str(ckpt), 64)


def test_the_loss_counts_assistant_targets_within_their_own_conversation_only():
    from lmfoundry.train.sft import masked_mean, token_losses

    class Uniform(torch.nn.Module):
        def forward(self, idx, doc_ids):
            return torch.zeros(*idx.shape, 11), None

    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assistant = torch.tensor([[0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    _, losses, counted = token_losses(Uniform(), tokens, assistant, docs)
    # targets 2, 3 (doc 0) and 6 (doc 1); token 4 opens doc 1 and is not predicted from doc 0
    assert counted.tolist() == [[True, True, False, False, True]]
    assert masked_mean(losses, counted).item() == pytest.approx(float(np.log(11)))
