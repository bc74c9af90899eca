"""Constrained decoding's string bounds: a plain string's maxLength costs the automaton nothing
(it is counted while decoding), the count holds the bound on every path a token can take through
a string (quotes and escapes inside tokens, strings opened mid-token), and the orders workflow's
tool calls compile far under the server's transition limit. No Ray, no model: the tokenizer of
the tiny serving checkpoint and outlines-core."""

import json

import pytest
from tokenizers import Tokenizer

from lmfoundry.model.checkpoint import TOKENIZER
from lmfoundry.model.tokenizer import eos_id
from lmfoundry.serving.grammar import (
    MAX_TRANSITIONS,
    Grammars,
    JsonScanner,
    SchemaRefused,
    StringBounds,
    check_schema,
    tool_call_schema,
)

pytestmark = pytest.mark.timeout(120)

ORDERS_TOOLS = [  # as the orders workflow offers them (agents/tools.py, workflow.final_answer_spec)
    {
        "name": "sql",
        "parameters": {
            "type": "object",
            "required": ["query"],
            "additionalProperties": False,
            "properties": {"query": {"type": "string", "maxLength": 64}},
        },
    },
    {
        "name": "docs",
        "parameters": {
            "type": "object",
            "required": ["query"],
            "additionalProperties": False,
            "properties": {
                "query": {"type": "string", "maxLength": 64},
                "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
            },
        },
    },
    {
        "name": "final_answer",
        "parameters": {
            "type": "object",
            "required": ["answer"],
            "properties": {"answer": {"type": "string", "maxLength": 64}},
        },
    },
]


@pytest.fixture(scope="module")
def grammars(tiny_serving_checkpoint):
    tok = Tokenizer.from_file(f"{tiny_serving_checkpoint}/{TOKENIZER}")
    return Grammars(tok, eos_id(tok))


def transitions(grammars, schema) -> int:
    index, _ = grammars._index(schema)
    return sum(len(t) for t in index.get_transitions().values())


def write(constraint, text: bytes) -> tuple[bytes, bool]:
    """Follow `text` with the longest allowed token each step: (what was written, finished)."""
    out = b""
    while not constraint.done():
        fits = [
            i
            for i in constraint.allowed()
            if constraint.tokens.bytes[i] and text[len(out) :].startswith(constraint.tokens.bytes[i])
        ]
        if not fits:
            return out, False
        token = max(fits, key=lambda i: len(constraint.tokens.bytes[i]))
        constraint.advance(token)
        out += constraint.tokens.bytes[token]
    return out, True


def test_max_length_adds_nothing_to_the_automaton(grammars):
    sizes = {
        n: transitions(grammars, {"type": "object", "properties": {"q": {"type": "string", "maxLength": n}}})
        for n in (1, 16, 64)
    }
    assert len(set(sizes.values())) == 1, sizes


def test_the_orders_tool_calls_compile_far_under_the_limit(grammars):
    for name in ("sql", None):  # the forced first step, and any of the three tools
        schema = tool_call_schema(ORDERS_TOOLS, name)
        check_schema(schema)
        assert transitions(grammars, schema) < MAX_TRANSITIONS // 10


@pytest.mark.parametrize("length, fits", [(63, True), (64, True), (65, False)])
def test_a_string_is_held_to_its_max_length(grammars, length, fits):
    query = ("SELECT item FROM orders WHERE customer='acme' " * 2)[:length]
    text = json.dumps({"name": "sql", "arguments": {"query": query}}).encode()
    written, done = write(grammars.constraint(tool_call_schema(ORDERS_TOOLS, None)), text)
    assert done == fits and (written == text if fits else len(written) < len(text))
    if not fits:  # stopped at the bound: only the closing quote is left inside the string
        assert written.endswith(query[:64].encode())


def test_escapes_and_utf8_characters_count_once_and_the_bound_holds_across_quotes_in_one_token():
    bounds = StringBounds(
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"type": "string"}}}
    )
    scanner = JsonScanner(bounds)
    assert scanner.feed(b'{"a": "x\\"')  # an escaped quote: one character, and the string goes on
    assert scanner.room() == 1 and scanner.feed("\u00e9".encode())  # two bytes, one character
    assert scanner.room() == 0 and not scanner.copy().feed(b"y") and scanner.copy().feed(b'", "b": "')
    assert scanner.feed(b'", "b": "' + b"z" * 100)  # b is unbounded
    assert JsonScanner(bounds).feed(b'{"a": "abc') and not JsonScanner(bounds).feed(b'{"a": "abcd')


def test_a_random_walk_through_bounded_strings_never_runs_out_of_tokens(grammars):
    """Sampled paths (multi-byte characters, escapes) always have a token to go on with, end as
    JSON the schema accepts, and hold the bound."""
    import random

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
    for seed in range(40):
        rng, constraint, text = random.Random(seed), grammars.constraint(schema), b""
        while not constraint.done():
            allowed = constraint.allowed()
            assert allowed, f"seed {seed}: no token allowed after {text!r}"
            token = rng.choice(allowed)
            constraint.advance(token)
            text += constraint.tokens.bytes[token]
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert len(value["city"]) <= 8


def test_bounds_follow_refs_and_branches_and_the_loosest_branch_wins():
    schema = {
        "$defs": {"short": {"type": "string", "maxLength": 4}},
        "anyOf": [
            {"type": "object", "properties": {"x": {"$ref": "#/$defs/short"}}},
            {
                "type": "object",
                "properties": {
                    "x": {"type": "string", "maxLength": 9},
                    "y": {"type": "array", "items": {"$ref": "#/$defs/short"}},
                },
            },
            {"type": "object", "properties": {"z": {"type": "string"}}},
        ],
    }
    bounds = StringBounds(schema)
    assert bounds.at(("x",)) == 9 and bounds.at(("y", 3)) == 4 and bounds.at(("z",)) is None
    assert bounds.at(("other",)) is None  # in no branch (the automaton writes listed properties only)
    assert StringBounds({"type": "object"}).at(("any",)) is None  # any object: any string


def test_literals_are_not_rewritten_and_contradictory_bounds_are_refused(grammars):
    literal = {"type": "string", "maxLength": 2}
    constraint = grammars.constraint({"enum": [literal]})
    assert write(constraint, json.dumps(literal).encode()) == (json.dumps(literal).encode(), True)
    with pytest.raises(SchemaRefused, match="minLength=5 is above maxLength=2"):
        check_schema({"type": "string", "minLength": 5, "maxLength": 2})


def test_a_compile_over_its_memory_is_the_schemas_fault_and_a_broken_compiler_the_servers(grammars, monkeypatch):
    """The child's address space is limited: a schema whose automaton outgrows it is refused
    (a 400), as one past the timeout is. A child that fails for a reason of the server's (here
    it cannot even start) is CompilerFailed, a 503, never a 400 blaming the client's schema."""
    import sys

    from lmfoundry.serving import grammar_compile

    hostile = json.dumps({"type": "string", "pattern": ".*a.{20}"})
    why = grammar_compile.build_index(hostile, "", grammars._vocabulary_pickle, MAX_TRANSITIONS, 60, memory=150 << 20)
    assert isinstance(why, str) and "took more than 150 MiB" in why
    plain = json.dumps({"type": "string"})
    index, transitions = grammar_compile.build_index(plain, "", grammars._vocabulary_pickle, MAX_TRANSITIONS, 60)
    assert transitions > 0 and index.get_transitions()
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(grammar_compile.CompilerFailed, match="exit code 1"):
        grammar_compile.build_index(plain, "", grammars._vocabulary_pickle, MAX_TRANSITIONS, 60)
