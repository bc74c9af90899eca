"""Agent run traces: a run written to the store becomes one OpenTelemetry trace (a root span and
a child per step, with tools, latencies and token counts), as JSON lines and over real OTLP/HTTP
to a receiver that decodes the protobuf the way a collector does."""

import json
import threading
import time
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmfoundry.agents.store import AgentStore
from lmfoundry.agents.tracing import RunTracer
from lmfoundry.platform.tracing import TracingConfig

pytestmark = pytest.mark.timeout(60)


def ended_run(tmp_path) -> dict:
    store = AgentStore(str(tmp_path / "runs.sqlite"))
    run_id = store.create("acme", "orders", "What did acme spend?")
    lease = store.claim("w1", 30, 4)
    time.sleep(0.25)  # each model step is written when its call returns, its seconds after it began
    store.write_step(
        lease,
        0,
        "model",
        "done",
        {
            "tool": "sql",
            "arguments": {"query": "SELECT SUM(total) FROM orders"},
            "prompt_tokens": 120,
            "completion_tokens": 14,
        },
        seconds=0.25,
    )
    store.write_step(lease, 1, "tool", "started", {"tool": "sql", "arguments": {}}, key=f"{run_id}:1")
    store.write_step(
        lease,
        1,
        "tool",
        "done",
        {"tool": "sql", "arguments": {}, "ok": True, "output": [[12.5]], "attempts": 1, "model_view": "[[12.5]]"},
        f"{run_id}:1",
        0.01,
    )
    time.sleep(0.2)
    store.write_step(
        lease,
        2,
        "model",
        "done",
        {"tool": "http", "arguments": {"url": "http://evil/"}, "prompt_tokens": 150, "completion_tokens": 9},
        seconds=0.2,
    )
    store.write_step(
        lease,
        3,
        "tool",
        "done",
        {"tool": "http", "arguments": {}, "ok": False, "refused": "not allowed", "model_view": "error"},
    )
    time.sleep(0.2)
    store.write_step(
        lease,
        4,
        "model",
        "done",
        {"tool": "final_answer", "arguments": {"answer": "12.5"}, "prompt_tokens": 170, "completion_tokens": 8},
        seconds=0.2,
    )
    store.set_state(lease, "succeeded", output="12.5")
    return store.get(run_id)


def check_trace(spans: list[dict], run: dict) -> None:
    """spans: name, trace, id, parent, start/end (ns), attributes, status code."""
    assert len(spans) == 1 + len(run["steps"])
    root = next(s for s in spans if s["name"] == "agent.run")
    children = sorted((s for s in spans if s is not root), key=lambda s: s["attributes"]["agent.step"])
    assert {s["trace"] for s in spans} == {root["trace"]} and all(s["parent"] == root["id"] for s in children)
    assert root["attributes"]["agent.run_id"] == run["id"] and root["attributes"]["agent.state"] == "succeeded"
    assert root["attributes"]["agent.prompt_tokens"] == 440 and root["attributes"]["agent.completion_tokens"] == 31
    assert [s["name"] for s in children] == ["agent.model", "agent.tool"] * 2 + ["agent.model"]
    assert children[0]["attributes"]["agent.tool"] == "sql" and children[0]["attributes"]["agent.prompt_tokens"] == 120
    # the model call's latency: an exporter that writes microseconds truncates each end, and an
    # epoch second as a float is exact to a quarter microsecond, so allow two microseconds
    assert abs((children[0]["end"] - children[0]["start"]) / 1e9 - 0.25) <= 2e-6
    assert "SUM(total)" in children[0]["attributes"]["agent.arguments"]
    assert children[3]["attributes"]["agent.refused"] == "not allowed" and children[3]["status"] == "ERROR"
    assert all(root["start"] <= s["start"] <= s["end"] <= root["end"] for s in children)


def test_a_run_is_one_trace_in_json_lines(tmp_path):
    run = ended_run(tmp_path)
    path = tmp_path / "spans.jsonl"
    tracer = RunTracer(TracingConfig(exporter="jsonl", path=str(path)))
    tracer.export(run)
    tracer.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]

    def ns(stamp):  # exact integer microseconds: a float timestamp can round a 0.25 s span to 0.249999
        moment = datetime.fromisoformat(stamp)
        epoch = datetime(1970, 1, 1, tzinfo=moment.tzinfo)
        return (moment - epoch) // timedelta(microseconds=1) * 1000

    check_trace(
        [
            {
                "name": s["name"],
                "trace": s["context"]["trace_id"],
                "id": s["context"]["span_id"],
                "parent": s["parent_id"],
                "start": ns(s["start_time"]),
                "end": ns(s["end_time"]),
                "attributes": s["attributes"],
                "status": s["status"]["status_code"],
            }
            for s in lines
        ],
        run,
    )
    assert lines[0]["resource"]["attributes"]["service.name"] == "lmfoundry-agents"


def test_a_run_is_one_trace_over_otlp_http(tmp_path):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], ExportTraceServiceRequest.FromString(body)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run = ended_run(tmp_path)
        tracer = RunTracer(
            TracingConfig(exporter="otlp", endpoint=f"http://127.0.0.1:{server.server_address[1]}/v1/traces")
        )
        tracer.export(run)
        tracer.shutdown()
    finally:
        server.shutdown()
    assert {(path, kind) for path, kind, _ in received} == {("/v1/traces", "application/x-protobuf")}

    def value(v):
        return getattr(v, v.WhichOneof("value"))

    spans = [
        {
            "name": s.name,
            "trace": s.trace_id,
            "id": s.span_id,
            "parent": s.parent_span_id,
            "start": s.start_time_unix_nano,
            "end": s.end_time_unix_nano,
            "attributes": {a.key: value(a.value) for a in s.attributes},
            "status": "ERROR" if s.status.code == 2 else "UNSET",
        }
        for _, _, request in received
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]
    check_trace(spans, run)


def test_a_tracing_setting_without_its_destination_is_refused():
    with pytest.raises(ValueError, match="needs 'endpoint'"):
        TracingConfig(exporter="otlp")
    with pytest.raises(ValueError, match="needs 'path'"):
        TracingConfig(exporter="jsonl")
    with pytest.raises(ValueError, match="exporter"):
        TracingConfig(exporter="zipkin")


def test_an_inference_span_bounds_what_the_client_wrote_and_marks_a_refusal(tmp_path):
    from lmfoundry.serving.protocol import ChatCompletionRequest
    from lmfoundry.serving.tracing import MAX_MODEL_CHARS, InferenceTracer

    path = tmp_path / "spans.jsonl"
    tracer = InferenceTracer(TracingConfig(exporter="jsonl", path=str(path)), "tiny")
    req = ChatCompletionRequest(model="x" * 100_000, messages=[{"role": "user", "content": "secret prompt"}])
    tracer.start("chat", req, "acme").end(404, "none", "model 'xxx' is not served here")
    tracer.shutdown()
    (span,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert span["name"] == "chat tiny" and span["resource"]["attributes"]["service.name"] == "lmfoundry-serving"
    assert len(span["attributes"]["gen_ai.request.model"]) == MAX_MODEL_CHARS
    assert span["attributes"]["error.type"] == "404" and span["status"]["status_code"] == "ERROR"
    assert "secret prompt" not in path.read_text()
