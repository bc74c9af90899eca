"""Constrained decoding: a JSON schema becomes a token-level automaton (outlines-core, the Rust
core of Outlines, which vLLM also uses), so a tool call's arguments always parse against the
tool's schema.

`JsonSchemaConstraint` follows one generation: `allowed()` lists the token ids that keep the
text inside the schema's language, `advance(token)` moves on, `done()` says the JSON is
complete. Indexes are built once per (schema, tokenizer) and cached: building one walks the
whole vocabulary through the schema's regular expression.

Schemas come from clients, and some small ones compile to huge automata (a string with
maxLength 16 takes minutes, the time doubling with each step). So a schema is first held to
static limits (`check_schema`), then compiled in a worker thread under a timeout
(`Grammars.prepare`), and the cache is bounded by count and by approximate size.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from tokenizers import Tokenizer

from lmfoundry.model.tokenizer import SPECIAL_TOKENS

try:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
except ImportError as e:  # a runtime dependency; named so that a broken install says what to do
    raise ImportError("constrained decoding needs outlines-core: pip install outlines-core") from e

# One optional space between JSON tokens: a tiny model left free to put newlines and tabs there
# can wander through whitespace until its token budget is gone.
WHITESPACE = r"[ ]?"


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the others
    for the characters from U+0100 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer: Tokenizer) -> dict[int, bytes]:
    """The bytes each non-special token of a byte-level BPE stands for."""
    decoder = _byte_decoder()
    out = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token in SPECIAL_TOKENS:
            continue
        if not all(c in decoder for c in token):
            raise ValueError(f"token {token!r} is not byte-level; constrained decoding needs a byte-level BPE")
        out[token_id] = bytes(decoder[c] for c in token)
    return out


# What a client's schema may ask of the automaton. Each limit keeps compilation to well under a
# second for vocabularies of tens of thousands of tokens; past them a 400 names the limit.
MAX_SCHEMA_BYTES = 32 * 1024  # the schema's JSON, all tools together
MAX_DEPTH = 10  # nested subschemas, $refs followed
MAX_SUBSCHEMAS = 512  # all subschemas, $refs followed (a ref used twice counts twice)
MAX_PROPERTIES = 256  # object properties, all objects together
MAX_ENUM_VALUES = 256  # enum values, all enums together
MAX_PATTERN_CHARS = 128
MAX_PATTERN_REPEAT = 64  # the n and m of {n}, {n,} and {n,m} in a pattern
MAX_STRING_LENGTH = 64  # minLength / maxLength: each step adds states (a top-level string grows exponentially)
MAX_ITEMS = 16  # minItems / maxItems, minProperties / maxProperties
MAX_TRANSITIONS = 250_000  # of the built automaton; bigger ones are refused, not cached
COMPILE_TIMEOUT_S = 10.0
COMPILE_THREADS = 2
CACHE_ENTRIES = 64
CACHE_BYTES = 256 << 20
BYTES_PER_TRANSITION = 16  # a (token, next state) entry in outlines-core's hash maps, with overhead

# Keywords whose value is a subschema, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "dependentSchemas")
_BOUNDS = {
    "minLength": MAX_STRING_LENGTH,
    "maxLength": MAX_STRING_LENGTH,
    "minItems": MAX_ITEMS,
    "maxItems": MAX_ITEMS,
    "minProperties": MAX_ITEMS,
    "maxProperties": MAX_ITEMS,
}
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class SchemaRefused(ValueError):
    """A schema over a limit, or one that cannot be compiled; the message names the limit."""


class GrammarBusy(RuntimeError):
    """Every compile thread is busy (some perhaps with schemas that timed out): retry later."""


def check_schema(schema) -> str:
    """The schema's canonical JSON (the cache key), after checking it against the limits above."""
    try:
        text = json.dumps(schema, sort_keys=True, allow_nan=False)
    except (ValueError, RecursionError) as e:
        raise SchemaRefused(f"the schema is not plain JSON ({e})") from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise SchemaRefused(f"the schema is {len(text.encode())} bytes of JSON; the limit is {MAX_SCHEMA_BYTES}")
    counts = {"subschemas": 0, "properties": 0, "enum values": 0}
    _walk(schema, schema, 1, (), counts)
    return text


def _walk(node, root, depth: int, refs: tuple[str, ...], counts: dict) -> None:
    if not isinstance(node, dict):
        if isinstance(node, bool):
            return
        raise SchemaRefused(f"a subschema is a {type(node).__name__}; subschemas are objects or booleans")
    if depth > MAX_DEPTH:
        raise SchemaRefused(f"the schema nests deeper than {MAX_DEPTH} levels ($refs followed)")
    counts["subschemas"] += 1
    counts["properties"] += len(node.get("properties") or {})
    counts["enum values"] += len(node["enum"]) if isinstance(node.get("enum"), list) else 0
    limits = {"subschemas": MAX_SUBSCHEMAS, "properties": MAX_PROPERTIES, "enum values": MAX_ENUM_VALUES}
    for what, limit in limits.items():
        if counts[what] > limit:
            raise SchemaRefused(f"the schema has more than {limit} {what} ($refs followed); the limit is {limit}")
    _check_bounds(node)
    if "$ref" in node:
        ref = node["$ref"]
        if ref in refs:
            raise SchemaRefused(f"$ref {ref!r} refers to itself (a cycle); recursive schemas are not supported")
        _walk(_resolve(ref, root), root, depth + 1, (*refs, ref), counts)
    for key in _ONE:
        if key in node:
            _walk(node[key], root, depth + 1, refs, counts)
    for key in _MANY:
        for sub in node.get(key) or []:
            _walk(sub, root, depth + 1, refs, counts)
    for key in _NAMED:
        for sub in (node.get(key) or {}).values():
            _walk(sub, root, depth + 1, refs, counts)


def _check_bounds(node: dict) -> None:
    for key, limit in _BOUNDS.items():
        value = node.get(key)
        if value is not None and not (isinstance(value, int) and 0 <= value <= limit):
            raise SchemaRefused(f"{key}={value!r}; constrained decoding allows 0 to {limit}")
    pattern = node.get("pattern")
    if pattern is None:
        return
    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN_CHARS:
        raise SchemaRefused(f"a pattern must be a string of at most {MAX_PATTERN_CHARS} characters")
    for low, high in _REPEAT.findall(pattern):
        if max(int(low), int(high or 0)) > MAX_PATTERN_REPEAT:
            raise SchemaRefused(f"pattern {pattern!r} repeats more than {MAX_PATTERN_REPEAT} times; that is the limit")


def _resolve(ref, root):
    """A local reference ("#/$defs/name"); remote ones would make the server fetch URLs."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaRefused(f"$ref {ref!r} is not local; only references inside the schema ('#/...') are allowed")
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise SchemaRefused(f"$ref {ref!r} points at nothing in the schema")
        node = node[part]
    return node


class Grammars:
    """Per tokenizer: the outlines-core vocabulary, and an index per schema (LRU-cached, bounded
    by entries and approximate bytes), built by `prepare` in worker threads."""

    def __init__(self, tokenizer: Tokenizer, eos_id: int, cache_size: int = CACHE_ENTRIES):
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, raw in token_bytes(tokenizer).items():
            by_bytes.setdefault(raw, []).append(token_id)
        self.vocabulary = Vocabulary(eos_id, by_bytes)
        self.cache_size, self.cache_bytes = cache_size, CACHE_BYTES
        self._cache: OrderedDict[str, tuple[Index, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="schema-compile")
        self._free = threading.Semaphore(COMPILE_THREADS)  # held until a compile ends, timed out or not

    async def prepare(self, schema: dict, timeout_s: float | None = None) -> None:
        """Check and compile `schema` into the cache without blocking the event loop. Raises
        SchemaRefused (over a limit, uncompilable, or slower than `timeout_s`, by default
        COMPILE_TIMEOUT_S) or GrammarBusy."""
        timeout_s = COMPILE_TIMEOUT_S if timeout_s is None else timeout_s
        if not self._free.acquire(blocking=False):
            raise GrammarBusy(f"all {COMPILE_THREADS} schema compile threads are busy")
        try:
            future = self._pool.submit(self._index, schema)
        except BaseException:
            self._free.release()
            raise
        future.add_done_callback(lambda _: self._free.release())
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            # The thread cannot be stopped; it keeps its slot until it ends, so that a flood of such
            # schemas meets GrammarBusy instead of piling up threads.
            raise SchemaRefused(f"the schema did not compile within {timeout_s} s (compile timeout)") from None

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._cache.values())

    def _index(self, schema: dict) -> Index:
        key = check_schema(schema)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][0]
        index, size = self._build(json.dumps(bounded_integers(schema), sort_keys=True))
        with self._lock:
            self._cache[key] = (index, size)
            while len(self._cache) > self.cache_size or (
                len(self._cache) > 1 and sum(s for _, s in self._cache.values()) > self.cache_bytes
            ):
                self._cache.popitem(last=False)
        return index

    def _build(self, schema_json: str) -> tuple[Index, int]:
        try:
            regex = build_regex_from_schema(schema_json, WHITESPACE)
            index = Index(regex, self.vocabulary)
        except Exception as e:  # the Rust side raises plain ValueErrors/RuntimeErrors with its reason
            raise SchemaRefused(f"the JSON schema cannot be compiled for constrained decoding: {e}") from None
        transitions = sum(len(t) for t in index.get_transitions().values())
        if transitions > MAX_TRANSITIONS:
            raise SchemaRefused(
                f"the schema compiles to an automaton of {transitions} transitions; the limit is {MAX_TRANSITIONS}"
            )
        return index, transitions * BYTES_PER_TRANSITION

    def constraint(self, schema: dict) -> JsonSchemaConstraint:
        """The schema's constraint; compiled here, on the caller's thread, unless `prepare` did it."""
        return JsonSchemaConstraint(Guide(self._index(schema)))


class JsonSchemaConstraint:
    def __init__(self, guide: Guide):
        self.guide = guide

    def allowed(self) -> list[int]:
        return self.guide.get_tokens()

    def advance(self, token: int) -> None:
        self.guide.advance(token)

    def done(self) -> bool:
        return self.guide.is_finished()


def bounded_integers(schema):
    """Integers with a minimum and maximum at most 256 apart become an enum of the values: the
    regex a schema compiles to checks types and structure, not numeric bounds."""
    if isinstance(schema, list):
        return [bounded_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_integers(v) for k, v in schema.items()}
    low, high = out.get("minimum"), out.get("maximum")
    if out.get("type") == "integer" and isinstance(low, int) and isinstance(high, int) and 0 <= high - low <= 256:
        return {"enum": list(range(low, high + 1))}
    return out


def tool_call_schema(tools: list[dict], name: str | None) -> dict:
    """The JSON a tool call must be: {"name": <one of the tools, or `name`>, "arguments": <that
    tool's parameters>}."""
    chosen = [t for t in tools if name is None or t["name"] == name]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, "arguments": t.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
        }
        for t in chosen
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}
