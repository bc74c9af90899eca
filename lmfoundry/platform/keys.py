"""API keys tied to tenants, stored hashed in one JSON file (a local path or s3://).

    lmfoundry keys create --tenant acme [--file KEYS]   # prints the new key once
    lmfoundry keys list [--file KEYS]
    lmfoundry keys revoke KEY_ID [--file KEYS]

The file holds only SHA-256 digests: keys are 32 random bytes, so a fast hash is as good as a
slow one here and lets every request be checked in microseconds. Serving replicas re-read the
file every few seconds, so a revoked key stops working without a restart. Keys from an
environment variable (comma-separated) are accepted too, as tenant "default".
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from lmfoundry.platform import storage

DEFAULT_FILE_ENV = "LMFOUNDRY_KEYS_FILE"
ENV_TENANT = "default"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def default_file() -> str:
    return os.environ.get(DEFAULT_FILE_ENV) or str(Path.home() / ".lmfoundry" / "keys.json")


def read_store(uri: str) -> list[dict]:
    if not storage.exists(uri):
        return []
    data = storage.read_json(uri)
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise ValueError(f"{uri} is not an lmfoundry key file (expected {{'keys': [...]}})")
    return data["keys"]


def _write_store(uri: str, keys: list[dict]) -> None:
    if not storage.is_remote(uri):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
    storage.write_json_atomic(uri, {"keys": keys})


def create_key(uri: str, tenant: str) -> tuple[str, dict]:
    """A new key for `tenant`: returns the key (shown once, never stored) and its record."""
    if not tenant or not tenant.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"tenant {tenant!r}: use letters, digits, '-' and '_'")
    keys = read_store(uri)
    key = "sk-lmf-" + secrets.token_urlsafe(32)
    record = {
        "id": "key_" + secrets.token_hex(6),
        "tenant": tenant,
        "sha256": digest(key),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "revoked": None,
    }
    _write_store(uri, keys + [record])
    return key, record


def revoke_key(uri: str, key_id: str) -> dict:
    keys = read_store(uri)
    for record in keys:
        if record["id"] == key_id:
            if record["revoked"] is None:
                record["revoked"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
                _write_store(uri, keys)
            return record
    known = ", ".join(r["id"] for r in keys) or "none"
    raise ValueError(f"no key with id {key_id!r} in {uri}; ids there: {known}")


def env_keys(var: str) -> list[str]:
    return [k.strip() for k in os.environ.get(var, "").split(",") if k.strip()]


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str


class Authenticator:
    """Maps a Bearer header to the tenant of a live key; re-reads the key file every `reload_s`."""

    def __init__(self, keys_file: str | None, env_digests: list[str], reload_s: float = 2.0):
        self.keys_file = keys_file
        self.env_digests = list(env_digests)
        self.reload_s = reload_s
        self._lock = threading.Lock()
        self._by_digest: dict[str, Principal] = {}
        self._loaded_at = float("-inf")
        self._refresh()

    def _refresh(self) -> None:
        table = {d: Principal(ENV_TENANT, f"env-{i}") for i, d in enumerate(self.env_digests)}
        if self.keys_file:
            for r in read_store(self.keys_file):
                if r.get("revoked") is None:
                    table[r["sha256"]] = Principal(r["tenant"], r["id"])
        self._by_digest = table
        self._loaded_at = time.monotonic()

    def principal(self, header: str | None) -> Principal | None:
        if time.monotonic() - self._loaded_at > self.reload_s:
            with self._lock:
                if time.monotonic() - self._loaded_at > self.reload_s:
                    self._refresh()
        if not header or not header.startswith("Bearer "):
            return None
        given = digest(header[len("Bearer ") :].strip())
        found = None
        for d, who in self._by_digest.items():  # every entry compared: timing does not reveal a match
            if hmac.compare_digest(given, d):
                found = who
        return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lmfoundry keys", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="action", required=True)
    for name in ("create", "list", "revoke"):
        p = sub.add_parser(name)
        p.add_argument("--file", default=None, help=f"key file (default ${DEFAULT_FILE_ENV} or ~/.lmfoundry/keys.json)")
        if name == "create":
            p.add_argument("--tenant", required=True)
        if name == "revoke":
            p.add_argument("key_id")
    args = parser.parse_args(argv)
    uri = args.file or default_file()
    try:
        if args.action == "create":
            key, record = create_key(uri, args.tenant)
            print(f"created {record['id']} for tenant {record['tenant']} in {uri}", file=sys.stderr)
            print("the key is shown this once; store it now:", file=sys.stderr)
            print(key)
        elif args.action == "revoke":
            record = revoke_key(uri, args.key_id)
            print(f"revoked {record['id']} (tenant {record['tenant']}) at {record['revoked']}")
        else:
            for r in read_store(uri):
                print(
                    f"{r['id']}\t{r['tenant']}\tcreated {r['created']}\t"
                    f"{'revoked ' + r['revoked'] if r['revoked'] else 'active'}"
                )
    except ValueError as e:
        print(f"error: keys {args.action}: {e}", file=sys.stderr)
        return 2
    return 0
