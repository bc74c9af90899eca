"""Gray release: several model versions behind one route, and the share of traffic each gets.

    lmfoundry traffic show     --file SPLIT
    lmfoundry traffic set      --file SPLIT v1=90 v2=10     # shift
    lmfoundry traffic rollback --file SPLIT                 # back to the split before the last change
    lmfoundry traffic set      --file SPLIT v2=100 --config configs/serve.yaml   # names and gates checked

The serve config lists the versions and their starting weights (`versions`); the split file,
when there is one (`traffic_file`), overrides the weights. Every replica re-reads it every two
seconds, so a shift or a rollback takes effect everywhere within seconds, without a redeploy,
and requests in flight finish on the version they started on. The file keeps its history, so
`rollback` restores the previous split, and again the one before.

With `--config` (the serve config), the versions' names are checked against it, and a split that
gives traffic to a checkpoint which failed its evaluation gate is refused unless
`--force-gate-failed` (logged), for `set` and for `rollback` alike.

A canary analysis (serving/canary.py) may roll a canary back by itself: its weight goes to the
stable version, the reason is kept in the history, and the canary is `withdrawn`: clients can no
longer pin it, until a `set` gives it traffic again.

A request goes to a version by weight: by a hash of its `user` field when it has one (a user
stays on one version while the split holds), else at random. `model: "NAME:VERSION"` pins one.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from lmfoundry.platform import storage


def check_weights(weights: dict[str, float], versions: list[str]) -> dict[str, float]:
    unknown = sorted(set(weights) - set(versions))
    if unknown:
        raise ValueError(f"unknown versions {unknown}; the versions served are {versions}")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"weights must be >= 0 and not all 0, got {weights}")
    return {v: float(weights.get(v, 0.0)) for v in versions}


class TrafficSplit:
    def __init__(self, weights: dict[str, float]):
        self.weights = {v: w for v, w in weights.items() if w > 0}
        self.total = sum(self.weights.values())

    def pick(self, user: str | None = None) -> str:
        if user:
            digest = hashlib.sha256(user.encode()).digest()
            point = int.from_bytes(digest[:8], "big") / 2**64 * self.total
        else:
            point = random.random() * self.total
        for version, weight in self.weights.items():
            point -= weight
            if point < 0:
                return version
        return next(reversed(self.weights))


def read_split_file(uri: str) -> dict:
    data = storage.read_json(uri)
    if not isinstance(data, dict) or not isinstance(data.get("weights"), dict):
        raise ValueError(f"{uri} is not an lmfoundry traffic file (expected {{'weights': {{...}}, 'history': [...]}})")
    return data


def write_split(uri: str, weights: dict[str, float], reason: str | None = None, withdraw: str | None = None) -> dict:
    """Record a new split, keeping the previous ones for rollback. A version given traffic is no
    longer withdrawn; `withdraw` withdraws one (a canary rolled back, for `reason`)."""
    previous = read_split_file(uri) if storage.exists(uri) else {"weights": None, "history": []}
    history = previous["history"] + (
        [{"weights": previous["weights"], "until": previous.get("since"), "reason": previous.get("reason")}]
        if previous["weights"]
        else []
    )
    withdrawn = [v for v in previous.get("withdrawn", []) if not weights.get(v)]
    if withdraw and withdraw not in withdrawn:
        withdrawn.append(withdraw)
    data = {
        "weights": weights,
        "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "reason": reason,
        "withdrawn": withdrawn,
        "history": history,
    }
    if not storage.is_remote(uri):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
    storage.write_json_atomic(uri, data)
    return data


def withdraw(uri: str, stable: str, canary: str, reason: str) -> dict | None:
    """The canary's traffic to the stable version, the canary withdrawn, and why; None when the
    file already gives the canary nothing (another replica got there first)."""
    current = read_split_file(uri) if storage.exists(uri) else None
    if current is None:
        raise ValueError(f"{uri}: no traffic file to roll the canary back in")
    weights = dict(current["weights"])
    if not weights.get(canary):
        return None
    weights[stable] = weights.get(stable, 0.0) + weights[canary]
    weights[canary] = 0.0
    return write_split(uri, weights, f"automatic rollback: {reason}", withdraw=canary)


def rollback(uri: str) -> dict:
    data = read_split_file(uri)
    if not data["history"]:
        raise ValueError(f"{uri} holds no earlier split to roll back to")
    restored = data["history"][-1]["weights"]
    out = {
        "weights": restored,
        "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "reason": "rollback",
        "withdrawn": [v for v in data.get("withdrawn", []) if not restored.get(v)],
        "history": data["history"][:-1],
    }
    storage.write_json_atomic(uri, out)
    return out


class SplitSource:
    """The split a replica routes by: the config's weights, overridden by the split file, which
    is re-read every `reload_s`. A file that cannot be read keeps the last good split (and says so)."""

    def __init__(
        self,
        versions: list[str],
        config_weights: dict[str, float],
        traffic_file: str | None,
        reload_s: float = 2.0,
        log=None,
    ):
        self.versions = versions
        self.traffic_file = traffic_file
        self.reload_s = reload_s
        self.log = log
        self.split = TrafficSplit(check_weights(config_weights, versions))
        self.withdrawn: frozenset[str] = frozenset()  # rolled back by the canary analysis: not pinnable
        self._checked = float("-inf")
        self._lock = threading.Lock()

    def current(self) -> TrafficSplit:
        if self.traffic_file and time.monotonic() - self._checked > self.reload_s:
            with self._lock:
                if time.monotonic() - self._checked > self.reload_s:
                    self._checked = time.monotonic()
                    self._reload()
        return self.split

    def _reload(self) -> None:
        if not storage.exists(self.traffic_file):
            return
        try:
            data = read_split_file(self.traffic_file)
            self.split = TrafficSplit(check_weights(data["weights"], self.versions))
            self.withdrawn = frozenset(v for v in data.get("withdrawn", []) if isinstance(v, str))
        except (ValueError, OSError) as e:
            if self.log:
                self.log.error("traffic file %s ignored, keeping the last split: %s", self.traffic_file, e)

    def reload_now(self) -> None:
        with self._lock:
            self._checked = time.monotonic()
            self._reload()


def parse_weights(items: list[str]) -> dict[str, float]:
    weights = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            weights[name] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise ValueError(f"{item!r}: write VERSION=WEIGHT, e.g. v1=90 v2=10")
    return weights


def served_checkpoints(config: str) -> dict[str, str]:
    """version -> checkpoint, from a serve config file."""
    from lmfoundry.platform.config import load_config
    from lmfoundry.serving.app import ServeConfig

    cfg = load_config(ServeConfig, config)
    return {v.name: v.checkpoint for v in cfg.served_versions()}


def check_gates(weights: dict[str, float], checkpoints: dict[str, str], force: bool) -> None:
    """Refuse a split that sends traffic to a checkpoint which failed its gate (unless forced)."""
    from lmfoundry.platform import checkpoint

    for version, weight in weights.items():
        if weight > 0 and version in checkpoints:
            checkpoint.check_gate(checkpoints[version], force, f"traffic (version {version})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lmfoundry traffic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=["show", "set", "rollback"])
    parser.add_argument("weights", nargs="*", metavar="VERSION=WEIGHT")
    parser.add_argument("--file", required=True, help="the traffic file named by the serve config's traffic_file")
    parser.add_argument("--versions", help="comma-separated versions served, to check names against (optional)")
    parser.add_argument("--config", help="the serve config: versions and checkpoints, to check names and gates against")
    parser.add_argument("--force-gate-failed", action="store_true", help="route to a gate-failed checkpoint (logged)")
    args = parser.parse_args(argv)
    try:
        checkpoints = served_checkpoints(args.config) if args.config else {}
        if args.action == "set":
            weights = parse_weights(args.weights)
            versions = list(checkpoints) or (args.versions.split(",") if args.versions else list(weights))
            weights = check_weights(weights, versions)
            check_gates(weights, checkpoints, args.force_gate_failed)
            data = write_split(args.file, weights)
        elif args.action == "rollback":
            history = read_split_file(args.file)["history"]
            check_gates(history[-1]["weights"] if history else {}, checkpoints, args.force_gate_failed)
            data = rollback(args.file)
        else:
            data = read_split_file(args.file)
    except ValueError as e:
        print(f"error: traffic {args.action}: {e}", file=sys.stderr)
        return 2
    print(describe(data["weights"]), f"(since {data['since']}, {len(data['history'])} earlier)")
    if data.get("reason"):
        print(f"  why: {data['reason']}")
    if data.get("withdrawn"):
        print(f"  withdrawn (cannot be pinned): {', '.join(data['withdrawn'])}")
    if args.action == "show" and data["history"]:
        print("history, newest first:")
        for old in reversed(data["history"]):
            why = f"  why: {old['reason']}" if old.get("reason") else ""
            print(f"  {describe(old['weights'])}  (until {old.get('until')}){why}")
    return 0


def describe(weights: dict[str, float]) -> str:
    total = sum(weights.values())
    return "  ".join(f"{v}={100 * w / total:.0f}%" for v, w in weights.items())
