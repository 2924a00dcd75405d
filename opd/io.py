"""Atomic writes and content hashes: every artifact lands whole or not at all."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file


def pid_alive(pid: int) -> bool:
    """Whether a process of this machine with id `pid` exists (one of another user's counts: the kill
    signal 0 is refused, not unanswered)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file, or a directory entry list, to disk: a rename is only durable once both the
    renamed data and the directory that names it are."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (a temp artifact directory, before its rename)."""
    for d, _, files in os.walk(root):
        for f in files:
            fsync_path(os.path.join(d, f))
        fsync_path(d)


def sweep_stale(final: Path) -> None:
    """Clean up after a process killed inside `atomic_dir` or an atomic file write: drop its temp dirs
    and files, and if it died between the two renames (old moved away, new not yet in place) put the
    old version back."""
    for p in final.parent.glob(f".{final.name}.old-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            if final.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.rename(final)
    for p in final.parent.glob(f".{final.name}.tmp-*"):
        pid = p.name[len(f".{final.name}.tmp-"):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp directory next to `final`; on success it replaces `final` in one rename."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; an artifact directory is not
    try:
        yield tmp
        fsync_tree(tmp)
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            fsync_path(final.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
            fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _temp_file(path: Path) -> tuple[int, str]:
    """A temp file next to `path`, named with this pid so that a later write of `path` can sweep it
    away if this process is killed before the rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path)
    return tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    fd, tmp = _temp_file(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def atomic_write_file(path: str | os.PathLike, write, keep_previous: bool = False) -> None:
    """`write(tmp_path)` writes the file's content to a temp path beside `path`, which is then fsynced
    and renamed over `path`. `keep_previous`: the file being replaced stays as `previous_path(path)`,
    for `load_checkpoint` to fall back to if the new one turns out unreadable."""
    path = Path(path)
    fd, tmp = _temp_file(path)
    os.close(fd)
    try:
        write(tmp)
        fsync_path(tmp)
        if keep_previous and path.exists():
            # the previous version becomes a second name of the current file (a hard link) before the
            # new one replaces it, so `path` exists at every instant; where links are unsupported, a rename
            prev, link = previous_path(path), Path(f"{tmp}.prev")
            try:
                os.link(path, link)
                os.replace(link, prev)
            except OSError:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(link)
                os.replace(path, prev)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_torch_save(obj, path: str | os.PathLike, keep_previous: bool = False) -> None:
    atomic_write_file(path, lambda tmp: torch.save(obj, tmp), keep_previous)


def atomic_save_safetensors(tensors: dict, path: str | os.PathLike) -> None:
    atomic_write_file(path, lambda tmp: save_file(tensors, tmp))


@contextlib.contextmanager
def exclusive_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Hold an exclusive lock on directory `path` (an flock on `<path>/.lock`, released when the
    process dies): two processes never train into the same directory. Raises RuntimeError at once
    when another process holds it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"{path} is in use by another process (it holds {path / '.lock'}); "
                               "wait for it to finish") from None
        yield path
    finally:
        os.close(fd)


def previous_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint written with `keep_previous` and its previous version."""
    path = Path(path)
    for p in (path, previous_path(path)):
        p.unlink(missing_ok=True)


def torn_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.torn{path.suffix}")


def load_checkpoint(path: str | os.PathLike, log=print, safe_globals: list | None = None) -> dict | None:
    """The newest readable checkpoint of `path` and its previous version (`keep_previous`), or None.
    A torn or empty file (killed mid-write on a filesystem without ordering, a full disk) is skipped
    with a one-line warning instead of stopping the run until someone deletes it."""
    return next(readable_checkpoints(path, log, safe_globals), None)


def readable_checkpoints(path: str | os.PathLike, log=print, safe_globals: list | None = None) -> Iterator[dict]:
    """`path`'s checkpoint, then its previous version, each only if it can be read (see
    `load_checkpoint`); several ranks pick the latest step they all hold from these."""
    path = Path(path)
    for p in (path, previous_path(path)):
        if not p.exists():
            continue
        try:
            with torch.serialization.safe_globals(safe_globals or []):
                ck = torch.load(p, weights_only=True)
            if not isinstance(ck, dict):
                raise TypeError(f"holds a {type(ck).__name__}, not a checkpoint")
            yield ck
        except pickle.UnpicklingError as e:
            if "Unsupported global" not in str(e):  # torch/_weights_only_unpickler.py names a class it refuses so
                _unreadable(p, path, e, log)
            else:  # whole, but holding classes not allowed here (a DeepSpeed run's, read by a plain run): left alone
                log(f"warning: checkpoint {p} holds classes this run does not load (a DeepSpeed run's?); passed over")
        except Exception as e:  # EOFError, RuntimeError (torn zip), ...
            _unreadable(p, path, e, log)


def _unreadable(p: Path, path: Path, e: Exception, log) -> None:
    """Warn that checkpoint `p` (`path` or its previous version) cannot be read, and set `path` aside."""
    first = (str(e).strip().splitlines() or [""])[0][:120]
    fallback = "trying the previous one" if p == path and previous_path(path).exists() else "starting fresh"
    if p == path:  # set aside, or the next save would keep this torn file as the previous version
        with contextlib.suppress(OSError):
            os.replace(p, torn_path(p))
            fallback = f"moved to {torn_path(p).name}; {fallback}"
    log(f"warning: checkpoint {p} is unreadable ({type(e).__name__}: {first}); {fallback}")


def state_dict_hash(model_or_sd) -> str:
    """sha256 over parameter names, dtypes, shapes and bytes, in sorted name order (short hex)."""
    sd = model_or_sd.state_dict() if hasattr(model_or_sd, "state_dict") else model_or_sd
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def file_hash(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    """What makes two tokenizers interchangeable for per-token scores: the id of every token and,
    for a fast tokenizer, its merges and added tokens (short hex). Saving and reloading keeps it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        doc = json.loads(backend.to_str())
        key = {"model": doc.get("model"), "added": [(t["id"], t["content"]) for t in doc.get("added_tokens") or []]}
    else:
        key = {"vocab": sorted(tokenizer.get_vocab().items())}
    return text_hash(json.dumps(key, sort_keys=True))
