"""Automatic step labels for a process reward model, the way Math-Shepherd (Wang et al., 2024)
makes them: a step is good when completions that start from it reach the verified answer.

For each problem the policy writes `solutions` sampled solutions; for each step k of each, it
writes `completions` continuations of the solution up to and including step k, and the step's
soft label is the share of them whose final answer the verifier accepts. The hard label is 1 when
that share is at least `threshold` (Math-Shepherd's "hard estimation" is a threshold just above
0: any completion that reaches the answer). The ground-truth labels of verifiers.step_labels are
kept beside them, so the labels' agreement with the truth is measured, not assumed.
"""

from __future__ import annotations

from lmfoundry.reasoning import verifiers
from lmfoundry.reasoning.test_time import Sampler


def reaches_answer(problem: dict, text: str) -> bool:
    answer = verifiers.answer_of(text)
    return answer is not None and verifiers.verify({**problem, "answer": answer}) is None


def label_problem(
    sampler: Sampler,
    problem: dict,
    solutions: int,
    completions: int,
    max_tokens: int,
    temperature: float,
    threshold: float,
    seed: int,
) -> list[dict]:
    """One row {prompt, steps, labels, soft_labels, true_labels, solved} per sampled solution
    with at least one step."""
    prompt = problem["question"] + verifiers.STEP_DELIMITER
    rows = []
    for s, (text, _) in enumerate(sampler.continuations(prompt, solutions, max_tokens, temperature, seed)):
        steps = verifiers.split_steps(text)
        if not steps:
            continue
        soft = []
        for k in range(len(steps)):
            head = prompt + "".join(step + verifiers.STEP_DELIMITER for step in steps[: k + 1])
            tails = sampler.continuations(head, completions, max_tokens, temperature, seed + 1000 * (s + 1) + k)
            soft.append(sum(reaches_answer(problem, head + tail) for tail, _ in tails) / completions)
        rows.append(
            {
                "id": problem.get("id"),
                "prompt": prompt,
                "steps": steps,
                "labels": [float(x >= threshold) for x in soft],
                "soft_labels": soft,
                "true_labels": [float(x) for x in verifiers.step_labels(problem, verifiers.STEP_DELIMITER.join(steps))],
                "solved": reaches_answer(problem, text),
            }
        )
    return rows


def agreement(rows: list[dict]) -> dict:
    """How often the estimated labels equal the ground truth, per step."""
    pairs = [(a, b) for r in rows for a, b in zip(r["labels"], r["true_labels"])]
    if not pairs:
        return {"steps": 0}
    positives = [a for a, b in pairs if b == 1.0]
    negatives = [a for a, b in pairs if b == 0.0]
    return {
        "steps": len(pairs),
        "agreement": sum(a == b for a, b in pairs) / len(pairs),
        "true_steps_labelled_good": sum(positives) / len(positives) if positives else None,
        "false_steps_labelled_bad": (len(negatives) - sum(negatives)) / len(negatives) if negatives else None,
    }
