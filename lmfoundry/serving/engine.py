"""The default inference engine: a checkpoint run with PyTorch, one KV-cached generation per
request, a ChatML chat template over the tokenizer's special tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from lmfoundry.model.tokenizer import EOS, IM_END, IM_START
from lmfoundry.model.checkpoint import TOKENIZER, load_model_files
from lmfoundry.model.generate import stream_tokens
from lmfoundry.platform import checkpoint


@dataclass
class Delta:
    text: str
    finish_reason: str | None  # set on the last delta only
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def render_chat(messages: list[dict]) -> str:
    """ChatML: each message between <|im_start|>role and <|im_end|>, then the assistant's turn."""
    parts = [f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages]
    return "".join(parts) + f"{IM_START}assistant\n"


class InferenceEngine:
    def __init__(self, checkpoint_uri: str, device: str = "auto"):
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        local = checkpoint.local_copy(checkpoint_uri, model_only=True)
        self.manifest = checkpoint.verify(local, model_only=True)
        self.model = load_model_files(local, device)
        self.tokenizer = Tokenizer.from_file(f"{local}/{TOKENIZER}")
        self.stop_ids = frozenset(self.tokenizer.token_to_id(t) for t in (EOS, IM_END)
                                  if self.tokenizer.token_to_id(t) is not None)
        self.context = self.model.cfg.max_seq_len

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _budget(self, ids: list[int], max_tokens: int | None) -> int:
        room = self.context - len(ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {self.context}")
        if max_tokens is not None and max_tokens > room:
            raise ValueError(f"max_tokens={max_tokens} does not fit: the prompt has {len(ids)} tokens "
                             f"and the context is {self.context}, so at most {room}")
        return max_tokens if max_tokens is not None else room

    def stream(self, prompt: str, max_tokens: int | None, temperature: float, top_p: float,
               stop: list[str], seed: int | None) -> Iterator[Delta]:
        """Text as it is generated: Deltas of new text, the last one with the finish reason.
        Text that could be the start of a stop string is held back until it is clear it is not,
        and a partial UTF-8 character until it is complete."""
        ids = self.encode(prompt)
        budget = self._budget(ids, max_tokens)  # raises before the first chunk is sent
        return self._stream(ids, budget, temperature, top_p, stop, seed)

    def _stream(self, ids, budget, temperature, top_p, stop, seed) -> Iterator[Delta]:
        tokens: list[int] = []
        sent = 0  # characters of the decoded text already sent
        hold = max((len(s) for s in stop), default=1) - 1
        for item in stream_tokens(self.model, ids, budget, temperature, top_p, self.stop_ids, seed):
            if isinstance(item, str):
                text = self.tokenizer.decode(tokens)
                yield Delta(text[sent:], item, len(ids), len(tokens))
                return
            tokens.append(item)
            text = self.tokenizer.decode(tokens)
            hit = min((text.index(s) for s in stop if s in text), default=-1)
            if hit >= 0:
                yield Delta(text[sent:hit], "stop", len(ids), len(tokens))
                return
            ready = len(text) - hold
            while ready > sent and text[ready - 1] == "\ufffd":
                ready -= 1
            if ready > sent:
                yield Delta(text[sent:ready], None, len(ids), len(tokens))
                sent = ready

    def complete(self, prompt: str, max_tokens: int | None, temperature: float, top_p: float,
                 stop: list[str], seed: int | None) -> Completion:
        parts = list(self.stream(prompt, max_tokens, temperature, top_p, stop, seed))
        last = parts[-1]
        return Completion("".join(p.text for p in parts), last.prompt_tokens, last.completion_tokens,
                          last.finish_reason)
