"""Test-time compute: more generated tokens for a better answer, by one of four strategies.

- `greedy`: one greedy solution (the baseline every other strategy is measured against);
- `majority_vote`: N sampled solutions, the most frequent final answer (self-consistency);
- `best_of_n`: N sampled solutions, the one a scorer (an outcome reward model or a verifier) rates
  highest; `weighted_vote` sums the scorer's ratings per final answer instead;
- `step_beam_search`: solutions grown one step (one line) at a time; each round every kept partial
  solution is extended by `expand` sampled next steps, a process reward model scores the new
  partial solutions, and the `beam_width` best are kept, until they all reach an answer.

Every strategy stops drawing samples once it has generated `budget_tokens` tokens (counted as
generated, including what a stop string cut off), so strategies are compared at equal cost, and
reports what it spent. The model is asked through `Sampler`, the scorers through `Scorer`: a
checkpoint in process (clients/checkpoint.py) is a sampler; which scorer (a verifier, a reward
model) is the caller's choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

STRATEGIES = ("greedy", "majority_vote", "best_of_n", "weighted_vote", "step_beam_search")


class Sampler(Protocol):
    def continuations(
        self, prompt: str, n: int, max_tokens: int, temperature: float, seed: int, stop: list[str] = ()
    ) -> list[tuple[str, int]]:
        """n continuations of a raw prompt (greedy when temperature is 0), each cut at the first
        stop string, with the number of tokens generated for it."""


class Scorer(Protocol):
    def score(self, prompt: str, solutions: list[str]) -> list[float]:
        """How good each whole solution is (higher is better)."""


class StepScorer(Protocol):
    def score_steps(self, prompt: str, partials: list[list[str]]) -> list[float]:
        """How promising each partial solution (its steps so far) is (higher is better)."""


@dataclass
class Answer:
    strategy: str
    solution: str  # the chosen solution's text
    answer: str | None  # its final answer, as `answer_of` reads it
    tokens: int  # generated in all, by every sample the strategy drew
    samples: int
    votes: dict[str, float] = field(default_factory=dict)  # final answer -> votes or summed scores


@dataclass
class Budget:
    tokens: int
    spent: int = 0

    @property
    def left(self) -> int:
        return self.tokens - self.spent


def _draw(
    sampler: Sampler, prompt: str, n: int, budget: Budget, max_tokens: int, temperature: float, seed: int, stop=()
) -> list[str]:
    """Up to n samples, in rounds, while the budget lasts (a round never asks for more samples
    than the budget could pay for at max_tokens each, but always for at least one)."""
    texts: list[str] = []
    while len(texts) < n and budget.left > 0:
        ask = max(1, min(n - len(texts), budget.left // max(1, max_tokens)))
        for text, tokens in sampler.continuations(prompt, ask, max_tokens, temperature, seed + len(texts), list(stop)):
            texts.append(text)
            budget.spent += tokens
    return texts


def greedy(sampler: Sampler, prompt: str, answer_of: Callable[[str], str | None], max_tokens: int) -> Answer:
    (text, tokens), *_ = sampler.continuations(prompt, 1, max_tokens, 0.0, 0)
    return Answer("greedy", text, answer_of(text), tokens, 1)


def _vote(name: str, texts: list[str], weights: list[float], answer_of, budget: Budget) -> Answer:
    votes: dict[str, float] = {}
    first: dict[str, str] = {}
    for text, weight in zip(texts, weights):
        answer = answer_of(text)
        if answer is None:  # no final answer: no vote
            continue
        votes[answer] = votes.get(answer, 0.0) + weight
        first.setdefault(answer, text)
    if not votes:
        return Answer(name, texts[0] if texts else "", None, budget.spent, len(texts), votes)
    # ties go to the answer seen first, so the result does not depend on dict order
    order = list(first)
    winner = max(order, key=lambda a: (votes[a], -order.index(a)))
    return Answer(name, first[winner], winner, budget.spent, len(texts), votes)


def majority_vote(
    sampler: Sampler,
    prompt: str,
    answer_of: Callable[[str], str | None],
    n: int,
    budget_tokens: int,
    max_tokens: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> Answer:
    budget = Budget(budget_tokens)
    texts = _draw(sampler, prompt, n, budget, max_tokens, temperature, seed)
    return _vote("majority_vote", texts, [1.0] * len(texts), answer_of, budget)


def weighted_vote(
    sampler: Sampler,
    scorer: Scorer,
    prompt: str,
    answer_of: Callable[[str], str | None],
    n: int,
    budget_tokens: int,
    max_tokens: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> Answer:
    budget = Budget(budget_tokens)
    texts = _draw(sampler, prompt, n, budget, max_tokens, temperature, seed)
    return _vote("weighted_vote", texts, scorer.score(prompt, texts) if texts else [], answer_of, budget)


def best_of_n(
    sampler: Sampler,
    scorer: Scorer,
    prompt: str,
    answer_of: Callable[[str], str | None],
    n: int,
    budget_tokens: int,
    max_tokens: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> Answer:
    budget = Budget(budget_tokens)
    texts = _draw(sampler, prompt, n, budget, max_tokens, temperature, seed)
    if not texts:
        return Answer("best_of_n", "", None, budget.spent, 0)
    scores = scorer.score(prompt, texts)
    best = max(range(len(texts)), key=lambda i: (scores[i], -i))
    return Answer("best_of_n", texts[best], answer_of(texts[best]), budget.spent, len(texts))


def step_beam_search(
    sampler: Sampler,
    scorer: StepScorer,
    prompt: str,
    answer_of: Callable[[str], str | None],
    beam_width: int,
    expand: int,
    budget_tokens: int,
    max_step_tokens: int,
    max_steps: int,
    delimiter: str = "\n",
    temperature: float = 0.8,
    seed: int = 0,
) -> Answer:
    """Beam search over steps: a step is the text up to `delimiter`; a partial solution is
    finished once its last step holds a final answer (`answer_of` reads one)."""
    budget = Budget(budget_tokens)
    beams: list[list[str]] = [[]]
    finished: list[tuple[float, list[str]]] = []
    samples = 0
    for depth in range(max_steps):
        if not beams or budget.left <= 0:
            break
        children: list[list[str]] = []
        for b, steps in enumerate(beams):
            context = prompt + "".join(s + delimiter for s in steps)
            drawn = _draw(
                sampler,
                context,
                expand,
                budget,
                max_step_tokens,
                temperature,
                seed + 1000 * depth + 100 * b,
                [delimiter],
            )
            samples += len(drawn)
            children += [[*steps, text.strip()] for text in dict.fromkeys(drawn) if text.strip()]
            if budget.left <= 0:
                break
        if not children:
            break
        scores = scorer.score_steps(prompt, children)
        ranked = sorted(zip(scores, range(len(children))), key=lambda p: (-p[0], p[1]))[:beam_width]
        beams = []
        for score, i in ranked:
            if answer_of(delimiter.join(children[i])) is not None:
                finished.append((score, children[i]))
            else:
                beams.append(children[i])
        if len(finished) >= beam_width:
            break
    pool = finished or [(float("-inf"), steps) for steps in beams]
    score, steps = max(pool, key=lambda p: p[0]) if pool else (0.0, [])
    text = delimiter.join(steps)
    return Answer("step_beam_search", text, answer_of(text), budget.spent, samples)
