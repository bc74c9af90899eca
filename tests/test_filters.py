from lmfoundry.data.curate import DocumentProcessor, CurateConfig, mark_exact_duplicates
from lmfoundry.data.filters import HeuristicFilter, HeuristicFilterConfig
from lmfoundry.data.normalize import normalize_text
from lmfoundry.data.sample_corpus import stdlib_documents

PROSE = ("The quick brown fox jumps over the lazy dog while the farmer watches from the porch. "
         "Later that evening the family gathered to discuss the harvest and the weather ahead. ") * 4


def test_normalize_nfc_controls_whitespace_and_boilerplate():
    raw = "Cafe\u0301\x07  menu\r\nWe use cookies to track you.\nHome | About | Contact\n\n\n\nBody   text"
    text, removed = normalize_text(raw)
    assert text == "Caf\u00e9 menu\n\nBody text"
    assert removed == 2


def test_clean_prose_is_kept():
    assert HeuristicFilter()(PROSE) is None


def test_each_rule_has_its_own_reason():
    f = HeuristicFilter()
    assert f("too short") == "too_few_words"
    assert f(" ".join(["a"] * 80)) == "mean_word_length_too_short"
    assert f(" ".join(["supercalifragilistic"] * 80)) == "mean_word_length_too_long"
    assert f(PROSE + " #tag" * 30) == "symbol_word_ratio"
    assert f(PROSE + " 1234 5678" * 30) == "too_few_alphabetic_words"
    assert f("\n".join(["the same line of text here"] * 20)) == "duplicate_lines"
    assert f(PROSE + " buy now" * 60) == "top_2gram_repetition"


def test_thresholds_are_configurable():
    assert HeuristicFilter(HeuristicFilterConfig(min_words=2))("too short") is None


def test_most_stdlib_docstrings_pass_the_filters():
    docs = stdlib_documents(200)
    kept = sum(HeuristicFilter()(normalize_text(d)[0]) is None for d in docs)
    assert kept / len(docs) > 0.75


def test_document_processor_without_ray_derives_ids_and_reasons():
    import pyarrow as pa

    proc = DocumentProcessor(CurateConfig(input="x", output="y"))
    out = proc(pa.table({"text": [PROSE, "short", None], "path": ["/d/a.jsonl"] * 3}))
    assert out.column("reason").to_pylist() == ["", "too_few_words", "text_not_a_string"]
    ids = out.column("id").to_pylist()
    assert len(set(ids)) == 3 and all(i.startswith("a.jsonl:") for i in ids)
    assert proc(pa.table({"text": [PROSE], "path": ["/d/a.jsonl"]})).column("id")[0].as_py() == ids[0]


def test_exact_duplicates_keep_the_smallest_id_only():
    import pandas as pd

    g = pd.DataFrame({"id": ["b", "a", "c"], "reason": ["", "", "too_few_words"], "text_hash": ["h"] * 3})
    out = mark_exact_duplicates(g.copy())
    assert out.set_index("id")["reason"].to_dict() == {"a": "", "b": "exact_duplicate", "c": "too_few_words"}
    assert out.set_index("id")["duplicate_of"]["b"] == "a"
