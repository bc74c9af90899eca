"""The serving guardrails: the harm scorer in front of a model's input and behind its output."""

from __future__ import annotations

from lmfoundry.platform.config import StageConfig
from lmfoundry.safety.harm import HarmConfig, HarmScorer
from lmfoundry.safety.normalize import fold_with_index


class GuardrailsConfig(StageConfig):
    enabled: bool = True
    harm: HarmConfig = HarmConfig()


class Guardrail:
    """One harm threshold over texts: `check(text)` gives (blocked, score)."""

    def __init__(self, harm: HarmConfig):
        self.scorer = HarmScorer(harm)
        self.threshold = harm.threshold
        # Folded characters a stream holds back: a blocklist term not yet complete in the text so
        # far starts inside the last `window` characters of the folded text.
        self.window = max(len(t) for t in self.scorer.blocklist.folded_terms)

    def check(self, text: str) -> tuple[bool, float]:
        score = self.scorer([text])[0]
        return self.scorer.harmful(score), score

    def blocks(self, text: str) -> bool:
        return bool(text) and self.check(text)[0]


class StreamGate:
    """Releases a generated text piece by piece, only what the guardrail has passed.

    `feed(delta)` adds text and returns what may be sent now. What is held back is measured in
    folded text (safety/normalize.py), so invisible characters or runs of spaces cannot stretch a
    term past the window:
    - the last `window` folded characters (a blocklist term not yet complete starts inside them);
    - everything from the first blocklist term found, whatever its weight, until the end: a term
      that alone scores under the threshold can add up with a later one, and a reply that is
      blocked in the end must not have sent any of its terms.
    The blocklist reads the whole text at every delta (a regex: cheap). Every scorer (the trained
    classifier, a model, a judge) reads it when at least `release_chars` more characters could
    leave: both the whole text so far and the prefix about to leave must pass, so nothing is
    sent that every scorer has not passed, at a cost of one scoring per `release_chars`
    characters rather than per token. `finish()` checks the whole text and returns the rest.
    Either returns None when the text is blocked; after that the stream must end with
    finish_reason `content_filter` and send nothing more.
    """

    def __init__(self, guard: Guardrail, release_chars: int = 64):
        self.guard = guard
        self.release_chars = release_chars
        self.text = ""
        self.released = 0  # characters of `text` already given out
        self.blocked = False

    def feed(self, delta: str) -> str | None:
        if self.blocked:
            return None
        self.text += delta
        folded, index = fold_with_index(self.text)
        blocklist = self.guard.scorer.blocklist
        if self.guard.scorer.harmful(blocklist.score_folded(folded)):
            self.blocked = True
            return None
        cut = self._safe_end(folded, index)
        if cut - self.released < self.release_chars:
            return ""
        if self.guard.blocks(self.text):
            self.blocked = True
            return None
        # The prefix is checked on its own too: a term that only the text after the cut keeps from
        # matching (a word boundary) must not leave while the client would see it whole.
        if self.guard.blocks(self.text[:cut]):
            return ""
        return self._release(cut)

    def _safe_end(self, folded: str, index: list[int]) -> int:
        """The raw index up to which the text may leave: before the held-back folded window and
        before the first blocklist term found."""
        held_from = len(folded) - self.guard.window
        first = self.guard.scorer.blocklist.pattern.search(folded)
        if first is not None:
            held_from = min(held_from, first.start())
        if held_from <= 0:
            return 0
        return index[held_from] if held_from < len(index) else len(self.text)

    def finish(self, delta: str = "") -> str | None:
        if self.blocked:
            return None
        self.text += delta
        if self.guard.blocks(self.text):
            self.blocked = True
            return None
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out, self.released = self.text[self.released : upto], upto
        return out
