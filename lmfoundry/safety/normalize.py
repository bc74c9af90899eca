"""Text as a filter should read it: the spellings that look or read the same fold to one form.

Compatibility forms (fullwidth, ligatures) are decomposed, accents and other combining marks
dropped, invisible characters (zero-width, soft hyphen) removed, letters of other scripts that
look like Latin ones (homoglyphs) read as Latin, case folded, and every run of whitespace read as
one space. Each character folds on its own, so every folded character knows the raw character it
came from: a streaming guardrail can hold back exactly the raw text a partial match covers.
"""

from __future__ import annotations

import re
import unicodedata

# Letters from other scripts that look like Latin ones (homoglyphs), read as the Latin letter.
HOMOGLYPHS = str.maketrans(
    "аеорсухіјѕԁɡοαειντκρАЕОРСХІЈВМНТКΑΕΟΡΤΙΚΝΒΜ",
    "aeopcyxijsdgoaeivtkpAEOPCXIJBMHTKAEOPTIKNBM",
)
INVISIBLE = re.compile("[\u200b-\u200f\u2060-\u2064\ufeff\u00ad\u034f\u180e]")


def _fold_char(c: str) -> str:
    if INVISIBLE.match(c):
        return ""
    if c.isspace():
        return " "
    decomposed = unicodedata.normalize("NFKD", c)
    kept = "".join(d for d in decomposed if not unicodedata.combining(d))
    return kept.translate(HOMOGLYPHS).casefold()


def fold_with_index(text: str) -> tuple[str, list[int]]:
    """(folded text, for each folded character the index of the raw character it came from)."""
    out: list[str] = []
    index: list[int] = []
    for i, c in enumerate(text):
        for f in _fold_char(c):
            if f == " " and out and out[-1] == " ":
                continue  # a run of whitespace reads as one space
            out.append(f)
            index.append(i)
    return "".join(out), index


def fold(text: str) -> str:
    return fold_with_index(text)[0]
