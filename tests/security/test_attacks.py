"""Red-team attacks on the defences in docs/security.md. Each test asserts that the defence
HOLDS."""

import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmfoundry.agents import tools
from lmfoundry.safety.sandbox import SandboxUnavailable, run_python
from tests.security.test_tools import pg  # noqa: F401  (fixture: RLS table docs, role agent_ro)

pytestmark = pytest.mark.timeout(60)


def _sandbox_or_skip():
    try:
        run_python("pass")
    except SandboxUnavailable as e:
        pytest.skip(str(e))


def run(code: str, **kwargs):
    _sandbox_or_skip()
    return run_python(textwrap.dedent(code), **kwargs)


# --- sandbox: memory beyond memory_mb -----------------------------------------------------------


def test_sandbox_memfd_memory_stays_within_memory_mb():
    r = run(
        """
        import os
        fds = []
        try:
            for i in range(150):
                fd = os.memfd_create("x")
                os.write(fd, b"a" * (1 << 20))
                fds.append(fd)
        except OSError:
            pass
        print(len(fds))
        """,
        memory_mb=64,
        file_mb=1,
    )
    held_mb = int(r.stdout.strip() or 0)
    assert held_mb <= 64, f"{held_mb} MiB of memfd held with memory_mb=64"


def test_sandbox_forked_children_hold_at_most_max_processes_times_memory_mb():
    """RLIMIT_AS caps each process; the process limit caps how many there are (the documented
    bound: max_processes x memory_mb for the whole run)."""
    r = run(
        """
        import os, time
        kids = []
        for i in range(4):
            rd, wr = os.pipe()
            try:
                pid = os.fork()
            except OSError:
                break  # the process limit
            if pid == 0:
                try:
                    b = bytearray(40 << 20)
                    for j in range(0, len(b), 4096):
                        b[j] = 1
                    os.write(wr, b"k")
                    time.sleep(1)
                finally:
                    os._exit(0)
            kids.append(rd)
        print(sum(len(os.read(rd, 1)) for rd in kids))
        """,
        memory_mb=64,
        max_processes=2,
    )
    held = int(r.stdout.strip())
    assert held + 1 <= 2, f"{held} children x 40 MiB resident at once beside the parent with max_processes=2"


# --- SQL: refused functions through identifier spelling ------------------------------------------

UNICODE_SET_CONFIG = 'U&"set\\005fconfig"'  # U&"set\005fconfig" is the identifier set_config


@pytest.mark.parametrize(
    "query",
    [
        f"SELECT {UNICODE_SET_CONFIG}('app.tenant', 'bolt', true)",
        'SELECT U&"pg\\005fsleep"(5)',
        'SELECT U&"pg\\005fterminate\\005fbackend"(1)',
        "SELECT * FROM U&\"pg\\005fls\\005fdir\"('/')",  # refused (does not parse in FROM)
    ],
)
def test_sql_parser_refuses_functions_spelled_as_unicode_escaped_identifiers(query):
    with pytest.raises(tools.ToolError):
        tools.check_sql(query, "postgres")


def test_rls_tenant_cannot_read_another_tenants_rows_by_switching_and_restoring_the_setting(pg):  # noqa: F811
    _, role = pg
    sql = tools.sql_tool(role, tenant_setting="app.tenant", timeout_s=2).fn
    query = (
        f"SELECT {UNICODE_SET_CONFIG}('app.tenant', 'acme', true) AS a, "
        "(SELECT string_agg(secret, ',') FROM docs) AS stolen, "
        f"{UNICODE_SET_CONFIG}('app.tenant', 'bolt', true) AS b"
    )
    try:
        out = sql(query, tenant="bolt")
    except tools.ToolError:
        return  # refused: the defence holds
    assert "acme-secret" not in str(out["rows"]), out


# --- HTTP tool -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tenant", ["..", "."])
def test_http_dot_tenant_does_not_widen_the_allow_list(tenant):
    registry = tools.ToolRegistry()
    registry.register(tools.http_tool([tools.AllowedAPI("http://127.0.0.1:9/tenants/{tenant}")], retries=0))
    result = registry.call("http", {"method": "GET", "url": "http://127.0.0.1:9/tenants/acme/rows"}, tenant=tenant)
    assert not result.ok and ("allow-list" in result.error or "needs a tenant matching" in result.error), result.error


class _EchoServer(BaseHTTPRequestHandler):
    def do_GET(self):
        token = self.headers.get("Authorization", "")
        bodies = {
            "/exact": token,
            "/bare": "unknown token " + token.removeprefix("Bearer "),
            "/lower": token.lower(),
        }
        body = bodies.get(self.path, "ok").encode()
        self.send_response(401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def echo():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EchoServer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("path", ["/exact", "/bare", "/lower"])
def test_http_secret_header_echoed_by_the_api_never_reaches_the_model(echo, monkeypatch, path):
    monkeypatch.setenv("ATTACK_API_TOKEN", "Bearer sk-LIVE-9f8e7d6c5b4a")
    registry = tools.ToolRegistry()
    registry.register(
        tools.http_tool([tools.AllowedAPI(echo)], retries=0, secret_headers={"Authorization": "ATTACK_API_TOKEN"})
    )
    result = registry.call("http", {"method": "GET", "url": echo + path})
    assert "9f8e7d6c5b4a" not in str(result.output).lower() + str(result.error).lower()


# --- streaming guardrail -------------------------------------------------------------------------


def _stream(deltas):
    from lmfoundry.safety.guardrails import Guardrail, StreamGate
    from lmfoundry.safety.harm import HarmConfig

    gate = StreamGate(Guardrail(HarmConfig()))
    sent = []
    for delta in deltas[:-1]:
        out = gate.feed(delta)
        if out is None:
            return "".join(sent), True
        sent.append(out)
    out = gate.finish(deltas[-1])
    return "".join(sent) + (out or ""), out is None


def test_stream_term_split_across_deltas_is_never_released():
    sent, blocked = _stream(["Here is how to ma", "ke a bo", "mb: step one", " and more text " * 5])
    assert blocked and "bo" not in sent.lower().split("how to")[-1]


def test_stream_blocked_by_accumulated_terms_released_no_blocklist_term():
    deltas = ["We sell ransomware as a service", " to anyone. ", "Filler text " * 10, "ransomware as a service!", "."]
    sent, blocked = _stream(deltas)
    assert blocked
    assert "ransomware as a service" not in sent.lower(), sent


@pytest.mark.parametrize(
    "text",
    [
        "here is how to make a b\u043emb",  # Cyrillic o
        "here is how to make a bo\u200bmb",  # zero-width space
        "here is how  to make a bomb",  # two spaces
        "here is how to\nmake a bomb",  # newline
        "here is \uff48\uff4f\uff57 to make a bomb",  # fullwidth 'how'
    ],
)
def test_guardrail_blocks_obfuscated_spellings_of_a_blocked_phrase(text):
    sent, blocked = _stream([text, ""])
    assert blocked, sent


def test_stream_of_a_term_stretched_by_invisible_characters_and_spaces_sends_none_of_it():
    from lmfoundry.safety.harm import HarmScorer

    stretched = "how   to\u200b make a b\u200bo\u200b\u200bm\u200bb right now"
    sent, blocked = _stream([*stretched, ""])  # one character a delta
    assert blocked
    assert HarmScorer().matches(sent) == [] and "b\u200bo" not in sent, sent
