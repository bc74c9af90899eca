"""Hostile requests against the inference API: the real FastAPI app of the Serve deployment, its
real engine on a tiny random-weight checkpoint, its real guardrail, over real HTTP (uvicorn in a
thread; Ray Serve's proxy is left out, so no Ray starts). Each test names the attack and asserts
the defence held."""

import asyncio
import json
import re
import time

import httpx
import pytest
from conftest import INFERENCE_KEY as KEY

from lmfoundry.model.checkpoint import TOKENIZER

pytestmark = pytest.mark.timeout(300)
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def api(inference_api):
    return inference_api


def auth():
    return {"Authorization": f"Bearer {KEY}"}


def post(api, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{api.url}{path}", json=body, headers=auth(), timeout=120, **kw)


def post_raw(api, path: str, raw: bytes) -> httpx.Response:  # bytes that json= would refuse to send
    headers = {**auth(), "Content-Type": "application/json"}
    return httpx.post(f"{api.url}{path}", content=raw, headers=headers, timeout=120)


def streamed(api, body: dict) -> list[dict]:
    """The completion chunks exactly as the client receives them."""
    with httpx.stream(
        "POST", f"{api.url}/v1/completions", json={**body, "stream": True}, headers=auth(), timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# ---- the output guardrail on streams ----


def _phrase_across_deltas(deltas: list[str], last: bool) -> tuple[str, int] | None:
    """A blocklist term found in the reply that spans two or more deltas (when `last`, one that
    ends inside the final delta), and where the scorer first finds it."""
    text = "".join(deltas)
    bounds = [0]
    for d in deltas:
        bounds.append(bounds[-1] + len(d))
    words = [m.span() for m in re.finditer(r"[A-Za-z]+", text)]
    for i, (start, _) in enumerate(words):
        for _, end in words[i:]:
            phrase = text[start:end]
            spans_deltas = any(start < b < end for b in bounds)
            in_last = end > bounds[-2]
            if not spans_deltas or (last and not in_last) or re.search(r"[\x00-\x1f]", phrase):
                continue
            first = re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text, re.IGNORECASE)
            if first:
                return phrase, first.start()
    return None


def _reply_with_split_phrase(api, last: bool) -> tuple[dict, list[str], str, int]:
    """A seeded request whose unguarded streamed reply has such a phrase: the request, the
    deltas, the phrase and where it starts."""
    # A stop string makes the engine hold back its length less one character, which the final
    # delta then carries: the delta an interval check at the end is most likely to miss.
    hold_back = {"stop": ["~" * 64]} if last else {}
    for seed in range(60):
        body = {"prompt": "The farmer", "max_tokens": 40, "temperature": 1.0, "seed": seed, **hold_back}
        deltas = [c["choices"][0]["text"] for c in streamed(api, body)]
        found = _phrase_across_deltas(deltas, last)
        if found:
            return body, deltas, *found
    pytest.fail("the model never said a phrase split across deltas")


@pytest.mark.parametrize("where", ["mid_stream", "in_the_final_delta"])
def test_harmful_phrase_split_across_deltas_never_reaches_the_stream(api, tmp_path, where):
    api.use()
    body, deltas, phrase, starts_at = _reply_with_split_phrase(api, last=where == "in_the_final_delta")
    blocklist = tmp_path / "blocklist.txt"
    blocklist.write_text(f"{phrase}\n")
    api.use({"blocklist": str(blocklist)})
    chunks = streamed(api, body)
    received = "".join(c["choices"][0]["text"] for c in chunks)
    # nothing of the phrase left: what came is the reply up to (not into) the phrase's first letter
    assert "".join(deltas).startswith(received)
    assert len(received) <= starts_at, (phrase, received)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "content_filter"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["text"] == ""
    # the same reply unstreamed is filtered whole
    whole = post(api, "/v1/completions", body).json()["choices"][0]
    assert whole["text"] == "" and whole["finish_reason"] == "content_filter"


def test_text_the_guardrail_passes_streams_whole_and_equals_the_unstreamed_reply(api, tmp_path):
    blocklist = tmp_path / "blocklist.txt"
    blocklist.write_text("zebra crossing tonight\n")  # a long term: a long held-back window
    api.use({"blocklist": str(blocklist)})
    body = {"prompt": "The farmer", "max_tokens": 30, "temperature": 1.0, "seed": 1}
    chunks = streamed(api, body)
    whole = post(api, "/v1/completions", body).json()["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] != "content_filter"


# ---- request bodies: encoding, types, numbers ----


@pytest.mark.parametrize(
    "raw, problem",
    [
        (b'{"prompt": "caf\xe9 \xff"}', "not valid UTF-8"),  # Latin-1 and a stray byte
        (b'{"prompt": "\xed\xa0\x80"}', "surrogate"),  # a surrogate encoded as UTF-8 (CESU)
        (rb'{"prompt": "x\ud800y"}', "surrogate"),
        (rb'{"prompt": "x\udfffy"}', "surrogate"),
        (rb'{"prompt": "x\u0000y"}', "NUL"),
        (rb'{"prompt": "x", "stop": ["a\ud83d"]}', "surrogate"),
        (rb'{"prompt": "x", "user": "\udc00"}', "surrogate"),
        (rb'{"prompt": "x", "model": "tiny\ud800"}', "surrogate"),
    ],
)
def test_invalid_utf8_lone_surrogates_and_nul_in_completions_are_400(api, raw, problem):
    r = post_raw(api, "/v1/completions", raw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and problem in error["message"], error


def _tool(name="f", parameters=None, description="d"):
    function = {"name": name, "description": description}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "hi \ud800"}]},
        {"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": "\udbff"}]},
        {"messages": [{"role": "user", "content": "nul \x00 here"}]},
        {"messages": HELLO, "tools": [_tool(name="f\ud800")]},
        {"messages": HELLO, "tools": [_tool(description="\udc01")], "tool_choice": "required"},
        {"messages": HELLO, "tools": [_tool(parameters={"type": "object", "properties": {"\ud800": {}}})]},
        {"messages": HELLO, "tools": [_tool(parameters={"enum": ["a\udfff"]})], "tool_choice": "required"},
        {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]},
    ],
)
def test_lone_surrogates_and_nul_anywhere_in_a_chat_are_400(api, body):
    # json.dumps escapes the surrogates as \\uXXXX: exactly what a hostile client sends
    r = post_raw(api, "/v1/chat/completions", json.dumps(body).encode())
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "surrogate" in message or "NUL" in message, message


@pytest.mark.parametrize(
    "raw, field",
    [
        (b'{"prompt": "x", "max_tokens": 1e309}', "max_tokens"),  # parses as infinity
        (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "JSON"),  # past Python's digit limit
        (b'{"prompt": "x", "max_tokens": 1' + b"0" * 100 + b"}", "max_tokens"),
        (b'{"prompt": "x", "max_tokens": -5}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 2.5}', "max_tokens"),
        (b'{"prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"prompt": "x", "temperature": -Infinity}', "temperature"),
        (b'{"prompt": "x", "top_p": NaN}', "top_p"),
        (b'{"prompt": "x", "n": -1}', "n"),
        (b'{"prompt": "x", "seed": 1' + b"0" * 40 + b"}", "seed"),
        (b'{"prompt": "x", "seed": -1' + b"0" * 40 + b"}", "seed"),
        (b'{"prompt": 5}', "prompt"),
        (b'{"prompt": ["x", 5]}', "prompt"),
        (b'{"prompt": []}', "prompt"),
        (b'{"prompt": [[]]}', "prompt"),
        (b'{"prompt": [-1]}', "prompt"),
        (b'{"prompt": null}', "prompt"),
        (b'{"prompt": "x", "stream": "maybe"}', "stream"),
        (b'{"prompt": "x", "stop": 7}', "stop"),
        (b'["prompt", "x"]', "body"),
        (b'"x"', "body"),
        (b"null", "body"),
        (b'{"prompt": "x",}', "JSON"),
        (b'{"prompt": "x"', "JSON"),
        (b'{"prompt": "x"}{"prompt": "y"}', "JSON"),
        (b"[" * 200_000 + b"]" * 200_000, ""),  # nesting past the parser's recursion limit
        (b"\x00\x01\x02", ""),
    ],
)
def test_malformed_json_wrong_types_and_hostile_numbers_are_400(api, raw, field):
    r = post_raw(api, "/v1/completions", raw)
    assert r.status_code == 400, (raw[:80], r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"], error


@pytest.mark.parametrize(
    "stop, limit",
    [
        (["a", "b", "c", "d", "e"], "at most 4"),
        (["x" * 65], "1 to 64 characters"),
        ("y" * 10_000, "1 to 64 characters"),
        ([""], "1 to 64 characters"),
    ],
)
def test_stop_strings_over_the_limits_are_400_naming_the_limit(api, stop, limit):
    r = post(api, "/v1/completions", {"prompt": "The", "max_tokens": 4, "stop": stop})
    assert r.status_code == 400 and limit in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "stop"


def test_four_stop_strings_of_64_characters_are_accepted(api):
    stop = [c * 64 for c in "abcd"]
    r = post(api, "/v1/completions", {"prompt": "The", "max_tokens": 4, "stop": stop})
    assert r.status_code == 200, r.text


# ---- the fields of the OpenAI surface, over their limits ----

TOO_MANY_BIASES = {str(i): 1 for i in range(301)}


@pytest.mark.parametrize(
    "path, body, expected",
    [
        ("/v1/completions", {"prompt": "x", "n": 5}, "limit of 4"),
        ("/v1/completions", {"prompt": ["x"] * 65}, "at most 64"),
        ("/v1/completions", {"prompt": ["x"] * 17, "n": 4}, "68 choices; the limit is 64"),
        ("/v1/completions", {"prompt": [[1]] * 65}, "at most 64"),
        ("/v1/completions", {"prompt": [10**6]}, "outside the vocabulary"),
        ("/v1/completions", {"prompt": [2**40]}, "less than"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, "outside the vocabulary (0 to 369)"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1}}, "not a token id"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"٣": 1}}, "not a token id"),  # a digit, not ASCII
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1" * 5000: 1}}, "not a token id"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, "less than or equal to 100"),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"1": Infinity}}', "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": TOO_MANY_BIASES}, "at most 300"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "less than or equal to 20"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "less than or equal to 2"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "greater than or equal to -2"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "allowed with echo=true"),
        ("/v1/completions", {"prompt": "x" * 3000, "max_tokens": 0, "echo": True}, "context is 512"),
        ("/v1/chat/completions", {"messages": HELLO, "top_logprobs": 2}, "top_logprobs needs logprobs"),
        ("/v1/chat/completions", {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "20"),
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 3, "max_completion_tokens": 4}, "differ"),
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 0}, "at least 1 token"),
        ("/v1/chat/completions", {"messages": HELLO, "response_format": {"type": "json_schema"}}, "json_schema"),
        ("/v1/chat/completions", {"messages": HELLO, "response_format": {"type": "xml"}}, "response_format"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/"}}]}]},
            "messages",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}] * 65}]}, "64"),
        ("/detokenize", {"tokens": [10**6]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": [1] * 70_000}, "at most 65536"),
        ("/tokenize", {"prompt": "x", "messages": HELLO}, "either prompt or messages"),
        ("/tokenize", rb'{"prompt": "\ud800"}', "surrogate"),
    ],
)
def test_openai_fields_over_their_limits_are_400_naming_the_field(api, path, body, expected):
    r = post_raw(api, path, body) if isinstance(body, bytes) else post(api, path, body)
    assert r.status_code == 400, (path, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and expected in error["message"], error


MATHS = [{"role": "user", "content": "Compute (12 + 5) * 3."}]
VOTE = {"strategy": "majority", "n": 2, "budget_tokens": 16}


@pytest.mark.parametrize(
    "reasoning, extra, param, expected",
    [
        ({**VOTE, "strategy": "mcts"}, {}, "reasoning.strategy", "'best_of_n', 'majority', 'weighted' or 'step_beam'"),
        ({**VOTE, "n": 65}, {}, "reasoning.n", "less than or equal to 64"),
        ({**VOTE, "n": 0}, {}, "reasoning.n", "greater than or equal to 1"),
        ({**VOTE, "n": 10**40}, {}, "reasoning.n", "less than or equal to 64"),
        ({**VOTE, "beam_width": 9}, {}, "reasoning.beam_width", "less than or equal to 8"),
        ({**VOTE, "expand": 100}, {}, "reasoning.expand", "less than or equal to 8"),
        ({**VOTE, "max_steps": 17}, {}, "reasoning.max_steps", "less than or equal to 16"),
        ({**VOTE, "budget_tokens": 32_769}, {}, "reasoning.budget_tokens", "less than or equal to 32768"),
        ({**VOTE, "budget_tokens": -1}, {}, "reasoning.budget_tokens", "greater than or equal to 1"),
        ({"strategy": "majority", "n": 2}, {}, "reasoning.budget_tokens", "Field required"),
        ({**VOTE, "budget_tokens": "lots"}, {}, "reasoning.budget_tokens", "valid integer"),
        ({**VOTE, "temperature": 0}, {}, "reasoning.temperature", "Extra inputs are not permitted"),
        ("best", {}, "reasoning", "valid dictionary"),
        ({**VOTE, "scorer": "verifier"}, {}, "reasoning", "takes no scorer"),
        ({**VOTE, "strategy": "best_of_n"}, {}, "reasoning", "needs a scorer"),
        ({**VOTE, "strategy": "weighted", "scorer": "x" * 65}, {}, "reasoning.scorer", "at most 64 characters"),
        ({**VOTE, "strategy": "best_of_n", "scorer": "gpt-judge"}, {}, "reasoning.scorer", "allowed: ['verifier']"),
        ({**VOTE, "strategy": "step_beam", "scorer": "verifier"}, {"messages": HELLO}, "reasoning.scorer", "Compute"),
        ({**VOTE, "n": 64}, {}, "reasoning.n", "queues at most 16"),
        (
            {"strategy": "step_beam", "beam_width": 8, "expand": 8, "scorer": "verifier", "budget_tokens": 16},
            {},
            "reasoning.beam_width",
            "64 samples at once; this server queues at most 16",
        ),
        (VOTE, {"n": 2}, None, "does not combine with n"),
        (VOTE, {"stream": True}, None, "does not combine with stream"),
        (VOTE, {"logprobs": True}, None, "does not combine with logprobs"),
        (VOTE, {"response_format": {"type": "json_object"}}, None, "does not combine with response_format"),
    ],
)
def test_reasoning_out_of_range_or_unknown_is_400_naming_the_field(api, reasoning, extra, param, expected):
    r = post(api, "/v1/chat/completions", {"messages": MATHS, "max_tokens": 4, "reasoning": reasoning, **extra})
    assert r.status_code == 400, (reasoning, extra, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and expected in error["message"], error
    if param is not None:
        assert error["param"] == param, error


def test_hostile_questions_and_answers_never_reach_sympy_as_code():
    """The verifier scorer reads the question and the model's answers with sympy, which evaluates
    Python: anything but short arithmetic is refused before it, and powers cannot explode."""
    from lmfoundry.reasoning import verifiers

    assert verifiers.problem_of("Compute __import__('os').system('true').") is None
    assert verifiers.problem_of("Solve for x: 2*x + 1 = 5")["equation"] == "2*x + 1 = 5"
    problem = verifiers.problem_of("Compute (12 + 5) * 3.")
    assert verifiers.verify({**problem, "answer": "Answer: 51"}) is None
    for answer in ("__import__('os').system('true')", "9**9**9**9**9", "x" * 200, "lambda: 1"):
        started = time.perf_counter()
        assert "not a mathematical expression" in verifiers.verify({**problem, "answer": f"Answer: {answer}"})
        assert time.perf_counter() - started < 1.0
    assert verifiers.VerifierScorer(problem).score_steps("", [["__import__('os') = 1"]]) == [0.0]


def test_unimplemented_field_names_cannot_forge_or_flood_the_warning_header(api):
    """Ignored fields are named in a response header: names that are not plain identifiers
    (a CR LF that would start a header of its own, non-Latin-1 text a header cannot carry) and
    names past the first 16 are counted, never repeated."""
    fields = {"evil\r\nSet-Cookie: a=b": 1, "名前": 2, **{f"f{i:03}": i for i in range(500)}}
    r = post(api, "/v1/completions", {"prompt": "The", "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text[:300]
    header = r.headers["x-lmfoundry-ignored-fields"]
    assert header == ", ".join([f"f{i:03}" for i in range(16)] + ["486 more"])
    assert "set-cookie" not in r.headers


# ---- tool schemas ----


def _nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _nested_json(levels: int) -> dict:
    """{"a": {"a": ...}} under a key no subschema names: only the whole document's depth sees it."""
    node: dict = {}
    for _ in range(levels):
        node = {"a": node}
    return node


def _laughs(levels: int) -> dict:
    """Each definition refers to the one below 8 times: 8**levels subschemas once expanded."""
    defs = {"l0": {"type": "integer"}}
    for i in range(1, levels + 1):
        defs[f"l{i}"] = {"type": "array", "prefixItems": [{"$ref": f"#/$defs/l{i - 1}"}] * 8}
    return {"$defs": defs, "$ref": f"#/$defs/l{levels}"}


@pytest.mark.parametrize(
    "parameters, limit",
    [
        ({"enum": list(range(5000))}, "enum values"),
        (_nested(20), "nests deeper than"),
        ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}, "properties"),
        ({"type": "string", "pattern": "a" * 500}, "pattern must be a string of at most"),
        ({"type": "string", "pattern": "[a-z]{0,100000}"}, "repeats more than"),
        ({"type": "string", "pattern": "([a-z]{60}){60}"}, "transitions"),  # nested repeats: the automaton's size
        ({"type": "string", "maxLength": 100000}, "maxLength"),
        ({"type": "string", "minLength": 100}, "minLength"),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 100000}, "minItems"),
        ({"type": "array", "items": {"type": "integer"}, "maxItems": -1}, "maxItems"),
        ({"$ref": "https://attacker.example/schema.json"}, "not local"),
        ({"$ref": "#/nowhere"}, "points at nothing"),
        ({"type": "object", "description": "x" * 40_000}, "bytes of JSON"),
        ({"type": "object", "properties": {"x": {"type": "nonsense"}}}, "cannot be compiled"),
        ({"type": "object", "properties": ["a"]}, "properties is a list; it must be an object"),
        ({"anyOf": 5}, "anyOf is a int; it must be a list"),
        ({"type": "object", "required": "a"}, "required is a str"),
        ({"type": "object", "x-note": _nested_json(600)}, "nests deeper than 32 levels"),
    ],
)
def test_hostile_tool_and_response_schemas_are_a_quick_400_naming_the_limit(api, parameters, limit):
    """The same schema as a forced tool's parameters and as a response format, on both routes."""
    forced = {"tools": [_tool(parameters=parameters)], "tool_choice": "required"}
    response_format = {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": parameters}}}
    for path, body, field in [
        ("/v1/chat/completions", {"messages": HELLO, **forced}, "tools"),
        ("/v1/chat/completions", {"messages": HELLO, **response_format}, "response_format"),
        ("/v1/completions", {"prompt": "The", **response_format}, "response_format"),
    ]:
        started = time.perf_counter()
        r = post(api, path, {**body, "max_tokens": 8})
        elapsed = time.perf_counter() - started
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["param"] == field and (limit is None or limit in error["message"]), error
        assert elapsed < 12, f"took {elapsed:.1f} s"


def test_ordinary_forced_tool_call_still_compiles_and_decodes(api):
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    }
    body = {"messages": HELLO, "tools": [_tool("weather", weather)], "tool_choice": "required", "max_tokens": 60}
    r = post(api, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "tool_calls":  # a random model may run out of tokens first
        arguments = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
        assert set(arguments) == {"city", "unit"}


@pytest.mark.parametrize(
    "schema, limit",
    [
        ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "cycle"),
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "cycle"),
        (_laughs(4), "subschemas"),
        ({"$ref": "file:///etc/passwd"}, "not local"),
    ],
)
def test_ref_cycles_ref_expansion_bombs_and_remote_refs_are_refused(schema, limit):
    from lmfoundry.serving.grammar import SchemaRefused, check_schema

    with pytest.raises(SchemaRefused, match=limit):
        check_schema(schema)


def test_slow_schemas_are_stopped_at_their_deadline_and_busy_refuses_only_while_they_run(tiny_serving_checkpoint):
    """Small schemas whose automata blow up pass every static limit (a 9-character pattern
    `.*a.{20}`: the build's time and memory double with the count). Each compiles in a child
    process that is killed at the timeout: the event loop keeps ticking, the callers get
    SchemaRefused at the timeout, a third schema meets GrammarBusy at once while both compile
    slots are taken (a cached schema meanwhile takes none, and a tenant holds one slot at most),
    and then the slots are free again: an ordinary schema compiles, not a 503 for every tenant
    until the runaway builds end."""
    from tokenizers import Tokenizer

    from lmfoundry.model.tokenizer import eos_id
    from lmfoundry.serving import grammar

    tok = Tokenizer.from_file(f"{tiny_serving_checkpoint}/{TOKENIZER}")
    grammars = grammar.Grammars(tok, eos_id(tok))
    hostile = [{"type": "string", "pattern": f".*{c}.{{20}}"} for c in "ab"]
    for schema in hostile:
        grammar.check_schema(schema)  # within every static limit

    async def scenario():
        gaps, stop = [], asyncio.Event()

        async def heartbeat():  # what /health needs: the loop running every few milliseconds
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        cached = {"type": "object", "properties": {"n": {"type": "integer"}}}
        await grammars.prepare(cached, tenant="c")
        started = time.perf_counter()
        slow = [
            asyncio.create_task(grammars.prepare(schema, timeout_s=1.0, tenant=tenant))
            for schema, tenant in zip(hostile, "ab")
        ]
        await asyncio.sleep(0.2)
        asked = time.perf_counter()
        with pytest.raises(grammar.GrammarBusy, match="all 2 schema compile threads are busy"):
            await grammars.prepare({"type": "string", "maxLength": 4}, timeout_s=1.0, tenant="c")
        busy_after = time.perf_counter() - asked
        await grammars.prepare(cached, tenant="c")  # a cached schema takes no slot
        with pytest.raises(grammar.GrammarBusy, match="tenant a is compiling"):
            await grammars.prepare({"type": "string", "maxLength": 5}, tenant="a")
        outcomes = await asyncio.gather(*slow, return_exceptions=True)
        refused_after = time.perf_counter() - started
        await grammars.prepare({"type": "object", "properties": {"city": {"type": "string"}}})
        stop.set()
        await beat
        return gaps, outcomes, busy_after, refused_after

    gaps, outcomes, busy_after, refused_after = asyncio.run(scenario())
    for outcome in outcomes:
        assert isinstance(outcome, grammar.SchemaRefused) and "did not compile within 1.0 s" in str(outcome)
    assert busy_after < 0.05 and refused_after < 3
    assert len(gaps) >= 20 and max(gaps) < 0.25, max(gaps)


def test_compiled_grammar_cache_is_bounded_by_count_and_bytes(tiny_serving_checkpoint):
    from tokenizers import Tokenizer

    from lmfoundry.model.tokenizer import eos_id
    from lmfoundry.serving.grammar import Grammars

    tok = Tokenizer.from_file(f"{tiny_serving_checkpoint}/{TOKENIZER}")
    grammars = Grammars(tok, eos_id(tok), cache_size=3)
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "string"}}} for i in range(6)]
    for s in schemas:
        grammars.constraint(s)
        assert len(grammars._cache) <= 3
    one = grammars.cached_bytes() // 3
    grammars.cache_bytes = 2 * one
    grammars.constraint({"type": "array", "items": {"type": "integer"}})
    assert grammars.cached_bytes() <= 2 * one and len(grammars._cache) <= 2
