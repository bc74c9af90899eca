"""Harm scoring: a weighted blocklist and a trained offensive-language classifier by default, plus,
when configured, a local Hugging Face classifier and a generative safety judge. A text's score is
the largest of its scorers' (each in [0, 1]); at or above `threshold` it is harmful.

Each scorer covers what the others miss: the blocklist names the phrases of mass harm that no
offensive word marks ("synthesize sarin"); the classifier (`offensive.py`), trained on labelled
data, finds insults, slurs and abusive threats in wordings nobody listed; a Hugging Face model
(`hf_classifier.py`) and a judge (`judge.py`) bring what the operator has, in more languages.
The same scorer serves curation (a filter), serving (guardrails), evaluation and red teaming
(the judge of a reply); `benchmarks/harm_scorers.py` gives each one's precision and recall on the
labelled set in `harm_eval.jsonl`.

Blocklist score: 1 - exp(-sum of the weights of the terms found), so one weight-1 term scores
0.63 and the score rises towards 1 as terms accumulate. Terms match whole words, case-insensitive,
in folded text (safety/normalize.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from lmfoundry.platform.config import StageConfig
from lmfoundry.safety.hf_classifier import HeadActivation
from lmfoundry.safety.judge import JudgeConfig
from lmfoundry.safety.normalize import fold

# A small default: phrases whose presence marks text a pretraining corpus should not keep
# (instructions for mass harm, incitement, sexual content involving minors). Real deployments
# bring their own list (one term per line, optionally "term<TAB>weight").
DEFAULT_BLOCKLIST = {
    "how to make a bomb": 1.0,
    "build a pipe bomb": 1.0,
    "make nerve gas": 1.0,
    "synthesize sarin": 1.0,
    "weaponize anthrax": 1.0,
    "child pornography": 1.0,
    "child sexual abuse material": 1.0,
    "kill all the": 0.7,
    "kill yourself": 1.0,
    "ethnic cleansing now": 1.0,
    "school shooting plan": 1.0,
    "buy stolen credit cards": 1.0,
    "ransomware as a service": 0.5,
}


class HarmConfig(StageConfig):
    enabled: bool = True
    blocklist: str | None = Field(None, description="file of terms, one per line, optional '<TAB>weight'")
    threshold: float = Field(0.5, gt=0, le=1, description="texts scoring at or above are harmful")
    offensive_language: bool = Field(
        True, description="the trained offensive-language classifier shipped in alt-profanity-check (English)"
    )
    # A local Hugging Face sequence-classification model directory, and the labels that mean harm.
    model: str | None = None
    harmful_labels: list[str] = Field(["toxic", "harmful", "unsafe", "LABEL_1"], min_length=1)
    model_activation: HeadActivation = Field(
        "auto", description="auto: sigmoid for a multi-label head (config.problem_type), else softmax"
    )
    model_max_tokens: int = Field(512, ge=8)
    judge: JudgeConfig | None = Field(None, description="a Llama-Guard-style judge at an OpenAI-compatible endpoint")


def read_blocklist(path: str) -> dict[str, float]:
    terms: dict[str, float] = {}
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        term, _, weight = line.partition("\t")
        try:
            terms[term.strip().lower()] = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ValueError(f"{path}:{n}: weight {weight!r} is not a number (format: term<TAB>weight)") from None
    if not terms:
        raise ValueError(f"blocklist {path} holds no terms")
    return terms


class Blocklist:
    """`__call__(texts)` -> blocklist scores; `matches(text)` -> the (folded) terms found."""

    def __init__(self, terms: dict[str, float]):
        # terms are matched in folded text (safety/normalize.py), so they are folded the same way
        self.folded_terms = {fold(t).strip(): w for t, w in terms.items()}
        alternation = "|".join(re.escape(t) for t in sorted(self.folded_terms, key=len, reverse=True))
        self.pattern = re.compile(rf"(?<!\w)(?:{alternation})(?!\w)")

    def matches(self, text: str) -> list[str]:
        """Other spellings of a term (homoglyphs, invisible characters, fullwidth letters, accents,
        case, spacing) match it too."""
        return [m.group(0) for m in self.pattern.finditer(fold(text))]

    def score_folded(self, folded: str) -> float:
        """The score of a text already folded (a stream folds once per delta)."""
        return 1.0 - math.exp(-sum(self.folded_terms.get(m.group(0), 1.0) for m in self.pattern.finditer(folded)))

    def score(self, text: str) -> float:
        return self.score_folded(fold(text))

    def __call__(self, texts: list[str]) -> list[float]:
        return [self.score(t) for t in texts]


class HarmScorer:
    """`__call__(texts)` -> scores in [0, 1]; `by_scorer(texts)` -> each scorer's scores."""

    def __init__(self, cfg: HarmConfig | None = None):
        self.cfg = cfg or HarmConfig()
        self.blocklist = Blocklist(read_blocklist(self.cfg.blocklist) if self.cfg.blocklist else DEFAULT_BLOCKLIST)
        self.scorers: dict[str, Callable[[list[str]], list[float]]] = {"blocklist": self.blocklist}
        if self.cfg.offensive_language:
            from lmfoundry.safety.offensive import OffensiveLanguageClassifier

            self.scorers["offensive_language"] = OffensiveLanguageClassifier()
        if self.cfg.model:
            from lmfoundry.safety.hf_classifier import HFClassifier

            self.scorers["model"] = HFClassifier(
                self.cfg.model, self.cfg.harmful_labels, self.cfg.model_max_tokens, self.cfg.model_activation
            )
        if self.cfg.judge is not None:
            from lmfoundry.safety.judge import GenerativeJudge

            self.scorers["judge"] = GenerativeJudge(self.cfg.judge)

    def matches(self, text: str) -> list[str]:
        """The (folded) blocklist terms in `text`."""
        return self.blocklist.matches(text)

    def by_scorer(self, texts: list[str]) -> dict[str, list[float]]:
        return {name: scorer(texts) for name, scorer in self.scorers.items()}

    def __call__(self, texts: list[str]) -> list[float]:
        texts = list(texts)
        if not texts:
            return []
        return [max(scores) for scores in zip(*self.by_scorer(texts).values())]

    def harmful(self, score: float) -> bool:
        return score >= self.cfg.threshold
