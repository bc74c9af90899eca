"""The serving guardrails: the harm scorer in front of a model's input and behind its output."""

from __future__ import annotations

from lmfoundry.platform.config import StageConfig
from lmfoundry.safety.harm import HarmConfig, HarmScorer


class GuardrailsConfig(StageConfig):
    enabled: bool = True
    harm: HarmConfig = HarmConfig()


class Guardrail:
    """One harm threshold over texts: `check(text)` gives (blocked, score)."""

    def __init__(self, harm: HarmConfig):
        self.scorer = HarmScorer(harm)
        self.threshold = harm.threshold

    def check(self, text: str) -> tuple[bool, float]:
        score = self.scorer([text])[0]
        return self.scorer.harmful(score), score
