"""A database connection by DSN: SQLite (a path or `sqlite:///path`, the embedded default) or
PostgreSQL (`postgresql://...`, needs psycopg: pip install 'lmfoundry[postgres]'). Statements are
written with `?` placeholders; `Database.run` turns them into the driver's own."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class Database:
    def __init__(self, dsn: str):
        self.dsn = dsn
        self.postgres = dsn.startswith(("postgresql://", "postgres://"))
        self._lock = threading.Lock()  # one connection, shared by the threads of a replica
        if self.postgres:
            try:
                import psycopg
            except ImportError as e:
                raise ImportError("a PostgreSQL DSN needs psycopg: pip install 'lmfoundry[postgres]'") from e
            self.conn = psycopg.connect(dsn, autocommit=True)
            self.marker = "%s"
        else:
            path = dsn.removeprefix("sqlite:///")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # autocommit; a busy database waits instead of failing when two writers meet
            self.conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
            self.marker = "?"

    def run(self, sql: str, params: tuple = ()) -> tuple[list[tuple], int]:
        """(rows, rowcount) of one statement."""
        with self._lock:
            cur = self.conn.cursor()
            cur.execute(sql.replace("?", self.marker), params)
            rows = cur.fetchall() if cur.description else []
            return rows, cur.rowcount

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """Statements that commit together or not at all. The write lock is taken at BEGIN
        (SQLite's BEGIN IMMEDIATE; PostgreSQL locks each row an UPDATE touches until COMMIT), so
        a row a statement checked cannot change under the transaction before it commits."""
        with self._lock:
            cur = self.conn.cursor()
            cur.execute("BEGIN" if self.postgres else "BEGIN IMMEDIATE")
            try:
                yield Transaction(cur, self.marker)
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()


class Transaction:
    """`run` inside `Database.transaction`."""

    def __init__(self, cursor, marker: str):
        self.cursor, self.marker = cursor, marker

    def run(self, sql: str, params: tuple = ()) -> tuple[list[tuple], int]:
        self.cursor.execute(sql.replace("?", self.marker), params)
        rows = self.cursor.fetchall() if self.cursor.description else []
        return rows, self.cursor.rowcount
