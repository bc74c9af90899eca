"""Heuristic document filters with the published rules and thresholds.

Four rule sets, each a plain function of a `DocumentView` (the text split once into words, lines
and paragraphs) that returns a drop reason or None, testable without Ray:

- Gopher quality    Rae et al. 2021, "Scaling Language Models: Methods, Analysis & Insights from
                    Training Gopher", appendix A.1.1 (MassiveText quality filter).
- Gopher repetition the same appendix, table A1 (repetition removal).
- C4                Raffel et al. 2020, "Exploring the Limits of Transfer Learning", section 2.2.
- FineWeb           Penedo et al. 2024, "The FineWeb Datasets", section 3.3 (custom filters).

Words are whitespace-separated, as Gopher defines them. C4 and the Gopher stop-word rule apply to
English, the languages they were built for; the other Gopher rules and FineWeb's line rules
(punctuation, short lines, repeated lines, lists: nothing in them is a word of one language, and
FineWeb-2 applies them to every language) to every language that separates words with spaces,
and to text whose language is unknown (""). In languages written without spaces (Chinese,
Japanese, Thai, ...) a "word" is a whole clause and a line need not end in punctuation, so there
only the line and paragraph repetition rules run.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

import numpy as np
from pydantic import Field

from lmfoundry.platform.config import StageConfig

_ALPHA = re.compile(r"[^\W\d_]", re.UNICODE)
_BULLET = ("\u2022", "\u2023", "\u25e6", "\u2043", "\u2219", "-", "*", "\u25cf", "\u25aa")
_ELLIPSIS = ("...", "\u2026")
_TERMINAL = (".", "!", "?", '"', "'", "\u3002", "\uff01", "\uff1f", "\u061f", "\u0964")
# Languages whose script does not separate words with spaces (ISO 639-1).
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "km", "my", "bo"})
ANY = "*"
# Gopher: "the, be, to, of, and, that, have, with" - a document needs at least two of them.
GOPHER_STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
# C4 drops lines that mention any of these (its "policy" lines).
C4_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f]+(?:\s|$)")


class GopherQualityConfig(StageConfig):
    enabled: bool = True
    languages: list[str] = Field([ANY], description="ISO 639-1 codes the rules apply to; '*' = all spaced languages")
    min_words: int = Field(50, ge=0)  # Gopher: 50 to 100,000 words
    max_words: int = Field(100_000, ge=1)
    min_mean_word_length: float = Field(3.0, ge=0)  # Gopher: mean word length 3 to 10 characters
    max_mean_word_length: float = Field(10.0, gt=0)
    max_symbol_word_ratio: float = Field(0.1, ge=0)  # Gopher: '#' and ellipses per word below 0.1
    max_bullet_lines_fraction: float = Field(0.9, ge=0, le=1)  # Gopher: at most 90% of lines start with a bullet
    max_ellipsis_lines_fraction: float = Field(0.3, ge=0, le=1)  # Gopher: at most 30% end with an ellipsis
    min_alpha_word_fraction: float = Field(0.8, ge=0, le=1)  # Gopher: 80% of words hold a letter
    min_stop_words: int = Field(2, ge=0)  # Gopher: at least two English stop words ...
    stop_word_languages: list[str] = ["en"]  # ... a rule made for English only


class GopherRepetitionConfig(StageConfig):
    enabled: bool = True
    languages: list[str] = [ANY]
    # Gopher table A1: duplicate lines / paragraphs as a fraction of lines and of characters.
    max_duplicate_line_fraction: float = Field(0.3, ge=0, le=1)
    max_duplicate_paragraph_fraction: float = Field(0.3, ge=0, le=1)
    max_duplicate_line_char_fraction: float = Field(0.2, ge=0, le=1)
    max_duplicate_paragraph_char_fraction: float = Field(0.2, ge=0, le=1)
    # Gopher table A1: the most frequent n-gram's characters as a fraction of the document's.
    max_top_ngram_char_fraction: dict[int, float] = {2: 0.20, 3: 0.18, 4: 0.16}
    # Gopher table A1: characters in n-grams that occur more than once.
    max_duplicate_ngram_char_fraction: dict[int, float] = {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}


class C4Config(StageConfig):
    enabled: bool = True
    languages: list[str] = ["en"]  # C4 is an English corpus
    # Document rules of C4.
    drop_lorem_ipsum: bool = True
    # C4 drops any page with a curly bracket to remove code; that removes technical documentation
    # too, which this platform keeps by default. Turn on for web-prose-only corpora.
    drop_curly_bracket: bool = False
    min_sentences: int = Field(5, ge=0)  # C4: pages with fewer than 5 sentences
    # Line rules of C4 (they edit the document rather than drop it).
    remove_javascript_lines: bool = True
    remove_policy_lines: bool = True
    remove_citations: bool = True  # Wikipedia-style [1], [edit], [citation needed]
    max_word_length: int = Field(1000, ge=1)  # C4: lines with a word over 1,000 characters
    # C4 keeps only lines ending in terminal punctuation and with 3+ words. Both strip code,
    # headings and list items from technical text; FineWeb turned the first off. Off by default.
    require_terminal_punctuation: bool = False
    min_words_per_line: int = Field(0, ge=0)


class FineWebConfig(StageConfig):
    enabled: bool = True
    # FineWeb built these rules for English; they look at lines and punctuation, not at words of a
    # language, and FineWeb-2 applies them to every language it covers. They run on every spaced
    # language and on text of no identifiable language, whose keyword salads pass every other
    # rule (see docs/curation.md, "Text of no identifiable language").
    languages: list[str] = [ANY]
    min_line_punctuation_fraction: float = Field(0.12, ge=0, le=1)  # lines ending in terminal punctuation
    short_line_length: int = Field(30, ge=1)
    max_short_line_fraction: float = Field(0.67, ge=0, le=1)  # lines of <= 30 characters
    max_duplicate_line_char_fraction: float = Field(0.01, ge=0, le=1)  # characters in repeated lines
    max_newline_word_ratio: float = Field(0.3, ge=0)  # newlines per word: lists


class HeuristicFilterConfig(StageConfig):
    gopher_quality: GopherQualityConfig = GopherQualityConfig()
    gopher_repetition: GopherRepetitionConfig = GopherRepetitionConfig()
    c4: C4Config = C4Config()
    fineweb: FineWebConfig = FineWebConfig()


def applies(languages: list[str], lang: str, word_based: bool = False) -> bool:
    """Whether a rule set scoped to `languages` runs on a document in `lang` ('' = unknown)."""
    if word_based and lang in NO_SPACE_LANGUAGES:
        return False
    return ANY in languages or lang in languages


class DocumentView:
    """The text split once, shared by every rule."""

    __slots__ = ("text", "words", "lines", "paragraphs", "_word_ids", "_char_ends")

    def __init__(self, text: str):
        self.text = text
        self.words = text.split()
        self.lines = [line for line in (raw.strip() for raw in text.split("\n")) if line]
        self.paragraphs = [p for p in (raw.strip() for raw in text.split("\n\n")) if p]
        self._word_ids: list[int] | None = None
        self._char_ends: list[int] | None = None

    @property
    def word_ids(self) -> list[int]:
        """Words as small integers, so n-grams hash as tuples of ints."""
        if self._word_ids is None:
            vocab: dict[str, int] = {}
            self._word_ids = [vocab.setdefault(w, len(vocab)) for w in self.words]
        return self._word_ids

    @property
    def char_ends(self) -> list[int]:
        """char_ends[i] = characters in the first i words (so a span's length is one subtraction)."""
        if self._char_ends is None:
            self._char_ends = [0, *itertools.accumulate(map(len, self.words))]
        return self._char_ends

    def ngram_hashes(self, n: int) -> list[int]:
        """One 64-bit polynomial hash per word n-gram (collisions: ~n^2 / 2^64)."""
        ids = np.asarray(self.word_ids, dtype=np.uint64)
        if len(ids) < n:
            return []
        count = len(ids) - n + 1
        h = ids[:count].copy()
        with np.errstate(over="ignore"):
            for j in range(1, n):
                h = h * np.uint64(1_000_003) + ids[j : j + count]
        return h.tolist()


# -- Gopher quality -----------------------------------------------------------------------------


def gopher_quality_reason(doc: DocumentView, lang: str, cfg: GopherQualityConfig) -> str | None:
    words = doc.words
    n = len(words)
    if n < cfg.min_words:
        return "gopher_too_few_words"
    if n > cfg.max_words:
        return "gopher_too_many_words"
    mean = sum(map(len, words)) / max(n, 1)
    if mean < cfg.min_mean_word_length:
        return "gopher_mean_word_length_too_short"
    if mean > cfg.max_mean_word_length:
        return "gopher_mean_word_length_too_long"
    symbols = doc.text.count("#") + doc.text.count("...") + doc.text.count("\u2026")
    if symbols / max(n, 1) > cfg.max_symbol_word_ratio:
        return "gopher_symbol_word_ratio"
    lines = doc.lines
    if lines:
        if sum(line.startswith(_BULLET) for line in lines) / len(lines) > cfg.max_bullet_lines_fraction:
            return "gopher_bullet_lines"
        if sum(line.endswith(_ELLIPSIS) for line in lines) / len(lines) > cfg.max_ellipsis_lines_fraction:
            return "gopher_ellipsis_lines"
    if sum(1 for w in words if _ALPHA.search(w)) / max(n, 1) < cfg.min_alpha_word_fraction:
        return "gopher_too_few_alphabetic_words"
    if lang in cfg.stop_word_languages and cfg.min_stop_words:
        found = 0
        for w in words:
            if w.lower() in GOPHER_STOP_WORDS:
                found += 1
                if found >= cfg.min_stop_words:
                    break
        else:
            return "gopher_too_few_stop_words"
    return None


# -- Gopher repetition --------------------------------------------------------------------------


def repeated(items: list[str]) -> tuple[int, int]:
    """Occurrences after the first of each item, and their characters (Gopher's duplicate counts)."""
    seen: set[str] = set()
    count = chars = 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


def top_ngram_char_fraction(doc: DocumentView, n: int) -> float:
    """Characters of the most frequent n-gram, all its occurrences, over the document's characters
    (as datatrove computes Gopher's rule, an n-gram measured with its inner spaces)."""
    ids = doc.word_ids
    if len(ids) < n:
        return 0.0
    grams = list(zip(*(ids[i:] for i in range(n))))
    gram, count = Counter(grams).most_common(1)[0]
    if count < 2:
        return 0.0
    i = grams.index(gram)
    gram_chars = sum(len(w) for w in doc.words[i : i + n]) + n - 1
    return count * gram_chars / max(len(doc.text), 1)


def duplicate_ngram_char_fraction(doc: DocumentView, n: int) -> float:
    """Characters of the n-gram occurrences that repeat an earlier one, counted without overlap
    (an occurrence found, the scan jumps past it), over the document's characters."""
    hashes, ends = doc.ngram_hashes(n), doc.char_ends
    seen: set[int] = set()
    chars = i = 0
    last = len(hashes) - 1
    while i <= last:
        h = hashes[i]
        if h in seen:
            chars += ends[i + n] - ends[i] + n - 1
            i += n
        else:
            seen.add(h)
            i += 1
    return chars / max(len(doc.text), 1)


def _has_repeated_ngram(doc: DocumentView, n: int) -> bool:
    hashes = doc.ngram_hashes(n)
    return len(set(hashes)) < len(hashes)


def gopher_repetition_reason(doc: DocumentView, lang: str, cfg: GopherRepetitionConfig) -> str | None:
    text_chars = max(len(doc.text), 1)
    for unit, items, max_fraction, max_chars in (
        ("paragraph", doc.paragraphs, cfg.max_duplicate_paragraph_fraction, cfg.max_duplicate_paragraph_char_fraction),
        ("line", doc.lines, cfg.max_duplicate_line_fraction, cfg.max_duplicate_line_char_fraction),
    ):
        if items:
            count, chars = repeated(items)
            if count / len(items) > max_fraction:
                return f"gopher_duplicate_{unit}s"
            if chars / text_chars > max_chars:
                return f"gopher_duplicate_{unit}_chars"
    if lang in NO_SPACE_LANGUAGES:
        return None
    for n, limit in sorted(cfg.max_top_ngram_char_fraction.items()):
        if top_ngram_char_fraction(doc, n) > limit:
            return f"gopher_top_{n}gram"
    dup_limits = sorted(cfg.max_duplicate_ngram_char_fraction.items())
    if dup_limits and not _has_repeated_ngram(doc, dup_limits[0][0]):
        return None  # no n-gram repeats at the smallest n, so none repeats at a larger one
    for n, limit in dup_limits:
        if duplicate_ngram_char_fraction(doc, n) > limit:
            return f"gopher_duplicate_{n}grams"
    return None


# -- C4 -----------------------------------------------------------------------------------------


def c4_clean(text: str, cfg: C4Config) -> tuple[str | None, str | None, int]:
    """C4's line rules and document rules. Returns (cleaned text, drop reason, lines removed)."""
    kept: list[str] = []
    removed = sentences = 0
    lines = text.split("\n")
    for line in lines:
        stripped = line.strip()
        if not stripped:
            kept.append("")
            continue
        lower = stripped.lower()
        if cfg.drop_lorem_ipsum and "lorem ipsum" in lower:
            return None, "c4_lorem_ipsum", 0
        if cfg.drop_curly_bracket and "{" in stripped:
            return None, "c4_curly_bracket", 0
        words = stripped.split()
        if (
            any(len(w) > cfg.max_word_length for w in words)
            or (cfg.remove_javascript_lines and "javascript" in lower)
            or (cfg.remove_policy_lines and any(p in lower for p in C4_POLICY))
            or (cfg.require_terminal_punctuation and (not stripped.endswith(_TERMINAL) or stripped.endswith(_ELLIPSIS)))
            or len(words) < cfg.min_words_per_line
        ):
            removed += 1
            continue
        if cfg.remove_citations:
            line = _CITATION.sub("", line)
        sentences += len(_SENTENCE_END.findall(stripped + " "))
        kept.append(line)
    if sentences < cfg.min_sentences:
        return None, "c4_too_few_sentences", removed
    return ("\n".join(kept).strip() if removed or cfg.remove_citations else text), None, removed


# -- FineWeb ------------------------------------------------------------------------------------


def fineweb_reason(doc: DocumentView, cfg: FineWebConfig) -> str | None:
    lines = doc.lines
    if not lines:
        return "fineweb_empty"
    if sum(line.endswith(_TERMINAL) for line in lines) / len(lines) < cfg.min_line_punctuation_fraction:
        return "fineweb_line_punctuation"
    if sum(len(line) <= cfg.short_line_length for line in lines) / len(lines) > cfg.max_short_line_fraction:
        return "fineweb_short_lines"
    if repeated(lines)[1] / max(len(doc.text.replace("\n", "")), 1) > cfg.max_duplicate_line_char_fraction:
        return "fineweb_duplicate_line_chars"
    if doc.text.count("\n") / max(len(doc.words), 1) > cfg.max_newline_word_ratio:
        return "fineweb_list_ratio"
    return None


class HeuristicFilter:
    """All rule sets in order. `__call__(text, lang)` returns (text after C4's line edits, the first
    drop reason or None, lines removed by C4)."""

    def __init__(self, cfg: HeuristicFilterConfig | None = None):
        self.cfg = cfg or HeuristicFilterConfig()

    def __call__(self, text: str, lang: str = "en") -> tuple[str, str | None, int]:
        cfg = self.cfg
        removed = 0
        if cfg.c4.enabled and applies(cfg.c4.languages, lang):
            cleaned, reason, removed = c4_clean(text, cfg.c4)
            if reason:
                return text, reason, removed
            text = cleaned
        doc = DocumentView(text)
        reason = None
        if cfg.gopher_quality.enabled and applies(cfg.gopher_quality.languages, lang, word_based=True):
            reason = gopher_quality_reason(doc, lang, cfg.gopher_quality)
        if not reason and cfg.gopher_repetition.enabled and applies(cfg.gopher_repetition.languages, lang):
            reason = gopher_repetition_reason(doc, lang, cfg.gopher_repetition)
        if not reason and cfg.fineweb.enabled and applies(cfg.fineweb.languages, lang, word_based=True):
            reason = fineweb_reason(doc, cfg.fineweb)
        return text, reason, removed
