"""The trained offensive-language classifier: alt-profanity-check's linear SVM (calibrated, over
TF-IDF word n-grams), trained on labelled offensive-language data and shipped inside its wheel, so
it runs offline, in microseconds per text, with no model download.

What it knows: English insults, slurs, profanity and abusive threats. What it does not: other
languages (it scores them low), and polite requests for dangerous instructions ("how to
synthesize sarin" holds no offensive word); the blocklist and, when configured, a Hugging Face
classifier or a generative judge cover those (see `harm.HarmScorer`). Its probability falls as a
text grows around one offensive sentence (TF-IDF vectors are normalised over the whole text).
"""

from __future__ import annotations

import numpy as np

from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)

# Texts to check the direct computation against the package's own, once per load.
PROBES = ["you are a stupid idiot", "kill the process and restart it", "the river floods in spring", ""]


class OffensiveLanguageClassifier:
    """`__call__(texts)` -> the probability of each text being offensive, in [0, 1].

    The model is an ensemble of linear SVMs, each with a sigmoid calibration, averaged
    (scikit-learn's CalibratedClassifierCV). Its `predict_proba` spends ~10x the arithmetic in
    per-call checks, which a streaming guardrail pays on every release; the same arithmetic is
    done here directly, in one sparse matrix product, and checked against `predict_proba` at
    load (on a mismatch, as after a change of the package's model, `predict_proba` is used)."""

    def __init__(self):
        try:
            # the package loads its vectorizer and model (joblib pickles) once, at import
            from profanity_check import profanity_check as package
        except ImportError as e:
            raise ImportError(
                "harm.offensive_language needs alt-profanity-check (a dependency of lmfoundry: "
                "pip install -e .), or set harm.offensive_language: false"
            ) from e
        self.vectorizer, self.model = package.vectorizer, package.model
        self.direct = None
        try:
            members = self.model.calibrated_classifiers_
            self.direct = (
                np.stack([m.estimator.coef_[0] for m in members], 1),  # (features, members)
                np.array([m.estimator.intercept_[0] for m in members]),
                np.array([m.calibrators[0].a_ for m in members]),
                np.array([m.calibrators[0].b_ for m in members]),
            )
            same = np.allclose(self._direct(PROBES), self.model.predict_proba(self.vectorizer.transform(PROBES))[:, 1])
        except (AttributeError, IndexError, ValueError):
            same = False
        if not same:
            logger.warning("offensive-language model: not the expected calibrated linear ensemble; using predict_proba")
            self.direct = None

    def _direct(self, texts: list[str]) -> np.ndarray:
        weights, bias, a, b = self.direct
        decision = self.vectorizer.transform(texts) @ weights + bias  # (texts, members)
        return (1.0 / (1.0 + np.exp(a * decision + b))).mean(1)  # _SigmoidCalibration, averaged

    def __call__(self, texts: list[str]) -> list[float]:
        texts = list(texts)
        if not texts:
            return []
        if self.direct is not None:
            return self._direct(texts).tolist()
        return self.model.predict_proba(self.vectorizer.transform(texts))[:, 1].tolist()
