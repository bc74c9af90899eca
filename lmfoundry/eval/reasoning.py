"""Reasoning at several test-time budgets: accuracy against generated tokens per problem.

Problems come from a synthetic-data output (`lmfoundry synth`, its kept.jsonl: arithmetic and
algebra, made with a seed the training data did not use). Each strategy of reasoning/test_time.py
answers every problem at each sample count N (greedy once); an answer counts when the verifier
(reasoning/verifiers.py) accepts it. The scorer of best-of-N and weighted voting, and the step
scorer of beam search, is the verifier itself unless a reward model is named: a verifier scorer is
an oracle, the upper bound of what a learned reward model can do with the same samples.
"""

from __future__ import annotations

import statistics

from pydantic import Field, model_validator

from lmfoundry.clients.reward import RewardScorer
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.reasoning import test_time, verifiers

KINDS = ("arithmetic", "algebra")


class ReasoningConfig(StageConfig):
    problems: str = Field(description="a synth output directory (its kept.jsonl) or a JSONL of synth samples")
    limit: int = Field(50, ge=1, le=10_000, description="at most this many problems")
    strategies: list[str] = Field(["greedy", "majority_vote", "best_of_n", "step_beam_search"])
    samples: list[int] = Field([1, 4, 16, 64], description="sample counts N (beam search: width x expansion = N)")
    max_tokens: int = Field(64, ge=1, le=4096, description="tokens per solution (per step in beam search)")
    max_steps: int = Field(8, ge=1, le=64)
    temperature: float = Field(0.8, gt=0, le=2)
    seed: int = 0
    scorer: str = Field("verifier", description="best-of-N and weighted voting: 'verifier' or an outcome reward model")
    step_scorer: str = Field("verifier", description="beam search: 'verifier' or a process reward model")

    @model_validator(mode="after")
    def _check(self) -> ReasoningConfig:
        unknown = sorted(set(self.strategies) - set(test_time.STRATEGIES))
        if unknown:
            raise ValueError(f"reasoning.strategies {unknown}; allowed: {list(test_time.STRATEGIES)}")
        if not self.samples or any(n < 1 or n > 1024 for n in self.samples):
            raise ValueError(f"reasoning.samples {self.samples}: each must be between 1 and 1024")
        return self


def read_problems(path: str, limit: int) -> list[dict]:
    uri = storage.normalize(path)
    if not uri.endswith(".jsonl"):
        uri = storage.join(uri, "kept.jsonl")
    problems = []
    for _, sample in storage.numbered_jsonl(uri):
        if not isinstance(sample, dict) or sample.get("kind") not in KINDS or "question" not in sample:
            continue  # code and qa samples are not scored here
        problems.append(sample)
        if len(problems) == limit:
            break
    if not problems:
        raise ValueError(f"{uri} holds no arithmetic or algebra problems (a synth output's kept.jsonl)")
    return problems


def open_scorers(cfg: ReasoningConfig) -> tuple[RewardScorer | None, RewardScorer | None]:
    """The reward models named in place of the verifier, loaded once."""
    from lmfoundry.platform import checkpoint

    def load(name: str) -> RewardScorer | None:
        return None if name == "verifier" else RewardScorer(checkpoint.resolve(name))

    return load(cfg.scorer), load(cfg.step_scorer)


def solve(model, problem: dict, strategy: str, n: int, cfg: ReasoningConfig, scorers=(None, None)) -> test_time.Answer:
    prompt = problem["question"] + verifiers.STEP_DELIMITER
    oracle = verifiers.VerifierScorer(problem)
    scorer = (scorers[1] or oracle) if strategy == "step_beam_search" else (scorers[0] or oracle)
    budget = n * cfg.max_tokens * (cfg.max_steps if strategy == "step_beam_search" else 1)
    common = dict(budget_tokens=budget, temperature=cfg.temperature, seed=cfg.seed)
    if strategy == "greedy":
        return test_time.greedy(model, prompt, verifiers.answer_of, cfg.max_tokens)
    if strategy == "majority_vote":
        return test_time.majority_vote(model, prompt, verifiers.answer_of, n, max_tokens=cfg.max_tokens, **common)
    if strategy in ("best_of_n", "weighted_vote"):
        run = test_time.best_of_n if strategy == "best_of_n" else test_time.weighted_vote
        return run(model, scorer, prompt, verifiers.answer_of, n, max_tokens=cfg.max_tokens, **common)
    width = max(1, round(n**0.5))
    return test_time.step_beam_search(
        model, scorer, prompt, verifiers.answer_of, width, max(1, n // width), max_step_tokens=cfg.max_tokens,
        max_steps=cfg.max_steps, **common,
    )  # fmt: skip


def run_reasoning(model, cfg: ReasoningConfig) -> dict:
    """{strategy: {N: accuracy, generated tokens per problem}} and the curve's points."""
    problems = read_problems(cfg.problems, cfg.limit)
    scorers = open_scorers(cfg)
    result: dict = {"problems": len(problems), "scorer": cfg.scorer, "step_scorer": cfg.step_scorer, "strategies": {}}
    for strategy in cfg.strategies:
        counts = [1] if strategy == "greedy" else cfg.samples
        rows = {}
        for n in counts:
            answers = [solve(model, p, strategy, n, cfg, scorers) for p in problems]
            correct = [a.answer is not None and verifiers.verify({**p, "answer": a.answer}) is None
                       for a, p in zip(answers, problems)]  # fmt: skip
            rows[str(n)] = {
                "accuracy": sum(correct) / len(problems),
                "tokens_per_problem": statistics.fmean(a.tokens for a in answers),
                "correct": sum(correct),
            }
        result["strategies"][strategy] = rows
    return result


def plot(result: dict, path: str) -> None:
    """Accuracy against generated tokens per problem, one line per strategy."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy, rows in result["strategies"].items():
        points = sorted((r["tokens_per_problem"], r["accuracy"]) for r in rows.values())
        ax.plot(*zip(*points), marker="o", label=strategy)
    ax.set_xscale("log")
    ax.set_xlabel("generated tokens per problem")
    ax.set_ylabel("verified accuracy")
    ax.set_title(f"{result['problems']} held-out problems")
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    storage.write_bytes_atomic(path, buffer.getvalue())
