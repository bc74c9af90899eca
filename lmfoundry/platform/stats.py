"""Statistics more than one stage reports: the Wilson interval of a rate (evaluation's suites and
red teaming, curation's harm audit)."""

from __future__ import annotations

import math


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95% (by default) Wilson score interval of a binomial rate: unlike the normal
    approximation it stays inside [0, 1] and is sensible at 0 or n successes of few trials."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)
