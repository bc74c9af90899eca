"""Heuristic document filters. Each is a plain function of the text returning a drop reason or
None, testable without Ray; `HeuristicFilter` runs them in order and reports the first reason.

Thresholds default to the published ones: Gopher (Rae et al. 2021, appendix A "MassiveText
quality filters"), with repetition rules from the same appendix.
"""

from __future__ import annotations

import re
from collections import Counter

from pydantic import Field

from lmfoundry.platform.config import StageConfig

_WORD = re.compile(r"\S+")
_ALPHA = re.compile(r"[^\W\d_]", re.UNICODE)


class HeuristicFilterConfig(StageConfig):
    # Gopher: keep documents of 50 to 100,000 words.
    min_words: int = Field(50, ge=0)
    max_words: int = Field(100_000, ge=1)
    # Gopher: mean word length between 3 and 10 characters.
    min_mean_word_length: float = Field(3.0, ge=0)
    max_mean_word_length: float = Field(10.0, gt=0)
    # Gopher: symbol-to-word ratio below 0.1 for hash symbols and for ellipses.
    max_symbol_word_ratio: float = Field(0.1, ge=0)
    # Gopher: 80% of words contain at least one alphabetic character.
    min_alpha_word_fraction: float = Field(0.8, ge=0, le=1)
    # Gopher repetition: fraction of duplicate lines below 0.3, of characters in them below 0.2.
    max_duplicate_line_fraction: float = Field(0.3, ge=0, le=1)
    max_duplicate_line_char_fraction: float = Field(0.2, ge=0, le=1)
    # Gopher repetition: the most frequent word 2-gram covers at most 20% of characters.
    max_top_2gram_char_fraction: float = Field(0.2, ge=0, le=1)


def word_count_reason(words: list[str], cfg: HeuristicFilterConfig) -> str | None:
    if len(words) < cfg.min_words:
        return "too_few_words"
    if len(words) > cfg.max_words:
        return "too_many_words"
    return None


def mean_word_length_reason(words: list[str], cfg: HeuristicFilterConfig) -> str | None:
    mean = sum(len(w) for w in words) / max(len(words), 1)
    if mean < cfg.min_mean_word_length:
        return "mean_word_length_too_short"
    if mean > cfg.max_mean_word_length:
        return "mean_word_length_too_long"
    return None


def symbol_ratio_reason(text: str, words: list[str], cfg: HeuristicFilterConfig) -> str | None:
    symbols = text.count("#") + text.count("...") + text.count("\u2026")
    if symbols / max(len(words), 1) > cfg.max_symbol_word_ratio:
        return "symbol_word_ratio"
    return None


def alpha_words_reason(words: list[str], cfg: HeuristicFilterConfig) -> str | None:
    alpha = sum(1 for w in words if _ALPHA.search(w))
    if alpha / max(len(words), 1) < cfg.min_alpha_word_fraction:
        return "too_few_alphabetic_words"
    return None


def duplicate_lines_reason(text: str, cfg: HeuristicFilterConfig) -> str | None:
    lines = [line for line in text.split("\n") if line.strip()]
    if not lines:
        return None
    counts = Counter(lines)
    dup_lines = sum(c for c in counts.values() if c > 1)
    dup_chars = sum(len(line) * c for line, c in counts.items() if c > 1)
    if dup_lines / len(lines) > cfg.max_duplicate_line_fraction:
        return "duplicate_lines"
    if dup_chars / max(sum(len(line) for line in lines), 1) > cfg.max_duplicate_line_char_fraction:
        return "duplicate_line_chars"
    return None


def top_2gram_reason(words: list[str], cfg: HeuristicFilterConfig) -> str | None:
    if len(words) < 2:
        return None
    grams = Counter(zip(words, words[1:]))
    (a, b), count = grams.most_common(1)[0]
    if count < 2:
        return None
    covered = count * (len(a) + len(b))
    if covered / max(sum(len(w) for w in words), 1) > cfg.max_top_2gram_char_fraction:
        return "top_2gram_repetition"
    return None


class HeuristicFilter:
    """Applies the rules in order; returns None to keep a document, or the first drop reason."""

    def __init__(self, cfg: HeuristicFilterConfig | None = None):
        self.cfg = cfg or HeuristicFilterConfig()

    def __call__(self, text: str) -> str | None:
        cfg = self.cfg
        words = _WORD.findall(text)
        return (
            word_count_reason(words, cfg)
            or mean_word_length_reason(words, cfg)
            or symbol_ratio_reason(text, words, cfg)
            or alpha_words_reason(words, cfg)
            or duplicate_lines_reason(text, cfg)
            or top_2gram_reason(words, cfg)
        )
