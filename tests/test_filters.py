"""Every heuristic rule on crafted inputs: one that keeps, one that drops; the defaults on good text
that is not English web prose."""

import pytest
from texts import (
    CHINESE,
    FRENCH,
    GERMAN,
    JAPANESE,
    KEYWORD_SALADS,
    KEYWORDS,
    NAVIGATION,
    PROSE,
    RUSSIAN,
    SHORT_FOREIGN_TECH,
    SPAM,
    SPANISH,
    TECH_DOC,
)

from lmfoundry.data.filters import (
    C4Config,
    DocumentView,
    FineWebConfig,
    GopherQualityConfig,
    GopherRepetitionConfig,
    HeuristicFilter,
    HeuristicFilterConfig,
    c4_clean,
    duplicate_ngram_char_fraction,
    fineweb_reason,
    gopher_quality_reason,
    gopher_repetition_reason,
    top_ngram_char_fraction,
)
from lmfoundry.data.normalize import normalize_text
from lmfoundry.data.sample_corpus import stdlib_documents

GQ, GR, C4, FW = GopherQualityConfig(), GopherRepetitionConfig(), C4Config(), FineWebConfig()


def gq(text, lang="en", **cfg):
    return gopher_quality_reason(DocumentView(text), lang, GQ.model_copy(update=cfg))


def gr(text, lang="en", **cfg):
    return gopher_repetition_reason(DocumentView(text), lang, GR.model_copy(update=cfg))


def test_normalize_nfc_controls_whitespace_and_boilerplate():
    raw = "Cafe\u0301\x07  menu\r\nWe use cookies to track you.\nHome | About | Contact\n\n\n\nBody   text"
    text, removed = normalize_text(raw)
    assert text == "Caf\u00e9 menu\n\nBody text"
    assert removed == 2


@pytest.mark.parametrize(
    "name,text,lang",
    [
        ("english prose", PROSE, "en"),
        ("technical documentation", TECH_DOC, "en"),
        ("german", GERMAN, "de"),
        ("french", FRENCH, "fr"),
        ("spanish", SPANISH, "es"),
        ("russian", RUSSIAN, "ru"),
        ("chinese", CHINESE, "zh"),
        ("japanese", JAPANESE, "ja"),
    ],
)
def test_defaults_keep_good_text_of_every_kind(name, text, lang):
    assert HeuristicFilter()(text, lang)[1] is None, name


@pytest.mark.parametrize("name,text", [("spam", SPAM), ("keyword list", KEYWORDS), ("navigation", NAVIGATION)])
def test_defaults_drop_web_noise(name, text):
    assert HeuristicFilter()(text, "en")[1] is not None, name
    assert HeuristicFilter()(text, "")[1] is not None, name  # language unknown: the general rules still drop it


def test_gopher_quality_rules_each_keep_and_drop():
    assert gq(PROSE) is None
    assert gq("too short") == "gopher_too_few_words"
    assert gq(PROSE, max_words=60) == "gopher_too_many_words"
    assert gq(" ".join(["a"] * 80)) == "gopher_mean_word_length_too_short"
    assert gq(" ".join(["supercalifragilistic"] * 80)) == "gopher_mean_word_length_too_long"
    assert gq(PROSE + " #tag" * 30) == "gopher_symbol_word_ratio"
    bullets = "\n".join(f"- item number {i} of the list with the words to count" for i in range(20))
    assert gq(bullets) == "gopher_bullet_lines"
    assert gq(bullets, max_bullet_lines_fraction=1.0) is None
    ellipses = "\n".join(f"and then the story of the day number {i} went on..." for i in range(12))
    assert gq(ellipses, max_symbol_word_ratio=1.0) == "gopher_ellipsis_lines"
    assert gq(PROSE + " 1234 5678" * 30) == "gopher_too_few_alphabetic_words"
    no_stop = " ".join(["farmer watches porch evening family gathered discuss harvest weather"] * 8)
    assert gq(no_stop) == "gopher_too_few_stop_words"


def test_the_stop_word_rule_applies_to_english_only():
    no_stop = " ".join(["farmer watches porch evening family gathered discuss harvest weather"] * 8)
    assert gq(no_stop, lang="de") is None
    assert gq(GERMAN, lang="de") is None
    assert gq(GERMAN, lang="en") == "gopher_too_few_stop_words"


def test_gopher_repetition_rules_each_keep_and_drop():
    assert gr(PROSE) is None
    assert (
        gr("\n".join(["the same line of text here"] * 20)) == "gopher_duplicate_paragraphs"
        or gr("\n".join(["the same line of text here"] * 20)) == "gopher_duplicate_lines"
    )
    lines = "\n".join(["the same line of text here"] * 20)
    assert (
        gr(lines, max_duplicate_paragraph_fraction=1, max_duplicate_paragraph_char_fraction=1)
        == "gopher_duplicate_lines"
    )
    paragraphs = "\n\n".join([PROSE.split("\n\n")[0]] * 3 + ["A different closing paragraph that ends the page."])
    assert gr(paragraphs) == "gopher_duplicate_paragraphs"
    one_long_repeat = PROSE + "\n" + "\n".join([PROSE.split(". ")[0]] * 5)
    assert gr(one_long_repeat, max_duplicate_line_fraction=1.0) == "gopher_duplicate_line_chars"
    assert gr(PROSE + " buy now" * 60) == "gopher_top_2gram"
    assert gr(PROSE + " buy it now" * 45, max_top_ngram_char_fraction={3: 0.18}) == "gopher_top_3gram"
    repeated_phrase = PROSE + " " + " ".join(["the farmer watches the harvest from the porch"] * 6)
    assert gr(repeated_phrase, max_top_ngram_char_fraction={}) == "gopher_duplicate_5grams"


def test_ngram_fractions_match_the_definitions():
    doc = DocumentView("a b a b a b")
    # the 2-gram "a b" occurs 3 times, each 3 characters with its inner space: 9 of 11
    assert top_ngram_char_fraction(doc, 2) == pytest.approx(9 / 11)
    doc = DocumentView("x y z x y z q")
    # "x y z" repeats once after its first occurrence: 5 of 13 characters
    assert duplicate_ngram_char_fraction(doc, 3) == pytest.approx(5 / 13)
    assert duplicate_ngram_char_fraction(DocumentView("one two three four five six"), 2) == 0


def test_word_based_rules_skip_languages_written_without_spaces():
    assert gq(CHINESE, lang="zh") == "gopher_too_few_words"  # a whitespace "word" there is a clause ...
    assert HeuristicFilter()(CHINESE, "zh")[1] is None  # ... so the filter does not apply the word rules
    assert HeuristicFilter()("\n".join([CHINESE[:40]] * 10), "zh")[1] == "gopher_duplicate_lines"


def test_c4_rules_each_keep_and_drop():
    assert c4_clean(PROSE, C4)[1] is None
    assert c4_clean(PROSE + "\nLorem ipsum dolor sit amet.", C4)[1] == "c4_lorem_ipsum"
    assert c4_clean(PROSE + "\nint f() { return 1; }", C4)[1] is None  # off by default: keeps code
    assert (
        c4_clean(PROSE + "\nint f() { return 1; }", C4.model_copy(update={"drop_curly_bracket": True}))[1]
        == "c4_curly_bracket"
    )
    assert c4_clean("One sentence. Two sentences.", C4)[1] == "c4_too_few_sentences"
    text, reason, removed = c4_clean(
        PROSE + "\nPlease enable JavaScript to view this page.\nRead our privacy policy.", C4
    )
    assert reason is None and removed == 2 and "JavaScript" not in text and "privacy" not in text
    text, _, _ = c4_clean(
        PROSE.replace("porch.", "porch.[1]") + "\nSee history [edit] and [citation needed] notes.", C4
    )
    assert "[1]" not in text and "[edit]" not in text
    strict = C4.model_copy(update={"require_terminal_punctuation": True, "min_words_per_line": 3})
    text, reason, removed = c4_clean(PROSE + "\nMenu\nnot ending in punctuation here", strict)
    assert reason is None and removed == 2


def test_fineweb_rules_each_keep_and_drop():
    assert fineweb_reason(DocumentView(PROSE), FW) is None
    no_punct = "\n".join(f"a line of words number {i} without an ending mark" for i in range(20))
    assert fineweb_reason(DocumentView(no_punct), FW) == "fineweb_line_punctuation"
    short = "\n".join(["Short line."] * 2 + [f"Item {i}." for i in range(10)] + [PROSE[:200]])
    assert fineweb_reason(DocumentView(short), FW) == "fineweb_short_lines"
    dup = PROSE + "\nThis sentence appears twice in the page.\nThis sentence appears twice in the page."
    assert fineweb_reason(DocumentView(dup), FW) == "fineweb_duplicate_line_chars"
    listy = "\n".join(f"{w} again." for w in PROSE.split()[:40])
    assert (
        fineweb_reason(
            DocumentView(listy),
            FW.model_copy(update={"max_short_line_fraction": 1.0, "max_duplicate_line_char_fraction": 1.0}),
        )
        == "fineweb_list_ratio"
    )


def test_rule_sets_apply_only_to_their_languages():
    dup = PROSE + "\nThis sentence appears twice in the page.\nThis sentence appears twice in the page."
    for lang in ("en", "de", ""):  # FineWeb's line rules: every spaced language, and unknown ones
        assert HeuristicFilter()(dup, lang)[1] == "fineweb_duplicate_line_chars", lang
    english_only = HeuristicFilterConfig(fineweb=FineWebConfig(languages=["en"]))
    assert HeuristicFilter(english_only)(dup, "de")[1] is None
    few_sentences = PROSE.replace(". ", ", ")  # one long sentence
    assert HeuristicFilter()(few_sentences, "en")[1] == "c4_too_few_sentences"
    assert HeuristicFilter()(few_sentences, "de")[1] is None  # C4 is an English rule set


def test_keyword_salad_of_no_language_is_dropped_and_short_foreign_technical_text_kept():
    """Lingua names a language for keyword salads (Latin, German, Croatian, ... often at full
    confidence: its confidence is relative to its other languages), so no confidence threshold
    catches them; FineWeb's line rules, which hold for every spaced language, do."""
    from lmfoundry.data.langid import LanguageConfig, LanguageIdentifier

    identify = LanguageIdentifier(LanguageConfig())
    english_only = HeuristicFilter(HeuristicFilterConfig(fineweb=FineWebConfig(languages=["en"])))
    for text, (lang, _) in zip(KEYWORD_SALADS, identify(KEYWORD_SALADS)):
        assert lang not in ("", "en") and english_only(text, lang)[1] is None  # kept, with FineWeb English-only
        assert HeuristicFilter()(text, lang)[1] == "fineweb_line_punctuation", text[:60]
        assert HeuristicFilter()(text, "")[1] == "fineweb_line_punctuation", text[:60]
    for text, (lang, _) in zip(SHORT_FOREIGN_TECH, identify(SHORT_FOREIGN_TECH)):
        assert lang not in ("", "en")
        assert HeuristicFilter()(text, lang)[1] is None, text[:60]
        assert HeuristicFilter()(text, "")[1] is None, text[:60]


def test_thresholds_are_configurable():
    cfg = HeuristicFilterConfig(gopher_quality=GopherQualityConfig(min_words=2), c4=C4Config(min_sentences=0))
    assert HeuristicFilter(cfg)("the cat and the dog slept on the warm kitchen floor.", "en")[1] is None


def test_most_stdlib_docstrings_pass_the_filters():
    docs = stdlib_documents(200)
    kept = sum(HeuristicFilter()(normalize_text(d)[0], "en")[1] is None for d in docs)
    assert kept / len(docs) > 0.7
