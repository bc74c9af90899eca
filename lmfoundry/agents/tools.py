"""Tools an agent may call: a registry of named functions, each with a JSON schema for its
arguments, a timeout, retries with exponential backoff, and whether it has side effects.

Built-in tools, each made from its configuration:
- `sql_tool`: read-only queries against SQLite (the embedded default) or PostgreSQL (by DSN).
  One statement, parsed by sqlglot: a SELECT (set operations, WITH, EXPLAIN of one) with no write,
  DDL, command, SELECT INTO, row lock or function that reaches outside the query anywhere in it
  (on PostgreSQL, a function not on an allow-list: some run SQL given as text).
  Then the database enforces it too: SQLite opened read-only with an authorizer (reads and
  allow-listed functions only), length limits and a progress-handler deadline; PostgreSQL through
  the extended query protocol (one statement, by the server), a READ ONLY transaction,
  statement_timeout and idle_in_transaction_session_timeout, ideally as a role made by
  `create_readonly_role`. Rows are read incrementally up to a row and a byte cap.
- `search_tool`: BM25 (Okapi, k1 1.5, b 0.75) over a curated corpus (a curate output's kept/
  shards or a JSONL with `text`).
- `http_tool`: calls to internal APIs on an allow-list of base URLs and methods, checked on the
  normalised URL that is then sent; redirects re-checked hop by hop; the body read up to a byte
  cap within one total deadline. A call with side effects carries an `Idempotency-Key` header, so
  a retried or resumed call is not done twice by a server that honours it.
Tenant scoping: a tool made with per-tenant settings (SQL `tenant_dsns` or PostgreSQL row-level
security through `tenant_setting`, search `tenant_corpora`, HTTP `{tenant}` in a base URL or a
`tenant_header`) receives the calling run's tenant from the service, never from the model.
- `python_tool`: code in the sandbox (safety/sandbox.py).

A tool's output is data, never instructions: the agent service marks it untrusted before the
model sees it, and what a tool may reach is enforced here, not by the model's good behaviour.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import math
import os
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from sqlglot import expressions as sqlglot_exp

from lmfoundry.platform.corpus import read_documents
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


class ToolError(RuntimeError):
    """A tool call that failed; `retryable` ones are tried again with backoff."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict
    fn: Callable[..., object]
    timeout_s: float = 10.0
    retries: int = 0
    backoff_s: float = 0.5
    side_effects: bool = False
    tenant_scoped: bool = False  # fn takes `tenant`, the calling run's tenant, set by the service

    def spec(self) -> dict:
        """The OpenAI `tools` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolResult:
    ok: bool
    output: object
    attempts: int
    seconds: float
    error: str | None = None


@dataclass
class ToolRegistry:
    tools: dict[str, Tool] = field(default_factory=dict)
    tenants: list[str] | None = None  # the tenants that may call these tools; None: any

    def register(self, tool: Tool) -> Tool:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", tool.name):
            raise ValueError(f"tool name {tool.name!r}: 1-64 letters, digits, _ or -")
        if tool.name in self.tools:
            raise ValueError(f"a tool named {tool.name!r} is registered already")
        from jsonschema import Draft202012Validator

        Draft202012Validator.check_schema(tool.parameters)
        self.tools[tool.name] = tool
        return tool

    def tool(
        self,
        name: str | None = None,
        description: str = "",
        parameters: dict | None = None,
        timeout_s: float = 10.0,
        retries: int = 0,
        side_effects: bool = False,
    ):
        """Decorator: `@registry.tool(parameters={...})` over `def fn(**arguments)`."""

        def wrap(fn):
            self.register(
                Tool(
                    name or fn.__name__,
                    description or (fn.__doc__ or "").strip(),
                    parameters or {"type": "object", "properties": {}},
                    fn,
                    timeout_s,
                    retries,
                    side_effects=side_effects,
                )
            )
            return fn

        return wrap

    def get(self, name: str) -> Tool:
        if name not in self.tools:
            raise ToolError(f"no tool {name!r}; registered: {sorted(self.tools)}")
        return self.tools[name]

    def specs(self, names: list[str]) -> list[dict]:
        return [self.get(n).spec() for n in names]

    def call(
        self, name: str, arguments: dict, idempotency_key: str | None = None, tenant: str | None = None
    ) -> ToolResult:
        """Validate the arguments, run the tool under its timeout, retry what is retryable. `tenant`
        is the calling run's tenant: refused when not among `tenants`, and given to a tenant-scoped
        tool by the service (an argument named `tenant` from the model is refused)."""
        from jsonschema import Draft202012Validator

        tool = self.get(name)
        if self.tenants is not None and tenant not in self.tenants:
            return ToolResult(False, None, 0, 0.0, f"tenant {tenant!r} may not use {name}; allowed: {self.tenants}")
        if tool.tenant_scoped and (tenant is None or "tenant" in arguments):
            return ToolResult(
                False, None, 0, 0.0, f"{name} is tenant-scoped: the service, not the model, names the tenant"
            )
        errors = sorted(Draft202012Validator(tool.parameters).iter_errors(arguments), key=lambda e: e.path)
        if errors:
            return ToolResult(False, None, 0, 0.0, f"arguments do not fit {name}'s schema: {errors[0].message}")
        if "idempotency_key" in arguments:  # the caller's, never the model's: a chosen key could replay another call
            return ToolResult(False, None, 0, 0.0, "idempotency_key is set by the service, not passed as an argument")
        started, attempt = time.perf_counter(), 0
        kwargs = dict(arguments)
        if tool.side_effects and idempotency_key is not None:
            if not _takes_idempotency_key(tool.fn):
                return ToolResult(
                    False,
                    None,
                    0,
                    0.0,
                    f"{name} has side effects but its function takes no idempotency_key argument, so a "
                    "retried or resumed call could act twice; refused (add `idempotency_key: str` and pass it on)",
                )
            kwargs["idempotency_key"] = idempotency_key
        if tool.tenant_scoped:
            kwargs["tenant"] = tenant
        while True:
            attempt += 1
            pool = concurrent.futures.ThreadPoolExecutor(1)
            try:
                output = pool.submit(tool.fn, **kwargs).result(timeout=tool.timeout_s)
                return ToolResult(True, output, attempt, time.perf_counter() - started)
            except concurrent.futures.TimeoutError:
                error = ToolError(f"{name} timed out after {tool.timeout_s:g} s", retryable=True)
            except ToolError as e:
                error = e
            except Exception as e:  # a tool's own failure is the call's result, never the service's crash
                error = ToolError(f"{type(e).__name__}: {e}")
            finally:
                pool.shutdown(wait=False)
            if not error.retryable or attempt > tool.retries:
                return ToolResult(False, None, attempt, time.perf_counter() - started, str(error))
            time.sleep(tool.backoff_s * 2 ** (attempt - 1))


def _takes_idempotency_key(fn: Callable) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.name == "idempotency_key" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


# --- sql -------------------------------------------------------------------------------------

TENANT_PATTERN = r"[A-Za-z0-9_-]{1,64}"  # no dots: `{tenant}` in a URL path must not be `..`

# Statement kinds a read-only call may run: a query, or a set operation of queries.
_READ_ROOTS = (sqlglot_exp.Select, sqlglot_exp.SetOperation)
_WRITE_ROOTS = (sqlglot_exp.Insert, sqlglot_exp.Update, sqlglot_exp.Delete)
# Nodes refused anywhere in the tree, CTEs and subqueries included: writes, schema changes,
# session and transaction control, statements sqlglot could not parse (Command), SELECT INTO
# (creates a table) and row locks (FOR UPDATE: a read that blocks other sessions' writes).
_REFUSED_NODES = (
    sqlglot_exp.DML,
    sqlglot_exp.DDL,
    sqlglot_exp.Command,
    sqlglot_exp.Copy,
    sqlglot_exp.Set,
    sqlglot_exp.Transaction,
    sqlglot_exp.Commit,
    sqlglot_exp.Rollback,
    sqlglot_exp.Into,
    sqlglot_exp.Lock,
    sqlglot_exp.Pragma,
    sqlglot_exp.Attach,
    sqlglot_exp.Detach,
    sqlglot_exp.TruncateTable,
    sqlglot_exp.Grant,
    sqlglot_exp.Use,
    sqlglot_exp.Analyze,
    sqlglot_exp.Kill,
    sqlglot_exp.Declare,
)
# Functions that reach the server's files, other sessions, the server's state, the transaction's
# identity, other databases, or that sleep, lock, or run SQL given as a string (which the parser
# never sees): refused by name or prefix, whatever the schema qualifier or case.
_REFUSED_FUNCTIONS = {
    "pg_read_file", "pg_read_binary_file", "pg_ls_dir", "pg_stat_file", "pg_terminate_backend",
    "pg_cancel_backend", "pg_reload_conf", "pg_rotate_logfile", "set_config", "copy", "pg_notify",
    "pg_current_xact_id", "pg_current_xact_id_if_assigned", "pg_switch_wal", "pg_promote",
    "pg_export_snapshot", "pg_file_write", "pg_log_backend_memory_contexts", "nextval", "setval",
    "query_to_xml", "query_to_xml_and_xmlschema", "query_to_xmlschema", "cursor_to_xml",
    "cursor_to_xmlschema", "ts_stat", "database_to_xml", "schema_to_xml", "pg_logdir_ls",
    "load_extension", "readfile", "writefile", "edit", "fts3_tokenizer", "randomblob", "zeroblob",
    "printf", "format", "sqlite_compileoption_get", "sqlite_compileoption_used",
}  # fmt: skip
_REFUSED_FUNCTION_PREFIXES = (
    "pg_sleep", "dblink", "lo_", "pg_advisory", "pg_try_advisory", "txid_", "pg_ls_", "pg_read_",
    "pg_logical_", "pg_replication_", "pg_create_", "pg_drop_", "pg_backup", "pg_wal_", "pg_stat_reset",
)  # fmt: skip
# PostgreSQL has no authorizer to ask, and thousands of functions, some of which run SQL given as
# text that the parser never sees (ts_rewrite, the *_to_xml family): a query may call only these,
# by the name sqlglot gives them (strpos is str_position, string_agg group_concat, json_agg
# j_s_o_n_array_agg, to_char time_to_str, to_timestamp str_to_time, date_trunc timestamp_trunc,
# x->>'k' json_extract_scalar, x @> y array_contains_all, x ? 'k' j_s_o_n_b_contains_top_key),
# and the syntax sqlglot parses as functions (EXISTS, ARRAY[...], unnest, CASE, CAST). What a
# query may compute is bounded by the statement timeout and the server's limits, not this list.
POSTGRES_FUNCTIONS = {
    # syntax
    "exists", "array", "unnest", "explode", "cast", "try_cast", "case", "if",
    # aggregates
    "count", "sum", "avg", "min", "max", "group_concat", "array_agg", "logical_and", "logical_or",
    "every", "stddev", "stddev_pop", "stddev_samp", "variance", "variance_pop", "percentile_cont",
    "percentile_disc", "mode", "corr", "covar_pop", "covar_samp", "regr_slope", "regr_intercept",
    "regr_r2", "regr_count", "regr_avgx", "regr_avgy", "grouping", "j_s_o_n_array_agg", "jsonb_agg",
    # window
    "row_number", "rank", "dense_rank", "percent_rank", "cume_dist", "ntile", "lag", "lead",
    "first_value", "last_value", "nth_value",
    # strings
    "lower", "upper", "length", "octet_length", "substring", "trim", "replace", "str_position", "left",
    "right", "concat", "concat_ws", "initcap", "split_part", "starts_with", "reverse", "md5",
    "regexp_replace", "regexp_like", "overlay", "translate", "chr", "ascii", "pad", "repeat",
    "array_to_string", "string_to_array",
    # numbers
    "abs", "round", "ceil", "floor", "trunc", "power", "sqrt", "cbrt", "exp", "ln", "log", "sign",
    "degrees", "radians", "pi", "width_bucket", "gcd", "lcm", "greatest", "least", "rand",
    "to_number", "num_nulls", "num_nonnulls",
    # dates and times
    "current_timestamp", "current_date", "current_time", "localtimestamp", "localtime", "date",
    "timestamp_trunc", "extract", "age", "make_date", "make_interval", "justify_days",
    "time_to_str", "str_to_date", "str_to_time", "unix_to_time",
    # conditional
    "coalesce", "nullif",
    # JSON
    "json_extract_scalar", "json_extract", "jsonb_extract_scalar", "jsonb_extract",
    "jsonb_extract_path_text", "json_array_length", "jsonb_array_length", "json_build_object",
    "jsonb_build_object", "to_json", "to_jsonb", "json_typeof", "jsonb_typeof", "json_array_elements",
    "jsonb_array_elements", "json_each", "jsonb_each", "json_object_keys", "jsonb_object_keys",
    "array_contains_all", "j_s_o_n_b_contains_top_key", "j_s_o_n_b_contains_all_top_keys",
    "j_s_o_n_b_contains_any_top_keys", "jsonb_contains",
    # operators sqlglot parses as functions
    "array_contains", "array_contained_by", "array_overlaps", "regexp_i_like", "collate",
    # arrays and series
    "array_size", "cardinality", "exploding_generate_series",
}  # fmt: skip
# SQLite's authorizer allows only these functions (an allow-list: an unknown one is refused).
SQLITE_FUNCTIONS = {
    "abs", "avg", "count", "max", "min", "sum", "total", "group_concat", "length", "lower", "upper",
    "substr", "substring", "trim", "ltrim", "rtrim", "round", "coalesce", "ifnull", "nullif", "iif",
    "instr", "replace", "date", "time", "datetime", "julianday", "strftime", "unixepoch", "typeof",
    "like", "glob", "hex", "quote", "cast", "json_extract", "json_array_length", "json_type",
    "json_valid", "likely", "unlikely", "sign", "char", "unicode",
}  # fmt: skip
_SQLITE_READ_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    getattr(sqlite3, "SQLITE_RECURSIVE", 33),
}
_SQLITE_WRITE_ACTIONS = {
    sqlite3.SQLITE_INSERT,
    sqlite3.SQLITE_UPDATE,
    sqlite3.SQLITE_DELETE,
    sqlite3.SQLITE_TRANSACTION,  # the BEGIN Python issues before a write
}
SQLITE_MAX_VALUE_BYTES = 1_000_000  # SQLITE_LIMIT_LENGTH: no string or blob (or row) above this


def _function_name(node: sqlglot_exp.Func) -> str:
    return (node.name if isinstance(node, sqlglot_exp.Anonymous) else node.sql_name()).lower()


def _refused_function(name: str) -> bool:
    return name in _REFUSED_FUNCTIONS or name.startswith(_REFUSED_FUNCTION_PREFIXES)


def _explained(statement: sqlglot_exp.Expression, dialect: str) -> str | None:
    """The statement an `EXPLAIN` (or SQLite's `EXPLAIN QUERY PLAN`) is of, or None for another."""
    if not isinstance(statement, sqlglot_exp.Command) or str(statement.this).upper() != "EXPLAIN":
        return None
    rest = statement.expression.name if statement.expression else ""
    if dialect == "sqlite":
        rest = re.sub(r"(?is)^\s*query\s+plan\b", "", rest)
    return rest


_UNICODE_ESCAPED = re.compile(r"(?<![\w$])u&\s*[\"']", re.IGNORECASE)


def check_sql(query: str, dialect: str, allow_writes: bool = False, _depth: int = 0) -> None:
    """Refuse (ToolError) anything but one read-only statement, parsed by sqlglot: a SELECT, a set
    operation of SELECTs, WITH ... SELECT, or EXPLAIN of one; no write, DDL or command anywhere in
    the tree; no function that reaches outside the query (files, sessions, settings, sleeps)."""
    import sqlglot

    if _UNICODE_ESCAPED.search(query):
        # PostgreSQL's U&"..." spells an identifier in escapes (U&"set\005fconfig" is set_config),
        # which the parser reads as something else: refused rather than decoded
        raise ToolError("Unicode-escaped identifiers or strings (U&\"...\", U&'...') are not allowed")
    try:
        statements = [s for s in sqlglot.parse(query, read=dialect) if s is not None]
    except sqlglot.errors.SqlglotError as e:
        raise ToolError(f"the query does not parse as {dialect} SQL: {str(e).splitlines()[0][:200]}") from None
    if len(statements) != 1:
        raise ToolError(f"one statement per call; this has {len(statements)}")
    statement = statements[0]
    explained = _explained(statement, dialect)
    if explained is not None and _depth == 0:
        return check_sql(explained, dialect, allow_writes=False, _depth=1)
    roots = _READ_ROOTS + (_WRITE_ROOTS if allow_writes else ())
    allowed = "SELECT, WITH ... SELECT, UNION/INTERSECT/EXCEPT, EXPLAIN" + (
        ", INSERT, UPDATE, DELETE" if allow_writes else ""
    )
    if not isinstance(statement, roots):
        kind = statement.key.upper() if not isinstance(statement, sqlglot_exp.Command) else str(statement.this)
        raise ToolError(f"statement {kind} is not allowed; allowed: {allowed}")
    for node in statement.walk():
        if allow_writes and isinstance(node, _WRITE_ROOTS):
            continue
        if isinstance(node, _REFUSED_NODES):
            raise ToolError(f"{node.key.upper()} is not allowed in a read-only query; allowed: {allowed}")
        if dialect == "postgres" and isinstance(node, sqlglot_exp.Dot):
            # PostgreSQL reads `(x).name` as the call name(x) when no field is called so: a way
            # to call any one-argument function that the function checks never see
            raise ToolError(f"field selection {node.sql(dialect='postgres')[:80]!r} is not allowed: (x).f calls f(x)")
        if isinstance(node, sqlglot_exp.Func):
            name = _function_name(node)
            if _refused_function(name):
                raise ToolError(f"function {name}() is not allowed: it reaches outside the query")
            if dialect == "postgres" and name not in POSTGRES_FUNCTIONS and not isinstance(node, sqlglot_exp.Connector):
                raise ToolError(
                    f"function {name}() is not allowed; allowed: aggregates, window, string, number, date, "
                    "JSON and conditional functions (tools.POSTGRES_FUNCTIONS)"
                )


def _row_bytes(row) -> int:
    return sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in row)


def _take_rows(rows, max_rows: int, max_bytes: int) -> tuple[list, bool]:
    """Rows from an iterator until the row or byte cap; (rows, truncated). Stops reading at the cap,
    so a huge result is never held whole."""
    taken, size = [], 0
    for row in rows:
        size += _row_bytes(row)
        if len(taken) == max_rows or size > max_bytes:
            return taken, True
        taken.append(list(row))
    return taken, False


def _sqlite_rows(path: str, query: str, allow_writes: bool, max_rows: int, max_bytes: int, timeout_s: float):
    if path.startswith("file:") or "?" in path:
        raise ToolError(f"sqlite path {path!r}: give a plain file path (no URI, no query string)")
    from urllib.parse import quote

    uri = f"file:{quote(path)}?mode={'rw' if allow_writes else 'ro'}"
    conn = sqlite3.connect(uri, uri=True, timeout=timeout_s, check_same_thread=False)
    deadline = time.monotonic() + timeout_s

    def authorize(action, arg1, arg2, *_):
        if action == sqlite3.SQLITE_FUNCTION:
            return sqlite3.SQLITE_OK if (arg2 or "").lower() in SQLITE_FUNCTIONS else sqlite3.SQLITE_DENY
        if action in _SQLITE_READ_ACTIONS or (allow_writes and action in _SQLITE_WRITE_ACTIONS):
            return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_DENY

    # Memory: no value or row above SQLITE_MAX_VALUE_BYTES, a small page cache, temporary b-trees
    # on disk; sqlite's hard heap limit is process-wide (it would starve the run store too), so the
    # memory-hungry functions are refused by the authorizer instead.
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, SQLITE_MAX_VALUE_BYTES)
    conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 100_000)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.execute("PRAGMA cache_size = -8192")  # 8 MiB
    conn.execute("PRAGMA temp_store = FILE")
    conn.set_authorizer(authorize)
    conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 1000)
    try:
        cur = conn.execute(query)
        columns = [d[0] for d in cur.description or ()]
        rows, truncated = _take_rows(cur, max_rows, max_bytes)
        if allow_writes:
            conn.commit()
        return columns, rows, truncated
    except sqlite3.OperationalError as e:
        if "interrupted" in str(e):
            raise ToolError(f"the query ran past {timeout_s:g} s") from None
        raise ToolError(f"sqlite: {e}") from None
    except sqlite3.DatabaseError as e:
        raise ToolError(f"sqlite: {e}") from None
    finally:
        conn.close()


def _postgres_rows(
    dsn: str,
    query: str,
    allow_writes: bool,
    max_rows: int,
    max_bytes: int,
    timeout_s: float,
    tenant_setting: str | None,
    tenant: str | None,
):
    import psycopg

    ms = int(timeout_s * 1000)
    options = f"-c statement_timeout={ms} -c idle_in_transaction_session_timeout={ms} -c lock_timeout={ms}"
    if not allow_writes:
        options += " -c default_transaction_read_only=on"
    try:
        with psycopg.connect(dsn, connect_timeout=max(2, int(timeout_s)), options=options) as conn:
            conn.read_only = not allow_writes  # BEGIN READ ONLY
            with conn.cursor() as cur:
                if tenant_setting:
                    # Issued by the tool, with the tenant as a bound parameter, never by the model.
                    cur.execute("SELECT set_config(%s, %s, true)", (tenant_setting, tenant))
                # stream(): the extended query protocol (one statement per call, enforced by the
                # server) and rows read in chunks, so reading stops at the cap.
                stream = cur.stream(query, size=64)
                rows, truncated = _take_rows(stream, max_rows, max_bytes)
                columns = [d.name for d in cur.description or ()]
                stream.close()
                if tenant_setting:
                    cur.execute("SELECT current_setting(%s, true)", (tenant_setting,))
                    if cur.fetchone()[0] != tenant:
                        raise ToolError("the query changed the tenant setting; its result is withheld")
            if allow_writes:
                conn.commit()
            else:
                conn.rollback()
    except psycopg.errors.QueryCanceled:
        raise ToolError(f"the query ran past {timeout_s:g} s (statement timeout)") from None
    except psycopg.Error as e:
        raise ToolError(f"postgresql: {str(e).strip()[:500]}") from None
    return columns, rows, truncated


def sql_tool(
    dsn: str | None = None,
    allow_writes: bool = False,
    max_rows: int = 100,
    timeout_s: float = 5.0,
    name: str = "sql",
    max_query_chars: int = 4000,
    max_bytes: int = 200_000,
    tenant_dsns: dict[str, str] | None = None,
    tenant_setting: str | None = None,
) -> Tool:
    """A SQL tool on one database (`dsn`), or tenant-scoped: `tenant_dsns` gives each tenant its own
    database or role; `tenant_setting` (PostgreSQL) names the setting row-level security policies
    read (`current_setting('app.tenant')`), which the tool sets to the calling tenant."""
    if bool(dsn) == bool(tenant_dsns):
        raise ValueError("sql_tool: give either dsn or tenant_dsns ({tenant: dsn}), one of them")
    dsns = list(tenant_dsns.values()) if tenant_dsns else [dsn]
    postgres = all(d.startswith(("postgresql://", "postgres://")) for d in dsns)
    if not postgres and any(d.startswith(("postgresql://", "postgres://")) for d in dsns):
        raise ValueError("sql_tool: every DSN must be of one kind, PostgreSQL or SQLite")
    if tenant_setting is not None:
        if not postgres:
            raise ValueError("sql_tool: tenant_setting needs PostgreSQL (row-level security); use tenant_dsns")
        if not re.fullmatch(r"[a-z_][a-z0-9_]*\.[a-z_][a-z0-9_]*", tenant_setting):
            raise ValueError(f"tenant_setting {tenant_setting!r}: a custom setting like 'app.tenant'")
    for tenant in tenant_dsns or {}:
        if not re.fullmatch(TENANT_PATTERN, tenant):
            raise ValueError(f"tenant_dsns: tenant {tenant!r} must match {TENANT_PATTERN}")
    dialect = "postgres" if postgres else "sqlite"
    tenant_scoped = bool(tenant_dsns or tenant_setting)

    def database_for(tenant: str | None) -> str:
        if not tenant_scoped:
            return dsn
        if tenant is None:
            raise ToolError(f"{name} is tenant-scoped and was called without a tenant")
        if tenant_dsns is None:
            return dsn
        if tenant not in tenant_dsns:
            raise ToolError(f"{name} has no database for tenant {tenant!r}")
        return tenant_dsns[tenant]

    def sql(query: str, tenant: str | None = None) -> dict:
        check_sql(query, dialect, allow_writes)
        target = database_for(tenant)
        if postgres:
            columns, rows, truncated = _postgres_rows(
                target, query, allow_writes, max_rows, max_bytes, timeout_s, tenant_setting, tenant
            )
        else:
            path = target.removeprefix("sqlite:///")
            columns, rows, truncated = _sqlite_rows(path, query, allow_writes, max_rows, max_bytes, timeout_s)
        return {"columns": columns, "rows": rows, "truncated": truncated}

    return Tool(
        name,
        "Run one read-only SQL query"
        + (" (writes allowed)" if allow_writes else "")
        + f"; at most {max_rows} rows come back.",
        {
            "type": "object",
            "required": ["query"],
            "additionalProperties": False,
            "properties": {"query": {"type": "string", "maxLength": max_query_chars}},
        },
        sql,
        timeout_s=timeout_s + 1,
        side_effects=allow_writes,
        tenant_scoped=tenant_scoped,
    )


def create_readonly_role(
    admin_dsn: str, role: str, password: str, tables: list[str], schema: str = "public", timeout_s: float = 5.0
) -> None:
    """Create (or reset) a PostgreSQL login role for the SQL tool that can only read `tables`:
    SELECT on them and nothing else, no superuser/createdb/createrole/replication/BYPASSRLS,
    read-only transactions by default and a statement timeout. Run it as an administrator."""
    import psycopg
    from psycopg import sql as pgsql

    ident, ms = pgsql.Identifier(role), int(timeout_s * 1000)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
        verb = "ALTER" if exists else "CREATE"
        conn.execute(
            pgsql.SQL(
                verb + " ROLE {} LOGIN PASSWORD {} NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"
            ).format(ident, pgsql.Literal(password))
        )
        conn.execute(pgsql.SQL("ALTER ROLE {} SET default_transaction_read_only = on").format(ident))
        conn.execute(pgsql.SQL("ALTER ROLE {} SET statement_timeout = {}").format(ident, pgsql.Literal(ms)))
        conn.execute(
            pgsql.SQL("ALTER ROLE {} SET idle_in_transaction_session_timeout = {}").format(ident, pgsql.Literal(ms))
        )
        conn.execute(pgsql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {} FROM {}").format(pgsql.Identifier(schema), ident))
        conn.execute(pgsql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(pgsql.Identifier(schema), ident))
        for table in tables:
            conn.execute(pgsql.SQL("GRANT SELECT ON {} TO {}").format(pgsql.Identifier(schema, table), ident))


def enable_tenant_rls(admin_dsn: str, table: str, column: str = "tenant", setting: str = "app.tenant") -> None:
    """Row-level security on `table`: a role sees only rows whose `column` equals the `setting`
    the SQL tool sets to the calling tenant (none when it is unset). The table's owner and
    BYPASSRLS roles are not bound by it, so the tool must connect as another role."""
    import psycopg
    from psycopg import sql as pgsql

    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(pgsql.Identifier(table)))
        conn.execute(pgsql.SQL("DROP POLICY IF EXISTS tenant_rows ON {}").format(pgsql.Identifier(table)))
        conn.execute(
            pgsql.SQL("CREATE POLICY tenant_rows ON {} FOR SELECT USING ({} = current_setting({}, true))").format(
                pgsql.Identifier(table), pgsql.Identifier(column), pgsql.Literal(setting)
            )
        )


# --- search ----------------------------------------------------------------------------------


def _terms(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class BM25:
    """Okapi BM25 over a list of documents (Robertson et al.; k1 1.5, b 0.75, the usual values)."""

    def __init__(self, docs: list[dict], k1: float = 1.5, b: float = 0.75):
        self.docs, self.k1, self.b = docs, k1, b
        self.tfs = [Counter(_terms(d["text"])) for d in docs]
        self.lengths = [sum(tf.values()) for tf in self.tfs]
        self.avg = sum(self.lengths) / max(len(docs), 1)
        df = Counter(t for tf in self.tfs for t in tf)
        n = len(docs)
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def search(self, query: str, k: int = 5) -> list[tuple[float, int]]:
        q = [t for t in _terms(query) if t in self.idf]
        scores = []
        for i, (tf, length) in enumerate(zip(self.tfs, self.lengths)):
            s = sum(
                self.idf[t] * tf[t] * (self.k1 + 1) / (tf[t] + self.k1 * (1 - self.b + self.b * length / self.avg))
                for t in q
                if t in tf
            )
            if s > 0:
                scores.append((s, i))
        return sorted(scores, reverse=True)[:k]


def search_tool(
    corpus: str | list[dict] | None = None,
    k: int = 5,
    snippet_chars: int = 400,
    name: str = "search",
    max_query_chars: int = 500,
    tenant_corpora: dict[str, str | list[dict]] | None = None,
) -> Tool:
    """BM25 over one corpus, or tenant-scoped: `tenant_corpora` gives each tenant its own corpus
    and index, so one tenant's documents are never in another's results."""
    if (corpus is None) == (tenant_corpora is None):
        raise ValueError("search_tool: give either corpus or tenant_corpora ({tenant: corpus}), one of them")
    sources = tenant_corpora or {None: corpus}
    for tenant in tenant_corpora or {}:
        if not re.fullmatch(TENANT_PATTERN, tenant):
            raise ValueError(f"tenant_corpora: tenant {tenant!r} must match {TENANT_PATTERN}")
    indexes = {}
    for tenant, source in sources.items():
        docs = read_documents(source) if isinstance(source, str) else source
        indexes[tenant] = (docs, BM25(docs))

    def search(query: str, top_k: int = k, tenant: str | None = None) -> dict:
        key = tenant if tenant_corpora is not None else None
        if key not in indexes:
            raise ToolError(f"{name} has no corpus for tenant {tenant!r}")
        docs, index = indexes[key]
        hits = index.search(query, min(top_k, 20))
        return {
            "results": [
                {"id": docs[i]["id"], "score": round(s, 4), "text": docs[i]["text"][:snippet_chars]} for s, i in hits
            ]
        }

    count = sum(len(docs) for docs, _ in indexes.values())
    return Tool(
        name,
        f"Search {'your' if tenant_corpora else count} documents by keywords (BM25); the best matches come back.",
        {
            "type": "object",
            "required": ["query"],
            "additionalProperties": False,
            "properties": {
                "query": {"type": "string", "maxLength": max_query_chars},
                "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
            },
        },
        search,
        timeout_s=10.0,
        tenant_scoped=tenant_corpora is not None,
    )


# --- http ------------------------------------------------------------------------------------


@dataclass
class AllowedAPI:
    """A base URL and the methods allowed under it. `{tenant}` in the base URL is replaced by the
    calling tenant, so each tenant reaches only its own part of an API."""

    base_url: str
    methods: tuple[str, ...] = ("GET",)


_DEFAULT_PORTS = {"http": 80, "https": 443}
_UNRESERVED = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


@dataclass(frozen=True)
class NormalURL:
    """A URL in the one form that is both checked against the allow-list and sent."""

    scheme: str
    host: str  # lower-case ASCII (IDNA), or a canonical IP address
    port: int
    path: str  # no dot segments, unreserved characters decoded, other escapes upper-case
    query: str

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = "" if _DEFAULT_PORTS[self.scheme] == self.port else f":{self.port}"
        return f"{self.scheme}://{host}{port}{self.path}" + (f"?{self.query}" if self.query else "")


def _normal_path(path: str) -> str:
    """Percent-decode unreserved characters, upper-case the other escapes, refuse encoded slashes
    and backslashes (a server may decode them into separators the check never saw), then remove
    dot segments (RFC 3986 5.2.4)."""
    out, i = [], 0
    while i < len(path):
        if path[i] != "%":
            out.append(path[i])
            i += 1
            continue
        escape = path[i + 1 : i + 3]
        if not re.fullmatch(r"[0-9A-Fa-f]{2}", escape):
            raise ToolError(f"the path has a malformed percent escape at {path[i : i + 3]!r}")
        char = chr(int(escape, 16))
        if char in "/\\\0":
            raise ToolError(f"the path has an encoded {'slash' if char == '/' else 'backslash or NUL'} (%{escape})")
        out.append(char if char in _UNRESERVED else "%" + escape.upper())
        i += 3
    segments: list[str] = []
    parts = "".join(out).split("/")
    for n, segment in enumerate(parts[1:], 1):
        last = n == len(parts) - 1
        if segment == "..":
            if segments:
                segments.pop()
            if last:
                segments.append("")
        elif segment == ".":
            if last:
                segments.append("")
        else:
            segments.append(segment)
    return "/" + "/".join(segments)


def _normal_host(host: str) -> str:
    """An IDNA-encoded lower-case host name, or a canonical IP address; refuse numeric forms a
    resolver or browser reads as IPv4 (127.1, 0x7f.1, 2130706433, 0177.0.0.1) and IPv4-mapped
    IPv6 addresses, which would slip past an allow-list that names a host."""
    import ipaddress

    import idna

    if host.startswith("["):
        if not host.endswith("]") or "%" in host:
            raise ToolError(f"host {host!r}: a malformed IPv6 literal (or one with a zone)")
        try:
            address = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ToolError(f"host {host!r} is not an IPv6 address") from None
        if address.ipv4_mapped or address.sixtofour or address.teredo:
            raise ToolError(f"host {host!r}: IPv4 addresses embedded in IPv6 are refused")
        return address.compressed
    if not host or host.endswith("."):
        raise ToolError(f"host {host!r}: give a host name without a trailing dot")
    last_label = host.rsplit(".", 1)[-1].lower()
    if re.fullmatch(r"0x[0-9a-f]*|[0-9]+", last_label):  # the WHATWG rule: it is an IPv4 address
        try:
            address = ipaddress.IPv4Address(host)
        except ValueError:
            raise ToolError(f"host {host!r}: write IPv4 addresses as four decimal numbers (a.b.c.d)") from None
        if str(address) != host:
            raise ToolError(f"host {host!r}: write IPv4 addresses as four decimal numbers (a.b.c.d)")
        return host
    try:
        return idna.encode(host, uts46=True).decode("ascii")
    except idna.IDNAError as e:
        raise ToolError(f"host {host!r} is not a valid host name: {e}") from None


def normalise_url(url: str) -> NormalURL:
    """The URL in normal form, or a ToolError that says what is wrong with it."""
    if re.search(r"[\x00-\x20\x7f\\]", url):
        raise ToolError("the URL has whitespace, a control character or a backslash")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ToolError(f"scheme {parts.scheme!r} is not allowed; allowed: http, https")
    if "@" in parts.netloc:
        raise ToolError("user information (user@host) in the URL is refused")
    host_port = re.fullmatch(r"(\[[^\]]*\]|[^:]*)(?::(\d{1,5}))?", parts.netloc)
    if not host_port:
        raise ToolError(f"the URL's authority {parts.netloc!r} is not host[:port]")
    port = int(host_port[2]) if host_port[2] else _DEFAULT_PORTS[scheme]
    if not 0 < port < 65536:
        raise ToolError(f"port {port} is out of range 1-65535")
    return NormalURL(scheme, _normal_host(host_port[1]), port, _normal_path(parts.path or "/"), parts.query)


def _within(url: NormalURL, base: NormalURL) -> bool:
    if (url.scheme, url.host, url.port) != (base.scheme, base.host, base.port):
        return False
    prefix = base.path.rstrip("/")
    return not prefix or url.path == prefix or url.path.startswith(prefix + "/")


class _DeadlineStream:
    """A network stream whose every read and write ends by the call's deadline, so a server that
    trickles its headers or body (slowloris) cannot hold the call past it."""

    def __init__(self, stream, deadline: float):
        self.stream, self.deadline = stream, deadline

    def _left(self, timeout: float | None) -> float:
        import httpcore

        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ReadTimeout("the call's deadline has passed")
        return left if timeout is None else min(timeout, left)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.stream.read(max_bytes, self._left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.stream.write(buffer, self._left(timeout))

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _DeadlineStream(self.stream.start_tls(ssl_context, server_hostname, self._left(timeout)), self.deadline)

    def get_extra_info(self, info: str):
        return self.stream.get_extra_info(info)


def _deadline_client(deadline: float):
    """An httpx client (no proxies or netrc from the environment, no redirects followed) whose
    connections are bounded by `deadline` as a whole, not per read."""
    import httpcore
    import httpx

    class Backend(httpcore.SyncBackend):
        def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
            left = max(0.001, deadline - time.monotonic())
            stream = super().connect_tcp(host, port, min(timeout or left, left), local_address, socket_options)
            return _DeadlineStream(stream, deadline)

    transport = httpx.HTTPTransport(retries=0)
    # httpx takes no network backend; its pool is rebuilt with one (the rest as httpx makes it).
    transport._pool = httpcore.ConnectionPool(
        ssl_context=transport._pool._ssl_context, max_connections=1, network_backend=Backend()
    )
    return httpx.Client(transport=transport, trust_env=False, follow_redirects=False, timeout=None)


def http_tool(
    allow: list[AllowedAPI],
    timeout_s: float = 10.0,
    max_bytes: int = 20_000,
    retries: int = 2,
    name: str = "http",
    max_argument_chars: int = 2000,
    max_redirects: int = 3,
    tenant_header: str | None = None,
    secret_headers: dict[str, str] | None = None,
) -> Tool:
    """HTTP calls within `allow`. Tenant-scoped when a base URL holds `{tenant}` or `tenant_header`
    is set (the tool sends the calling tenant in that header; the model cannot set headers).
    `secret_headers` ({header: ENV_VAR}): credentials read from the environment at call time,
    inside the tool; a response that repeats one of them is withheld."""
    secret_headers = dict(secret_headers or {})
    if not allow:
        raise ValueError("http_tool needs at least one allowed base URL")
    for a in allow:  # fail at build time on a base URL that does not normalise
        try:
            normalise_url(a.base_url.replace("{tenant}", "t"))
        except ToolError as e:
            raise ValueError(f"allowed base URL {a.base_url!r}: {e}") from None
    methods = sorted({m.upper() for a in allow for m in a.methods})
    tenant_scoped = tenant_header is not None or any("{tenant}" in a.base_url for a in allow)
    listing = "; ".join(f"{'/'.join(a.methods)} {a.base_url}" for a in allow)

    def permitted(method: str, url: NormalURL, tenant: str | None) -> bool:
        for a in allow:
            base = normalise_url(a.base_url.replace("{tenant}", tenant or ""))
            if method in (m.upper() for m in a.methods) and _within(url, base):
                return True
        return False

    def checked(method: str, url: str, tenant: str | None) -> NormalURL:
        normal = normalise_url(url)
        if not permitted(method, normal, tenant):
            raise ToolError(f"{method} {normal} is outside the allow-list: {listing}")
        return normal

    def http(
        method: str, url: str, body: str | None = None, idempotency_key: str | None = None, tenant: str | None = None
    ) -> dict:
        import httpx

        method = method.upper()
        if tenant_scoped and (tenant is None or not re.fullmatch(TENANT_PATTERN, tenant)):
            raise ToolError(f"{name} is tenant-scoped and needs a tenant matching {TENANT_PATTERN}")
        target = checked(method, url, tenant)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key and method != "GET" else {}
        if tenant_header:
            headers[tenant_header] = tenant
        if body is not None:
            headers["Content-Type"] = "application/json" if body.lstrip()[:1] in ("{", "[") else "text/plain"
        credentials = _secret_values(secret_headers)
        headers.update(credentials)
        deadline = time.monotonic() + timeout_s
        with _deadline_client(deadline) as client:
            for _ in range(max_redirects + 1):
                # the request is built from the checked URL's own string: what is checked is sent
                request = client.build_request(
                    method, httpx.URL(str(target)), content=body.encode() if body is not None else None, headers=headers
                )
                try:
                    response = client.send(request, stream=True)
                except httpx.TimeoutException:
                    raise ToolError(f"{method} {target} ran past {timeout_s:g} s") from None
                except httpx.TransportError as e:
                    raise ToolError(f"{method} {target}: {e}", retryable=True) from None
                try:
                    location = response.headers.get("location")
                    if response.is_redirect and location and method == "GET":
                        # each hop is checked like the first
                        target = checked(method, str(httpx.URL(str(target)).join(location)), tenant)
                        continue
                    return withhold_reflected(read_capped(response, method, target, deadline), response, credentials)
                finally:
                    response.close()
        raise ToolError(f"{method} {url}: more than {max_redirects} redirects")

    def withhold_reflected(result: dict, response, credentials: dict[str, str]) -> dict:
        # an API that echoes its credentials back would hand them to the model
        seen = (result["body"] + "\n" + str(response.headers)).casefold()
        reflected = [h for h, v in credentials.items() if any(n in seen for n in _secret_forms(v))]
        if reflected:
            raise ToolError(f"the response repeats the {', '.join(reflected)} credential; withheld")
        return result

    def read_capped(response, method: str, target: NormalURL, deadline: float) -> dict:
        import httpx

        data, truncated = bytearray(), False
        try:
            for chunk in response.iter_raw(chunk_size=4096):
                data += chunk
                if len(data) > max_bytes:
                    truncated = True
                    break
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("deadline")
        except httpx.TimeoutException:
            raise ToolError(f"{method} {target}: the response ran past {timeout_s:g} s") from None
        except httpx.TransportError as e:
            raise ToolError(f"{method} {target}: {e}", retryable=True) from None
        if response.status_code >= 500:
            raise ToolError(f"{method} {target} answered {response.status_code}", retryable=True)
        text = bytes(data[:max_bytes]).decode(response.encoding or "utf-8", errors="replace")
        return {"status": response.status_code, "body": text, "truncated": truncated}

    return Tool(
        name,
        "Call an internal HTTP API (allowed: " + listing + ").",
        {
            "type": "object",
            "required": ["method", "url"],
            "additionalProperties": False,
            "properties": {
                "method": {"type": "string", "enum": methods},
                "url": {"type": "string", "maxLength": max_argument_chars},
                "body": {
                    "type": "string",
                    "maxLength": max_argument_chars,
                    "description": "the request body (JSON text for JSON APIs)",
                },
            },
        },
        http,
        timeout_s=timeout_s + 1,
        retries=retries,
        side_effects=any(m.upper() != "GET" for a in allow for m in a.methods),
        tenant_scoped=tenant_scoped,
    )


def _secret_forms(value: str) -> set[str]:
    """How an API might echo a credential back, case-folded: whole, each long token of it (a
    `Bearer` scheme stripped), percent-encoded and base64-encoded."""
    import base64
    from urllib.parse import quote

    tokens = {value, *(t for t in value.split() if len(t) >= 8)}
    forms = set()
    for t in tokens:
        forms |= {t, quote(t, safe=""), base64.b64encode(t.encode()).decode().rstrip("=")}
    return {f.casefold() for f in forms}


def _secret_values(secret_headers: dict[str, str]) -> dict[str, str]:
    """{header: value} from the environment variables named; a missing one fails the call."""
    missing = [env for env in secret_headers.values() if not os.environ.get(env)]
    if missing:
        raise ToolError(f"the secret environment variables {missing} are not set in this worker")
    return {header: os.environ[env] for header, env in secret_headers.items()}


# --- python ----------------------------------------------------------------------------------


def python_tool(timeout_s: float = 10.0, memory_mb: int = 512, name: str = "python") -> Tool:
    from lmfoundry.safety.sandbox import run_python

    def python(code: str) -> dict:
        r = run_python(code, timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)), memory_mb=memory_mb)
        return {"ok": r.ok, "stdout": r.stdout[-4000:], "stderr": r.stderr[-2000:], "killed": r.killed}

    return Tool(
        name,
        "Run Python code in a sandbox (no network, no files outside a scratch directory, "
        f"{timeout_s:g} s, {memory_mb} MB); print what you want back.",
        {
            "type": "object",
            "required": ["code"],
            "additionalProperties": False,
            "properties": {"code": {"type": "string", "maxLength": 20000}},
        },
        python,
        timeout_s=timeout_s + 5,
    )
