"""The `reasoning` extension of chat completions: test-time compute (reasoning/test_time.py) on
the serving engine.

The strategy runs in a worker thread, since its scorers (a verifier, a reward model's forward
pass) block. Every sample it asks for is an engine request, queued on the event loop into the
same continuous batch as every other request, so the N samples of a round share forward passes
with each other and with the traffic around them; the thread waits for them, never past the
request's deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time

from lmfoundry.reasoning import test_time, verifiers
from lmfoundry.serving.errors import ApiError
from lmfoundry.serving.protocol import Reasoning
from lmfoundry.serving.sampling import SamplingParams

VERIFIER = "verifier"


class ReasoningTimeout(Exception):
    """The deadline passed, or the request was dropped (`EngineSampler.stop`), before a round."""


class EngineSampler:
    """test_time.Sampler on an InferenceEngine, called from a thread other than the event loop's.
    `base` carries the request's sampling settings (top_p, penalties, logit bias, its stop
    strings); a strategy sets the token limit, temperature, seed and extra stop strings of each
    call."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, base: SamplingParams, deadline: float):
        self.engine, self.loop, self.base, self.deadline = engine, loop, base, deadline
        self.streams: list = []  # every sample asked for, for what the request used
        self.stopped = threading.Event()

    def stop(self) -> None:
        """The request is over (dropped, timed out, failed): no further round starts, and the
        samples in flight give their batch slots back. Call on the event loop's thread."""
        self.stopped.set()
        for s in self.streams:
            s.cancel()

    def continuations(
        self, prompt: str, n: int, max_tokens: int, temperature: float, seed: int, stop=()
    ) -> list[tuple[str, int]]:
        ids = self.engine.encode(prompt)
        room = self.engine.context - len(ids)
        if room < 1 or not ids:  # a search grew its partial solution to the context: nothing more to say
            return [("", 0)] * n
        stops = tuple(dict.fromkeys((*self.base.stop, *stop)))
        params = [
            dataclasses.replace(
                self.base, max_tokens=min(max_tokens, room), temperature=temperature, seed=seed + i, stop=stops
            )
            for i in range(n)
        ]

        if self.stopped.is_set():
            raise ReasoningTimeout

        async def generate() -> list:
            streams = []
            try:
                for p in params:
                    streams.append(self.engine.stream(ids, p))
                    self.streams.append(streams[-1])
                return await asyncio.gather(*(s.collect() for s in streams))
            finally:  # cancelled (the deadline passed) or failed: free the batch slots
                for s in streams:
                    s.cancel()

        future = asyncio.run_coroutine_threadsafe(generate(), self.loop)
        try:
            outs = future.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ReasoningTimeout from None
        return [(o.text, o.completion_tokens) for o in outs]


def scorer_for(spec: Reasoning, question: str, reward_models: dict):
    """The scorer the request names: the verifier of the maths question it asks, or a served
    reward model; None for majority voting. A 400 names what is wrong and what is allowed."""
    if spec.scorer is None:
        return None
    if spec.scorer == VERIFIER:
        problem = verifiers.problem_of(question)
        if problem is None:
            raise ApiError(
                400,
                "reasoning.scorer: the verifier checks questions of the forms "
                f"{', '.join(map(repr, verifiers.QUESTION_FORMS))} in the last user message; this one is none",
                param="reasoning.scorer",
            )
        return verifiers.VerifierScorer(problem)
    if spec.scorer in reward_models:
        return reward_models[spec.scorer]
    allowed = [VERIFIER, *sorted(reward_models)]
    raise ApiError(
        400, f"reasoning.scorer {spec.scorer[:64]!r} is not served here; allowed: {allowed}", param="reasoning.scorer"
    )


def sample_bound(spec: Reasoning) -> int:
    """Samples drawn in one round at most: a strategy overshoots its budget by at most one round."""
    return spec.beam_width * spec.expand if spec.strategy == "step_beam" else spec.n


def solve(sampler: EngineSampler, spec: Reasoning, scorer, prompt: str, max_tokens: int, seed: int):
    """Run the strategy (in the calling thread). `max_tokens` bounds each sample (each step of a
    beam search)."""
    answer_of = verifiers.answer_of
    common = dict(budget_tokens=spec.budget_tokens, temperature=sampler.base.temperature, seed=seed)
    if spec.strategy == "majority":
        return test_time.majority_vote(sampler, prompt, answer_of, spec.n, max_tokens=max_tokens, **common)
    if spec.strategy == "best_of_n":
        return test_time.best_of_n(sampler, scorer, prompt, answer_of, spec.n, max_tokens=max_tokens, **common)
    if spec.strategy == "weighted":
        return test_time.weighted_vote(sampler, scorer, prompt, answer_of, spec.n, max_tokens=max_tokens, **common)
    return test_time.step_beam_search(
        sampler,
        scorer,
        prompt,
        answer_of,
        spec.beam_width,
        spec.expand,
        max_step_tokens=max_tokens,
        max_steps=spec.max_steps,
        delimiter=verifiers.STEP_DELIMITER,
        **common,
    )
