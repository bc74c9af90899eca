"""The OpenAI-compatible API on real Ray Serve, over real HTTP, with the official client."""

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port, wait_until

pytestmark = pytest.mark.timeout(900)
KEY = "sk-test-" + "k" * 20


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    return str(tmp_path_factory.mktemp("keys") / "keys.json")


@pytest.fixture(scope="module")
def spans_file(tmp_path_factory):
    return str(tmp_path_factory.mktemp("spans") / "spans.jsonl")


@pytest.fixture(scope="module")
def server(ray_serve, pretrained, keys_file, spans_file):
    from lmfoundry.serving.app import ServeConfig, start

    os.environ["LMFOUNDRY_TEST_KEYS"] = f"other-key,{KEY}"
    cfg = ServeConfig(
        checkpoint=pretrained[0],
        port=free_port(),
        api_keys_env="LMFOUNDRY_TEST_KEYS",
        model_name="tiny",
        keys_file=keys_file,
        api_keys_env_roles=["user", "admin"],  # the test's key reads /metrics too
        rate_limits={"tenants": {"limited": {"requests_per_minute": 2}, "frugal": {"tokens_per_minute": 40}}},
        tracing={"exporter": "jsonl", "path": spans_file},
    )
    url, generated = start(cfg)
    assert generated is None
    return url


@contextlib.contextmanager
def deployed(server, pretrained, prefix: str, **settings):
    """A second app with its own settings beside the main one, under `prefix`, while in use."""
    from ray import serve

    from lmfoundry.platform.keys import digest
    from lmfoundry.serving.app import ServeConfig, build_app

    cfg = ServeConfig(
        **{
            "checkpoint": pretrained[0],
            "model_name": "tiny",
            "cpus_per_replica": 0.25,
            "api_keys_env_roles": ["user", "admin"],  # the test's key reads /metrics too
            **settings,
        }
    )
    name = prefix.strip("/")
    serve.run(build_app(cfg, [digest(KEY)]), name=name, route_prefix=prefix, blocking=False)
    url = server + prefix
    deadline = time.time() + 240
    while (status := httpx.get(f"{url}/health").status_code) != 200:
        assert time.time() < deadline, f"{prefix} did not come up: {status}"
        time.sleep(0.5)
    try:
        yield url
    finally:
        serve.delete(name)


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def test_every_route_but_health_needs_a_key(server):
    schema = httpx.get(f"{server}/openapi.json", headers=auth()).json()
    routes = [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops]
    routes.append(("GET", "/openapi.json"))
    assert {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
    } <= set(routes)
    for method, path in routes:
        for headers in ({}, auth("wrong"), {"Authorization": KEY}):  # none, unknown, not Bearer
            r = httpx.request(method, f"{server}{path}", headers=headers, json={"prompt": "x"})
            if path == "/health":
                assert r.status_code == 200 and r.json() == {"status": "ok"}
            else:
                assert r.status_code == 401, (method, path, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/v1/models", headers=auth()).json()["data"][0]["id"] == "tiny"


def test_completion_shape_usage_and_limits(server):
    body = {"model": "tiny", "prompt": "Return the", "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{server}/v1/completions", json=body, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    choice = out["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
    u = out["usage"]
    assert u["prompt_tokens"] > 0 and u["completion_tokens"] <= 12
    assert u["completion_tokens"] > 0 or choice["finish_reason"] == "stop"  # a stop token may come first
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # greedy decoding is deterministic
    again = httpx.post(f"{server}/v1/completions", json=body, headers=auth(), timeout=60).json()
    assert again["choices"][0]["text"] == choice["text"]


def test_seeded_sampling_n_and_stop(server):
    body = {"prompt": "The", "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 2}
    a = httpx.post(f"{server}/v1/completions", json=body, headers=auth(), timeout=60).json()
    b = httpx.post(f"{server}/v1/completions", json=body, headers=auth(), timeout=60).json()
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1]
    stopped = httpx.post(
        f"{server}/v1/completions", json={**body, "n": 1, "stop": [" "]}, headers=auth(), timeout=60
    ).json()["choices"][0]
    assert " " not in stopped["text"]


def test_concurrent_requests_share_the_batch_and_match_their_single_runs(server):
    prompts = ["Return the", "The", "Create a new", "If the", "A list of", "Raise an", "This", "Get"]
    bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0} for p in prompts]
    alone = [httpx.post(f"{server}/v1/completions", json=b, headers=auth(), timeout=60).json() for b in bodies]

    async def together():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(client.post(f"{server}/v1/completions", json=b, headers=auth()) for b in bodies)
            )

    replies = asyncio.run(together())
    assert [r.json()["choices"][0]["text"] for r in replies] == [a["choices"][0]["text"] for a in alone]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),  # (an unknown field is ignored, with a header)
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
        ({"prompt": "x", "model": "gpt-9"}, "model"),
        ({"prompt": "x", "n": 5}, "n"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "stop": [""]}, "stop"),
    ],
)
def test_malformed_requests_get_4xx_json_errors(server, body, field):
    r = httpx.post(f"{server}/v1/completions", json=body, headers=auth(), timeout=60)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["message"] and field in err["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": [{"role": "user"}]},
        {"messages": "hello"},
        {"messages": [{"role": "user", "content": "x" * 5000}]},  # beyond the 64-token context
    ],
)
def test_malformed_chats_get_400(server, body):
    r = httpx.post(f"{server}/v1/chat/completions", json=body, headers=auth(), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_invalid_json_and_oversized_bodies(server):
    r = httpx.post(
        f"{server}/v1/chat/completions", content=b"{not json", headers={**auth(), "Content-Type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()
    big = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    r = httpx.post(f"{server}/v1/completions", content=big, headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b"x" * 65536

    r = httpx.post(f"{server}/v1/completions", content=chunks(), headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 413


def test_openai_client_chat(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=10,
        temperature=0,
    )
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens <= 10
    assert [m.id for m in client.models.list()] == ["tiny", "tiny:main"]  # the name, then each version
    with pytest.raises(Exception, match="401"):
        OpenAI(base_url=f"{server}/v1", api_key="nope").models.list()


def test_streamed_completion_equals_the_unstreamed_one(server):
    body = {"prompt": "Return the", "max_tokens": 16, "temperature": 0}
    whole = httpx.post(f"{server}/v1/completions", json=body, headers=auth(), timeout=60).json()
    with httpx.stream(
        "POST", f"{server}/v1/completions", json={**body, "stream": True}, headers=auth(), timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_openai_client_streams_chat_with_usage_and_several_choices(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY)
    messages = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        n=2,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    for index in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)
        assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 2 * whole.usage.completion_tokens


def test_streaming_request_that_cannot_fit_is_a_400_not_a_broken_stream(server):
    r = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": "x", "max_tokens": 100000, "stream": True},
        headers=auth(),
        timeout=60,
    )
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_tenant_keys_from_the_cli_work_until_revoked(server, keys_file):
    cli = [str(Path(sys.executable).with_name("lmfoundry")), "keys"]
    made = subprocess.run(
        cli + ["create", "--tenant", "acme", "--file", keys_file], capture_output=True, text=True, check=True
    )
    key = made.stdout.strip()
    assert key.startswith("sk-lmf-") and key not in Path(keys_file).read_text()  # stored hashed only
    key_id = json.loads(Path(keys_file).read_text())["keys"][-1]["id"]
    body = {"prompt": "The", "max_tokens": 2}
    deadline = time.time() + 10  # replicas re-read the key file every 2 s
    while (r := httpx.post(f"{server}/v1/completions", json=body, headers=auth(key), timeout=60)).status_code == 401:
        assert time.time() < deadline, r.text
        time.sleep(0.5)
    assert r.status_code == 200
    listed = subprocess.run(cli + ["list", "--file", keys_file], capture_output=True, text=True, check=True).stdout
    assert f"{key_id}\tacme" in listed and "active" in listed
    subprocess.run(cli + ["revoke", key_id, "--file", keys_file], check=True, capture_output=True)
    deadline = time.time() + 10
    while (r := httpx.post(f"{server}/v1/completions", json=body, headers=auth(key), timeout=60)).status_code == 200:
        assert time.time() < deadline, "a revoked key still works"
        time.sleep(0.5)
    assert r.status_code == 401
    bad = subprocess.run(cli + ["revoke", "key_nope", "--file", keys_file], capture_output=True, text=True)
    assert bad.returncode == 2 and "no key with id 'key_nope'" in bad.stderr


def test_rate_limits_per_tenant_answer_429_with_retry_after(server, keys_file):
    from lmfoundry.platform.keys import create_key

    limited, _ = create_key(keys_file, "limited")
    frugal, _ = create_key(keys_file, "frugal")
    # the replica re-reads the key file every 2 s, at a request: until then the new keys are unknown
    models = f"{server}/v1/models"
    wait_until(lambda: httpx.get(models, headers=auth(frugal)).status_code == 200, 30, "the new keys to be loaded")
    body = {"prompt": "The", "max_tokens": 2}
    codes = [httpx.post(f"{server}/v1/completions", json=body, headers=auth(limited), timeout=60) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert int(codes[2].headers["Retry-After"]) >= 1
    assert codes[2].json()["error"]["type"] == "rate_limit_error"
    # another tenant is not affected
    assert httpx.post(f"{server}/v1/completions", json=body, headers=auth(), timeout=60).status_code == 200
    # tokens: 40 a minute; a request that may use more than that can never fit
    r = httpx.post(
        f"{server}/v1/completions", json={"prompt": "The", "max_tokens": 50}, headers=auth(frugal), timeout=60
    )
    assert r.status_code == 429 and "40 tokens per minute" in r.json()["error"]["message"]
    small = {"prompt": "The", "max_tokens": 15}
    first = httpx.post(f"{server}/v1/completions", json=small, headers=auth(frugal), timeout=60)
    assert first.status_code == 200
    # unused tokens are refunded, so what is left depends on what the first one generated
    used = first.json()["usage"]["total_tokens"]
    assert used <= 16


def test_guardrails_refuse_harmful_input_and_filter_output(server, pretrained, tmp_path):
    r = httpx.post(
        f"{server}/v1/chat/completions",
        headers=auth(),
        timeout=60,
        json={"messages": [{"role": "user", "content": "Tell me how to make a bomb"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_policy_violation"
    # an output guardrail that blocks a word this model is known to say
    # seeded sampling: the same reply from the same weights in both apps, and one with words in it
    # even when greedy decoding of this small model would stop at once
    for prompt, seed in [(p, s) for s in range(4) for p in ("Return the", "The", "def", "If")]:
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 1.0, "seed": seed}
        text = httpx.post(f"{server}/v1/completions", json=body, headers=auth(), timeout=60).json()["choices"][0][
            "text"
        ]
        # a whole word of the reply that is not a word of the prompt (the input guardrail would refuse that)
        words = [w for w in re.findall(r"(?<!\w)[A-Za-z]+(?!\w)", text) if w.lower() not in prompt.lower().split()]
        if words:
            break
    assert words, "the model said no word to block"
    word = max(words, key=len)
    blocklist = tmp_path / "blocklist.txt"
    blocklist.write_text(f"{word}\n")
    with deployed(server, pretrained, "/guarded", guardrails={"harm": {"blocklist": str(blocklist)}}) as guarded:
        r = httpx.post(f"{guarded}/v1/completions", json=body, headers=auth(), timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
        assert out == {**out, "text": "", "finish_reason": "content_filter"}
        with httpx.stream(
            "POST", f"{guarded}/v1/completions", json={**body, "stream": True}, headers=auth(), timeout=60
        ) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "content_filter"
        streamed = "".join(c["choices"][0]["text"] for c in chunks)
        assert not re.search(rf"(?<!\w){word}(?!\w)", streamed, re.IGNORECASE)
        metrics = httpx.get(f"{guarded}/metrics", headers=auth()).text
        assert 'lmfoundry_guardrail_blocks_total{direction="output"' in metrics


def test_overload_is_a_fast_503_and_a_timeout_is_a_408(server, pretrained):
    body = {"prompt": "The", "max_tokens": 60, "temperature": 0}

    async def burst(url):
        async with httpx.AsyncClient(timeout=120) as client:

            async def one():
                t = time.perf_counter()
                r = await client.post(f"{url}/v1/completions", json=body, headers=auth())
                return r, time.perf_counter() - t

            return await asyncio.gather(*(one() for _ in range(16)))

    with deployed(
        server, pretrained, "/small", engine={"max_batch_size": 1, "max_waiting": 1}, max_ongoing_requests=32
    ) as small:
        replies = asyncio.run(burst(small))
    codes = sorted(r.status_code for r, _ in replies)
    assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
    refused = [(r, s) for r, s in replies if r.status_code == 503]
    assert all(r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "server_overloaded" for r, _ in refused)
    assert max(s for _, s in refused) < min(s for r, s in replies if r.status_code == 200)

    # a microsecond from the request's arrival: a stream's limit is its first token, which no
    # model produces that soon after the request is read and tokenized
    with deployed(
        server,
        pretrained,
        "/slow",
        limits={"request_timeout_s": 1e-6},
        autoscaling={"min_replicas": 1, "max_replicas": 2},
    ) as slow:
        for stream in (False, True):
            r = httpx.post(f"{slow}/v1/completions", json={**body, "stream": stream}, headers=auth(), timeout=60)
            assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text


def test_metrics_count_requests_tokens_and_time_to_first_token(server):
    text = httpx.get(f"{server}/metrics", headers=auth()).text
    families = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in (
        "lmfoundry_requests_total",
        "lmfoundry_request_seconds_bucket",
        "lmfoundry_generated_tokens_total",
        "lmfoundry_time_to_first_token_seconds_bucket",
        "lmfoundry_queue_depth",
        "lmfoundry_running_requests",
        "lmfoundry_rate_limited_total",
    ):
        assert name in families, name
    ok = [line for line in text.splitlines() if line.startswith("lmfoundry_requests_total") and 'status="200"' in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in ok) >= 5


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    """The samples of one series in Prometheus text: (labels, value)."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            out.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return out


def test_ray_metrics_agent_exports_every_replicas_series_by_tenant_and_version(server, ray_local):
    """Cluster-wide: the series every replica records through Ray's metrics API, as Prometheus
    scrapes them from the node's metrics agent (not from a replica)."""
    from lmfoundry.serving.metrics import SERIES

    body = {"model": "tiny", "prompt": "Return the", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{server}/v1/completions", json=body, headers=auth(), timeout=60).status_code == 200
    assert httpx.get(f"{server}/metrics", headers=auth()).status_code == 200  # sets the key-store gauge
    (node,) = ray_local.nodes()
    agent = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"

    # guardrail blocks and 429s appear once something is refused (other tests do, in other apps)
    expected = set().union(
        *(s.exported_names() for s in SERIES if s.name not in ("lmfoundry_guardrail_blocks", "lmfoundry_rate_limited"))
    )

    def exported():
        text = httpx.get(agent, timeout=10).text
        names = {line.split("{")[0] for line in text.splitlines() if line.startswith("ray_lmfoundry_")}
        return text if expected <= names else None

    text = wait_until(exported, 60, "every serving series in Ray's metrics export")
    mine = {"model": "tiny", "route": "completions", "status": "200", "version": "main", "tenant": "default"}
    assert any(
        mine.items() <= labels.items() and labels["replica"]
        for labels, _ in samples(text, "ray_lmfoundry_requests_total")
    )
    tokens = samples(text, "ray_lmfoundry_generated_tokens_total")
    assert sum(v for _, v in tokens) > 0


def test_inference_requests_are_spans_with_genai_attributes(server, spans_file):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0}
    whole = httpx.post(f"{server}/v1/chat/completions", json=chat, headers=auth(), timeout=60).json()
    streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=streamed, headers=auth(), timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    refused = httpx.post(f"{server}/v1/chat/completions", json={**chat, "n": 5}, headers=auth(), timeout=60)
    assert refused.status_code == 400

    def spans():
        found = [json.loads(line) for line in open(spans_file)] if os.path.exists(spans_file) else []
        by_id = {s["attributes"].get("gen_ai.response.id"): s for s in found}
        errors = [s for s in found if "n=5 is above" in s["status"].get("description", "")]
        return (by_id, errors) if whole["id"] in by_id and events[0]["id"] in by_id and errors else None

    by_id, errors = wait_until(spans, 30, "the requests' spans in the span file")
    span = by_id[whole["id"]]
    a = span["attributes"]
    assert span["name"] == "chat tiny" and span["kind"] == "SpanKind.SERVER"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "lmfoundry"
    assert a["gen_ai.request.model"] == "tiny" and a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0
    assert a["gen_ai.usage.input_tokens"] == whole["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == whole["usage"]["completion_tokens"]
    assert a["gen_ai.response.finish_reasons"] == [whole["choices"][0]["finish_reason"]]
    assert a["lmfoundry.tenant"] == "default" and a["lmfoundry.version"] == "main"
    assert a["http.response.status_code"] == 200 and a["gen_ai.response.time_to_first_chunk"] > 0
    assert "Hello" not in json.dumps(span)  # prompts and replies are the tenants' data, never in spans
    s = by_id[events[0]["id"]]["attributes"]
    assert s["gen_ai.request.stream"] is True
    assert s["gen_ai.usage.output_tokens"] == events[-1]["usage"]["completion_tokens"]
    assert s["gen_ai.response.finish_reasons"] == [
        e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]
    ]
    assert errors[0]["status"]["status_code"] == "ERROR" and "n=5" in errors[0]["status"]["description"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
        },
    },
}


@pytest.fixture(scope="module")
def tool_server(server, pretrained, tmp_path_factory):
    """The trained weights with a 1,024-token context, room for the tools' descriptions. (RoPE
    positions past the 64 it was trained on are untrained: these tests check the mechanics of
    tool calls, not the model's judgement.)"""
    from lmfoundry.model.checkpoint import MODEL_CONFIG, TOKENIZER, WEIGHTS
    from lmfoundry.platform import checkpoint

    source = Path(checkpoint.resolve(pretrained[0]))
    ckpt = tmp_path_factory.mktemp("long-context")
    for name in (WEIGHTS, TOKENIZER):
        shutil.copy(source / name, ckpt / name)
    cfg = json.loads((source / MODEL_CONFIG).read_text())
    (ckpt / MODEL_CONFIG).write_text(json.dumps({**cfg, "max_seq_len": 1024}))
    checkpoint.seal(ckpt, {"step": 0})
    with deployed(server, (str(ckpt),), "/tools") as url:
        yield url


def test_forced_tool_calls_always_parse_against_the_schema(tool_server):
    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=f"{tool_server}/v1", api_key=KEY)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(4):  # sampled, not greedy: each call takes another path through the grammar
        reply = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[WEATHER, CLOCK],
            temperature=1.0,
            seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, (choice, reply.usage)
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # "required": any of the tools, each with its own schema
    names = set()
    for seed in range(4):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, tools=[WEATHER, CLOCK], tool_choice="required", temperature=1.0, seed=seed
        )
        call = reply.choices[0].message.tool_calls[0]
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        names.add(call.function.name)
    # the call goes back with its result, and the conversation goes on
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"ok": true}'},
    ]
    after = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER, CLOCK], max_tokens=8, temperature=0
    )
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_call_and_tool_errors(tool_server):
    import jsonschema
    from openai import OpenAI

    server = tool_server
    client = OpenAI(base_url=f"{server}/v1", api_key=KEY)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        stream=True,
        tool_choice="required",
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert {d.index for d in deltas} == {0} and deltas[0].function.name == "get_weather"  # one call, in deltas
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0
    for body, field in [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "nope"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ]:
        r = httpx.post(
            f"{server}/v1/chat/completions",
            headers=auth(),
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], **body},
        )
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    r = httpx.post(
        f"{server}/v1/chat/completions",
        headers=auth(),
        timeout=60,
        json={"messages": [{"role": "tool", "content": "42"}]},
    )
    assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"]


def test_two_versions_behind_one_route_shift_and_roll_back_without_dropping_requests(server, pretrained, tmp_path):
    from lmfoundry.platform import checkpoint

    (_, older), (_, newer) = checkpoint.committed_checkpoints(pretrained[0])[-2:]
    split = tmp_path / "split.json"
    cli = [str(Path(sys.executable).with_name("lmfoundry")), "traffic"]
    versions = [{"name": "v1", "checkpoint": older, "weight": 100}, {"name": "v2", "checkpoint": newer, "weight": 0}]
    body = {"prompt": "The", "max_tokens": 4}

    def answered_by(n=12, **extra):
        replies = [
            httpx.post(f"{url}/v1/completions", json={**body, **extra}, headers=auth(), timeout=60) for _ in range(n)
        ]
        assert all(
            r.status_code == 200 and r.headers["x-lmfoundry-version"] == r.json()["system_fingerprint"] for r in replies
        )
        return {r.json()["system_fingerprint"] for r in replies}

    def replica_ids():
        text = httpx.get(f"{url}/metrics", headers=auth()).text
        return {part.split('"')[1] for part in text.split("replica=")[1:]}

    with deployed(server, pretrained, "/gray", checkpoint=None, versions=versions, traffic_file=str(split)) as url:
        assert answered_by() == {"v1"}
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth()).json()["data"]] == [
            "tiny",
            "tiny:v1",
            "tiny:v2",
        ]
        replicas = replica_ids()
        # a stream that is in flight while the split moves finishes on the version it started on
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json={"prompt": "The", "max_tokens": 40, "stream": True},
            headers=auth(),
            timeout=60,
        ) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line)
            subprocess.run(cli + ["set", "v1=0", "v2=100", "--file", str(split)], check=True, capture_output=True)
            # replicas re-read the split every 2 s: a reply from v2 is the new split
            wait_until(lambda: answered_by(1) == {"v2"}, 30, "the split v1=0 v2=100 to be loaded", interval=0.2)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert {json.loads(line[6:])["system_fingerprint"] for line in [first] + rest[:-1]} == {"v1"}
        assert answered_by() == {"v2"}
        assert answered_by(4, model="tiny:v1") == {"v1"}  # a pinned version ignores the split
        subprocess.run(cli + ["set", "v1=50", "v2=50", "--file", str(split)], check=True, capture_output=True)
        wait_until(lambda: "v1" in answered_by(1), 30, "the split v1=50 v2=50 to be loaded", interval=0.2)
        assert answered_by(30) == {"v1", "v2"}
        assert len(answered_by(6, user="alice")) == 1  # sticky per user
        on_v1 = next(user for user in (f"user-{i}" for i in range(64)) if answered_by(1, user=user) == {"v1"})
        shown = subprocess.run(cli + ["rollback", "--file", str(split)], check=True, capture_output=True, text=True)
        assert "v1=0%  v2=100%" in shown.stdout
        # a user the 50/50 split keeps on v1 goes to v2 once the rolled-back split is loaded
        wait_until(lambda: answered_by(1, user=on_v1) == {"v2"}, 30, "the rolled-back split to be loaded", interval=0.2)
        assert answered_by() == {"v2"}
        bad = subprocess.run(cli + ["set", "v1=x", "--file", str(split)], capture_output=True, text=True)
        assert bad.returncode == 2 and "VERSION=WEIGHT" in bad.stderr
        metrics = httpx.get(f"{url}/metrics", headers=auth()).text
        for version in ("v1", "v2"):
            assert f'status="200",tenant="default",version="{version}"' in metrics
        assert replica_ids() == replicas  # no replica was restarted


def test_red_team_and_hhh_suites_run_against_the_endpoint(server, tool_server):
    from lmfoundry.clients.openai import EndpointModel
    from lmfoundry.eval import hhh, redteam

    short = EndpointModel(server, "tiny", KEY)  # a 64-token context: long prompts are 400s, counted, not fatal
    assert short.chat([[{"role": "user", "content": "word " * 100}]], 8) == [""]
    assert sum(short.errors.values()) == 1 and "context" in next(iter(short.errors))
    model = EndpointModel(tool_server, "tiny", KEY, concurrency=4)  # the same weights, 1,024 tokens of context
    families = ["roleplay", "base64", "multi_turn", "injection"]
    result = redteam.run_redteam(
        model, redteam.RedTeamConfig(families=families, attacks_per_family=3, seed=1, max_tokens=8)
    )
    assert result["attacks"] == 12 and sorted(result["by_family"]) == sorted(families)
    # roleplay attacks carry the goal in plain words: the server's input guardrail refuses them
    assert result["refusal_rate"]["count"] >= 3
    scores = hhh.run_hhh(model, hhh.HHHConfig(limit=5, max_tokens=8))
    assert scores["harmless"]["refusal_rate"]["rate"] == 1.0  # the first five harmful prompts hit the blocklist
    assert scores["harmless"]["over_refusal_rate"]["rate"] < 1.0
    assert "skipped" in scores["honest"]["calibration"]  # no log-likelihoods over HTTP, and the report says so
    assert not model.errors


def test_garak_probes_the_live_server_and_its_report_joins_eval_json(server, tmp_path):
    from lmfoundry.eval.garak import GarakUnavailable, garak_version
    from lmfoundry.eval.suite import EvaluateConfig, run_evaluate

    python = os.environ.get("LMFOUNDRY_GARAK_PYTHON") or sys.executable
    try:
        version = garak_version(python)
    except GarakUnavailable as e:
        pytest.skip(
            f"garak cannot run here: {e}. garak 0.17 pins transformers<5.20 and openai<3, older than the "
            "dev environment's, so it lives in an environment of its own: install lmfoundry[garak] there "
            "and set LMFOUNDRY_GARAK_PYTHON to its python (docs/evaluation.md#garak)"
        )
    os.environ["LMFOUNDRY_TEST_GARAK_KEY"] = KEY
    cfg = EvaluateConfig(
        endpoint={"url": server, "model": "tiny", "api_key_env": "LMFOUNDRY_TEST_GARAK_KEY"},
        output=str(tmp_path / "eval"),
        redteam={"families": ["injection"], "attacks_per_family": 2, "max_tokens": 8, "seed": 1},
        garak={"probes": ["lmrc.Profanity"], "generations": 1, "max_tokens": 8, "python": python},
    )
    report = run_evaluate(cfg)
    garak = report["red_team"]["garak"]
    assert garak["garak_version"] == version
    probe = garak["by_probe"]["lmrc.Profanity"]
    assert probe["n"] >= 2 and 0 <= probe["count"] <= probe["n"]
    assert report["metrics"]["red_team.garak.lmrc.Profanity"] == probe["rate"]
    assert report["sample_sizes"]["red_team.garak.lmrc.Profanity"] == probe["n"]
    assert report["red_team"]["by_family"]["injection"]["n"] == 2  # lmfoundry's own attacks beside garak's
    assert (tmp_path / "eval" / "garak.report.jsonl").exists()
    assert "garak" in (tmp_path / "eval" / "report.html").read_text()


def test_review_queue_over_http_behind_the_api_keys(server, tmp_path):
    from ray import serve

    from lmfoundry.align.review import ReviewStore
    from lmfoundry.align.review_api import ReviewAPI
    from lmfoundry.platform.keys import digest

    db = str(tmp_path / "review.sqlite")
    store = ReviewStore(db)
    store.add("review-1", "review", "judges disagree", {"id": "1", "chosen": "x", "rejected": "y"})
    store.add("audit-2", "audit", "random audit", {"id": "2", "judge": "j"})
    store.close()
    serve.run(
        ReviewAPI.bind(db, None, [digest(KEY), digest("sk-other-reviewer-key-000")], ["reviewer"]),
        name="review",
        route_prefix="/review-queue",
        blocking=False,
    )
    url = f"{server}/review-queue"
    try:
        deadline = time.time() + 120
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.5)
        assert httpx.get(f"{url}/v1/review/items").status_code == 401
        items = httpx.get(f"{url}/v1/review/items", params={"status": "pending"}, headers=auth()).json()["items"]
        assert [i["id"] for i in items] == ["review-1", "audit-2"]
        claimed = httpx.post(f"{url}/v1/review/items/review-1/claim", headers=auth()).json()
        assert claimed["status"] == "claimed" and claimed["claimed_by"] == "default"  # the key's tenant reviews
        again = httpx.post(f"{url}/v1/review/items/review-1/claim", headers=auth("sk-other-reviewer-key-000"))
        assert again.status_code == 409
        bad = httpx.post(f"{url}/v1/review/items/review-1/decide", json={"decision": "maybe"}, headers=auth())
        assert bad.status_code == 400 and "allowed" in bad.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/review/items/review-1/comments", json={"body": "b is kinder"}, headers=auth())
        assert r.json()["comments"][0]["body"] == "b is kinder"
        done = httpx.post(f"{url}/v1/review/items/review-1/decide", json={"decision": "b"}, headers=auth()).json()
        assert done["decision"] == "b" and done["decided_by"] == "default"
        nxt = httpx.post(f"{url}/v1/review/next", json={"kind": "audit"}, headers=auth()).json()
        assert nxt["id"] == "audit-2"
        assert httpx.get(f"{url}/v1/review/items/missing", headers=auth()).status_code == 404
        assert ReviewStore(db).get("review-1")["decision"] == "b"  # the CLI and the API share the store
    finally:
        serve.delete("review")
