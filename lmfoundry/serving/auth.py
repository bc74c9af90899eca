"""API keys: the server holds only their SHA-256 digests and compares in constant time."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def keys_from_env(var: str) -> tuple[list[str], str | None]:
    """Digests of the comma-separated keys in `var`; when it is unset, one fresh key is made
    and returned so the operator can be told it once."""
    raw = os.environ.get(var, "")
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    generated = None
    if not keys:
        generated = "sk-lmf-" + secrets.token_urlsafe(24)
        keys = [generated]
    return [digest(k) for k in keys], generated


def authorized(header: str | None, digests: list[str]) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    given = digest(header[len("Bearer "):].strip())
    # compare against every key so the time taken does not reveal which one matched
    return any([hmac.compare_digest(given, d) for d in digests])
