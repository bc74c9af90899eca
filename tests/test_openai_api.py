"""The OpenAI surface that real clients send, with the official `openai` client and with
lm-evaluation-harness, against the real inference app over HTTP (`inference_api`: no Ray; a
random-weight model, so these tests check the mechanics, not the model's judgement). Expected
values come from the model run directly in the test, not from the server."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
import yaml

pytestmark = pytest.mark.timeout(300)
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def client(inference_api):
    from openai import OpenAI

    return OpenAI(base_url=f"{inference_api.url}/v1", api_key=inference_api.key, max_retries=0)


@pytest.fixture(scope="module")
def model(tiny_serving_checkpoint):
    from tokenizers import Tokenizer

    from lmfoundry.model.checkpoint import TOKENIZER, load_model_files

    return load_model_files(tiny_serving_checkpoint).eval(), Tokenizer.from_file(
        f"{tiny_serving_checkpoint}/{TOKENIZER}"
    )


def post(api, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{api.url}{path}", json=body, headers={"Authorization": f"Bearer {api.key}"}, timeout=120)


@torch.no_grad()
def log_softmax(model, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([ids]))[0][0].float(), -1)


def greedy(model, ids: list[int], steps: int, frequency=0.0, presence=0.0, stop=frozenset()) -> list[int]:
    """Greedy decoding under OpenAI's definitions of the penalties, written out."""
    out, counts = [], torch.zeros(model.cfg.vocab_size)
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out]))[0][0, -1].float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        token = int(logits.argmax())
        if token in stop:
            break
        out.append(token)
        counts[token] += 1
    return out


def test_echo_scores_the_prompt_as_the_model_does(inference_api, client, model):
    net, tok = model
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(prompt, add_special_tokens=False).ids
    want = log_softmax(net, ids)
    # lm-evaluation-harness's loglikelihood request: echo, logprobs, one token (or none)
    for max_tokens in (0, 1):
        reply = client.completions.create(
            model="tiny", prompt=prompt, echo=True, max_tokens=max_tokens, logprobs=2, temperature=0
        )
        lp = reply.choices[0].logprobs
        assert reply.choices[0].text.startswith(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        expected = [float(want[t, ids[t + 1]]) for t in range(len(ids) - 1)]
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-5)
        for t in range(1, len(ids)):
            best = want[t - 1].topk(2).values.tolist()
            assert sorted(lp.top_logprobs[t].values(), reverse=True) == pytest.approx(best, abs=1e-5)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert reply.usage.completion_tokens == max_tokens or reply.choices[0].finish_reason == "stop"
    # streamed: the prompt first, then the completion, the same text and scores
    whole = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=4, logprobs=1, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompt, echo=True, max_tokens=4, logprobs=1, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-6, nan_ok=True)
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == whole.choices[0].logprobs.text_offset
    # token ids and a list of prompts, as the harness sends them: n choices per prompt, in order
    batch = post(
        inference_api,
        "/v1/completions",
        {"prompt": [ids, ids[:3]], "echo": True, "max_tokens": 0, "logprobs": 0, "n": 1},
    ).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
    assert batch["choices"][1]["logprobs"]["token_logprobs"][1:] == pytest.approx(expected[:2], abs=1e-5)
    assert batch["usage"]["prompt_tokens"] == len(ids) + 3


def test_chat_logprobs_top_logprobs_and_their_stream(client):
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    reply = client.chat.completions.create(**kwargs)
    content = reply.choices[0].logprobs.content
    assert len(content) >= reply.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])  # greedy: the chosen token is the likeliest
        assert entry.bytes == list(entry.token.encode())
    streamed = [
        t
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_penalties_and_logit_bias_run_in_the_batch_beside_plain_requests(inference_api, model):
    from lmfoundry.model.tokenizer import SpecialTokens

    net, tok = model
    stop = SpecialTokens().stop_ids(tok)
    ids = tok.encode("The farmer watches the", add_special_tokens=False).ids
    bias_token = tok.encode(" dog", add_special_tokens=False).ids[0]
    cases = [
        ({}, greedy(net, ids, 10, stop=stop)),
        ({"frequency_penalty": 2.0}, greedy(net, ids, 10, frequency=2.0, stop=stop)),
        ({"presence_penalty": 1.5, "frequency_penalty": -0.5}, greedy(net, ids, 10, -0.5, 1.5, stop)),
        ({"logit_bias": {str(bias_token): 100}}, [bias_token] * 10),
    ]
    assert cases[1][1] != cases[0][1]  # the penalty changes this greedy path: the test can fail
    replies = [None] * len(cases)

    def ask(i: int, extra: dict) -> None:  # all at once: they share the batcher's forward passes
        replies[i] = post(
            inference_api,
            "/v1/completions",
            {"prompt": ids, "max_tokens": 10, "temperature": 0, **extra},
        ).json()

    threads = [threading.Thread(target=ask, args=(i, extra)) for i, (extra, _) in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for reply, (extra, want) in zip(replies, cases):
        assert reply["choices"][0]["text"] == tok.decode(want), extra
        assert reply["usage"]["completion_tokens"] == len(want), extra


def test_seeds_reproduce_each_choice_and_n_choices_differ(client):
    kwargs = dict(model="tiny", prompt="The", max_tokens=8, temperature=1.0, seed=7, n=3)
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each choice samples its own sequence
    other = client.completions.create(**{**kwargs, "seed": 8})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_response_formats_decode_json_under_the_schema(client):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny",
            messages=HELLO,
            seed=seed,
            max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}},
        )
        assert reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    # the completions route honours it too; json_object is any object
    done = client.completions.create(
        model="tiny",
        prompt="The",
        max_tokens=64,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}},
    )
    jsonschema.validate(json.loads(done.choices[0].text), schema)
    free = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, response_format={"type": "text"})
    assert free.choices[0].finish_reason in ("stop", "length")
    obj = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
        logit_bias={"0": 0},
    )
    text = obj.choices[0].message.content
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_chat_fields_clients_send(inference_api, client):
    # developer role, content as text parts, max_completion_tokens, stop, user, named and "none" tools
    reply = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
        ],
        max_completion_tokens=3,
        stop=["\n\n"],
        user="someone",
        parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        tool_choice="none",
    )
    assert reply.usage.completion_tokens <= 3 and reply.choices[0].message.tool_calls is None
    tokens = post(
        inference_api,
        "/tokenize",
        {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]}]},
    ).json()
    rendered = post(inference_api, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert "<|im_start|>system\nAnswer briefly." in rendered  # developer is the template's system
    # fields this server does not implement: answered, and named in a header and the log
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=HELLO, max_tokens=2, store=True, metadata={"a": "b"}, service_tier="auto"
    )
    assert raw.headers["x-lmfoundry-ignored-fields"] == "metadata, service_tier, store"
    assert raw.parse().choices[0].message.content is not None


def test_forced_and_streamed_tool_calls_arrive_as_deltas(client):
    import jsonschema

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"],
            },
        },
    }
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=HELLO, tools=[weather], tool_choice="required", stream=True, seed=1, max_tokens=64
        )
    )
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), weather["function"]["parameters"])
    assert {d.index for d in deltas} == {0}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_tool_choice_streams_the_same_reply_it_answers_whole(client):
    """With tools offered and `auto`, streamed text passes the tool-call reader: what it holds
    back (a possible tag's start) still arrives, and the stream adds up to the whole reply."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kwargs = dict(model="tiny", messages=HELLO, tools=tools, tool_choice="auto", max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and whole.choices[0].message.tool_calls is None
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_models_tokenize_and_detokenize(inference_api, model):
    _, tok = model
    cards = httpx.get(f"{inference_api.url}/v1/models", headers={"Authorization": f"Bearer {inference_api.key}"})
    assert [m["id"] for m in cards.json()["data"]] == ["tiny", "tiny:main"]
    out = post(inference_api, "/tokenize", {"prompt": "The lazy dog", "return_token_strs": True}).json()
    assert out["tokens"] == tok.encode("The lazy dog").ids and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512 and len(out["token_strs"]) == out["count"]
    assert post(inference_api, "/detokenize", {"tokens": out["tokens"]}).json() == {"prompt": "The lazy dog"}
    info = httpx.get(f"{inference_api.url}/tokenizer_info", headers={"Authorization": f"Bearer {inference_api.key}"})
    assert info.json()["eos_token"] == "<|endoftext|>"


def test_lm_evaluation_harness_local_completions_scores_equal_the_in_process_evaluation(
    inference_api, tiny_serving_checkpoint, tmp_path, monkeypatch
):
    """lm-evaluation-harness's `local-completions` model against the live API (the server's own
    tokenizer through /tokenize), on the shipped multiple-choice tasks: every choice's
    log-likelihood equals the in-process evaluation of the same checkpoint."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.eval.tasks import harness_copy, load_tasks, run_task

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", inference_api.key)
    tasks_dir = os.path.join(os.path.dirname(__file__), "..", "lmfoundry", "eval", "suites", "tasks")
    files = [os.path.join(tasks_dir, f) for f in ("arithmetic_mc.yaml", "common_sense_mc.yaml")]
    ours = {t.name: run_task(t, CheckpointModel(tiny_serving_checkpoint), limit=8) for t in load_tasks(files)}
    theirs = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"base_url={inference_api.url}/v1/completions,model=tiny,tokenizer_backend=remote,"
            f"auth_token={inference_api.key},num_concurrent=1,max_retries=1,batch_size=8"
        ),
        tasks=sorted(ours),
        task_manager=TaskManager(include_path=str(harness_copy(files, tmp_path / "tasks")), include_defaults=False),
        limit=8,
        log_samples=True,
    )
    for name, result in ours.items():
        for sample in theirs["samples"][name]:
            mine = result["samples"][sample["doc_id"]]["loglikelihoods"]
            assert [r[0][0] for r in sample["resps"]] == pytest.approx(mine, abs=1e-4), name
        for metric, value in result["metrics"].items():
            assert theirs["results"][name][f"{metric},none"] == pytest.approx(value, abs=1e-9), (name, metric)


def test_schema_fuzzing_of_every_route_finds_no_server_error(inference_api):
    """Schemathesis generates requests from the app's own OpenAPI schema (valid and invalid
    bodies, odd types, boundary values: the new fields, prompt lists, token ids, tokenize and
    detokenize among them) and checks that none is answered with a 5xx. The app is the one Serve
    runs, here without Ray: the proxy adds nothing to what a body can do to a handler."""
    schema = httpx.get(f"{inference_api.url}/openapi.json", headers={"Authorization": f"Bearer {inference_api.key}"})
    paths = set(schema.json()["paths"])
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/tokenizer_info"} <= paths
    r = subprocess.run(
        [
            str(Path(sys.executable).with_name("st")),
            "run",
            f"{inference_api.url}/openapi.json",
            "-H",
            f"Authorization: Bearer {inference_api.key}",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "20",
            "--generation-deterministic",
            "--request-timeout",
            "60",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


# ---- the pieces alone (no server) ----

CALL_F = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
CALL_G = '<tool_call>{"name": "g", "arguments": {"b": "</tool"}}</tool_call>'


@pytest.mark.parametrize(
    "text, parallel, names, content",
    [
        (f"Sure. {CALL_F}{CALL_G}", True, ["f", "g"], "Sure. "),
        (f"Sure. {CALL_F} and {CALL_G}", False, ["f"], "Sure.  and "),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', True, [], None),  # not an offered tool
        ("<tool_call>{not json}</tool_call> x", True, [], None),
        ('<tool_ca and <tool_call>{"name": "f", "arguments": {}}', True, ["f"], "<tool_ca and "),  # cut short
        ("a < b <tool", True, [], None),
    ],
)
def test_tool_calls_are_read_the_same_from_a_whole_reply_and_from_any_split_of_its_stream(
    text, parallel, names, content
):
    from lmfoundry.serving.tool_calls import Call, ToolCallStream, parse_tool_calls

    calls, rest = parse_tool_calls(text, ["f", "g"], forced=False, parallel=parallel)
    assert [c.name for c in calls] == names and rest == (text if content is None else content)
    for size in (1, 2, 3, 7, len(text)):  # the text as a stream, in pieces of every size
        stream = ToolCallStream(["f", "g"], parallel=parallel)
        events = [e for i in range(0, len(text), size) for e in stream.feed(text[i : i + size])] + stream.finish()
        assert [e.name for e in events if isinstance(e, Call)] == names
        assert "".join(e for e in events if isinstance(e, str)) == rest
        if names:  # text before a call is passed on before the call is
            assert isinstance(events[-1], Call) or not isinstance(events[0], Call)


def test_a_forced_call_is_the_reply_itself():
    from lmfoundry.serving.tool_calls import parse_tool_calls

    calls, rest = parse_tool_calls('{"name": "f", "arguments": {"a": [1]}}', ["f"], forced=True)
    assert [(c.name, c.arguments) for c in calls] == [("f", {"a": [1]})] and rest == ""


def test_bias_and_penalties_apply_per_row_and_leave_other_rows_alone():
    from lmfoundry.serving.sampling import SamplingParams, adjust_logits

    logits = torch.randn(3, 10)
    counts = torch.zeros(10)
    counts[[2, 5, 5]] = torch.tensor([1.0, 3.0, 3.0])
    params = [
        SamplingParams(4),
        SamplingParams(4, frequency_penalty=0.5, presence_penalty=1.0),
        SamplingParams(4, logit_bias=((7, -100.0), (1, 2.5))),
    ]
    out = adjust_logits(logits, params, [None, counts, None])
    assert torch.equal(out[0], logits[0])
    want = logits[1] - 0.5 * counts - 1.0 * (counts > 0).float()
    torch.testing.assert_close(out[1], want)
    assert out[2, 7] == logits[2, 7] - 100 and out[2, 1] == logits[2, 1] + 2.5
    assert adjust_logits(logits, [SamplingParams(4)] * 3, [None] * 3) is logits  # nothing to do: no copy


def test_lm_evaluation_harness_local_chat_completions_gets_the_in_process_replies(
    inference_api, tiny_serving_checkpoint, tmp_path, monkeypatch
):
    """`local-chat-completions` (generation tasks only: chat completions carry no prompt
    log-probabilities) on the shipped generation task: each reply is the in-process reply to the
    very messages the harness sent, sampled under the same seed, cut at its stop strings."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from lmfoundry.clients.checkpoint import CheckpointModel, cut_at_stop
    from lmfoundry.eval.tasks import harness_copy

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", inference_api.key)
    tasks_dir = os.path.join(os.path.dirname(__file__), "..", "lmfoundry", "eval", "suites", "tasks")
    include = harness_copy([os.path.join(tasks_dir, "repeat_word.yaml")], tmp_path / "tasks")
    # a random model's greedy reply is newlines: sample instead (the harness sends seed 1234),
    # stopping at a string it will not meet, so that replies are text that can differ
    spec = yaml.safe_load((include / "repeat_word.yaml").read_text())
    spec["generation_kwargs"].update(until=["\n\n\n"], temperature=1.0)
    (include / "repeat_word.yaml").write_text(yaml.safe_dump(spec))
    theirs = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=f"base_url={inference_api.url}/v1/chat/completions,model=tiny,num_concurrent=1,max_retries=1",
        tasks=["lmfoundry_repeat_word"],
        task_manager=TaskManager(include_path=str(include), include_defaults=False),
        apply_chat_template=True,
        limit=4,
        log_samples=True,
    )
    local = CheckpointModel(tiny_serving_checkpoint)
    samples = theirs["samples"]["lmfoundry_repeat_word"]
    assert len(samples) == 4
    for sample in samples:
        ((messages,), gen_kwargs) = sample["arguments"][0]  # the messages as JSON text, as they were sent
        ids = local.encode(local.template.render(json.loads(messages)))
        reply = local._generate(ids, gen_kwargs["max_gen_toks"], gen_kwargs["temperature"], seed=1234)[0]
        want = cut_at_stop(reply, gen_kwargs["until"])
        assert sample["resps"][0][0] == want
    assert all(sample["resps"][0][0].strip() for sample in samples)  # text, not blanks that match anything


# ---- the `reasoning` extension of chat completions (serving/reasoning.py) ----

MATHS = [{"role": "user", "content": "Compute (12 + 5) * 3."}]


def test_a_plain_chat_request_is_answered_as_without_the_reasoning_extension(inference_api, client, model):
    """No `reasoning` (or null): greedy decoding of the rendered chat, and usage as before."""
    net, _ = model
    ids = post(inference_api, "/tokenize", {"messages": MATHS}).json()["tokens"]
    expected = greedy(net, ids, 12)
    _, tok = model
    for extra in ({}, {"reasoning": None}):
        raw = post(
            inference_api, "/v1/chat/completions", {"messages": MATHS, "max_tokens": 12, "temperature": 0, **extra}
        )
        body = raw.json()
        assert "reasoning" not in body
        assert body["choices"][0]["message"]["content"] == tok.decode(expected)
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}


def test_majority_samples_are_engine_requests_and_usage_counts_every_token(inference_api, client):
    """The n samples of one round are the same engine requests as a completions request with n
    choices (seed + i each): the same texts, and usage counts all their tokens."""
    ids = post(inference_api, "/tokenize", {"messages": MATHS}).json()["tokens"]
    reasoning = {"strategy": "majority", "n": 4, "budget_tokens": 32}
    reply = client.chat.completions.create(
        model="tiny", messages=MATHS, max_tokens=8, temperature=1.0, seed=7, extra_body={"reasoning": reasoning}
    )
    same = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=1.0, seed=7, n=4)
    samples = [c.text for c in same.choices]
    report = reply.model_extra["reasoning"]
    assert report["strategy"] == "majority" and report["samples"] == 4 and report["scorer"] is None
    assert reply.usage.completion_tokens == same.usage.completion_tokens
    assert reply.usage.prompt_tokens == len(ids) == same.usage.prompt_tokens
    assert reply.choices[0].message.content in samples  # a random model states no answer: the first sample
    assert reply.choices[0].message.content == samples[0] and report["votes"] == {}
    again = client.chat.completions.create(
        model="tiny", messages=MATHS, max_tokens=8, temperature=1.0, seed=7, extra_body={"reasoning": reasoning}
    )
    assert again.choices[0].message.content == reply.choices[0].message.content


def test_best_of_n_and_step_beam_stay_within_their_token_budget(client):
    """Sampling stops once the budget is spent: at most one round (n x max_tokens) over it."""
    for reasoning, bound in (
        ({"strategy": "best_of_n", "n": 8, "scorer": "verifier", "budget_tokens": 20}, 8),
        ({"strategy": "weighted", "n": 8, "scorer": "verifier", "budget_tokens": 20}, 8),
        ({"strategy": "step_beam", "beam_width": 2, "expand": 2, "max_steps": 3, "scorer": "verifier",
          "budget_tokens": 40}, 2 * 2),
    ):  # fmt: skip
        reply = client.chat.completions.create(
            model="tiny", messages=MATHS, max_tokens=8, seed=1, extra_body={"reasoning": reasoning}
        )
        report = reply.model_extra["reasoning"]
        assert 0 < reply.usage.completion_tokens <= reasoning["budget_tokens"] + bound * 8, (reasoning, reply.usage)
        assert report["strategy"] == reasoning["strategy"] and report["scorer"] == "verifier"
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert report["samples"] >= 2  # the beam search sampled steps from at least one partial solution


def test_a_served_reward_model_scores_best_of_n(inference_api, client, tiny_serving_checkpoint, tmp_path):
    """A reward model named in the serve config is a scorer: best-of-N picks the sample it rates
    highest, so its reply is among the samples and the choice is reproducible."""
    from lmfoundry.model.checkpoint import TOKENIZER, save_model_files
    from lmfoundry.platform import checkpoint
    from lmfoundry.train.reward import reward_model

    torch.manual_seed(0)
    rm = reward_model(tiny_serving_checkpoint)
    torch.nn.init.normal_(rm.lm_head.weight)  # a new head scores 0 everywhere: give it an opinion
    save_model_files(rm, tmp_path)
    (tmp_path / TOKENIZER).write_text(Path(tiny_serving_checkpoint, TOKENIZER).read_text())
    checkpoint.seal(tmp_path, {"step": 0})
    inference_api.use(reward_models={"orm": str(tmp_path)})
    try:
        reasoning = {"strategy": "best_of_n", "n": 4, "scorer": "orm", "budget_tokens": 64}
        kwargs = dict(model="tiny", messages=MATHS, max_tokens=8, seed=3, extra_body={"reasoning": reasoning})
        reply, again = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
        ids = post(inference_api, "/tokenize", {"messages": MATHS}).json()["tokens"]
        samples = [
            c.text for c in client.completions.create(model="tiny", prompt=ids, max_tokens=8, seed=3, n=4).choices
        ]
        from lmfoundry.clients.reward import RewardScorer

        prompt = post(inference_api, "/detokenize", {"tokens": ids}).json()["prompt"]
        scores = RewardScorer(str(tmp_path)).score(prompt, samples)
        best = max(range(4), key=lambda i: (scores[i], -i))
        assert reply.choices[0].message.content == samples[best] == again.choices[0].message.content
        assert reply.model_extra["reasoning"]["scorer"] == "orm"
    finally:
        inference_api.use()


def test_the_request_deadline_counts_from_arrival_to_when_the_batcher_produced_the_reply():
    """The deadline counts from the request's arrival to when the batcher produced what was
    waited for. A wait that completes without yielding to the event loop (a token already
    produced) can beat `wait_for`'s timer: it is still a 408 when it came late. A reply produced
    in time is answered however late the event loop gets to it. On a 408, a failed generation
    or a client gone every stream is cancelled and the charge refunded, once, but for the tokens
    the streams had used."""
    import asyncio
    import functools
    import time
    from types import SimpleNamespace

    from lmfoundry.serving.api import ApiError, LLMServer
    from lmfoundry.serving.engine import GenerationFailed

    cancelled, refunds = [], []

    class Stream:
        produced_at = first_token_at = None
        generated = 0

        def cancel(self):
            cancelled.append(self)

    async def ready():  # returns at once: nothing for the timer to interrupt
        return "token"

    async def blocking():  # the reply reaches the handler 60 ms on, without ever yielding
        time.sleep(0.06)
        return "token"

    async def failing():
        raise GenerationFailed("generation failed: the batcher stopped")

    server = SimpleNamespace(timeout_s=0.05, _refund=lambda tenant, n: refunds.append((tenant, n)))
    for name in ("_abandon", "_refund_unused"):
        setattr(server, name, functools.partial(getattr(LLMServer.func_or_class, name), server))
    in_time = LLMServer.func_or_class._in_time

    def run(waits, started, produced_at=lambda s: s.produced_at, streams=None):
        cancelled.clear(), refunds.clear()
        streams = streams or [Stream(), Stream()]
        return streams, asyncio.run(in_time(server, waits, streams, "t", 7, 2, "late", started, produced_at))

    for waits, started in (([ready(), ready()], time.perf_counter() - 0.06), ([blocking()], time.perf_counter())):
        with pytest.raises(ApiError) as err:
            run(waits, started)  # arrived 60 ms ago, or produced (as far as anyone knows) 60 ms on
        assert err.value.status == 408 and len(cancelled) == 2 and refunds == [("t", 7)]

    # produced 10 ms after arrival; the handler got to it 60 ms after: in time
    started = time.perf_counter()
    streams, results = run([blocking()], started, produced_at=lambda s: started + 0.01)
    assert results == ["token"] and not cancelled and not refunds

    with pytest.raises(GenerationFailed):
        run([failing(), ready()], time.perf_counter())
    assert len(cancelled) == 2 and refunds == [("t", 7)]

    # a client gone (the handler cancelled) after its streams generated 1 and 2 tokens: the
    # prompt (2, prefilled) and those 3 stay paid for, only the rest of the charge comes back
    generating = [Stream(), Stream()]
    for stream, made in zip(generating, (1, 2)):
        stream.generated, stream.first_token_at = made, time.perf_counter()

    async def cancelled_by_the_client():
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        run([cancelled_by_the_client()], time.perf_counter(), streams=generating)
    assert len(cancelled) == 2 and refunds == [("t", 7 - 2 - 3)]


def test_a_reasoning_request_that_times_out_pays_for_the_samples_it_generated():
    """Majority voting over 64 samples of up to 32,768 tokens each, against a 0.3 s deadline, on
    an engine that makes a token a millisecond: the 408 refunds the charge but what the samples
    generated, and no round starts after it (a dropped request refunded everything, so a tenant
    could keep the model busy past its tokens-per-minute limit)."""
    import asyncio
    import functools
    import time
    import types

    from lmfoundry.serving import api
    from lmfoundry.serving.protocol import ChatCompletionRequest

    made = []

    class Stream:
        def __init__(self, ids, params):
            self.budget, self.cancelled, self.generated = params.max_tokens, False, 0
            made.append(self)

        async def collect(self):
            while self.generated < self.budget and not self.cancelled:
                await asyncio.sleep(0.001)
                self.generated += 1
            return types.SimpleNamespace(text="x" * self.generated, completion_tokens=self.generated)

        def cancel(self):
            self.cancelled = True

    engine = types.SimpleNamespace(
        encode=lambda text: [1] * 10,
        context=100_000,
        vocab_size=1000,
        stream=Stream,
        batcher=types.SimpleNamespace(max_waiting=1000),
    )
    ledger = {"charged": 0, "refunded": 0}

    async def admit(tenant, tokens):
        ledger["charged"] += tokens
        return 0, ""

    def refund(tenant, tokens):
        ledger["refunded"] += tokens

    server_class = api.LLMServer.func_or_class
    server = types.SimpleNamespace(
        limiter=types.SimpleNamespace(
            admit=types.SimpleNamespace(remote=admit), refund=types.SimpleNamespace(remote=refund)
        ),
        timeout_s=0.3,
        reward_models={},
        _tenant=lambda request: "acme",
    )
    for name in ("_admit", "_refund", "_refund_unused"):
        setattr(server, name, functools.partial(getattr(server_class, name), server))
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "What is 2+2?"}],
            "reasoning": {"strategy": "majority", "n": 64, "budget_tokens": 32768},
        }
    )

    async def ask():
        with pytest.raises(api.ApiError) as timed_out:
            await server_class._reason(
                server, engine, api.Prompt("What is 2+2?", [1] * 10, 512), req, [], time.perf_counter(), "v1", None
            )
        assert timed_out.value.status == 408
        made_then = len(made)
        await asyncio.sleep(0.2)
        return made_then

    made_at_the_408 = asyncio.run(ask())
    generated = sum(s.generated for s in made)
    assert generated > 0 and all(s.cancelled for s in made) and len(made) == made_at_the_408
    # the samples and the prompt; a sample may finish the token it was making when cancelled
    assert generated + 10 - len(made) <= ledger["charged"] - ledger["refunded"] <= generated + 10


def test_a_stream_its_client_leaves_pays_for_what_was_generated_and_one_that_ends_reports_once():
    """A streamed reply whose client goes away after the first chunk: the streams are cancelled
    and `abandoned` refunds the rest of the charge (nothing came back before, so a client that
    stopped a reply paid its whole max_tokens); a stream read to its end reports `finished` only."""
    import asyncio
    import types

    from lmfoundry.serving.engine import Delta
    from lmfoundry.serving.protocol import ChatCompletionRequest
    from lmfoundry.serving.streaming import stream_events

    class Stream:
        def __init__(self):
            self.generated, self.cancelled = 1, False

        async def next_delta(self):
            await asyncio.sleep(0.01)
            self.generated += 1
            return Delta("b", "stop" if self.generated == 4 else None, 3, self.generated, [])

        def cancel(self):
            self.cancelled = True

    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "stream": True})

    async def run(chunks_read):
        streams, said = [Stream()], []
        events = stream_events(
            streams,
            [Delta("a", None, 3, 1, [])],
            req,
            True,
            [],
            [types.SimpleNamespace(text="hi", ids=[1, 2, 3])],
            None,
            "m",
            "v1",
            3,
            lambda: None,
            lambda gate, text, last: text,
            lambda finishes, completion, rid: said.append(("finished", completion)),
            lambda: said.append(("abandoned", streams[0].generated)),
        )
        read = []
        async for chunk in events:
            read.append(chunk)
            if len(read) == chunks_read:
                break
        await events.aclose()  # the client is gone (or done)
        return streams[0], said, read

    stream, said, read = asyncio.run(run(1))
    assert stream.cancelled and len(read) == 1 and said == [("abandoned", stream.generated)]
    stream, said, read = asyncio.run(run(100))
    assert read[-1] == "data: [DONE]\n\n" and said == [("finished", 4)]
