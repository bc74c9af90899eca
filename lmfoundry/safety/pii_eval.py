"""A labelled PII set, generated deterministically, and the redactor's recall and precision on it.

Every example holds at most one PII value: positives of every type in several formats, and hard
negatives that look like PII but are not (versions, dates, times, ISBNs, non-Luhn card-length
numbers, SSNs the SSA never issues, IBANs with a wrong check, bare order numbers).
"""

from __future__ import annotations

import random

from lmfoundry.safety.pii import PIIRedactor

TEMPLATES = ("Contact: {} (ask for Sam).", "Please use {} for this.", "{}", "Record 7: value {} noted.")


def _luhn_complete(prefix: str, length: int, rng: random.Random) -> str:
    body = prefix + "".join(rng.choice("0123456789") for _ in range(length - len(prefix) - 1))
    for check in "0123456789":
        digits = body + check
        total = sum(
            (d * 2 - 9 if d * 2 > 9 else d * 2) if i % 2 else d for i, d in enumerate(int(c) for c in reversed(digits))
        )
        if total % 10 == 0:
            return digits
    raise AssertionError("unreachable")


def _iban(country: str, length: int, rng: random.Random) -> str:
    bban = "".join(rng.choice("0123456789") for _ in range(length - 4))
    moved = bban + country + "00"
    check = 98 - int("".join(str(int(c, 36)) for c in moved)) % 97
    return f"{country}{check:02d}{bban}"


def _grouped(s: str, sep: str = " ") -> str:
    return sep.join(s[i : i + 4] for i in range(0, len(s), 4))


def _positives(rng: random.Random) -> list[tuple[str, str]]:
    out = []
    for i in range(12):
        out.append((f"user{i}.{rng.choice(['doe', 'li', 'ng'])}@example{i}.org", "email"))
    d = lambda n: "".join(rng.choice("0123456789") for _ in range(n))  # noqa: E731
    for _ in range(5):
        out.append((f"(212) 555-{rng.randint(1000, 9999)}", "phone"))  # US
        out.append((f"020 7946 {d(4)}", "phone"))  # UK London
        out.append((f"030 {rng.randint(1000000, 9999999)}", "phone"))  # DE Berlin
        out.append((f"01 {d(2)} {d(2)} {d(2)} {d(2)}", "phone"))  # FR Paris
        out.append((f"098{d(3)} {d(5)}", "phone"))  # IN mobile with trunk 0
        out.append((f"+49 30 {rng.randint(1000000, 9999999)}", "phone"))
        out.append((f"+91 98{d(3)} {d(5)}", "phone"))
    for _ in range(8):
        out.append((f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}", "ip_address"))
    out.append(("2001:db8::8a2e:370:7334", "ip_address"))
    out.append(("fe80::1ff:fe23:4567:890a", "ip_address"))
    for prefix, length in [("4", 16), ("51", 16), ("37", 15), ("6011", 16), ("5018", 12), ("6759", 19), ("2201", 16)]:
        for sep in ("", " ", "-"):
            number = _luhn_complete(prefix, length, rng)
            out.append((_grouped(number, sep) if sep else number, "credit_card"))
    for country, length in [("DE", 22), ("GB", 22), ("FR", 27), ("ES", 24), ("NL", 18)]:
        iban = _iban(country, length, rng) if country != "GB" else None
        if iban is None:  # a GB IBAN has a bank code of letters
            bban = "WEST" + d(14)
            check = 98 - int("".join(str(int(c, 36)) for c in bban + "GB00")) % 97
            iban = f"GB{check:02d}{bban}"
        out += [(iban, "iban"), (_grouped(iban), "iban"), (_grouped(iban).lower(), "iban"), (iban.lower(), "iban")]
    for _ in range(12):
        area = rng.choice([n for n in range(1, 900) if n != 666])
        sep = rng.choice("- ")
        out.append((f"{area:03d}{sep}{rng.randint(1, 99):02d}{sep}{rng.randint(1, 9999):04d}", "us_ssn"))
    return out


def _negatives(rng: random.Random) -> list[str]:
    out = [
        "release 1.2.3.4",
        "v10.0.19041",
        "10.0.19041.1",
        "version 2.4.1.7",
        "Python 3.11.4",
        "2024-01-15",
        "15/01/2024",
        "01.02.2024",
        "2023.10.05",
        "12:30:45",
        "16:9",
        "ISBN 978-3-16-148410-0",
        "x[1:2:3]",
        "3.14159265358979",
        "1000000007",
        "order 9876543210",
        "invoice 2025550143",
        "a1b2c3d4e5f6a7b8",
        "RFC 2616 section 14.9",
        "DE89 3704 0044 0532 0130 01",
        "de00 1234 5678 9012 3456 78",
        "000-12-3456",
        "666-12-3456",
        "912-12-3456",
        "123-00-4567",
        "123-45-0000",
    ]
    for _ in range(40):
        number = _luhn_complete(rng.choice(["4", "51", "6011"]), 16, rng)
        bad = number[:-1] + str((int(number[-1]) + rng.randint(1, 9)) % 10)
        out.append(rng.choice([bad, _grouped(bad), _grouped(bad, "-")]))
    for _ in range(20):
        out.append(f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}")
        out.append(f"{rng.randint(0, 20)}.{rng.randint(0, 30)}.{rng.randint(0, 99999)}")
    return out


def labelled_set(seed: int = 0) -> list[tuple[str, str | None]]:
    """(text, PII type or None), the same for a given seed."""
    rng = random.Random(seed)
    examples = [(rng.choice(TEMPLATES).format(v), kind) for v, kind in _positives(rng)]
    examples += [(rng.choice(TEMPLATES).format(v), None) for v in _negatives(rng)]
    return examples


def score(redactor: PIIRedactor, examples: list[tuple[str, str | None]] | None = None) -> dict:
    """Recall and precision per PII type the redactor handles, on the labelled set: an example
    counts as found for a type when the redactor replaced at least one value of that type."""
    examples = labelled_set() if examples is None else examples
    out = {}
    results = [(redactor.redact(text)[1], kind) for text, kind in examples]
    for kind in redactor.cfg.types:
        labelled = sum(k == kind for _, k in results)
        flagged = sum(counts.get(kind, 0) > 0 for counts, _ in results)
        hits = sum(counts.get(kind, 0) > 0 and k == kind for counts, k in results)
        out[kind] = {
            "examples": labelled,
            "recall": hits / labelled if labelled else None,
            "precision": hits / flagged if flagged else None,
        }
    negatives = [counts for counts, k in results if k is None]
    out["_set"] = {
        "examples": len(examples),
        "hard_negatives": len(negatives),
        "false_alarms_on_negatives": sum(any(c.values()) for c in negatives),
    }
    return out
