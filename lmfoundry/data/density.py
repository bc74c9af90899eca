"""Knowledge density: how much of a document is specific information rather than glue.

Definition. A word is *specific* when it names or quantifies something: it holds a digit
(quantities, dates, versions, identifiers), or it is capitalised somewhere other than at the start
of a sentence (people, places, products, defined terms), or it has eight or more letters (the
technical and domain vocabulary of alphabetic languages). The knowledge density of a document is
the number of *distinct* specific words divided by the number of words:

    density = |{specific words}| / words

Distinct, so that repeating a name or a keyword does not raise it: keyword spam and templated
pages score low, reference text, documentation and encyclopaedic prose score high, and chatty
filler sits in between. Why this measure: pretraining on knowledge-dense text (textbooks,
documentation) buys more capability per token (Gunasekar et al. 2023, "Textbooks Are All You
Need"), and this proxy needs no model, runs at filter speed and reads the same in every
language written with spaces. Languages written without spaces get no score (None): a
whitespace word there is a clause.
"""

from __future__ import annotations

import re

from pydantic import Field

from lmfoundry.data.filters import NO_SPACE_LANGUAGES
from lmfoundry.platform.config import StageConfig

_PUNCTUATION = "\"'()[]{}<>.,;:!?\u201c\u201d\u2018\u2019\u00ab\u00bb-*_`"
_DIGIT = re.compile(r"\d")
_LETTERS = re.compile(r"[^\W\d_]")
_SENTENCE_END = (".", "!", "?", ":", "\u3002")


class DensityConfig(StageConfig):
    enabled: bool = True
    high_density_threshold: float = Field(0.15, ge=0, le=1, description="a document at or above is 'high density'")


def knowledge_density(text: str, lang: str = "") -> float | None:
    if lang in NO_SPACE_LANGUAGES:
        return None
    raw = text.split()
    if not raw:
        return 0.0
    specific: set[str] = set()
    sentence_start = True
    for token in raw:
        word = token.strip(_PUNCTUATION)
        if word:
            if word.isalpha():
                if len(word) >= 8 or (not sentence_start and word[0].isupper()):
                    specific.add(word.lower())
            elif _DIGIT.search(word) or (not sentence_start and word[0].isupper()) or len(_LETTERS.findall(word)) >= 8:
                specific.add(word.lower())
        sentence_start = token.endswith(_SENTENCE_END)
    return len(specific) / len(raw)
