"""Sampling with a KV cache: temperature, nucleus (top-p), stop tokens, a seed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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


@torch.no_grad()
def sample_many(
    model: Transformer,
    prompt: list[int],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seeds: list[int],
    stop_tokens: frozenset[int] = frozenset(),
    finished: Callable[[list[int]], bool] | None = None,
    top_p: float = 1.0,
) -> list[Generation]:
    """n samples after one prompt, decoded together: the prompt is prefilled once and its keys and
    values copied to every row's cache slot; each step runs the rows still going as one batch.
    Row i samples with its own generator seeded `seeds[i]`, so it is the sequence `generate` gives
    with that seed. `finished(tokens)` may end a row early (e.g. a stop string in its text)."""
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} samples")
    return sample_groups(model, [prompt], n, max_new_tokens, temperature, [seeds], stop_tokens, finished, top_p)[0]


@torch.no_grad()
def sample_groups(
    model: Transformer,
    prompts: list[list[int]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seeds: list[list[int]],
    stop_tokens: frozenset[int] = frozenset(),
    finished: Callable[[list[int]], bool] | None = None,
    top_p: float = 1.0,
) -> list[list[Generation]]:
    """n samples after each of several prompts (a GRPO batch's groups), all decoded as one batch:
    each prompt is prefilled once into the first cache slot of its group and copied to the
    others; rows of different lengths decode together, each at its own position. Row j of prompt
    p samples with a generator seeded `seeds[p][j]`."""
    if any(not p for p in prompts):
        raise ValueError("every prompt must hold at least one token")
    if len(seeds) != len(prompts) or any(len(s) != n for s in seeds):
        raise ValueError(f"{[len(s) for s in seeds]} seeds for {len(prompts)} prompts of {n} samples")
    device = next(model.parameters()).device
    limit = model.cfg.max_seq_len
    longest = max(map(len, prompts))
    if longest >= limit:
        raise ValueError(f"prompt of {longest} tokens leaves no room in a context of {limit}")
    budgets = [min(max_new_tokens, limit - len(p)) for p in prompts for _ in range(n)]  # per row
    cache = KVCache(model.cfg, n * len(prompts), longest + max(budgets), device, next(model.parameters()).dtype)
    row_logits = {}
    for g, prompt in enumerate(prompts):
        first = g * n
        logits, _ = model(
            torch.tensor([prompt], device=device),
            cache=cache,
            slots=torch.tensor([first], device=device),
            logits_at=torch.tensor([len(prompt) - 1], device=device),
        )
        cache.k[:, first + 1 : first + n], cache.v[:, first + 1 : first + n] = (
            cache.k[:, first : first + 1],
            cache.v[:, first : first + 1],
        )
        cache.lengths[first : first + n] = cache.lengths[first]
        row_logits.update({first + j: logits[0, -1] for j in range(n)})
    gens = [torch.Generator(device=device).manual_seed(s) for group in seeds for s in group]
    out = [Generation([], "length") for _ in budgets]
    active = list(range(len(budgets)))
    while active:
        going = []
        for i in active:
            token = sample_next(row_logits[i], temperature, top_p, gens[i])
            if token in stop_tokens:
                out[i].finish_reason = "stop"
                continue
            out[i].tokens.append(token)
            if finished is not None and finished(out[i].tokens):
                out[i].finish_reason = "stop"
                continue
            if len(out[i].tokens) < budgets[i]:
                going.append(i)
        active = going
        if not active:
            break
        slots = torch.tensor(active, device=device)
        tokens = torch.tensor([[out[i].tokens[-1]] for i in active], device=device)
        logits, _ = model(tokens, cache=cache, slots=slots)
        row_logits = {i: logits[r, -1] for r, i in enumerate(active)}
    return [out[g * n : (g + 1) * n] for g in range(len(prompts))]
