"""Supervised fine-tuning data: conversations to packed token rows with a loss mask.

A conversation is one JSON line, `{"messages": [...], "tools": [...]}` (tools optional), with
system, developer, user, assistant and tool turns. It is rendered with the checkpoint's chat
template and tokenised; the loss mask marks the tokens that overlap a character span the template
marks as generation (`{% generation %}`), as transformers' `return_assistant_tokens_mask` and
TRL's `assistant_only_loss` do, so the model learns the assistant's replies and end of turn only.

Conversations are packed into rows of `seq_len` tokens by best-fit decreasing (the longest first,
each into the fullest row it fits, as TRL's "bfd" packing), every token tagged with its
conversation's index in the row so that the model attends within a conversation only
(transformer.py, doc_ids). The packing depends on nothing but the inputs: the same file,
template and seq_len give the same bytes. A conversation longer than seq_len is cut to it and
counted; one with no assistant turn (or none left after the cut) is skipped and counted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE, ChatTemplate
from lmfoundry.model.checkpoint import TOKENIZER
from lmfoundry.model.tokenizer import SpecialTokens
from lmfoundry.platform import storage

ROLES = ("system", "developer", "user", "assistant", "tool")
PAD_DOC = -1  # the document id of padding: no conversation, no loss


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolFunction(_Strict):
    name: str
    arguments: str | dict[str, Any]


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolFunction


class Message(_Strict):
    role: Literal[ROLES]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class Conversation(_Strict):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


def read_conversations(uri: str) -> list[tuple[int, Conversation]]:
    """(line, conversation) of a JSONL file; a malformed one is an error naming its line and field."""
    conversations = []
    for line, row in storage.numbered_jsonl(uri):
        try:
            conversations.append((line, Conversation.model_validate(row)))
        except ValidationError as e:
            problem = e.errors()[0]
            where = ".".join(str(p) for p in problem["loc"])
            raise ValueError(f"{uri}:{line}: {where}: {problem['msg']}") from None
    if not conversations:
        raise ValueError(f"{uri} holds no conversations")
    return conversations


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    assistant: list[bool]  # per token: inside a span the template marks as generation
    truncated: bool


class ConversationEncoder:
    """Conversations to token ids and assistant masks with a checkpoint's tokenizer and template."""

    def __init__(self, checkpoint_dir: str, seq_len: int):
        from tokenizers import Tokenizer

        if not (Path(checkpoint_dir) / CHAT_TEMPLATE_FILE).exists():
            raise ValueError(
                f"checkpoint {checkpoint_dir} has no chat template ({CHAT_TEMPLATE_FILE}): supervised "
                "fine-tuning renders conversations with the template the model will be served with"
            )
        self.template = ChatTemplate.from_checkpoint(checkpoint_dir)
        if not self.template.marks_generation:
            raise ValueError(
                f"the chat template of {checkpoint_dir} marks no assistant text: wrap what the assistant "
                "generates (its content and end of turn) in {% generation %} ... {% endgeneration %}, as "
                "lmfoundry's default template and TRL's training templates do"
            )
        self.tokenizer = Tokenizer.from_file(str(Path(checkpoint_dir) / TOKENIZER))
        self.pad = SpecialTokens.of_checkpoint(checkpoint_dir).eos_id(self.tokenizer)
        self.seq_len = seq_len

    def encode(self, conversation: Conversation) -> Encoded:
        messages = [m.model_dump(exclude_none=True) for m in conversation.messages]
        text, spans = self.template.render_conversation(messages, conversation.tools or ())
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids, assistant = encoding.ids, [False] * len(encoding.ids)
        # every token that overlaps a span (both in order: one pass), as transformers marks them
        span = 0
        for i, (start, end) in enumerate(encoding.offsets):
            while span < len(spans) and start >= spans[span][1]:
                span += 1
            if span == len(spans):
                break
            assistant[i] = end > spans[span][0]
        truncated = len(ids) > self.seq_len
        return Encoded(ids[: self.seq_len], assistant[: self.seq_len], truncated)


@dataclass
class Packed:
    """Rows of seq_len tokens: ids, the assistant mask and each token's conversation in its row
    (PAD_DOC for padding)."""

    tokens: np.ndarray  # (N, T) int64
    assistant: np.ndarray  # (N, T) bool
    docs: np.ndarray  # (N, T) int32

    def __len__(self) -> int:
        return len(self.tokens)


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices: the longest item first (ties by index), each into the bin with the
    least room that still fits it, else a new bin."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at == len(room):
            bins.append([i])
            bisect.insort(room, (capacity - lengths[i], len(bins) - 1))
        else:
            left, b = room.pop(at)
            bins[b].append(i)
            bisect.insort(room, (left - lengths[i], b))
    return bins


def pack(encoded: list[Encoded], seq_len: int, pad: int) -> Packed:
    bins = best_fit_decreasing([len(e.ids) for e in encoded], seq_len)
    tokens = np.full((len(bins), seq_len), pad, dtype=np.int64)
    assistant = np.zeros((len(bins), seq_len), dtype=bool)
    docs = np.full((len(bins), seq_len), PAD_DOC, dtype=np.int32)
    for row, members in enumerate(bins):
        at = 0
        for doc, i in enumerate(members):
            n = len(encoded[i].ids)
            tokens[row, at : at + n] = encoded[i].ids
            assistant[row, at : at + n] = encoded[i].assistant
            docs[row, at : at + n] = doc
            at += n
    return Packed(tokens, assistant, docs)


def prepare(uri: str, checkpoint_dir: str, seq_len: int) -> tuple[Packed, dict]:
    """The file's conversations packed for training, and the report of what was done to them."""
    from jinja2.exceptions import TemplateError

    encoder = ConversationEncoder(checkpoint_dir, seq_len)
    conversations = read_conversations(uri)
    kept, truncated, no_turn, none_left = [], 0, 0, 0
    for line, conversation in conversations:
        if not any(m.role == "assistant" for m in conversation.messages):
            no_turn += 1
            continue
        try:
            encoded = encoder.encode(conversation)
        except TemplateError as e:  # an imported template refuses what it cannot render
            raise ValueError(f"{uri}:{line}: the checkpoint's chat template refused the conversation: {e}") from None
        truncated += encoded.truncated
        if not any(encoded.assistant):
            none_left += 1  # its assistant turns were all beyond the cut
            continue
        kept.append(encoded)
    if not kept:
        raise ValueError(f"{uri}: none of its {len(conversations)} conversations has an assistant token to learn")
    packed = pack(kept, seq_len, encoder.pad)
    tokens = int((packed.docs != PAD_DOC).sum())
    report = {
        "conversations": len(conversations),
        "trained": len(kept),
        "truncated": truncated,
        "skipped": {"no_assistant_turn": no_turn, "no_assistant_tokens_after_truncation": none_left},
        "rows": len(packed),
        "seq_len": seq_len,
        "tokens": tokens,
        "assistant_tokens": int(packed.assistant.sum()),
        "fill": round(tokens / packed.tokens.size, 4),
    }
    return packed, report
