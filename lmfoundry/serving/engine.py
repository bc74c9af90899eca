"""The default inference engine: a checkpoint run with PyTorch, one KV-cached generation per
request, a ChatML chat template over the tokenizer's special tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from lmfoundry.data.tokenizer import EOS, IM_END, IM_START
from lmfoundry.model.checkpoint import TOKENIZER, load_model_files
from lmfoundry.model.generate import generate
from lmfoundry.platform import checkpoint


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
        local = checkpoint.local_copy(checkpoint_uri)
        self.manifest = checkpoint.verify(local)
        self.model = load_model_files(local, device)
        self.tokenizer = Tokenizer.from_file(f"{local}/{TOKENIZER}")
        self.stop_ids = frozenset(self.tokenizer.token_to_id(t) for t in (EOS, IM_END)
                                  if self.tokenizer.token_to_id(t) is not None)
        self.context = self.model.cfg.max_seq_len

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def complete(self, prompt: str, max_tokens: int | None, temperature: float, top_p: float,
                 stop: list[str], seed: int | None) -> Completion:
        ids = self.encode(prompt)
        room = self.context - len(ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {self.context}")
        if max_tokens is not None and max_tokens > room:
            raise ValueError(f"max_tokens={max_tokens} does not fit: the prompt has {len(ids)} tokens "
                             f"and the context is {self.context}, so at most {room}")
        budget = max_tokens if max_tokens is not None else room

        def reached_stop(tokens: list[int]) -> bool:
            return bool(stop) and any(s in self.tokenizer.decode(tokens) for s in stop)

        gen = generate(self.model, ids, budget, temperature, top_p, self.stop_ids, seed,
                       should_stop=reached_stop if stop else None)
        text = self.tokenizer.decode(gen.tokens)
        for s in stop:  # the stop string itself is not part of the reply
            if s in text:
                text = text[: text.index(s)]
        return Completion(text, len(ids), len(gen.tokens), gen.finish_reason)
