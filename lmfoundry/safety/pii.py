"""PII redaction: e-mail addresses, phone numbers, IP addresses, credit-card numbers and IBANs,
replaced by typed placeholders.

Patterns find candidates; validators decide (Luhn for cards, ISO 13616 mod-97 and the country's
length for IBANs, `ipaddress` for IPs, digit counts and separators for phones), so version
numbers, dates, times and code are left alone.
"""

from __future__ import annotations

import ipaddress
import re

from lmfoundry.platform.config import StageConfig

PII_TYPES = ("email", "phone", "ip_address", "credit_card", "iban")


class PIIConfig(StageConfig):
    enabled: bool = True
    types: list[str] = list(PII_TYPES)
    placeholder: str = "<{TYPE}>"  # e.g. <EMAIL>, <CREDIT_CARD>


_DIGIT = re.compile(r"\d")
_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9-]{1,63}\.)+[A-Za-z]{2,24}\b")
# Four dotted octets, not part of a longer dotted run (1.2.3.4.5) and not glued to letters.
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w]|\.\d)")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
_VERSION_CONTEXT = re.compile(r"\b(?:version|release|build|ver\.?|v)\s*$", re.IGNORECASE)
# 13 to 19 digits in groups separated by single spaces or hyphens.
_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b")
# International (+CC ...) or North American (NXX) NXX-XXXX, with consistent separators.
_PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]\d{2,4}){1,4}"
    r"|\(\d{3}\) ?\d{3}[ .-]\d{4}|\d{3}([.-])\d{3}\1\d{4})(?![\w])"
)
# ISO 13616 IBAN lengths by country (the common ones; others are checked by mod-97 alone).
IBAN_LENGTHS = {
    "AD": 24,
    "AT": 20,
    "BE": 16,
    "BG": 22,
    "CH": 21,
    "CY": 28,
    "CZ": 24,
    "DE": 22,
    "DK": 18,
    "EE": 20,
    "ES": 24,
    "FI": 18,
    "FR": 27,
    "GB": 22,
    "GR": 27,
    "HR": 21,
    "HU": 28,
    "IE": 22,
    "IS": 26,
    "IT": 27,
    "LI": 21,
    "LT": 20,
    "LU": 20,
    "LV": 21,
    "MC": 27,
    "MT": 31,
    "NL": 18,
    "NO": 15,
    "PL": 28,
    "PT": 25,
    "RO": 24,
    "SE": 24,
    "SI": 19,
    "SK": 24,
    "SM": 27,
    "TR": 26,
}
# Issuer prefixes of the major card networks (Visa, Mastercard, Amex, Discover, JCB, Diners, UnionPay).
_CARD_PREFIX = re.compile(r"^(?:4|5[1-5]|2[2-7]|3[47]|3[068]|6011|65|64[4-9]|35|62)")


def luhn_valid(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def iban_valid(candidate: str) -> bool:
    iban = candidate.replace(" ", "")
    expected = IBAN_LENGTHS.get(iban[:2])
    if expected is not None and len(iban) != expected:
        return False
    if not 15 <= len(iban) <= 34:
        return False
    moved = iban[4:] + iban[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _is_card(m: re.Match) -> bool:
    s = m.group(0)
    seps = {c for c in s if not c.isdigit()}
    if len(seps) > 1:
        return False
    digits = "".join(c for c in s if c.isdigit())
    return bool(_CARD_PREFIX.match(digits)) and luhn_valid(digits)


def _is_ipv4(m: re.Match, text: str) -> bool:
    if _VERSION_CONTEXT.search(text[max(0, m.start() - 12) : m.start()]):
        return False
    try:
        ipaddress.IPv4Address(m.group(0))
    except ValueError:
        return False
    return True


def _is_ipv6(m: re.Match) -> bool:
    s = m.group(0)
    if s.count(":") < 2 or not any(c.isalnum() for c in s):
        return False
    try:
        ipaddress.IPv6Address(s)
    except ValueError:
        return False
    # Clock times and ratios (12:30:45) are not IPv6 addresses: ipaddress refuses them already,
    # but "::" alone or "1::" in code (slices) is refused here.
    return sum(c.isalnum() for c in s) >= 4


def _is_phone(m: re.Match) -> bool:
    digits = sum(c.isdigit() for c in m.group(0))
    return 10 <= digits <= 15


class PIIRedactor:
    """`redact(text)` -> (text with placeholders, {type: count})."""

    def __init__(self, cfg: PIIConfig | None = None):
        self.cfg = cfg or PIIConfig()
        unknown = set(self.cfg.types) - set(PII_TYPES)
        if unknown:
            raise ValueError(f"unknown PII types {sorted(unknown)}; allowed: {list(PII_TYPES)}")

    def _tag(self, kind: str) -> str:
        return self.cfg.placeholder.replace("{TYPE}", kind.upper())

    def redact(self, text: str) -> tuple[str, dict[str, int]]:
        counts = dict.fromkeys(self.cfg.types, 0)
        # Order matters: e-mails before IPs (user@10.0.0.1), cards and IBANs before phones.
        steps = [
            ("email", _EMAIL, lambda m: True),
            ("iban", _IBAN, lambda m: iban_valid(m.group(0))),
            ("credit_card", _CARD, _is_card),
            ("ip_address", _IPV4, lambda m: _is_ipv4(m, text_now)),
            ("ip_address", _IPV6, _is_ipv6),
            ("phone", _PHONE, _is_phone),
        ]
        text_now = text
        for kind, pattern, valid in steps:
            if kind not in counts or not _may_contain(kind, text_now):
                continue

            def swap(m, kind=kind, valid=valid):
                if not valid(m):
                    return m.group(0)
                counts[kind] += 1
                return self._tag(kind)

            text_now = pattern.sub(swap, text_now)
        return text_now, counts


def _may_contain(kind: str, text: str) -> bool:
    """Cheap tests that skip a regex pass on most documents."""
    if kind == "email":
        return "@" in text
    if kind == "ip_address":
        return "." in text or ":" in text
    return _DIGIT.search(text) is not None
