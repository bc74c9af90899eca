"""The human review queue: preference pairs the judges were unsure of, and the audit sample of the
pairs they accepted, in a real database (SQLite by default, PostgreSQL by DSN).

An item is `pending` until a reviewer claims it (`claimed`, by one reviewer at a time: the claim
is a conditional UPDATE, so two reviewers never hold the same item), then `decided`:

- a `review` item (low confidence, or judges that disagreed): `a` keeps the judge's chosen /
  rejected order, `b` swaps it, `reject` drops the pair;
- an `audit` item (an accepted pair): `agree` or `disagree`, overall and per rubric dimension
  (`dimensions: {"helpfulness": "agree", ...}`); a disagreement overall takes the pair out.

Comments attach to any item. `lmfoundry review list|claim|decide|comment --db DSN` and the HTTP
API (align/review_api.py) are two doors to the same store.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from lmfoundry.platform.db import Database

DIMENSIONS = ("helpfulness", "harmlessness", "honesty")
DECISIONS = {"review": ("a", "b", "reject"), "audit": ("agree", "disagree")}
SCHEMA = [
    """CREATE TABLE IF NOT EXISTS review_items (
        id TEXT PRIMARY KEY, kind TEXT NOT NULL, reason TEXT NOT NULL, payload TEXT NOT NULL,
        status TEXT NOT NULL DEFAULT 'pending', claimed_by TEXT, claimed_at DOUBLE PRECISION,
        decision TEXT, dimensions TEXT, decided_by TEXT, decided_at DOUBLE PRECISION, created_at DOUBLE PRECISION)""",
    """CREATE TABLE IF NOT EXISTS review_comments (
        item_id TEXT NOT NULL, author TEXT NOT NULL, body TEXT NOT NULL, created_at DOUBLE PRECISION)""",
]


class ReviewError(ValueError):
    """A request the queue cannot honour: a decision or field not allowed (HTTP 400)."""

    status = 400


class ReviewNotFound(ReviewError):
    status = 404


class ReviewConflict(ReviewError):
    """The item is not in the state the request needs (claimed by another, already decided)."""

    status = 409


class ReviewStore:
    """`dsn`: a path or `sqlite:///path` for SQLite, `postgresql://...` for PostgreSQL."""

    def __init__(self, dsn: str):
        self.dsn = dsn
        self.db = Database(dsn)
        for statement in SCHEMA:
            self.db.run(statement)

    def _run(self, sql: str, params: tuple = ()):
        return self.db.run(sql, params)

    def close(self) -> None:
        self.db.close()

    # --- writing ---------------------------------------------------------------------------

    def add(self, item_id: str, kind: str, reason: str, payload: dict) -> bool:
        """Queue an item; False when it is already there (a rerun adds nothing twice)."""
        if kind not in DECISIONS:
            raise ReviewError(f"kind {kind!r}; allowed: {sorted(DECISIONS)}")
        if self._run("SELECT 1 FROM review_items WHERE id = ?", (item_id,))[0]:
            return False
        self._run(
            "INSERT INTO review_items (id, kind, reason, payload, created_at) VALUES (?, ?, ?, ?, ?)",
            (item_id, kind, reason, json.dumps(payload), time.time()),
        )
        return True

    def claim(self, item_id: str, reviewer: str) -> dict:
        _, updated = self._run(
            "UPDATE review_items SET status = 'claimed', claimed_by = ?, claimed_at = ? "
            "WHERE id = ? AND status = 'pending'",
            (reviewer, time.time(), item_id),
        )
        if updated != 1:
            item = self.get(item_id)
            raise ReviewConflict(
                f"item {item_id} is {item['status']}"
                + (f" by {item['claimed_by']}" if item["claimed_by"] else "")
                + ", not pending"
            )
        return self.get(item_id)

    def claim_next(self, reviewer: str, kind: str | None = None) -> dict | None:
        """The oldest pending item (of `kind`), claimed; None when there is none."""
        for item in self.list("pending", kind):
            try:
                return self.claim(item["id"], reviewer)
            except ReviewConflict:  # someone else claimed it first
                continue
        return None

    def decide(self, item_id: str, reviewer: str, decision: str, dimensions: dict | None = None) -> dict:
        item = self.get(item_id)
        allowed = DECISIONS[item["kind"]]
        if decision not in allowed:
            raise ReviewError(f"decision {decision!r} for a {item['kind']} item; allowed: {list(allowed)}")
        dimensions = dimensions or {}
        bad = {k: v for k, v in dimensions.items() if k not in DIMENSIONS or v not in ("agree", "disagree")}
        if bad:
            raise ReviewError(f"dimensions {bad}: keys from {list(DIMENSIONS)}, values agree or disagree")
        if item["status"] != "claimed" or item["claimed_by"] != reviewer:
            raise ReviewConflict(
                f"item {item_id} is {item['status']}"
                + (f" by {item['claimed_by']}" if item["claimed_by"] else "")
                + f"; {reviewer} must claim it before deciding"
            )
        self._run(
            "UPDATE review_items SET status = 'decided', decision = ?, dimensions = ?, decided_by = ?, "
            "decided_at = ? WHERE id = ?",
            (decision, json.dumps(dimensions), reviewer, time.time(), item_id),
        )
        return self.get(item_id)

    def comment(self, item_id: str, author: str, body: str) -> dict:
        self.get(item_id)
        if not body.strip():
            raise ReviewError("a comment needs text")
        self._run(
            "INSERT INTO review_comments (item_id, author, body, created_at) VALUES (?, ?, ?, ?)",
            (item_id, author, body, time.time()),
        )
        return self.get(item_id)

    # --- reading ---------------------------------------------------------------------------

    COLUMNS = (
        "id",
        "kind",
        "reason",
        "payload",
        "status",
        "claimed_by",
        "claimed_at",
        "decision",
        "dimensions",
        "decided_by",
        "decided_at",
        "created_at",
    )

    def _item(self, row) -> dict:
        item = dict(zip(self.COLUMNS, row))
        item["payload"] = json.loads(item["payload"])
        item["dimensions"] = json.loads(item["dimensions"]) if item["dimensions"] else {}
        item["comments"] = [
            {"author": a, "body": b, "at": t}
            for a, b, t in self._run(
                "SELECT author, body, created_at FROM review_comments WHERE item_id = ? ORDER BY created_at",
                (item["id"],),
            )[0]
        ]
        return item

    def get(self, item_id: str) -> dict:
        rows, _ = self._run(f"SELECT {', '.join(self.COLUMNS)} FROM review_items WHERE id = ?", (item_id,))
        row = rows[0] if rows else None
        if row is None:
            raise ReviewNotFound(f"no review item {item_id!r}")
        return self._item(row)

    def list(self, status: str | None = None, kind: str | None = None) -> list[dict]:
        where, params = [], []
        if status:
            where.append("status = ?")
            params.append(status)
        if kind:
            where.append("kind = ?")
            params.append(kind)
        sql = f"SELECT {', '.join(self.COLUMNS)} FROM review_items" + (f" WHERE {' AND '.join(where)}" if where else "")
        return [self._item(r) for r in self._run(sql + " ORDER BY created_at, id", tuple(params))[0]]


# --- the CLI -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lmfoundry review", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", required=True, help="the queue: a SQLite path or a postgresql:// DSN")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list")
    ls.add_argument("--status", choices=["pending", "claimed", "decided"])
    ls.add_argument("--kind", choices=sorted(DECISIONS))
    cl = sub.add_parser("claim")
    cl.add_argument("item", nargs="?", help="an item id (default: the oldest pending one)")
    cl.add_argument("--reviewer", required=True)
    cl.add_argument("--kind", choices=sorted(DECISIONS))
    de = sub.add_parser("decide")
    de.add_argument("item")
    de.add_argument("decision", help="review: a | b | reject; audit: agree | disagree")
    de.add_argument("--reviewer", required=True)
    de.add_argument("--dimension", action="append", default=[], metavar="NAME=agree|disagree")
    co = sub.add_parser("comment")
    co.add_argument("item")
    co.add_argument("text")
    co.add_argument("--author", required=True)
    sv = sub.add_parser("serve", help="the HTTP API on Ray Serve, until Ctrl-C")
    sv.add_argument("--keys-file", help="tenant keys (lmfoundry keys create); $LMFOUNDRY_API_KEYS work too")
    sv.add_argument("--port", type=int, default=8001)
    args = p.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    store = ReviewStore(args.db)
    try:
        if args.command == "list":
            out = [
                {k: i[k] for k in ("id", "kind", "reason", "status", "claimed_by", "decision")}
                for i in store.list(args.status, args.kind)
            ]
        elif args.command == "claim":
            out = store.claim(args.item, args.reviewer) if args.item else store.claim_next(args.reviewer, args.kind)
        elif args.command == "decide":
            dims = dict(d.split("=", 1) for d in args.dimension if "=" in d)
            if len(dims) != len(args.dimension):
                raise ReviewError(f"--dimension takes NAME=agree|disagree, got {args.dimension}")
            out = store.decide(args.item, args.reviewer, args.decision, dims)
        else:
            out = store.comment(args.item, args.author, args.text)
    except ReviewError as e:
        print(f"error: review: {e}", file=sys.stderr)
        return 2
    finally:
        store.close()
    print(json.dumps(out, indent=2))
    return 0


def _serve(args) -> int:
    from lmfoundry.align.review_api import ReviewServeConfig, start_review_api
    from lmfoundry.platform.ray_env import init_ray

    init_ray()
    try:
        url = start_review_api(ReviewServeConfig(db=args.db, keys_file=args.keys_file, port=args.port))
    except ValueError as e:
        print(f"error: review serve: {e}", file=sys.stderr)
        return 2
    print(f"review queue at {url} (Ctrl-C stops)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
