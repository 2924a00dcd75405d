"""Load a YAML file (plus dotted key=value overrides) into a frozen pydantic model, with errors
that name the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from opd.errors import OpdError, format_validation_error

M = TypeVar("M", bound=BaseModel)


def apply_overrides(raw: dict, overrides: list[str] | dict) -> dict:
    """Set dotted keys in `raw` in place: ["gspo.lr=1e-3"] or {"gspo.lr": "1e-3"}; values are YAML."""
    items = overrides.items() if isinstance(overrides, dict) else (_split(o) for o in overrides)
    for key, value in items:
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise OpdError(f"override {key!r}: {p!r} is not a mapping")
        node[leaf] = yaml.safe_load(value) if isinstance(value, str) else value
    return raw


def parse_overrides(items: list[str]) -> dict[str, str]:
    """Command-line `key=value` words as {dotted key: YAML text}; a word without '=' is an error."""
    return dict(_split(i) for i in items)


def _split(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise OpdError(f"override {item!r}: expected key=value (dotted keys for nested fields)")
    return key, value


def load_yaml_model(path: str | Path, model: type[M], what: str, overrides: list[str] | dict = (),
                    defaults: dict | None = None) -> M:
    """`what` names the kind of file in errors ("expert spec", "merge recipe", ...)."""
    path = Path(path)
    if not path.exists():
        raise OpdError(f"{path}: {what} not found")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OpdError(f"{path}: cannot be read as UTF-8 text ({type(e).__name__})") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise OpdError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise OpdError(f"{path}: expected a mapping of fields at the top level")
    for k, v in (defaults or {}).items():
        raw.setdefault(k, v)
    apply_overrides(raw, overrides)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise OpdError(format_validation_error(str(path), e)) from None
    except OpdError as e:
        raise OpdError(f"{path}: {e}") from None
