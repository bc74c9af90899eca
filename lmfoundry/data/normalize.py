"""Text normalisation: Unicode NFC, control characters, whitespace, boilerplate lines."""

from __future__ import annotations

import re
import unicodedata

# Control characters except tab and newline, which carry layout.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200b\u3000]+")
_BLANK_RUNS = re.compile(r"\n{3,}")
# Lines that are page chrome rather than content (C4 drops cookie/policy lines; navigation bars
# are runs of short items separated by pipes).
_BOILERPLATE_LINE = re.compile(
    r"(cookie|javascript must be enabled|all rights reserved|click here|subscribe to our newsletter"
    r"|share on (facebook|twitter|linkedin)|terms of use|privacy policy)",
    re.IGNORECASE,
)
_NAV_LINE = re.compile(r"^\s*(\w[\w ]{0,20}\s*\|\s*){2,}\w[\w ]{0,20}\s*$")


def is_boilerplate_line(line: str) -> bool:
    return bool(_BOILERPLATE_LINE.search(line) or _NAV_LINE.match(line))


def normalize_text(text: str, drop_boilerplate: bool = True) -> tuple[str, int]:
    """Returns the normalised text and the number of boilerplate lines removed."""
    text = unicodedata.normalize("NFC", text)
    text = _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    removed = 0
    if drop_boilerplate:
        kept = [line for line in lines if not is_boilerplate_line(line)]
        removed = len(lines) - len(kept)
        lines = kept
    text = _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()
    return text, removed
