"""API keys tied to tenants and roles, stored hashed in one JSON file (a local path or s3://).

    lmfoundry keys create --tenant acme [--role reviewer ...] [--file KEYS]   # prints the new key once
    lmfoundry keys list [--file KEYS]
    lmfoundry keys revoke KEY_ID [--file KEYS]

Roles: `user` (inference, agent runs: the default), `reviewer` (the review queue: decides
preference pairs), `approver` (agent tool-call approvals), `admin` (metrics, operations). Roles do
not imply one another: an admin key cannot decide review items unless it is a reviewer too.

The file holds only SHA-256 digests: keys are 32 random bytes, so a fast hash is as good as a
slow one here and lets every request be checked in microseconds. Serving replicas re-read a
local key file as soon as it changes (a stat per request), an s3:// one every few seconds, so a
revoked key stops working without a restart; a file that cannot be
read or parsed leaves the last good table in force (logged, and counted in `reload_failures`).
Create and revoke hold an fcntl lock on `KEYS.lock` around their read-modify-write, so that
concurrent changes to a local file are never lost; an s3:// key file has no such lock and must
have a single writer. Keys from an environment variable (comma-separated) are accepted too, as
tenant "default" with the roles the app's config gives them (`user` unless told otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import hmac
import os
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pydantic import Field, field_validator

from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

DEFAULT_FILE_ENV = "LMFOUNDRY_KEYS_FILE"
ENV_TENANT = "default"
ROLES = ("user", "reviewer", "approver", "admin")
DEFAULT_ROLES = ("user",)

logger = get_logger(__name__)

# RFC 6750: `Bearer` (any case), one space, a b64token; nothing else, no stray whitespace.
_BEARER = re.compile(r"(?i:bearer) ([A-Za-z0-9\-._~+/]+=*)")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TENANT = re.compile(r"[A-Za-z0-9_-]{1,64}")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def default_file() -> str:
    return os.environ.get(DEFAULT_FILE_ENV) or str(Path.home() / ".lmfoundry" / "keys.json")


def parse_roles(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Roles from `--role a --role b,c`: each must be one of ROLES; none given means `user`."""
    roles: list[str] = []
    for value in values or ():
        for role in value.split(","):
            role = role.strip()
            if role not in ROLES:
                raise ValueError(f"role {role!r} is unknown; roles are {', '.join(ROLES)}")
            if role not in roles:
                roles.append(role)
    return tuple(roles) or DEFAULT_ROLES


def _check_record(uri: str, n: int, r) -> dict:
    """One record as written by create_key; anything else makes the whole file unusable."""
    where = f"{uri}: key record {n}"
    if not isinstance(r, dict):
        raise ValueError(f"{where} is not an object")
    missing = sorted({"id", "tenant", "sha256", "revoked"} - set(r))
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    if not isinstance(r["tenant"], str) or not _TENANT.fullmatch(r["tenant"]):
        raise ValueError(f"{where}: tenant must be 1-64 letters, digits, '-' or '_'")
    if not isinstance(r["sha256"], str) or not _SHA256_HEX.fullmatch(r["sha256"]):
        raise ValueError(f"{where}: sha256 must be 64 lowercase hex digits")
    roles = r.get("roles", list(DEFAULT_ROLES))  # files from before roles: every key was a user key
    if not isinstance(roles, list) or not roles or any(role not in ROLES for role in roles):
        raise ValueError(f"{where}: roles must be a non-empty list of {', '.join(ROLES)}")
    return {**r, "roles": roles}


def read_store(uri: str) -> list[dict]:
    if not storage.exists(uri):
        return []
    data = storage.read_json(uri)
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise ValueError(f"{uri} is not an lmfoundry key file (expected {{'keys': [...]}})")
    return [_check_record(uri, n, r) for n, r in enumerate(data["keys"])]


def _write_store(uri: str, keys: list[dict]) -> None:
    if not storage.is_remote(uri):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
    storage.write_json_atomic(uri, {"keys": keys})


@contextlib.contextmanager
def _locked(uri: str):
    """Serialise read-modify-write of a local key file across threads and processes. The lock is
    a separate file: the key file itself is replaced by rename, so a lock on it would be lost."""
    if storage.is_remote(uri):
        yield  # s3://: no lock; one writer only (see the module docstring)
        return
    Path(uri).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{uri}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def create_key(uri: str, tenant: str, roles: list[str] | tuple[str, ...] | None = None) -> tuple[str, dict]:
    """A new key for `tenant` with `roles`: returns the key (shown once, never stored) and its record."""
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
        raise ValueError(f"tenant {tenant!r}: use 1-64 letters, digits, '-' and '_'")
    key = "sk-lmf-" + secrets.token_urlsafe(32)
    record = {
        "id": "key_" + secrets.token_hex(6),
        "tenant": tenant,
        "roles": list(parse_roles(roles)),
        "sha256": digest(key),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "revoked": None,
    }
    with _locked(uri):
        _write_store(uri, read_store(uri) + [record])
    return key, record


def revoke_key(uri: str, key_id: str) -> dict:
    with _locked(uri):
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


class ApiKeysConfig(StageConfig):
    """Where an app's API keys come from; every HTTP app's config extends it."""

    keys_file: str | None = Field(None, description="tenant keys made by `lmfoundry keys create`")
    api_keys_env: str = Field("LMFOUNDRY_API_KEYS", description="env var with comma-separated keys (tenant 'default')")
    api_keys_env_roles: list[str] = Field(["user"], description="roles of the keys in api_keys_env")

    @field_validator("api_keys_env_roles")
    @classmethod
    def _known_roles(cls, roles: list[str]) -> list[str]:
        return list(parse_roles(roles))


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str
    roles: frozenset[str] = frozenset(DEFAULT_ROLES)


def bearer_token(header: str | None) -> str | None:
    """The key in `Authorization: Bearer <key>` (scheme in any case), or None for anything else."""
    match = _BEARER.fullmatch(header) if header else None
    return match.group(1) if match else None


class Authenticator:
    """Maps a Bearer header to the principal (tenant, roles) of a live key; re-reads the key file
    every `reload_s`, keeping the last good table when the file is unreadable or corrupt."""

    def __init__(
        self,
        keys_file: str | None,
        env_digests: list[str],
        reload_s: float = 2.0,
        env_roles: list[str] | tuple[str, ...] | None = None,
    ):
        self.keys_file = keys_file
        self.env_digests = list(env_digests)
        self.env_roles = frozenset(parse_roles(env_roles))
        self.reload_s = reload_s
        self.reload_failures = 0  # exported as a metric: the key file could not be used
        self._lock = threading.Lock()
        self._by_digest: dict[str, Principal] = {
            d: Principal(ENV_TENANT, f"env-{i}", self.env_roles) for i, d in enumerate(self.env_digests)
        }  # until the file is read once: fail closed for file keys
        self._loaded_at = float("-inf")
        self._loaded_version: tuple | None = None
        self._refresh()

    def _table(self) -> dict[str, Principal]:
        table = {d: Principal(ENV_TENANT, f"env-{i}", self.env_roles) for i, d in enumerate(self.env_digests)}
        if self.keys_file:
            for r in read_store(self.keys_file):
                if r["revoked"] is None:
                    table[r["sha256"]] = Principal(r["tenant"], r["id"], frozenset(r["roles"]))
        return table

    def _file_version(self) -> tuple | None:
        """What changes when a local key file is rewritten (a new inode: writes replace it)."""
        if not self.keys_file or storage.is_remote(self.keys_file):
            return None
        try:
            st = os.stat(self.keys_file)
        except OSError:
            return ("absent",)
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _stale(self) -> bool:
        if time.monotonic() - self._loaded_at > self.reload_s:
            return True
        version = self._file_version()
        return version is not None and version != self._loaded_version

    def _refresh(self) -> None:
        self._loaded_version = self._file_version()  # before reading: a change during the read reloads again
        try:
            self._by_digest = self._table()
        except Exception as e:  # unreadable or corrupt: keep the last good table, raise the alarm
            self.reload_failures += 1
            logger.error("key file %s not reloaded, keeping the last good keys: %s", self.keys_file, e)
        self._loaded_at = time.monotonic()

    def principal(self, header: str | None) -> Principal | None:
        if self._stale():
            with self._lock:
                if self._stale():
                    self._refresh()
        token = bearer_token(header)
        if token is None:
            return None
        given = digest(token)
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
            p.add_argument(
                "--role",
                action="append",
                default=None,
                help=f"repeatable or comma-separated: {', '.join(ROLES)} (default: user)",
            )
        if name == "revoke":
            p.add_argument("key_id")
    args = parser.parse_args(argv)
    uri = args.file or default_file()
    try:
        if args.action == "create":
            key, record = create_key(uri, args.tenant, args.role)
            roles = ",".join(record["roles"])
            print(f"created {record['id']} for tenant {record['tenant']} (roles {roles}) in {uri}", file=sys.stderr)
            print("the key is shown this once; store it now:", file=sys.stderr)
            print(key)  # stdout only, never a logger: log handlers may ship it elsewhere
        elif args.action == "revoke":
            record = revoke_key(uri, args.key_id)
            print(f"revoked {record['id']} (tenant {record['tenant']}) at {record['revoked']}")
        else:
            for r in read_store(uri):
                print(
                    f"{r['id']}\t{r['tenant']}\t{','.join(r['roles'])}\tcreated {r['created']}\t"
                    f"{'revoked ' + r['revoked'] if r['revoked'] else 'active'}"
                )
    except ValueError as e:
        print(f"error: keys {args.action}: {e}", file=sys.stderr)
        return 2
    return 0
