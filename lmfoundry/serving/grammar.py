"""Constrained decoding: a JSON schema becomes a token-level automaton (outlines-core, the Rust
core of Outlines, which vLLM also uses), so a tool call's arguments always parse against the
tool's schema.

`JsonSchemaConstraint` follows one generation: `allowed()` lists the token ids that keep the
text inside the schema's language, `advance(token)` moves on, `done()` says the JSON is
complete. Indexes are built once per (schema, tokenizer) and cached: building one walks the
whole vocabulary through the schema's regular expression.
"""

from __future__ import annotations

import functools
import json

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


class Grammars:
    """Per tokenizer: the outlines-core vocabulary, and an index per schema (LRU-cached)."""

    def __init__(self, tokenizer: Tokenizer, eos_id: int, cache_size: int = 64):
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, raw in token_bytes(tokenizer).items():
            by_bytes.setdefault(raw, []).append(token_id)
        self.vocabulary = Vocabulary(eos_id, by_bytes)
        self._index = functools.lru_cache(maxsize=cache_size)(self._build)

    def _build(self, schema_json: str) -> Index:
        try:
            regex = build_regex_from_schema(schema_json, WHITESPACE)
        except Exception as e:  # the Rust side raises plain ValueErrors/RuntimeErrors with its reason
            raise ValueError(f"the JSON schema cannot be compiled for constrained decoding: {e}") from None
        return Index(regex, self.vocabulary)

    def constraint(self, schema: dict) -> JsonSchemaConstraint:
        return JsonSchemaConstraint(Guide(self._index(json.dumps(bounded_integers(schema), sort_keys=True))))


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
