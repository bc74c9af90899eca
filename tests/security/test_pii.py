"""PII redaction against hard cases: SSNs, national phone formats, spaced and lower-case IBANs,
Maestro and Mir cards, and look-alikes that must be left alone; its scores in the curation report."""

import pytest

from lmfoundry.data.report import pii_quality
from lmfoundry.safety.pii import PIIConfig, PIIRedactor, ssn_valid
from lmfoundry.safety.pii_eval import labelled_set, score

pytestmark = pytest.mark.timeout(120)

FOUND = [
    ("SSN 123-45-6789 on file", "us_ssn"),
    ("SSN 078 05 1120 on file", "us_ssn"),
    ("US (212) 555-0187 please", "phone"),
    ("UK 020 7946 0958 please", "phone"),
    ("DE 030 12345678 please", "phone"),
    ("DE 0211 1234567 please", "phone"),
    ("FR 01 23 45 67 89 please", "phone"),
    ("IN 098765 43210 please", "phone"),
    ("pay de89 3704 0044 0532 0130 00 now", "iban"),
    ("pay DE89 3704 0044 0532 0130 00 for rent", "iban"),
    ("pay gb82west12345698765432 now", "iban"),
    ("Maestro 6759 6498 2643 8453 now", "credit_card"),
    ("Maestro 501800000009 now", "credit_card"),
    ("Mir 2200 0000 0000 0004 now", "credit_card"),
]
LEFT_ALONE = [
    "SSN-like 000-12-3456",
    "SSN-like 666-12-3456",
    "SSN-like 912-12-3456",
    "SSN-like 123-00-4567",
    "SSN-like 123-45-0000",
    "build v10.0.19041 shipped",
    "version 1.2.3.4 shipped",
    "dates 15/01/2024 and 01.02.2024",
    "Mir-like 2200 0000 0000 0005 (bad Luhn)",
    "Maestro-like 6759 6498 2643 8454 (bad Luhn)",
    "iban-like de89 3704 0044 0532 0130 01 (bad check)",
    "order 9876543210 shipped",
    "hash 4111111111111112",
]


@pytest.mark.parametrize("text,kind", FOUND)
def test_pii_in_national_and_spaced_formats_is_redacted(text, kind):
    out, counts = PIIRedactor().redact(text)
    assert counts[kind] == 1 and sum(counts.values()) == 1, (out, counts)
    assert f"<{kind.upper()}>" in out


@pytest.mark.parametrize("text", LEFT_ALONE)
def test_look_alikes_that_are_not_pii_are_left_alone(text):
    out, counts = PIIRedactor().redact(text)
    assert out == text and sum(counts.values()) == 0, (out, counts)


def test_ssn_rules():
    assert ssn_valid("123", "45", "6789")
    assert not any(ssn_valid(a, g, s) for a, g, s in [("000", "1", "1"), ("666", "12", "1234"), ("987", "65", "4321")])
    assert not ssn_valid("123", "00", "4567") and not ssn_valid("123", "45", "0000")


def test_a_trailing_word_does_not_hide_an_iban():
    out, counts = PIIRedactor().redact("to ES90 1744 6660 2234 5007 6279 for rent")
    assert out == "to <IBAN> for rent" and counts["iban"] == 1


def test_unknown_phone_region_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown phone_regions.*allowed"):
        PIIRedactor(PIIConfig(phone_regions=["XX"]))


def test_labelled_set_is_large_deterministic_and_scores_high():
    examples = labelled_set()
    assert examples == labelled_set() and len(examples) >= 200
    kinds = {k for _, k in examples}
    assert kinds == {None, "email", "phone", "ip_address", "credit_card", "iban", "us_ssn"}
    result = score(PIIRedactor())
    for kind in ("email", "phone", "ip_address", "credit_card", "iban", "us_ssn"):
        assert result[kind]["recall"] >= 0.95 and result[kind]["precision"] >= 0.95, (kind, result[kind])
    assert result["_set"]["false_alarms_on_negatives"] == 0


def test_scores_can_fail_a_redactor_that_misses_a_type():
    only_emails = score(PIIRedactor(PIIConfig(types=["email", "phone"], phone_regions=["US"])))
    assert only_emails["phone"]["recall"] < 0.6  # UK, DE, FR, IN national formats are not found
    assert "iban" not in only_emails


def test_curation_report_section_uses_the_configured_redactor():
    section = pii_quality(PIIConfig(types=["us_ssn", "iban"]))
    assert section["enabled"] and set(section) >= {"us_ssn", "iban"} and "phone" not in section
    assert section["us_ssn"]["recall"] == 1.0
    assert pii_quality(PIIConfig(enabled=False)) == {"enabled": False}
