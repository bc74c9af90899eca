"""Sampling with a KV cache: temperature, nucleus (top-p), stop tokens, a seed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lmfoundry.model.transformer import KVCache, Transformer


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens or context full)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """logits: (V,). Greedy at temperature 0, otherwise nucleus sampling."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(0) - sorted_p >= top_p
        drop[0] = False  # even when top_p is below float32's smallest number
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.no_grad()
def stream_tokens(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_tokens: frozenset[int] = frozenset(),
    seed: int | None = None,
) -> Iterator[int | str]:
    """Yields each new token id as it is sampled, then the finish reason as a string: "stop"
    (a stop token, not yielded) or "length" (max_new_tokens or the context is full). A consumer
    that stops iterating early simply ends the generation."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    device = next(model.parameters()).device
    limit = model.cfg.max_seq_len
    if len(prompt) >= limit:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in a context of {limit}")
    max_new_tokens = min(max_new_tokens, limit - len(prompt))
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(model.cfg, 1, len(prompt) + max_new_tokens, device, next(model.parameters()).dtype)
    logits, _ = model(
        torch.tensor([prompt], device=device), cache=cache, logits_at=torch.tensor([len(prompt) - 1], device=device)
    )
    for produced in range(1, max_new_tokens + 1):
        token = sample_next(logits[0, -1], temperature, top_p, gen)
        if token in stop_tokens:
            yield "stop"
            return
        yield token
        if produced < max_new_tokens:
            logits, _ = model(torch.tensor([[token]], device=device), cache=cache)
    yield "length"


def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_tokens: frozenset[int] = frozenset(),
    seed: int | None = None,
) -> Generation:
    """All of stream_tokens' output at once."""
    out: list[int] = []
    for item in stream_tokens(model, prompt, max_new_tokens, temperature, top_p, stop_tokens, seed):
        if isinstance(item, str):
            return Generation(out, item)
        out.append(item)
    raise AssertionError("stream_tokens always ends with a finish reason")
