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
        # Characters a stream holds back: a blocklist term not yet complete in the text so far
        # starts inside the last `window` characters, so nothing of it has been released.
        self.window = max(len(t) for t in self.scorer.terms)

    def check(self, text: str) -> tuple[bool, float]:
        score = self.scorer([text])[0]
        return self.scorer.harmful(score), score

    def blocks(self, text: str) -> bool:
        return bool(text) and self.check(text)[0]


class StreamGate:
    """Releases a generated text piece by piece, only what the guardrail has passed.

    `feed(delta)` adds text and returns what may be sent now: the text so far minus a held-back
    window, once both the whole text so far and the released prefix pass (a term that straddles
    the cut, or two deltas, is seen whole before any of it leaves). `finish()` checks the whole
    text and returns the rest. Either returns None when the text is blocked; after that the
    stream must end with finish_reason `content_filter` and send nothing more.
    """

    def __init__(self, guard: Guardrail):
        self.guard = guard
        self.text = ""
        self.released = 0  # characters of `text` already given out
        self.blocked = False

    def feed(self, delta: str) -> str | None:
        if self.blocked:
            return None
        self.text += delta
        if self.guard.blocks(self.text):
            self.blocked = True
            return None
        cut = len(self.text) - self.guard.window
        # The prefix is checked on its own too: a term that only the text after the cut keeps from
        # matching (a word boundary) must not leave while the client would see it whole.
        if cut <= self.released or self.guard.blocks(self.text[:cut]):
            return ""
        return self._release(cut)

    def finish(self, delta: str = "") -> str | None:
        if self.feed(delta) is None:
            return None
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out, self.released = self.text[self.released : upto], upto
        return out
