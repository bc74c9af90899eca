"""Text that crosses an API into the model or a store: what neither can take.

JSON lets a client send `\\ud800` (half of a UTF-16 pair, no character) and `\\u0000`; the
tokenizer cannot encode the first, PostgreSQL's text columns refuse the second, and SQLite's
driver cannot encode the first either. Every API that takes text refuses both with a 4xx naming
the field, instead of failing later with a 500.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, model_validator

_UNUSABLE = re.compile("[\x00\ud800-\udfff]")


def text_problem(text: str) -> str | None:
    """What makes a string unusable as model or stored text, or None."""
    bad = _UNUSABLE.search(text)
    if bad is None:
        return None
    if bad.group() == "\x00":
        return "contains a NUL character (\\u0000), which is not allowed in text"
    return f"contains a lone UTF-16 surrogate (\\u{ord(bad.group()):04x}); text must be valid Unicode"


def check_texts(data) -> None:
    """Raise a ValueError naming the first string (value or key) anywhere in a request body that
    `text_problem` refuses. Iterative: a body may be nested as deep as the JSON parser allows."""
    stack = [("", data)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem:
                raise ValueError(f"{where or 'body'}: {problem}")
        elif isinstance(item, dict):
            for key, value in item.items():
                path = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and (problem := text_problem(key)):
                    raise ValueError(f"{where or 'body'}: a key {problem}")
                stack.append((path, value))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", value) for i, value in enumerate(item))


class TextBody(BaseModel):
    """A request body whose every string (values and keys, at any depth) is usable text: a
    refused one is a validation error naming the field, not a 500 from the store below."""

    @model_validator(mode="before")
    @classmethod
    def _usable_texts(cls, data):
        check_texts(data)
        return data


def storable(text: str | None) -> str | None:
    """`text` with each NUL and lone surrogate replaced by U+FFFD: for text a model wrote (a
    byte-level tokenizer can decode a 0x00 byte), which a store must keep rather than refuse."""
    return None if text is None else _UNUSABLE.sub("\ufffd", text)
