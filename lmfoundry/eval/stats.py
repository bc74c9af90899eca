"""The statistics the suites report: rates with their Wilson intervals (platform/stats.py),
Newcombe intervals for the difference of two rates (the gate's test), expected calibration error."""

from __future__ import annotations

import math

from lmfoundry.platform.stats import wilson_interval


def rate(flags: list[bool]) -> dict:
    """{"rate", "count", "n", "ci95"} of a list of yes/no outcomes."""
    k, n = sum(map(bool, flags)), len(flags)
    low, high = wilson_interval(k, n)
    return {"rate": k / n if n else 0.0, "count": k, "n": n, "ci95": [low, high]}


def rate_difference_interval(k1: int, n1: int, k2: int, n2: int, z: float = 1.96) -> tuple[float, float]:
    """95% (by default) interval of p2 - p1 for two independent binomial rates k1/n1 and k2/n2:
    Newcombe's hybrid score interval (method 10 of Newcombe, 1998), built from the two Wilson
    intervals. Unlike the Wald interval it keeps its coverage at small n and at rates of 0 or 1,
    which is where evaluation suites of a few dozen prompts live."""
    if n1 == 0 or n2 == 0:
        return -1.0, 1.0
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson_interval(k1, n1, z)
    l2, u2 = wilson_interval(k2, n2, z)
    d = p2 - p1
    return d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2), d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)


def expected_calibration_error(confidences: list[float], correct: list[bool], bins: int = 10) -> float:
    """Sum over equal-width confidence bins of (bin share) x |accuracy - mean confidence| (Guo
    et al., 2017). 0 is perfectly calibrated; always answering A with certainty scores 1 - acc."""
    if len(confidences) != len(correct):
        raise ValueError("confidences and correct differ in length")
    n, total = len(confidences), 0.0
    for b in range(bins):
        low, high = b / bins, (b + 1) / bins
        members = [i for i, c in enumerate(confidences) if (low < c <= high) or (b == 0 and c == 0)]
        if members:
            accuracy = sum(correct[i] for i in members) / len(members)
            confidence = sum(confidences[i] for i in members) / len(members)
            total += len(members) / n * abs(accuracy - confidence)
    return total
