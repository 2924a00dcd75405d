"""Where artifacts may be written and what a model path must be: checked before anything is loaded.

A name (expert, recipe, run) is one path component. An output directory lies under an allowed root
(the project's `runs/` and `experts/`, the same under the working directory, or a root named in
`OPD_OUTPUT_ROOTS`), and an existing one is replaced only when it holds an artifact of the same kind.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from opd.errors import OpdError

# One path component: no separator, no leading dot ('.', '..', '.history' and temp names are not names).
NAME_PATTERN = r"^[\w-][\w.-]*$"
NAME_HELP = "letters, digits, '_', '-', '.' and no leading '.'"
PROJECT = Path(__file__).resolve().parents[1]
ROOTS_ENV = "OPD_OUTPUT_ROOTS"


def check_name(name: str) -> str:
    """For pydantic validators: a ValueError that the loader turns into one line naming the field."""
    if not re.match(NAME_PATTERN, name):
        raise ValueError(f"{name!r} is not a plain name ({NAME_HELP})")
    return name


def allowed_roots(extra: tuple[str | os.PathLike, ...] = ()) -> list[Path]:
    roots = [PROJECT / "runs", PROJECT / "experts", Path.cwd() / "runs", Path.cwd() / "experts"]
    roots += [Path(p) for p in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    roots += [Path(p) for p in extra]
    return list(dict.fromkeys(r.resolve() for r in roots))


def manifest_kind(d: Path) -> str | None:
    try:
        return json.loads((d / "manifest.json").read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def check_output(path: str | os.PathLike, field: str, kind: str | None = None, markers: tuple[str, ...] = (),
                 roots: tuple[str | os.PathLike, ...] = ()) -> Path:
    """`path` when it may be written: strictly under an allowed root (symlinks followed), not hidden,
    and, if it exists and is not empty, holding a manifest of `kind` or one of the `markers` files.
    Otherwise an OpdError naming `field` and the fix. Nothing is created."""
    p = Path(path)
    real = p.resolve()
    allowed = allowed_roots(roots)
    root = next((r for r in allowed if real != r and real.is_relative_to(r)), None)
    if root is None:
        raise OpdError(f"{field} {str(path)!r}: resolves to {real}, outside the allowed output roots (runs/ and "
                       f"experts/ of the project or the working directory); write there, or add the root to "
                       f"{ROOTS_ENV}")
    if any(part.startswith(".") for part in real.relative_to(root).parts):
        raise OpdError(f"{field} {str(path)!r}: a hidden directory (temp files, checkpoints, .history) is not "
                       "an output; choose a plain name")
    if p.is_symlink():
        raise OpdError(f"{field} {str(path)!r}: is a symbolic link; give the real directory")
    if real.exists():
        if not real.is_dir():
            raise OpdError(f"{field} {str(path)!r}: exists and is not a directory; choose another {field}")
        if any(real.iterdir()) and not (kind and manifest_kind(real) == kind) \
                and not any((real / m).exists() for m in markers):
            what = f"an opd {kind}" if kind else "an opd run directory"
            raise OpdError(f"{field} {str(path)!r}: exists and does not hold {what}; it would be replaced: "
                           f"choose another {field} or move that directory away")
    return p


def history_dir(out: Path) -> Path:
    """Where a replaced expert is kept: `experts/.history/<path below experts/>` when `out` lies under a
    directory named experts/, else `.history/<name>` next to it."""
    real = Path(out).resolve()
    for anc in real.parents:
        if anc.name == "experts":
            return anc / ".history" / real.relative_to(anc)
    return Path(out).parent / ".history" / Path(out).name


def require_model_dir(path: str | os.PathLike, field: str, fix: str) -> Path:
    """A local HF model directory (config.json inside), or one line naming the field and the fix. A
    relative path is never read as a hub model id."""
    p = Path(path)
    if not (p / "config.json").is_file():
        why = "it does not exist" if not p.exists() else "not found in it"
        where = "" if p.is_absolute() else f", looked in {p.resolve()}"
        raise OpdError(f"field '{field}': {str(path)!r} is not a model directory (no config.json: {why}{where}); "
                       f"{fix}")
    return p


def redact_url(url: str | None) -> str | None:
    """A database URL with its password replaced by '***' (user@host stays, for the reader to recognise)."""
    if url is None:
        return None
    return re.sub(r"(://[^/@:]*:)[^/?#]*@", r"\1***@", url)


def require_same_tokenizer(reference: tuple[str, object], others: dict[str, str | os.PathLike]) -> None:
    """Refuse, in one line and before any model loads, a model directory whose tokenizer differs from
    `reference` = (label, tokenizer): per-token log-probs and KL compare ids, so one vocabulary only.
    `others`: label -> model directory."""
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    from opd.io import tokenizer_hash  # lazy: opd.io loads torch and numpy

    label, tok = reference
    want = tokenizer_hash(tok)
    for name, path in others.items():
        other = AutoTokenizer.from_pretrained(path)
        got = tokenizer_hash(other)
        if got != want:
            raise OpdError(f"tokenizer mismatch: {name} ({path}: {len(other)} ids, hash {got}) differs from {label}'s "
                           f"({len(tok)} ids, hash {want}); per-token scores need one vocabulary")
