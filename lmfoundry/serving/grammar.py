"""Constrained decoding: a JSON schema becomes a token-level automaton (outlines-core, the Rust
core of Outlines, which vLLM also uses), so a tool call's arguments always parse against the
tool's schema.

`JsonSchemaConstraint` follows one generation: `allowed()` lists the token ids that keep the
text inside the schema's language, `advance(token)` moves on, `done()` says the JSON is
complete. Indexes are built once per (schema, tokenizer) and cached: building one walks the
whole vocabulary through the schema's regular expression.

A string's `maxLength` is not compiled into the automaton. Written as a regular expression,
`"(char){0,n}"` takes one state per length, each with a transition for nearly every token of the
vocabulary: 64 characters over 4,096 tokens is about 260,000 transitions, and a top-level bounded
string also takes time exponential in n to build. xgrammar keeps such repetition counts out of its
precomputed automaton and checks them while decoding; so does this module: the automaton is built
with the plain string's `maxLength` left out (one state, whatever the bound), and
`JsonSchemaConstraint` follows the JSON as it is written, counts the characters of the string value
being written (an escape or a multi-byte UTF-8 character is one, as JSON Schema counts them) and
withholds the tokens that would take it past the bound that the schema gives at that place.

Schemas come from clients, and some small ones compile to huge automata (a string with
minLength 16, a pattern such as `.*a.{20}`). So a schema is first held to static limits
(`check_schema`), then compiled in a child process under a memory limit that is killed at its
deadline (grammar_compile.py; `Grammars.prepare` waits for it off the event loop), and the cache is
bounded by count and by approximate size.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tokenizers import Tokenizer

from lmfoundry.model.tokenizer import SPECIAL_TOKENS

try:
    from outlines_core import Guide, Index, Vocabulary
except ImportError as e:  # a runtime dependency; named so that a broken install says what to do
    raise ImportError("constrained decoding needs outlines-core: pip install outlines-core") from e

from lmfoundry.serving.grammar_compile import build_index

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
MAX_JSON_DEPTH = 32  # nested objects and arrays of the schema's JSON, keys no subschema names included
MAX_SUBSCHEMAS = 512  # all subschemas, $refs followed (a ref used twice counts twice)
MAX_PROPERTIES = 256  # object properties, all objects together
MAX_ENUM_VALUES = 256  # enum values, all enums together
MAX_PATTERN_CHARS = 128
MAX_PATTERN_REPEAT = 64  # the n and m of {n}, {n,} and {n,m} in a pattern
MAX_STRING_LENGTH = 64  # minLength (each step adds automaton states) and maxLength (counted while decoding)
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
    """The schema's JSON (the cache key), after checking it against the limits above. Keys keep
    their order: outlines-core writes an object's properties in the order the schema lists them
    (a tool call's "name" before its "arguments", as the chat template renders calls)."""
    try:
        text = json.dumps(schema, allow_nan=False)
    except (ValueError, RecursionError) as e:
        raise SchemaRefused(f"the schema is not plain JSON ({e})") from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise SchemaRefused(f"the schema is {len(text.encode())} bytes of JSON; the limit is {MAX_SCHEMA_BYTES}")
    # the whole document, not only the subschemas _walk follows: the steps after it walk it all
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise SchemaRefused(f"the schema's JSON nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
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
    for key in _MANY:
        if key in node and not isinstance(node[key], list):
            raise SchemaRefused(f"{key} is a {type(node[key]).__name__}; it must be a list of subschemas")
    for key in (*_NAMED, "$defs", "definitions"):
        if key in node and not isinstance(node[key], dict):
            raise SchemaRefused(f"{key} is a {type(node[key]).__name__}; it must be an object of subschemas")
    for key in ("required", "enum", "type"):
        if key in node and not isinstance(node[key], (list, str) if key == "type" else list):
            raise SchemaRefused(f"{key} is a {type(node[key]).__name__}; see JSON Schema for what it holds")
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
    low, high = node.get("minLength"), node.get("maxLength")
    if low is not None and high is not None and low > high:
        raise SchemaRefused(f"minLength={low} is above maxLength={high}: no string has such a length")
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
        self._vocabulary_pickle = pickle.dumps(self.vocabulary)  # what each compile's child reads
        self.tokens = TokenTable(token_bytes(tokenizer), tokenizer.get_vocab_size())
        self.cache_size, self.cache_bytes = cache_size, CACHE_BYTES
        self._cache: OrderedDict[str, tuple[Index, StringBounds, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="schema-compile")
        self._free = threading.Semaphore(COMPILE_THREADS)  # held until a compile ends, timed out or not
        self._compiling: set[str | None] = set()  # the tenants holding a slot

    async def prepare(self, schema: dict, timeout_s: float | None = None, tenant: str | None = None) -> None:
        """Check and compile `schema` into the cache without blocking the event loop. Raises
        SchemaRefused (over a limit, uncompilable, or slower than `timeout_s`, by default
        COMPILE_TIMEOUT_S) or GrammarBusy. A schema already cached takes no compile slot, and a
        `tenant` holds at most one slot at a time: one tenant's slow schemas cannot hold up the
        others' compiles, nor anyone's cached ones."""
        timeout_s = COMPILE_TIMEOUT_S if timeout_s is None else timeout_s
        key = check_schema(schema)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return
            if tenant is not None and tenant in self._compiling:
                raise GrammarBusy(f"a schema of tenant {tenant} is compiling; one at a time")
            if not self._free.acquire(blocking=False):
                raise GrammarBusy(f"all {COMPILE_THREADS} schema compile threads are busy")
            self._compiling.add(tenant)

        def release(_) -> None:
            with self._lock:
                self._compiling.discard(tenant)
            self._free.release()

        try:
            future = self._pool.submit(self._index, schema, timeout_s, key)
        except BaseException:
            release(None)
            raise
        future.add_done_callback(release)
        # the compile's child process is killed at timeout_s, and the thread returns then; the
        # margin covers starting the child on a busy machine
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), timeout_s + 30)
        except asyncio.TimeoutError:
            raise SchemaRefused(f"the schema did not compile within {timeout_s} s (compile timeout)") from None

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(size for *_, size in self._cache.values())

    def _index(
        self, schema: dict, timeout_s: float = COMPILE_TIMEOUT_S, key: str | None = None
    ) -> tuple[Index, StringBounds]:
        """`key`: check_schema's, when the caller has it."""
        key = key or check_schema(schema)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][:2]
        index, size = self._build(json.dumps(unbounded_strings(bounded_integers(schema))), timeout_s)
        bounds = StringBounds(schema)
        with self._lock:
            self._cache[key] = (index, bounds, size)
            while len(self._cache) > self.cache_size or (
                len(self._cache) > 1 and sum(s for *_, s in self._cache.values()) > self.cache_bytes
            ):
                self._cache.popitem(last=False)
        return index, bounds

    def _build(self, schema_json: str, timeout_s: float) -> tuple[Index, int]:
        built = build_index(schema_json, WHITESPACE, self._vocabulary_pickle, MAX_TRANSITIONS, timeout_s)
        if isinstance(built, str):
            raise SchemaRefused(built)
        index, transitions = built
        return index, transitions * BYTES_PER_TRANSITION

    def constraint(self, schema: dict) -> JsonSchemaConstraint:
        """The schema's constraint; compiled here, on the caller's thread, unless `prepare` did it."""
        index, bounds = self._index(schema)
        return JsonSchemaConstraint(Guide(index), bounds, self.tokens)


class TokenTable:
    """Each token's bytes and characters, and which tokens can open or close a string (those
    holding a quote or a backslash): the others add all their characters to a string they are in."""

    def __init__(self, by_id: dict[int, bytes], vocab_size: int):
        size = max(vocab_size, max(by_id, default=-1) + 1)
        self.bytes = [by_id.get(i, b"") for i in range(size)]  # special tokens: no text
        # characters: UTF-8 continuation bytes (0x80-0xBF) go on the character before them
        self.length = np.array([sum(not 0x80 <= c <= 0xBF for c in b) for b in self.bytes], dtype=np.int64)
        self.delimits = np.array([b'"' in b or b"\\" in b for b in self.bytes], dtype=bool)


class JsonScanner:
    """Where the JSON written so far stands: the path of keys and array positions to the current
    value, and inside a string value, its characters so far (as JSON Schema counts them: an
    escape or a multi-byte UTF-8 character is one) and its bound. The automaton has already
    checked the text, so this follows well-formed JSON only."""

    __slots__ = ("bounds", "frames", "in_string", "is_key", "escaped", "key", "used", "bound")

    def __init__(self, bounds: StringBounds):
        self.bounds = bounds
        self.frames: list[list] = []  # [kind, key or position, awaiting a key]
        self.in_string = self.is_key = self.escaped = False
        self.key = bytearray()
        self.used, self.bound = 0, None

    def copy(self) -> JsonScanner:
        other = JsonScanner.__new__(JsonScanner)
        other.bounds, other.frames = self.bounds, [list(f) for f in self.frames]
        other.in_string, other.is_key, other.escaped = self.in_string, self.is_key, self.escaped
        other.key, other.used, other.bound = bytearray(self.key), self.used, self.bound
        return other

    def room(self) -> int | None:
        """Characters the string value being written may still take (None: unbounded or not in one)."""
        if not self.in_string or self.is_key or self.bound is None:
            return None
        return self.bound - self.used

    def feed(self, data: bytes) -> bool:
        """Take the bytes in; False as soon as a string value goes past its bound."""
        for b in data:
            if self.in_string:
                if self.escaped:  # the character after a backslash: one character with it
                    self.escaped, counts = False, False
                elif b == 0x5C:
                    self.escaped, counts = True, True
                elif b == 0x22:  # the closing quote
                    self.in_string = False
                    if self.is_key:
                        self.frames[-1][1] = self.key.decode("utf-8", "replace")
                    continue
                else:  # a UTF-8 continuation byte belongs to the character before it
                    counts = not 0x80 <= b <= 0xBF
                if self.is_key:
                    self.key.append(b)
                elif counts:
                    self.used += 1
                    if self.bound is not None and self.used > self.bound:
                        return False
            elif b == 0x22:
                top = self.frames[-1] if self.frames else None
                self.in_string, self.escaped = True, False
                self.is_key = top is not None and top[0] == "object" and top[2]
                if self.is_key:
                    self.key.clear()
                else:
                    self.used, self.bound = 0, self.bounds.at(tuple(f[1] for f in self.frames))
            elif b == 0x7B:  # {
                self.frames.append(["object", None, True])
            elif b == 0x5B:  # [
                self.frames.append(["array", 0, False])
            elif b in (0x7D, 0x5D):  # } ]
                if self.frames:
                    self.frames.pop()
            elif b == 0x3A and self.frames:  # :
                self.frames[-1][2] = False
            elif b == 0x2C and self.frames:  # ,
                top = self.frames[-1]
                if top[0] == "object":
                    top[2] = True
                else:
                    top[1] += 1
        return True


class JsonSchemaConstraint:
    def __init__(self, guide: Guide, bounds: StringBounds | None = None, tokens: TokenTable | None = None):
        self.guide, self.tokens = guide, tokens
        self.scanner = JsonScanner(bounds) if bounds is not None and bounds.any and tokens is not None else None

    def allowed(self) -> list[int]:
        ids = self.guide.get_tokens()
        if self.scanner is None:
            return ids
        ids = np.asarray(ids, dtype=np.int64)
        plain = ~self.tokens.delimits[ids]
        room = self.scanner.room()
        keep = plain if room is None else plain & (self.tokens.length[ids] <= room)
        # a quote or backslash may end this string and begin another: follow those few through
        for i in np.flatnonzero(~plain):
            keep[i] = self.scanner.copy().feed(self.tokens.bytes[ids[i]])
        return ids[keep].tolist()

    def advance(self, token: int) -> None:
        self.guide.advance(token)
        if self.scanner is not None:
            self.scanner.feed(self.tokens.bytes[token])

    def done(self) -> bool:
        return self.guide.is_finished()


# Subschemas that a value's schema is the union or intersection of, and keys a node that has
# them may still constrain the value with itself.
_BRANCHES = ("anyOf", "oneOf", "allOf")
_OWN = ("type", "properties", "additionalProperties", "items", "prefixItems", "maxLength", "enum", "const")
# Keys whose values are JSON data, not subschemas: never rewritten.
_LITERALS = ("enum", "const", "default", "examples")


class StringBounds:
    """The `maxLength` a string value may have at a path of keys and array positions: the largest
    that any of the schema's branches there allows, or None where one of them allows any length.
    Paths are few (one per string value of the schema), so each is worked out once."""

    def __init__(self, schema):
        self.root = schema
        self.any = '"maxLength"' in json.dumps(schema)
        self._memo: dict[tuple, int | None] = {}
        self._lock = threading.Lock()

    def at(self, path: tuple) -> int | None:
        with self._lock:
            if path not in self._memo:
                self._memo[path] = self._bound(path)
            return self._memo[path]

    def _bound(self, path: tuple) -> int | None:
        nodes = self._expand(self.root, 0)
        for step in path:
            nodes = [sub for node in nodes for sub in self._expand(self._child(node, step), 0)]
        bounds = []
        for node in nodes:
            if node is False:
                continue
            if not isinstance(node, dict) or node.get("type") != "string" or "pattern" in node or "format" in node:
                return None  # not a plain string here: its own regex holds it, or any length goes
            if "enum" in node or "const" in node:
                continue  # the automaton spells these out
            if not isinstance(node.get("maxLength"), int):
                return None
            bounds.append(node["maxLength"])
        return max(bounds) if bounds else None

    def _expand(self, node, depth: int) -> list:
        """The node and the subschemas it is made of ($ref, anyOf, oneOf, allOf), checked
        acyclic and bounded by check_schema."""
        if not isinstance(node, dict) or depth > MAX_DEPTH:
            return [node]
        combines = "$ref" in node or any(key in node for key in _BRANCHES)
        # a node that only combines others ({"anyOf": [...]}) says nothing of its own
        out = [node] if not combines or any(key in node for key in _OWN) else []
        if "$ref" in node:
            out += self._expand(_resolve(node["$ref"], self.root), depth + 1)
        for key in _BRANCHES:
            for sub in node.get(key) or []:
                out += self._expand(sub, depth + 1)
        return out

    @staticmethod
    def _child(node, step):
        if not isinstance(node, dict):
            return node  # true: anything; false: nothing
        if isinstance(step, str):
            if isinstance(node.get("properties"), dict):  # outlines-core writes the listed properties only
                return node["properties"].get(step, False)
            return node.get("additionalProperties", True) if not node.get("patternProperties") else True
        if step is None:
            return True
        prefix = node.get("prefixItems") or []
        return prefix[step] if step < len(prefix) else node.get("items", True)


def bounded_integers(schema):
    """Integers with a minimum and maximum at most 256 apart become an enum of the values: the
    regex a schema compiles to checks types and structure, not numeric bounds."""
    if isinstance(schema, list):
        return [bounded_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _LITERALS else bounded_integers(v) for k, v in schema.items()}
    low, high = out.get("minimum"), out.get("maximum")
    if out.get("type") == "integer" and isinstance(low, int) and isinstance(high, int) and 0 <= high - low <= 256:
        return {"enum": list(range(low, high + 1))}
    return out


def unbounded_strings(schema):
    """The schema with each plain string's maxLength left out: JsonSchemaConstraint holds those
    bounds while decoding, so that the automaton needs one state per string, not one per length."""
    if isinstance(schema, list):
        return [unbounded_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _LITERALS else unbounded_strings(v) for k, v in schema.items()}
    if out.get("type") == "string" and "pattern" not in out and "format" not in out:
        out.pop("maxLength", None)
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
