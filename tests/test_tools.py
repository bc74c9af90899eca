"""Agent tools on real things: a SQLite file and a PostgreSQL server, a BM25 index, a local HTTP
server, the sandbox; and the registry's validation, timeouts and retries."""

import json
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmfoundry.agents import tools

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def orders_db(tmp_path):
    path = tmp_path / "orders.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT, total REAL)")
    conn.executemany("INSERT INTO orders (customer, total) VALUES (?, ?)", [(f"c{i % 7}", i * 1.5) for i in range(500)])
    conn.commit()
    conn.close()
    return str(path)


def test_sql_reads_with_a_row_limit_and_refuses_every_write(orders_db):
    sql = tools.sql_tool(orders_db, max_rows=10).fn
    out = sql("SELECT customer, COUNT(*) AS n FROM orders GROUP BY customer ORDER BY customer")
    assert out["columns"] == ["customer", "n"] and out["rows"][0] == ["c0", 72] and not out["truncated"]
    assert sql("SELECT * FROM orders")["truncated"] and len(sql("SELECT * FROM orders")["rows"]) == 10
    assert sql("WITH t AS (SELECT total FROM orders) SELECT MAX(total) FROM t")["rows"] == [[748.5]]
    for query, why in [
        ("DELETE FROM orders", "not allowed"),
        ("UPDATE orders SET total = 0", "not allowed"),
        ("DROP TABLE orders", "not allowed"),
        ("SELECT 1; DROP TABLE orders", "one statement"),
        ("ATTACH DATABASE '/tmp/x.db' AS x", "not allowed"),
        ("PRAGMA writable_schema = 1", "not allowed"),
        ("WITH x AS (SELECT 1) DELETE FROM orders", "not allowed"),
    ]:
        with pytest.raises(tools.ToolError, match=why):
            sql(query)
    assert sql("SELECT COUNT(*) FROM orders")["rows"] == [[500]]  # nothing was changed


def test_sql_stops_a_runaway_query_and_writes_only_when_granted(orders_db):
    sql = tools.sql_tool(orders_db, timeout_s=0.5).fn
    started = time.perf_counter()
    with pytest.raises(tools.ToolError, match="ran past"):
        sql("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT COUNT(*) FROM r")
    assert time.perf_counter() - started < 5
    writer = tools.sql_tool(orders_db, allow_writes=True)
    assert writer.side_effects
    writer.fn("INSERT INTO orders (customer, total) VALUES ('new', 1.0)")
    assert tools.sql_tool(orders_db).fn("SELECT COUNT(*) FROM orders")["rows"] == [[501]]


def test_sql_on_postgresql_is_read_only_with_a_statement_timeout(postgres_dsn):
    import psycopg

    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS orders")
        conn.execute("CREATE TABLE orders (id SERIAL PRIMARY KEY, customer TEXT, total NUMERIC)")
        conn.execute("INSERT INTO orders (customer, total) SELECT 'c' || (i % 3), i FROM generate_series(1, 50) i")
    sql = tools.sql_tool(postgres_dsn, max_rows=5, timeout_s=1).fn
    assert sql("SELECT COUNT(*) FROM orders")["rows"] == [[50]]
    assert sql("SELECT id FROM orders ORDER BY id")["truncated"]
    with pytest.raises(tools.ToolError, match="not allowed"):
        sql("WITH x AS (DELETE FROM orders RETURNING id) SELECT COUNT(*) FROM x")
    with pytest.raises(tools.ToolError, match="statement timeout"):
        sql("SELECT COUNT(*) FROM generate_series(1, 100000000)")


def test_bm25_search_finds_the_document_about_the_query():
    docs = [
        {"id": "refunds", "text": "Refunds are paid within 14 days of the return reaching the warehouse."},
        {"id": "shipping", "text": "Orders ship from the warehouse in two working days."},
        {"id": "privacy", "text": "We keep customer data for three years and never sell it."},
    ]
    search = tools.search_tool(docs).fn
    hits = search("how many days until my refund is paid")["results"]
    assert hits[0]["id"] == "refunds" and hits[0]["score"] > hits[-1]["score"]
    assert search("zebra")["results"] == []


class _API(BaseHTTPRequestHandler):
    seen: list = []

    def _reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply(200, {"path": self.path})

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        _API.seen.append((self.path, self.headers.get("Idempotency-Key"), self.rfile.read(length)))
        self._reply(201, {"created": True})

    def log_message(self, *args):
        pass


@pytest.fixture
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _API)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_reaches_only_the_allow_list_and_sends_idempotency_keys(api):
    tool = tools.http_tool([tools.AllowedAPI(f"{api}/api", ("GET", "POST")), tools.AllowedAPI(f"{api}/status")])
    registry = tools.ToolRegistry()
    registry.register(tool)
    ok = registry.call("http", {"method": "GET", "url": f"{api}/api/orders/7"})
    assert ok.ok and json.loads(ok.output["body"]) == {"path": "/api/orders/7"}
    created = registry.call(
        "http", {"method": "POST", "url": f"{api}/api/orders", "body": '{"sku": 1}'}, idempotency_key="run-1-step-3"
    )
    assert created.ok and _API.seen[-1][1] == "run-1-step-3"
    for method, url in [
        ("POST", f"{api}/status"),
        ("GET", f"{api}/admin"),
        ("GET", f"{api}/apiary"),
        ("GET", "http://169.254.169.254/latest/meta-data"),
        ("GET", f"http://user@{api[7:]}/api"),
    ]:
        refused = registry.call("http", {"method": method, "url": url})
        assert not refused.ok and ("outside the allow-list" in refused.error or "user@host" in refused.error), (
            method,
            url,
        )
    assert not registry.call("http", {"method": "DELETE", "url": f"{api}/api"}).ok  # not in the schema's enum


def test_python_runs_in_the_sandbox():
    python = tools.python_tool(timeout_s=3).fn
    assert python("print(6 * 7)")["stdout"].strip() == "42"
    assert python("import socket; socket.create_connection(('1.1.1.1', 80))")["ok"] is False
    assert python("while True: pass")["killed"] in ("cpu", "timeout")


def test_registry_validates_arguments_times_out_and_retries_with_backoff():
    registry = tools.ToolRegistry()
    calls = []

    @registry.tool(
        parameters={"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}, retries=2
    )
    def flaky(n):
        """Fails twice, then answers."""
        calls.append(time.perf_counter())
        if len(calls) < 3:
            raise tools.ToolError("busy", retryable=True)
        return n * 2

    registry.tools["flaky"].backoff_s = 0.05
    result = registry.call("flaky", {"n": 4})
    assert result.ok and result.output == 8 and result.attempts == 3
    assert calls[2] - calls[1] >= 0.09  # the second wait is twice the first
    bad = registry.call("flaky", {"n": "four"})
    assert not bad.ok and "schema" in bad.error and bad.attempts == 0

    @registry.tool(timeout_s=0.2)
    def slow():
        time.sleep(2)

    timed_out = registry.call("slow", {})
    assert not timed_out.ok and "timed out" in timed_out.error and timed_out.seconds < 1.5
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.tools["slow"])
    with pytest.raises(tools.ToolError, match="no tool"):
        registry.call("missing", {})
    assert registry.specs(["flaky"])[0]["function"]["description"] == "Fails twice, then answers."
