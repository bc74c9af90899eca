"""Adversarial tests for the agent tools: SQL (parser, then the database's own read-only
enforcement), HTTP (the allow-list on the normalised URL that is sent, redirects, byte cap,
deadline) and tenant scoping (a tenant never reads another's rows through any tool), each on the
real thing: a SQLite file, a throwaway PostgreSQL server, a local HTTP server, a BM25 index."""

import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmfoundry.agents import tools
from lmfoundry.agents.workflow import WorkflowConfig, build_registry

pytestmark = pytest.mark.timeout(120)

# --- SQL: what the parser refuses ------------------------------------------------------------

POSTGRES_ATTACKS = [
    "COMMIT; DROP TABLE orders",
    "SELECT 1; COMMIT; DELETE FROM orders",
    'SELECT 1 AS "x;COMMIT;"; DELETE FROM orders',
    "SELECT 'a; --'; DELETE FROM orders -- '",
    "SELECT $$;$$; DELETE FROM orders",
    "SELECT $body$ ' $body$; DELETE FROM orders",
    "DO $$ BEGIN DELETE FROM orders; END $$",
    "COPY orders TO PROGRAM 'id > /tmp/pwned'",
    "COPY (SELECT 1) TO '/tmp/pwned'",
    "CREATE TEMP TABLE t AS SELECT 1",
    "EXPLAIN ANALYZE DELETE FROM orders",
    "EXPLAIN (ANALYZE) DELETE FROM orders",
    "WITH x AS (DELETE FROM orders RETURNING id) SELECT * FROM x",
    "WITH x AS (UPDATE orders SET total = 0 RETURNING id) SELECT count(*) FROM x",
    "WITH x AS (SELECT 1) INSERT INTO orders (customer) SELECT 'x' FROM x",
    "SELECT * INTO stolen FROM orders",
    "SELECT * FROM orders FOR UPDATE",
    "SELECT * FROM orders FOR SHARE NOWAIT",
    "SET ROLE lmfoundry",
    "RESET ROLE",
    "RESET ALL",
    "SET app.tenant = 'a'",
    "BEGIN",
    "ROLLBACK",
    "LOCK TABLE orders",
    "VACUUM orders",
    "GRANT SELECT ON orders TO PUBLIC",
    "LISTEN x",
    "PREPARE p AS DELETE FROM orders",
    "SELECT set_config('app.tenant', 'a', false)",
    "SELECT pg_catalog.set_config('app.tenant', 'a', true)",
    "SELECT * FROM set_config('app.tenant', 'a', true)",
    "SELECT (SELECT SET_CONFIG('app.tenant', 'a', true))",
    "SELECT pg_read_file('/etc/passwd')",
    "SELECT pg_read_binary_file('/etc/passwd')",
    "SELECT pg_ls_dir('.')",
    "SELECT pg_stat_file('postgresql.conf')",
    "SELECT lo_import('/etc/passwd')",
    "SELECT lo_export(1, '/tmp/x')",
    "SELECT pg_terminate_backend(1)",
    "SELECT pg_cancel_backend(1)",
    "SELECT pg_reload_conf()",
    "SELECT pg_rotate_logfile()",
    "SELECT pg_sleep(10)",
    "SELECT pg_sleep_for('10 s')",
    "SELECT pg_advisory_lock(1)",
    "SELECT pg_try_advisory_xact_lock(1)",
    "SELECT txid_current()",
    "SELECT pg_current_xact_id()",
    "SELECT * FROM dblink('host=evil', 'SELECT 1') AS t(x int)",
    "SELECT query_to_xml('SELECT set_config(''app.tenant'', ''a'', true)', true, true, '')",
    "SELECT nextval('orders_id_seq')",
    "SELECT 1 /* ; */ UNION SELECT pg_sleep(1)",
    "SELECT '\\', set_config('app.tenant', 'a', true) --'",
    # functions that run SQL given as text, which the parser never sees
    "SELECT ts_rewrite('x'::tsquery, 'SELECT ''x''::tsquery, set_config(''app.tenant'', ''a'', true)::tsquery')",
    "SELECT database_to_xml_and_xmlschema(true, true, '')",
    "SELECT table_to_xml('docs', true, true, '')",
    "SELECT current_setting('data_directory')",
    "SELECT inet_server_addr()",
    # (x).f is the call f(x) to PostgreSQL, and no function call to the parser
    "SELECT (a).ts_stat FROM (SELECT 'select set_config(''app.tenant'',''acme'',true)::tsvector'::text AS a) v",
    "SELECT (3.0::float8).pg_sleep",
]

SQLITE_ATTACKS = [
    "ATTACH DATABASE '/tmp/x.db' AS x",
    "PRAGMA writable_schema = 1",
    "VACUUM INTO '/tmp/copy.db'",
    "REPLACE INTO orders (customer) VALUES ('x')",
    "CREATE TEMP TABLE t (x)",
    "SELECT load_extension('/tmp/evil.so')",
    "SELECT randomblob(1000000000)",
    "SELECT zeroblob(1000000000)",
    "SELECT printf('%.*c', 1000000000, 'x')",
    "SELECT readfile('/etc/passwd')",
    "SELECT writefile('/tmp/x', 'y')",
    "SELECT 1; DELETE FROM orders",
    'SELECT 1 AS "x;COMMIT;"; DELETE FROM orders',
    "WITH x AS (SELECT 1) DELETE FROM orders",
    "BEGIN",
    "SELECT * INTO stolen FROM orders",
]


@pytest.mark.parametrize("query", POSTGRES_ATTACKS)
def test_sql_parser_refuses_postgres_write_command_and_function_smuggling(query):
    with pytest.raises(tools.ToolError, match="not allowed|one statement|does not parse"):
        tools.check_sql(query, "postgres")


@pytest.mark.parametrize("query", SQLITE_ATTACKS)
def test_sql_parser_refuses_sqlite_write_attach_and_memory_bombs(query):
    with pytest.raises(tools.ToolError, match="not allowed|one statement|does not parse"):
        tools.check_sql(query, "sqlite")


def test_sql_parser_keeps_ordinary_read_queries():
    for query in [
        "SELECT customer, count(*) FROM orders GROUP BY customer",
        "WITH t AS (SELECT total FROM orders) SELECT max(total) FROM t",
        "SELECT 1 UNION SELECT 2 EXCEPT SELECT 3",
        "SELECT * FROM (SELECT id FROM orders) s WHERE id IN (SELECT id FROM orders)",
        "EXPLAIN SELECT * FROM orders",
        "SELECT 'COMMIT; DROP TABLE orders' AS text",
        'SELECT 1 AS "a;b"',
        "SELECT date_trunc('month', now()), extract(year FROM now()), to_char(now(), 'YYYY')",
        "SELECT customer, string_agg(customer, ','), round(avg(total), 2), coalesce(max(total), 0) FROM orders "
        "GROUP BY customer HAVING count(*) > 1",
        "SELECT lower(customer), strpos(customer, 'c'), row_number() OVER (ORDER BY total) FROM orders",
        "SELECT CASE WHEN total > 10 THEN 'big' ELSE 'small' END, CAST(total AS INT) FROM orders",
        "SELECT * FROM orders o WHERE NOT EXISTS (SELECT 1 FROM orders p WHERE p.id = o.id + 1)",
        "SELECT id FROM orders WHERE id = ANY(ARRAY[1, 2]) AND customer IS DISTINCT FROM 'x'",
        "SELECT * FROM unnest(ARRAY[1, 2]) AS u(x)",
        "SELECT ntile(4) OVER (ORDER BY total), percent_rank() OVER (ORDER BY total) FROM orders",
        "SELECT json_agg(customer), jsonb_build_object('n', count(*)) FROM orders",
        "SELECT to_timestamp('2024', 'YYYY'), date(now()), lpad(customer, 8, ' ') FROM orders",
        "SELECT * FROM orders WHERE (total > 1 OR customer ~* '^c') AND NOT customer LIKE 'x%'",
    ]:
        tools.check_sql(query, "postgres")
    tools.check_sql("EXPLAIN QUERY PLAN SELECT * FROM orders", "sqlite")


# --- SQL on PostgreSQL: the database enforces it too -----------------------------------------


def _role_dsn(admin_dsn: str, role: str) -> str:
    return admin_dsn.replace("lmfoundry@", f"{role}:pw@", 1)


@pytest.fixture
def pg(postgres_dsn):
    """orders and a per-tenant docs table with row-level security; a read-only role for the tool."""
    import psycopg

    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS orders, docs, stolen, payroll")
        conn.execute("CREATE TABLE orders (id SERIAL PRIMARY KEY, customer TEXT, total NUMERIC)")
        conn.execute("INSERT INTO orders (customer, total) SELECT 'c' || (i % 3), i FROM generate_series(1, 50) i")
        conn.execute("CREATE TABLE docs (tenant TEXT, secret TEXT)")
        conn.execute("INSERT INTO docs VALUES ('acme', 'acme-secret-1'), ('acme', 'acme-secret-2'), ('bolt', 'bolt-1')")
        conn.execute("CREATE TABLE payroll (who TEXT, pay INT)")
        conn.execute("INSERT INTO payroll VALUES ('ceo', 1000000)")
    tools.create_readonly_role(postgres_dsn, "agent_ro", "pw", ["orders", "docs"], timeout_s=2)
    tools.enable_tenant_rls(postgres_dsn, "docs", "tenant", "app.tenant")
    return postgres_dsn, _role_dsn(postgres_dsn, "agent_ro")


def _order_count(admin_dsn):
    import psycopg

    with psycopg.connect(admin_dsn) as conn:
        return conn.execute("SELECT count(*) FROM orders").fetchone()[0]


def test_postgres_attacks_change_nothing_through_the_tool(pg):
    admin, role = pg
    sql = tools.sql_tool(role, timeout_s=2).fn
    for query in POSTGRES_ATTACKS:
        with pytest.raises(tools.ToolError):
            sql(query)
    assert _order_count(admin) == 50
    with pytest.raises(tools.ToolError, match="does not exist"):
        sql("SELECT * FROM stolen")


def test_postgres_server_refuses_multi_statement_and_writes_when_the_parser_is_bypassed(pg):
    """The layer under the parser, called directly: the extended protocol, the READ ONLY
    transaction and the role's grants each refuse on their own."""
    admin, role = pg

    def raw(query, dsn=role):
        return tools._postgres_rows(dsn, query, False, 10, 10_000, 2.0, None, None)

    with pytest.raises(tools.ToolError, match="multiple commands"):
        raw("SELECT 1; DELETE FROM orders")
    with pytest.raises(tools.ToolError, match="multiple commands"):
        raw('SELECT 1 AS "x"; COMMIT; DELETE FROM orders')
    for query in ["DELETE FROM orders", "CREATE TEMP TABLE t AS SELECT 1", "SELECT * INTO stolen FROM orders"]:
        with pytest.raises(tools.ToolError, match="read-only transaction"):
            raw(query)
    with pytest.raises(tools.ToolError, match="permission denied"):
        raw("SELECT * FROM payroll")  # not granted to the role
    with pytest.raises(tools.ToolError, match="permission denied|must be superuser|read-only"):
        raw("SELECT pg_read_file('/etc/passwd')")
    with pytest.raises(tools.ToolError, match="read-only transaction"):
        raw("DELETE FROM orders", dsn=admin)  # even an owner's connection runs the tool read-only
    assert _order_count(admin) == 50


def test_postgres_huge_result_stops_at_the_row_and_byte_caps(pg):
    _, role = pg
    sql = tools.sql_tool(role, max_rows=5, max_bytes=50_000, timeout_s=10).fn
    started = time.perf_counter()
    out = sql("SELECT g, md5(g::text) FROM generate_series(1, 5000000) g")
    assert out["truncated"] and len(out["rows"]) == 5 and time.perf_counter() - started < 5
    wide = tools.sql_tool(role, max_rows=1000, max_bytes=2_000, timeout_s=10).fn
    out = wide("SELECT g, md5(g::text) FROM generate_series(1, 5000000) g")  # 40 bytes a row
    assert out["truncated"] and len(out["rows"]) <= 50


def test_postgres_cartesian_join_and_recursive_cte_bomb_hit_the_statement_timeout(pg):
    _, role = pg
    sql = tools.sql_tool(role, timeout_s=1).fn
    for query in [
        "SELECT count(*) FROM generate_series(1, 100000) a, generate_series(1, 100000) b",
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r",
    ]:
        started = time.perf_counter()
        with pytest.raises(tools.ToolError, match="ran past"):
            sql(query)
        assert time.perf_counter() - started < 4


TENANT_B_QUERIES = [
    "SELECT secret FROM docs",
    "SELECT secret FROM docs WHERE tenant = 'acme' OR 1 = 1",
    "SELECT secret FROM docs UNION ALL SELECT secret FROM docs WHERE tenant = 'acme'",
    "SELECT (SELECT string_agg(secret, ',') FROM docs WHERE tenant = 'acme')",
    "SELECT secret FROM docs -- WHERE tenant = 'bolt'",
    "SELECT secret FROM docs /* */ WHERE tenant /**/ <> 'bolt'",
    "SELECT current_setting('app.tenant'), secret FROM docs",
    "SET ROLE lmfoundry",
    "RESET app.tenant",
    "RESET ROLE",
    "SET app.tenant TO 'acme'",
    "SELECT set_config('app.tenant', 'acme', true), secret FROM docs",
    "SELECT secret FROM docs, set_config('app.tenant', 'acme', true)",
    "SELECT 1; SELECT set_config('app.tenant', 'acme', false)",
    "SELECT query_to_xml('SELECT secret FROM docs', true, true, '')",
]


def test_tenant_cannot_read_another_tenants_rows_on_postgres_rls(pg):
    _, role = pg
    registry = tools.ToolRegistry()
    registry.register(tools.sql_tool(role, tenant_setting="app.tenant", timeout_s=2))
    mine = registry.call("sql", {"query": "SELECT secret FROM docs"}, tenant="bolt")
    assert mine.ok and mine.output["rows"] == [["bolt-1"]]
    for query in TENANT_B_QUERIES:
        result = registry.call("sql", {"query": query}, tenant="bolt")
        assert "acme" not in str(result.output), query
    unscoped = registry.call("sql", {"query": "SELECT secret FROM docs"})
    assert not unscoped.ok and "tenant-scoped" in unscoped.error
    spoofed = registry.call("sql", {"query": "SELECT secret FROM docs", "tenant": "acme"}, tenant="bolt")
    assert not spoofed.ok


def test_tenant_setting_changed_inside_a_query_withholds_the_result(pg):
    """If a query ever slipped set_config past the parser, the tool sees the setting changed and
    returns nothing."""
    _, role = pg
    query = "SELECT set_config('app.tenant', 'acme', true), secret FROM docs"
    with pytest.raises(tools.ToolError, match="changed the tenant setting"):
        tools._postgres_rows(role, query, False, 10, 10_000, 2.0, "app.tenant", "bolt")


# --- SQL on SQLite ---------------------------------------------------------------------------


def _sqlite_db(path, rows):
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT, total REAL)")
    conn.executemany("INSERT INTO orders (customer, total) VALUES (?, ?)", rows)
    conn.commit()
    conn.close()
    return str(path)


@pytest.fixture
def orders_db(tmp_path):
    return _sqlite_db(tmp_path / "orders.sqlite", [(f"c{i % 7}", i * 1.5) for i in range(2000)])


def test_sqlite_attacks_change_nothing_and_the_engine_refuses_when_the_parser_is_bypassed(orders_db):
    sql = tools.sql_tool(orders_db, timeout_s=2).fn
    for query in SQLITE_ATTACKS:
        with pytest.raises(tools.ToolError):
            sql(query)

    def raw(query):
        return tools._sqlite_rows(orders_db, query, False, 10, 10_000, 2.0)

    for query in [
        "DELETE FROM orders",
        "SELECT randomblob(100)",
        "SELECT zeroblob(100)",
        "SELECT printf('%d', 1)",
        "SELECT load_extension('x')",
        "ATTACH DATABASE ':memory:' AS x",
        "PRAGMA writable_schema = 1",
        "SELECT 1; DELETE FROM orders",
    ]:
        with pytest.raises(tools.ToolError, match="not authorized|readonly|one statement at a time"):
            raw(query)
    assert sql("SELECT count(*) FROM orders")["rows"] == [[2000]]


def test_sqlite_memory_and_time_bombs_are_stopped(orders_db):
    sql = tools.sql_tool(orders_db, timeout_s=1, max_bytes=100_000).fn
    with pytest.raises(tools.ToolError, match="too big"):  # SQLITE_LIMIT_LENGTH
        sql(
            "WITH RECURSIVE r(s) AS (SELECT 'xxxxxxxxxx' UNION ALL SELECT s || s FROM r WHERE length(s) < 1e9) "
            "SELECT length(s) FROM r"
        )
    for query in [
        "SELECT count(*) FROM orders a, orders b, orders c",
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r",
    ]:
        started = time.perf_counter()
        with pytest.raises(tools.ToolError, match="ran past"):
            sql(query)
        assert time.perf_counter() - started < 3
    out = sql("SELECT a.id, b.customer FROM orders a, orders b")  # 4 million rows, read until the cap
    assert out["truncated"] and len(out["rows"]) == 100


def test_tenant_cannot_read_another_tenants_rows_on_sqlite(tmp_path):
    acme = _sqlite_db(tmp_path / "acme.sqlite", [("acme-secret", 1.0)])
    bolt = _sqlite_db(tmp_path / "bolt.sqlite", [("bolt-1", 2.0)])
    registry = tools.ToolRegistry()
    registry.register(tools.sql_tool(tenant_dsns={"acme": acme, "bolt": bolt}))
    mine = registry.call("sql", {"query": "SELECT customer FROM orders"}, tenant="bolt")
    assert mine.output["rows"] == [["bolt-1"]]
    for query in [
        "SELECT customer FROM orders UNION SELECT 'x'",
        f"ATTACH DATABASE '{acme}' AS a",
        f"SELECT * FROM orders; ATTACH '{acme}' AS a",
        f"SELECT readfile('{acme}')",
        "SELECT * FROM pragma_database_list",
    ]:
        result = registry.call("sql", {"query": query}, tenant="bolt")
        assert "acme" not in str(result.output), query
    assert not registry.call("sql", {"query": "SELECT 1"}, tenant="carp").ok  # no database for it


# --- search ----------------------------------------------------------------------------------


def test_tenant_cannot_find_another_tenants_documents_by_search():
    registry = tools.ToolRegistry()
    registry.register(
        tools.search_tool(
            tenant_corpora={
                "acme": [{"id": "a1", "text": "acme merger plan zanzibar confidential"}],
                "bolt": [{"id": "b1", "text": "bolt holiday rota"}],
            }
        )
    )
    for query in ["zanzibar merger", "acme confidential plan", "holiday zanzibar"]:
        result = registry.call("search", {"query": query}, tenant="bolt")
        assert "a1" not in str(result.output) and "zanzibar" not in str(result.output)
    assert registry.call("search", {"query": "zanzibar"}, tenant="acme").output["results"][0]["id"] == "a1"
    assert not registry.call("search", {"query": "rota"}, tenant="carp").ok


# --- HTTP ------------------------------------------------------------------------------------


class _Server(BaseHTTPRequestHandler):
    seen: list = []

    def _send(self, status, body=b"", headers=()):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        _Server.seen.append((self.path, self.headers.get("X-Tenant")))
        path = self.path
        if path == "/api/to-metadata":
            return self._send(302, headers=[("Location", "http://169.254.169.254/latest/meta-data")])
        if path == "/api/to-admin":
            return self._send(302, headers=[("Location", "/admin")])
        if path == "/api/to-dots":
            return self._send(302, headers=[("Location", "/api/%2e%2e/admin")])
        if path == "/api/to-orders":
            return self._send(302, headers=[("Location", "/api/orders/1")])
        if path == "/api/loop":
            return self._send(302, headers=[("Location", "/api/loop")])
        if path == "/tenants/bolt/jump":
            return self._send(302, headers=[("Location", "/tenants/acme/rows")])
        if path == "/api/slow-body":
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.2)
            return None
        if path == "/api/slow-headers":
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for _ in range(100):
                self.wfile.write(b"X-Slow: 1\r\n")
                self.wfile.flush()
                time.sleep(0.2)
            return None
        if path == "/api/endless":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"x" * 65536
            try:
                while True:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError):
                return None
        if path.startswith("/tenants/"):
            owner = path.split("/")[2]
            if owner != self.headers.get("X-Tenant"):
                return self._send(403, b"forbidden")
            return self._send(200, f"{owner}-rows".encode())
        return self._send(200, path.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def api():
    _Server.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server.server_address[1]
    server.shutdown()
    server.server_close()


def _http(base, **kw):
    registry = tools.ToolRegistry()
    registry.register(tools.http_tool([tools.AllowedAPI(base)], retries=0, **kw))
    return lambda url: registry.call("http", {"method": "GET", "url": url})


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:{port}@evil.example/api",
        "http://user:pw@127.0.0.1:{port}/api",
        "http://127.0.0.1.evil.example:{port}/api",
        "{api}/api/../admin",
        "{api}/api/./../admin",
        "{api}/api/%2e%2e/admin",
        "{api}/api/%2E%2e/admin",
        "{api}/api%2fadmin",
        "{api}/api%2F..%2Fadmin",
        "{api}/api/..%5cadmin",
        "{api}/api\\..\\admin",
        "{api}/api/%zz",
        "{api}/apiary",
        "http://127.1:{port}/api",
        "http://0x7f.1:{port}/api",
        "http://0x7f000001:{port}/api",
        "http://2130706433:{port}/api",
        "http://0177.0.0.1:{port}/api",
        "http://[::ffff:127.0.0.1]:{port}/api",
        "http://[::ffff:7f00:1]:{port}/api",
        "https://127.0.0.1:{port}/api",
        "file:///etc/passwd",
        "http://127.0.0.1:{port}/api\n/admin",
    ],
)
def test_http_allow_list_holds_against_url_tricks(api, url):
    base, port = api
    call = _http(f"{base}/api")
    result = call(url.format(api=base, port=port))
    assert not result.ok
    assert all(not path.startswith("/admin") for path, _ in _Server.seen)


def test_http_sends_the_normalised_url_it_checked(api):
    base, port = api
    call = _http(f"{base}/api")
    for url, sent in [
        (f"{base}/api/./orders/%7e1", "/api/orders/~1"),
        (f"HTTP://127.0.0.1:{port}/api/x/../orders", "/api/orders"),
        (f"{base}/api/a%3ab?q=1", "/api/a%3Ab?q=1"),
    ]:
        result = call(url)
        assert result.ok and result.output["body"] == sent, url
    assert [p for p, _ in _Server.seen] == ["/api/orders/~1", "/api/orders", "/api/a%3Ab?q=1"]


def test_http_redirects_are_rechecked_and_bounded(api):
    base, _ = api
    call = _http(f"{base}/api")
    for path, why in [
        ("/api/to-metadata", "outside the allow-list"),
        ("/api/to-admin", "outside the allow-list"),
        ("/api/to-dots", "outside the allow-list"),
        ("/api/loop", "redirects"),
    ]:
        result = call(base + path)
        assert not result.ok and why in result.error, path
    assert "/admin" not in [p for p, _ in _Server.seen]
    followed = call(base + "/api/to-orders")
    assert followed.ok and followed.output["body"] == "/api/orders/1"


def test_http_slowloris_body_and_headers_stop_at_the_total_deadline(api):
    base, _ = api
    call = _http(f"{base}/api", timeout_s=1.0)
    for path in ["/api/slow-body", "/api/slow-headers"]:
        started = time.perf_counter()
        result = call(base + path)
        elapsed = time.perf_counter() - started
        assert not result.ok and "ran past" in result.error and elapsed < 1.8, (path, elapsed, result.error)


def test_http_endless_body_stops_at_the_byte_cap(api):
    base, _ = api
    call = _http(f"{base}/api", max_bytes=100_000, timeout_s=5)
    started = time.perf_counter()
    result = call(base + "/api/endless")
    assert result.ok and result.output["truncated"] and len(result.output["body"]) == 100_000
    assert time.perf_counter() - started < 2


def test_tenant_cannot_reach_another_tenants_api_paths(api):
    base, _ = api
    registry = tools.ToolRegistry()
    registry.register(tools.http_tool([tools.AllowedAPI(base + "/tenants/{tenant}")], tenant_header="X-Tenant"))

    def call(url, tenant="bolt"):
        return registry.call("http", {"method": "GET", "url": url}, tenant=tenant)

    mine = call(base + "/tenants/bolt/rows")
    assert mine.ok and mine.output["body"] == "bolt-rows"
    for url in [
        "/tenants/acme/rows",
        "/tenants/bolt/../acme/rows",
        "/tenants/bolt/%2e%2e/acme/rows",
        "/tenants/bolt%2f..%2facme/rows",
        "/tenants/bolt/jump",
        "/tenants/bolt-x/../acme/rows",
    ]:
        assert "acme-rows" not in str(call(base + url).output), url
    assert not any(path.startswith("/tenants/acme") for path, _ in _Server.seen)
    assert not registry.call("http", {"method": "GET", "url": base + "/tenants/bolt/rows"}).ok  # no tenant


# --- workflow tenants ------------------------------------------------------------------------


def test_workflow_refuses_tool_calls_from_tenants_it_does_not_name(tmp_path):
    db = _sqlite_db(tmp_path / "o.sqlite", [("x", 1.0)])
    wf = WorkflowConfig(
        name="orders",
        model_url="http://127.0.0.1:1/v1",
        tenants=["acme"],
        tools={"sql": {"kind": "sql", "dsn": db}},
    )
    assert wf.allows("acme") and not wf.allows("bolt")
    registry = build_registry(wf)
    assert registry.call("sql", {"query": "SELECT 1"}, tenant="acme").ok
    refused = registry.call("sql", {"query": "SELECT 1"}, tenant="bolt")
    assert not refused.ok and "may not use" in refused.error
    assert not registry.call("sql", {"query": "SELECT 1"}).ok
