"""User-facing errors and the CLI wrapper that turns them into one line and exit code 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

import pydantic

T = TypeVar("T")


class OpdError(Exception):
    """A problem the user can fix (bad input, missing file). Printed as one line, exit 2."""


def format_validation_error(source: str, err: pydantic.ValidationError, prefix: str = "") -> str:
    """One line naming the file, the first bad field and what is allowed (`prefix`: the section of the
    file that was validated, put in front of the field's name)."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(first["loc"])) or "<root>"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown field (remove it or check its spelling)"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{source}: field '{loc}': {msg}{more}"


def naming_file(path, fn: Callable[..., T], *args, **kwargs) -> T:
    """Call `fn`; an OpdError that does not name the input file `path` gets it in front."""
    try:
        return fn(*args, **kwargs)
    except OpdError as e:
        if str(path) in str(e):
            raise
        raise OpdError(f"{path}: {e}") from None


def cli_main(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate a CLI entry point: OpdError -> one line on stderr, exit code 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OpdError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper
