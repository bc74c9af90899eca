"""The statistics the suites report: rates with their Wilson intervals (platform/stats.py),
expected calibration error."""

from __future__ import annotations

from lmfoundry.platform.stats import wilson_interval


def rate(flags: list[bool]) -> dict:
    """{"rate", "count", "n", "ci95"} of a list of yes/no outcomes."""
    k, n = sum(map(bool, flags)), len(flags)
    low, high = wilson_interval(k, n)
    return {"rate": k / n if n else 0.0, "count": k, "n": n, "ci95": [low, high]}


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
