"""A request's sampling settings as one object, and the per-request logit processing that the
continuous batch applies to all its rows in one go.

`SamplingParams` travels from the API to the engine to the scheduler unchanged (as vLLM's does).
The scheduler thread calls `adjust_logits` once per forward pass on the (rows, vocab) logits:
logit bias, presence and frequency penalties (OpenAI's definitions), each row with its own
request's values. Log-probabilities are reported from the model's own distribution, before
bias, penalties and temperature (vLLM's default), so that they score text, not sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# What a client may ask for; past these a 400 names the field and the limit.
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 300  # entries of logit_bias
LOGIT_BIAS_RANGE = (-100.0, 100.0)
PENALTY_RANGE = (-2.0, 2.0)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int  # new tokens at most; 0 scores the prompt only (echo with prompt logprobs)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: int | None = None  # report each new token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    stop: tuple[str, ...] = field(default=())

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


@dataclass
class TokenLogprob:
    """One token's log-probability and the `top` most likely tokens at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def adjust_logits(
    logits: torch.Tensor, params: list[SamplingParams], counts: list[torch.Tensor | None]
) -> torch.Tensor:
    """logits: (B, V), row b for a request with `params[b]`; counts[b]: (V,) how often each
    token was generated so far (None for a request without penalties). Returns new logits
    (the input is left as it is) with bias and penalties applied, in one batched operation per
    kind; rows that ask for neither are untouched."""
    biased = [b for b, p in enumerate(params) if p.logit_bias]
    penalised = [b for b, p in enumerate(params) if p.penalised]
    if not biased and not penalised:
        return logits
    out = logits.float().clone()
    if biased:
        bias = torch.zeros(len(biased), out.shape[1], device=out.device)
        for i, b in enumerate(biased):
            ids, values = zip(*params[b].logit_bias)
            bias[i, list(ids)] = torch.tensor(values, device=out.device)
        out[biased] += bias
    if penalised:
        seen = torch.stack([counts[b] for b in penalised])  # (P, V)
        frequency = torch.tensor([params[b].frequency_penalty for b in penalised], device=out.device)
        presence = torch.tensor([params[b].presence_penalty for b in penalised], device=out.device)
        out[penalised] -= frequency[:, None] * seen + presence[:, None] * (seen > 0)
    return out


def token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """logprobs: (T, V) log-softmaxed rows; tokens: (T,) the token chosen at each row."""
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    if top > 0:
        values, ids = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)
        alternatives = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [[] for _ in chosen]
    return [TokenLogprob(t, lp, alt) for t, lp, alt in zip(tokens.tolist(), chosen, alternatives)]
