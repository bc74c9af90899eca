"""Typed stage configs: YAML recipes validated by pydantic, with `--set a.b=c` overrides.

Every stage has one small config model (extra keys forbidden). A mistake in a recipe fails
before any Ray work starts with one message naming the file, the key and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

Cfg = TypeVar("Cfg", bound="StageConfig")


class StageFailed(RuntimeError):
    """The stage ran to the end and judged its own result a failure (e.g. a failed checklist)."""


class ConfigError(ValueError):
    """A recipe or override that does not fit its stage's config model."""


class StageConfig(BaseModel):
    """Base of every stage config: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set train.max_steps=50")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: the key must be dotted names, e.g. model.n_layer")
    # YAML parsing gives `--set a=3` an int, `--set a=[1,2]` a list and `--set a=x` a string.
    return key.split("."), yaml.safe_load(raw) if raw != "" else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names allowed at `loc` (the location pydantic reports), for the error message."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return sorted(model.model_fields)


def format_validation_error(cls: type[BaseModel], err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source} for {cls.__name__}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(cls, e["loc"]))
            lines.append(f"  key {key!r}: unknown key; allowed keys here: {allowed}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  key {key!r}: {e['msg']}{shown}")
    return "\n".join(lines)


def build_config(cls: type[Cfg], data: dict, source: str = "<dict>", overrides: list[str] | None = None) -> Cfg:
    data = apply_overrides(dict(data), overrides or [])
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(cls, err, source)) from None


def read_recipe(path: str | Path) -> dict:
    """The mapping in a YAML recipe, or a ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, not {type(data).__name__}")
    return data


def load_config(cls: type[Cfg], path: str | Path, overrides: list[str] | None = None) -> Cfg:
    """Read a YAML recipe into `cls`, applying `--set` overrides first."""
    return build_config(cls, read_recipe(path), source=str(path), overrides=overrides)
