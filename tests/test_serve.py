"""The OpenAI-compatible API on real Ray Serve, over real HTTP, with the official client."""

import os

import httpx
import pytest

from conftest import free_port

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
KEY = "sk-test-" + "k" * 20


@pytest.fixture(scope="module")
def server(pretrained):
    from ray import serve

    from lmfoundry.serving.app import ServeConfig, start

    os.environ["LMFOUNDRY_TEST_KEYS"] = f"other-key,{KEY}"
    cfg = ServeConfig(checkpoint=pretrained[0], port=free_port(), api_keys_env="LMFOUNDRY_TEST_KEYS",
                      model_name="tiny")
    url, generated = start(cfg)
    assert generated is None
    yield url
    serve.shutdown()


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def test_health_needs_no_key_but_everything_else_does(server):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    for key in (None, "wrong"):
        r = httpx.get(f"{server}/v1/models", headers=auth(key) if key else {})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
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
    assert u["prompt_tokens"] > 0 and 0 < u["completion_tokens"] <= 12
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
    stopped = httpx.post(f"{server}/v1/completions", json={**body, "n": 1, "stop": [" "]}, headers=auth(),
                         timeout=60).json()["choices"][0]
    assert " " not in stopped["text"]


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "frobnicate": True}, "frobnicate"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "max_tokens": 100000}, None),
    ({"prompt": "x", "model": "gpt-9"}, "model"),
])
def test_malformed_requests_get_4xx_json_errors(server, body, field):
    r = httpx.post(f"{server}/v1/completions", json=body, headers=auth(), timeout=60)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["message"]
    if field:
        assert field in err["message"]


def test_invalid_json_is_a_400(server):
    r = httpx.post(f"{server}/v1/chat/completions", content=b"{not json", headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_openai_client_chat(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": "Hello"}],
                                          max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens <= 10
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(Exception, match="401"):
        OpenAI(base_url=f"{server}/v1", api_key="nope").models.list()


def test_streamed_completion_equals_the_unstreamed_one(server):
    import json

    body = {"prompt": "Return the", "max_tokens": 16, "temperature": 0}
    whole = httpx.post(f"{server}/v1/completions", json=body, headers=auth(), timeout=60).json()
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, headers=auth(),
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_openai_client_streams_chat_with_usage(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY)
    messages = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_streaming_request_that_cannot_fit_is_a_400_not_a_broken_stream(server):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": 100000, "stream": True},
                   headers=auth(), timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
