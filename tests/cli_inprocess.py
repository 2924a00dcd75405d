"""Run a CLI entry point in this process as a user's command would run: its exit code and stderr.

A fresh interpreter per bad-input case spends ~5 s importing torch and transformers before it reads
the one bad field; the error path is the same in process. tests/test_fuzz_inputs.py still runs every
script as a subprocess on malformed files."""

from __future__ import annotations

import contextlib
import io
import os
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace


def run_main(main: Callable[[list[str]], object], args: Sequence[object], cwd: str | Path) -> SimpleNamespace:
    """`main(args)` in `cwd` with stderr captured: `returncode` (SystemExit's code, 1 and a traceback on
    stderr if it raised anything else, as a subprocess would) and `stderr`."""
    err, old = io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:
                code = e.code
            except Exception:  # noqa: BLE001 - what a subprocess would print: a traceback, exit code 1
                traceback.print_exc(file=err)
                code = 1
    finally:
        os.chdir(old)
    return SimpleNamespace(returncode=code or 0, stderr=err.getvalue())
