"""`lmfoundry config show STAGE`: every key of a stage's config, with its type, default and
description (nested sections as dotted keys), as the stage's recipes may set them.

    lmfoundry config show serve
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import types
import typing

from pydantic import BaseModel

from lmfoundry.platform.cli import COMMANDS


def stage_config(stage: str) -> type[BaseModel]:
    module, _, name = COMMANDS[stage].config.partition(":")
    return getattr(importlib.import_module(module), name)


def _section(annotation) -> tuple[type[BaseModel], str] | None:
    """The config class of a nested section and how its keys hang below the parent key:
    `X` and `X | None` as `key.`, `list[X]` as `key[].`, `dict[str, X]` as `key.NAME.`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, "."
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return _section(rest[0]) if len(rest) == 1 else None
    inner = _section(args[-1]) if origin in (list, dict) and args else None
    if inner is None or inner[1] != ".":
        return None
    return inner[0], "[]." if origin is list else ".NAME."


def _type_name(annotation) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    text = str(annotation).replace("typing.", "").replace("NoneType", "None")
    return re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", text)  # lmfoundry.serving.app.ModelVersion -> ModelVersion


def _bounds(field) -> str:
    """The numeric and length bounds pydantic enforces (ge=1, le=8, ...)."""
    out = []
    for m in field.metadata:
        for attr in ("gt", "ge", "lt", "le", "min_length", "max_length", "pattern"):
            value = getattr(m, attr, None)
            if value is not None:
                out.append(f"{attr}={value}")
    return ", ".join(out)


def _default(field) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    return json.dumps(value, default=str)


def config_rows(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every key, a nested section's keys after it."""
    rows = []
    for name, field in cls.model_fields.items():
        key = prefix + name
        bounds = _bounds(field)
        description = " ".join(filter(None, [field.description or "", f"({bounds})" if bounds else ""]))
        rows.append((key, _type_name(field.annotation), _default(field), description))
        section = _section(field.annotation)
        if section is not None:
            rows += config_rows(section[0], key + section[1])
    return rows


def format_rows(rows: list[tuple[str, str, str, str]]) -> str:
    head = ("KEY", "TYPE", "DEFAULT", "DESCRIPTION")
    widths = [min(48, max(len(r[i]) for r in [head, *rows])) for i in range(3)]
    lines = []
    for r in [head, *rows]:
        cells = [r[i].ljust(widths[i]) for i in range(3)]
        lines.append("  ".join([*cells, r[3]]).rstrip())
    return "\n".join(lines)


def main(argv=None) -> int:
    stages = sorted(s for s, c in COMMANDS.items() if c.is_stage)
    p = argparse.ArgumentParser(
        prog="lmfoundry config", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="a stage's config keys, types, defaults and descriptions")
    show.add_argument("stage", choices=stages)
    args = p.parse_args(argv)
    print(format_rows(config_rows(stage_config(args.stage))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
