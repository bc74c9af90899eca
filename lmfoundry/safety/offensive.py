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


class OffensiveLanguageClassifier:
    """`__call__(texts)` -> the probability of each text being offensive, in [0, 1]."""

    def __init__(self):
        try:
            # the package loads its vectorizer and model (joblib pickles) once, at import
            from profanity_check import predict_prob
        except ImportError as e:
            raise ImportError(
                "harm.offensive_language needs alt-profanity-check (a dependency of lmfoundry: "
                "pip install -e .), or set harm.offensive_language: false"
            ) from e
        self._predict_prob = predict_prob

    def __call__(self, texts: list[str]) -> list[float]:
        if not texts:
            return []
        return [float(p) for p in self._predict_prob(list(texts))]
