"""PII redaction: e-mail addresses, phone numbers, IP addresses, credit-card numbers, IBANs and
US social security numbers, replaced by typed placeholders.

Patterns find candidates; validators decide (Luhn and issuer ranges for cards, ISO 13616 mod-97
and the country's length for IBANs, `ipaddress` for IPs, the SSA's area/group/serial rules for
SSNs, and Google's libphonenumber metadata, through the `phonenumbers` package, for phone numbers
in the national formats of the configured regions), so version numbers, dates, times and code
are left alone.

Phones use `phonenumbers` because national formats differ per country in trunk prefixes, area
code lengths and valid number ranges (a German 0211 1234567, a French 01 23 45 67 89, an Indian
098765 43210): the library carries that metadata for every region and is kept current. It is
slow when run over whole documents, so a cheap pattern first finds digit runs that could be a
phone and only those are parsed.
"""

from __future__ import annotations

import ipaddress
import re

from lmfoundry.platform.config import StageConfig

PII_TYPES = ("email", "phone", "ip_address", "credit_card", "iban", "us_ssn")
PHONE_REGIONS = ("US", "GB", "DE", "FR", "IN")


class PIIConfig(StageConfig):
    enabled: bool = True
    types: list[str] = list(PII_TYPES)
    placeholder: str = "<{TYPE}>"  # e.g. <EMAIL>, <CREDIT_CARD>
    # national phone formats recognised (ISO 3166 codes); +CC numbers are found for every country
    phone_regions: list[str] = list(PHONE_REGIONS)


_DIGIT = re.compile(r"\d")
_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9-]{1,63}\.)+[A-Za-z]{2,24}\b")
# Four dotted octets, not part of a longer dotted run (1.2.3.4.5) and not glued to letters.
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w]|\.\d)")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
_VERSION_CONTEXT = re.compile(r"\b(?:version|release|build|ver\.?|v)\s*$", re.IGNORECASE)
# 12 to 19 digits in groups separated by single spaces or hyphens (12: Maestro only).
_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){11,18}(?![\d-])")
# Upper or lower case, compact or in groups of four (as printed on statements).
_IBAN = re.compile(r"\b[A-Za-z]{2}\d{2}(?: ?[A-Za-z0-9]{4}){2,7}(?: ?[A-Za-z0-9]{1,3})?\b")
# AAA-GG-SSSS or AAA GG SSSS (one separator kind), not inside a longer number or dashed run.
_SSN = re.compile(r"(?<![\w-])(\d{3})([- ])(\d{2})\2(\d{4})(?![\w]|-\d)")
# Digit runs that may be a phone: optional +, digits with spaces, dots, hyphens, parentheses.
_PHONE_CANDIDATE = re.compile(r"(?<![\w.+/-])\+?\(?\d[\d ().-]{5,22}\d(?![\w]|[.-]\d)")
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
# Issuer prefixes of the major card networks (Visa, Mastercard, Amex, Discover, JCB, Diners,
# UnionPay, Mir 2200-2204), 13 to 19 digits; Maestro (50, 56-58, 63, 67) also comes with 12.
_CARD_PREFIX = re.compile(r"^(?:4|5[1-5]|2[2-7]|3[47]|3[068]|6011|65|64[4-9]|35|62)")
_MAESTRO_PREFIX = re.compile(r"^(?:50|5[6-8]|6[37])")


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
    iban = candidate.replace(" ", "").upper()
    if not candidate.replace(" ", "").isupper() and iban[:2] not in IBAN_LENGTHS:
        return False  # lower or mixed case: only the countries whose length is known, fewer chance hits
    expected = IBAN_LENGTHS.get(iban[:2])
    if expected is not None and len(iban) != expected:
        return False
    if not 15 <= len(iban) <= 34:
        return False
    moved = iban[4:] + iban[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def valid_iban_prefix(candidate: str) -> int:
    """Length of the longest prefix of `candidate` (ending at a group) that is a valid IBAN, 0 if
    none: the pattern may swallow a short word after the number ("... 6279 for")."""
    groups = candidate.split(" ") if " " in candidate else [candidate]
    for n in range(len(groups), 0, -1):
        prefix = " ".join(groups[:n])
        if iban_valid(prefix):
            return len(prefix)
    return 0


def _is_card(m: re.Match) -> bool:
    s = m.group(0)
    seps = {c for c in s if not c.isdigit()}
    if len(seps) > 1:
        return False
    digits = "".join(c for c in s if c.isdigit())
    network = (len(digits) >= 13 and _CARD_PREFIX.match(digits)) or _MAESTRO_PREFIX.match(digits)
    return bool(network) and luhn_valid(digits)


def ssn_valid(area: str, group: str, serial: str) -> bool:
    """The SSA never issues area 000, 666 or 900-999, group 00 or serial 0000."""
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


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


def _phone_spans(candidate: str, regions: list[str]) -> list[tuple[int, int]]:
    """Spans of valid phone numbers inside one candidate digit run. A bare run of digits (no
    separator, no + or trunk 0) is left alone: order numbers and ids look just like that."""
    import phonenumbers

    spans: set[tuple[int, int]] = set()
    for region in regions:
        for m in phonenumbers.PhoneNumberMatcher(candidate, region, leniency=phonenumbers.Leniency.VALID):
            raw = m.raw_string
            if raw.isdigit() and not raw.startswith("0"):
                continue
            if not 7 <= sum(c.isdigit() for c in raw) <= 15:
                continue
            spans.add((m.start, m.end))
    # the longest wins where regions disagree on where a number ends
    kept: list[tuple[int, int]] = []
    for start, end in sorted(spans, key=lambda s: (s[0] - s[1], s[0])):
        if all(end <= a or start >= b for a, b in kept):
            kept.append((start, end))
    return sorted(kept)


class PIIRedactor:
    """`redact(text)` -> (text with placeholders, {type: count})."""

    def __init__(self, cfg: PIIConfig | None = None):
        self.cfg = cfg or PIIConfig()
        unknown = set(self.cfg.types) - set(PII_TYPES)
        if unknown:
            raise ValueError(f"unknown PII types {sorted(unknown)}; allowed: {list(PII_TYPES)}")
        import phonenumbers

        regions = phonenumbers.SUPPORTED_REGIONS
        bad = [r for r in self.cfg.phone_regions if r not in regions]
        if bad:
            raise ValueError(f"unknown phone_regions {bad}; allowed: ISO 3166 codes such as {list(PHONE_REGIONS)}")

    def _tag(self, kind: str) -> str:
        return self.cfg.placeholder.replace("{TYPE}", kind.upper())

    def redact(self, text: str) -> tuple[str, dict[str, int]]:
        counts = dict.fromkeys(self.cfg.types, 0)
        # Order matters: e-mails before IPs (user@10.0.0.1), cards, IBANs and SSNs before phones.
        steps = [
            ("email", _EMAIL, lambda m: True),
            ("iban", _IBAN, None),
            ("credit_card", _CARD, _is_card),
            ("us_ssn", _SSN, lambda m: ssn_valid(m.group(1), m.group(3), m.group(4))),
            ("ip_address", _IPV4, lambda m: _is_ipv4(m, text_now)),
            ("ip_address", _IPV6, _is_ipv6),
            ("phone", _PHONE_CANDIDATE, None),
        ]
        text_now = text
        for kind, pattern, valid in steps:
            if kind not in counts or not _may_contain(kind, text_now):
                continue

            def swap(m, kind=kind, valid=valid):
                if kind == "phone":
                    return self._swap_phones(m.group(0), counts)
                if kind == "iban":
                    n = valid_iban_prefix(m.group(0))
                    counts[kind] += n > 0
                    return self._tag(kind) + m.group(0)[n:] if n else m.group(0)
                if not valid(m):
                    return m.group(0)
                counts[kind] += 1
                return self._tag(kind)

            text_now = pattern.sub(swap, text_now)
        return text_now, counts

    def _swap_phones(self, candidate: str, counts: dict[str, int]) -> str:
        out, last = [], 0
        for start, end in _phone_spans(candidate, self.cfg.phone_regions):
            out += [candidate[last:start], self._tag("phone")]
            counts["phone"] += 1
            last = end
        return "".join(out) + candidate[last:]


def _may_contain(kind: str, text: str) -> bool:
    """Cheap tests that skip a regex pass on most documents."""
    if kind == "email":
        return "@" in text
    if kind == "ip_address":
        return "." in text or ":" in text
    return _DIGIT.search(text) is not None
