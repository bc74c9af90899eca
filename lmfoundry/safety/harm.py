"""Harm scoring: a weighted blocklist (the user's file, or a small default) and, optionally, any
local Hugging Face sequence-classification model. A document's score is the larger of the two.

Blocklist score: 1 - exp(-sum of the weights of the terms found), so one weight-1 term scores
0.63 and the score rises towards 1 as terms accumulate. Terms match whole words, case-insensitive.
The same scorer serves curation (a filter with a threshold) and serving (guardrails).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from pydantic import Field

from lmfoundry.platform.config import StageConfig
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
    threshold: float = Field(0.5, gt=0, le=1, description="documents scoring at or above are dropped")
    # A local Hugging Face sequence-classification model directory, and the labels that mean harm.
    model: str | None = None
    harmful_labels: list[str] = ["toxic", "harmful", "unsafe", "LABEL_1"]
    model_max_tokens: int = Field(512, ge=8)


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


class HarmScorer:
    """`__call__(texts)` -> scores in [0, 1]; `matches(text)` -> the blocklist terms found."""

    def __init__(self, cfg: HarmConfig | None = None):
        self.cfg = cfg or HarmConfig()
        self.terms = read_blocklist(self.cfg.blocklist) if self.cfg.blocklist else dict(DEFAULT_BLOCKLIST)
        # terms are matched in folded text (safety/normalize.py), so they are folded the same way
        self.folded_terms = {fold(t).strip(): w for t, w in self.terms.items()}
        alternation = "|".join(re.escape(t) for t in sorted(self.folded_terms, key=len, reverse=True))
        self.pattern = re.compile(rf"(?<!\w)(?:{alternation})(?!\w)")
        self.model = None
        if self.cfg.model:
            self._load_model()

    def _load_model(self):
        try:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as e:
            raise ImportError("harm.model needs transformers: pip install 'lmfoundry[curation-models]'") from e
        import torch

        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.cfg.model).eval()
        labels = self.model.config.id2label
        self.harm_ids = [i for i, name in labels.items() if name in self.cfg.harmful_labels]
        if not self.harm_ids:
            raise ValueError(
                f"harm model {self.cfg.model} has labels {list(labels.values())}; none is in "
                f"harmful_labels {self.cfg.harmful_labels}"
            )
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device)

    def matches(self, text: str) -> list[str]:
        """The (folded) blocklist terms in `text`: other spellings of a term (homoglyphs,
        invisible characters, fullwidth letters, accents, case, spacing) match it too."""
        return [m.group(0) for m in self.pattern.finditer(fold(text))]

    def blocklist_score(self, text: str) -> float:
        weight = sum(self.folded_terms.get(t, 1.0) for t in self.matches(text))
        return 1.0 - math.exp(-weight)

    def __call__(self, texts: list[str]) -> list[float]:
        scores = [self.blocklist_score(t) for t in texts]
        if self.model is not None and texts:
            import torch

            enc = self.tokenizer(
                texts, truncation=True, max_length=self.cfg.model_max_tokens, padding=True, return_tensors="pt"
            ).to(self.device)
            with torch.no_grad():
                probs = self.model(**enc).logits.softmax(-1)[:, self.harm_ids].sum(-1).tolist()
            scores = [max(a, b) for a, b in zip(scores, probs)]
        return scores

    def harmful(self, score: float) -> bool:
        return score >= self.cfg.threshold
