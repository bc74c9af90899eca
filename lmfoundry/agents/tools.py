"""Tools an agent may call: a registry of named functions, each with a JSON schema for its
arguments, a timeout, retries with exponential backoff, and whether it has side effects.

Built-in tools, each made from its configuration:
- `sql_tool`: read-only queries against SQLite (the embedded default) or PostgreSQL (by DSN).
  One statement, which must begin with an allowed keyword (SELECT, WITH, EXPLAIN, unless the
  workflow grants writes); SQLite's authorizer refuses every write, ATTACH and PRAGMA that
  changes state even if the keyword check were fooled, PostgreSQL runs it in a READ ONLY
  transaction; a row limit and a time limit (SQLite's progress handler, PostgreSQL's
  statement_timeout).
- `search_tool`: BM25 (Okapi, k1 1.5, b 0.75) over a curated corpus (a curate output's kept/
  shards or a JSONL with `text`).
- `http_tool`: calls to internal APIs on an allow-list of base URLs and methods; a call with
  side effects carries an `Idempotency-Key` header, so a retried or resumed call is not done twice
  by a server that honours it.
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

    def call(self, name: str, arguments: dict, idempotency_key: str | None = None) -> ToolResult:
        """Validate the arguments, run the tool under its timeout, retry what is retryable."""
        from jsonschema import Draft202012Validator

        tool = self.get(name)
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

READ_KEYWORDS = ("select", "with", "explain")
WRITE_KEYWORDS = ("insert", "update", "delete", "replace")
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
    sqlite3.SQLITE_TRANSACTION,
}


def _statement_keyword(query: str) -> str:
    stripped = re.sub(r"--[^\n]*|/\*.*?\*/", " ", query, flags=re.S).strip()
    if ";" in stripped.rstrip(";"):
        raise ToolError("one statement per call")
    return (stripped.split(None, 1) or [""])[0].lower()


def sql_tool(
    dsn: str,
    allow_writes: bool = False,
    max_rows: int = 100,
    timeout_s: float = 5.0,
    name: str = "sql",
    max_query_chars: int = 4000,
) -> Tool:
    allowed = READ_KEYWORDS + (WRITE_KEYWORDS if allow_writes else ())
    postgres = dsn.startswith(("postgresql://", "postgres://"))

    def run_sqlite(query: str):
        path = dsn.removeprefix("sqlite:///")
        uri = f"file:{path}?mode={'rw' if allow_writes else 'ro'}"
        conn = sqlite3.connect(uri, uri=True, timeout=timeout_s, check_same_thread=False)
        deadline = time.monotonic() + timeout_s

        def authorize(action, *_):
            if action in _SQLITE_READ_ACTIONS or (allow_writes and action in _SQLITE_WRITE_ACTIONS):
                return sqlite3.SQLITE_OK
            return sqlite3.SQLITE_DENY

        conn.set_authorizer(authorize)
        conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 1000)
        try:
            cur = conn.execute(query)
            rows = cur.fetchmany(max_rows + 1)
            columns = [d[0] for d in cur.description or ()]
            if allow_writes:
                conn.commit()
            return columns, rows
        except sqlite3.OperationalError as e:
            if "interrupted" in str(e):
                raise ToolError(f"the query ran past {timeout_s:g} s") from None
            raise ToolError(f"sqlite: {e}") from None
        except sqlite3.DatabaseError as e:
            raise ToolError(f"sqlite: {e}") from None
        finally:
            conn.close()

    def run_postgres(query: str):
        import psycopg

        with psycopg.connect(dsn, connect_timeout=max(1, int(timeout_s))) as conn:
            try:
                with conn.cursor() as cur:
                    cur.execute(f"SET LOCAL statement_timeout = {int(timeout_s * 1000)}")
                    if not allow_writes:
                        cur.execute("SET TRANSACTION READ ONLY")
                    cur.execute(query)
                    columns = [d.name for d in cur.description or ()]
                    rows = cur.fetchmany(max_rows + 1) if cur.description else []
            except psycopg.Error as e:
                raise ToolError(f"postgresql: {str(e).strip()}") from None
        return columns, [tuple(r) for r in rows]

    def sql(query: str) -> dict:
        keyword = _statement_keyword(query)
        if keyword not in allowed:
            raise ToolError(
                f"statement {keyword.upper() or '(empty)'} is not allowed; allowed: "
                f"{', '.join(k.upper() for k in allowed)}"
            )
        columns, rows = (run_postgres if postgres else run_sqlite)(query)
        return {"columns": columns, "rows": [list(r) for r in rows[:max_rows]], "truncated": len(rows) > max_rows}

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
    corpus: str | list[dict], k: int = 5, snippet_chars: int = 400, name: str = "search", max_query_chars: int = 500
) -> Tool:
    docs = read_documents(corpus) if isinstance(corpus, str) else corpus
    index = BM25(docs)

    def search(query: str, top_k: int = k) -> dict:
        hits = index.search(query, min(top_k, 20))
        return {
            "results": [
                {"id": docs[i]["id"], "score": round(s, 4), "text": docs[i]["text"][:snippet_chars]} for s, i in hits
            ]
        }

    return Tool(
        name,
        f"Search {len(docs)} documents by keywords (BM25); the best matches come back.",
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
    )


# --- http ------------------------------------------------------------------------------------


@dataclass
class AllowedAPI:
    base_url: str
    methods: tuple[str, ...] = ("GET",)


def _within(url: str, base: str) -> bool:
    u, b = urlsplit(url), urlsplit(base)
    if (u.scheme, u.hostname, u.port) != (b.scheme, b.hostname, b.port) or u.username or u.password:
        return False
    prefix = b.path.rstrip("/")
    return u.path == prefix or u.path.startswith(prefix + "/") or not prefix


def http_tool(
    allow: list[AllowedAPI],
    timeout_s: float = 10.0,
    max_bytes: int = 20_000,
    retries: int = 2,
    name: str = "http",
    max_argument_chars: int = 2000,
    secret_headers: dict[str, str] | None = None,
) -> Tool:
    """`secret_headers` ({header: ENV_VAR}): credentials read from the environment at call time,
    inside the tool; a response that repeats one of them is withheld."""
    secret_headers = dict(secret_headers or {})
    if not allow:
        raise ValueError("http_tool needs at least one allowed base URL")
    methods = sorted({m.upper() for a in allow for m in a.methods})

    def http(method: str, url: str, body: str | None = None, idempotency_key: str | None = None) -> dict:
        import httpx

        method = method.upper()
        permitted = [a for a in allow if _within(url, a.base_url) and method in (m.upper() for m in a.methods)]
        if not permitted:
            raise ToolError(
                f"{method} {url} is outside the allow-list: "
                + "; ".join(f"{'/'.join(a.methods)} {a.base_url}" for a in allow)
            )
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key and method != "GET" else {}
        if body is not None:
            headers["Content-Type"] = "application/json" if body.lstrip()[:1] in ("{", "[") else "text/plain"
        credentials = _secret_values(secret_headers)
        headers.update(credentials)
        try:
            r = httpx.request(
                method,
                url,
                content=body.encode() if body is not None else None,
                headers=headers,
                timeout=timeout_s,
                follow_redirects=False,
            )
        except httpx.TransportError as e:
            raise ToolError(f"{method} {url}: {e}", retryable=True) from None
        if r.status_code >= 500:
            raise ToolError(f"{method} {url} answered {r.status_code}", retryable=True)
        reflected = [h for h, v in credentials.items() if v in r.text or v in str(r.headers)]
        if reflected:  # an API that echoes its credentials back would hand them to the model
            raise ToolError(f"{method} {url}: the response repeats the {', '.join(reflected)} credential; withheld")
        return {"status": r.status_code, "body": r.text[:max_bytes], "truncated": len(r.text) > max_bytes}

    return Tool(
        name,
        "Call an internal HTTP API (allowed: " + "; ".join(f"{'/'.join(a.methods)} {a.base_url}" for a in allow) + ").",
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
    )


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
