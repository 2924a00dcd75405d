"""Model directories as inputs: any HF causal-LM directory fine-tuned from a base, with or without an
opd manifest, opened and checked against that base before any weights load.

An expert is named in a recipe (`experts:`) or a distillation run (`teachers:`) either as a plain
string (an opd expert: `experts/<name>/` or a path holding `manifest.json`) or as an entry
`{path: DIR, tasks: [...]}` for a fine-tune made by any tool (TRL, verl, the Hub). Before a weight is
read, `open_experts` compares every expert with the base in one line each: architecture
(config.json), every tensor's name and shape (safetensors headers only), and the tokenizer by content.
A BYO expert's content hash is `weights_hash` (the value `opd.io.state_dict_hash` gives the model
loaded in float32), computed once per version of its files and cached in $OPD_CACHE.

Every opened expert gets a typed record (`ExpertManifest`; kind "byo" for one without a manifest),
which the merge strategies and the weight-space methods read through `expert_record`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import safetensors
import torch
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from opd.errors import OpdError
from opd.io import atomic_write_json, tokenizer_hash
from opd.manifest import EXPERTS_DIR, ExpertManifest, load_manifest, resolve_expert
from opd.paths import NAME_PATTERN

# Files that hold weights: never read to key the tokenizer's cache entry.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
INDEX = "model.safetensors.index.json"
BYO = "byo"  # the record kind of an expert without an opd manifest


class ExpertEntry(BaseModel):
    """An expert given by its directory and the tasks it is an expert in (no opd manifest needed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str = Field(description="an HF causal-LM directory (config.json, safetensors weights, tokenizer) "
                      "fine-tuned from the base by any tool")
    tasks: list[str] | None = Field(None, min_length=1, description="the capabilities / tasks this expert is an "
                                    "expert in: prompts of these tasks are routed to it, and it is the reference "
                                    "the merge's retention is measured against (required without an opd manifest; "
                                    "default for an opd expert: its manifest's capability)")
    name: str | None = Field(None, pattern=NAME_PATTERN, description="how results and routes name it (default: "
                             "the directory's name; set it when two directories share one, e.g. checkpoint-500)")
    hub_id: str | None = Field(None, description="the Hub repo this directory was downloaded from (e.g. "
                               "org/model), listed as a base_model in merged models' cards")

    @field_validator("tasks")
    @classmethod
    def _distinct(cls, tasks):
        if tasks is not None and len(set(tasks)) != len(tasks):
            raise ValueError(f"lists a task twice: {tasks}")
        return tasks


# Told apart by shape, so that an error names the form the user wrote (a name, or an entry's field).
ExpertInput = Annotated[Annotated[str, Tag("name")] | Annotated[ExpertEntry, Tag("entry")],
                        Discriminator(lambda v: "name" if isinstance(v, str) else "entry")]


@dataclass(frozen=True)
class ModelHeader:
    """What a model directory declares, read without loading a weight."""

    path: Path
    model_type: str | None
    architectures: tuple[str, ...]
    tied: bool  # tie_word_embeddings: the head is the input embedding (absent from the files)
    tensors: dict[str, tuple[tuple[int, ...], str]]  # stored name -> (shape, safetensors dtype)
    files: tuple[Path, ...]  # the safetensors files, in name order

    def merge_names(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape as `opd.weights.merge.merge_keys` sees the loaded model: a tied head is
        the embedding's alias, which merge_keys drops, so it is left out whether or not a tool saved it."""
        drop = set(tied_aliases(self)) if self.tied else set()
        return {k: s for k, (s, _) in self.tensors.items() if k not in drop}


@dataclass(frozen=True)
class OpenedExpert:
    """An expert ready to load: its directory and its typed record."""

    name: str
    path: Path
    record: ExpertManifest

    @property
    def byo(self) -> bool:
        return self.record.kind == BYO


def read_header(path: str | os.PathLike, label: str) -> ModelHeader:
    """config.json and the safetensors headers (one file or a sharded index) of a model directory;
    OpdError naming `label` and the directory when it is not one."""
    from transformers import AutoConfig  # lazy: transformers is slow to import

    p = Path(path)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        why = "it does not exist" if not p.exists() else "no config.json in it"
        raise OpdError(f"{label} ({p}): not a model directory ({why}); give an HF model directory saved with "
                       "save_pretrained")
    try:
        # AutoConfig fills in the class defaults a saved config may leave out (tie_word_embeddings)
        cfg = AutoConfig.from_pretrained(p)
    except Exception as e:  # ValueError (unknown model_type), OSError, JSONDecodeError, ...
        first = (str(e).strip().splitlines() or [""])[0][:120]
        raise OpdError(f"{label} ({cfg_file}): unreadable config.json ({type(e).__name__}: {first})") from None
    index = p / INDEX
    if index.is_file():
        try:
            files = sorted({p / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise OpdError(f"{label} ({index}): unreadable shard index ({type(e).__name__})") from None
    else:
        files = sorted(p.glob("*.safetensors"))
    if not files:
        raise OpdError(f"{label} ({p}): no safetensors weights (model.safetensors or {INDEX}); save the model "
                       "with save_pretrained(safe_serialization=True)")
    tensors = {}
    for f in files:
        if not f.is_file():
            raise OpdError(f"{label} ({p}): {f.name} is listed in {INDEX} but missing")
        try:
            # safe_open reads the header only; get_slice gives shape and dtype without the data
            # (safetensors' Python API, safetensors/__init__.pyi)
            with safetensors.safe_open(str(f), "pt") as h:
                for k in h.keys():
                    s = h.get_slice(k)
                    tensors[k] = (tuple(s.get_shape()), s.get_dtype())
        except Exception as e:  # a torn or foreign file: safetensors raises its own error types
            raise OpdError(f"{label} ({f}): not a readable safetensors file ({type(e).__name__})") from None
    tied = getattr(cfg.get_text_config(), "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False))
    return ModelHeader(p, cfg.model_type, tuple(cfg.architectures or ()), bool(tied), tensors, tuple(files))


def tied_aliases(header: ModelHeader) -> dict[str, str]:
    """Tied head name -> the embedding it aliases, as the model class declares it (transformers 5's
    `_tied_weights_keys` is that dict, e.g. {'lm_head.weight': 'model.embed_tokens.weight'})."""
    import transformers  # lazy: transformers is slow to import

    cls = next((getattr(transformers, a, None) for a in header.architectures if hasattr(transformers, a)), None)
    keys = getattr(cls, "_tied_weights_keys", None)
    return dict(keys) if isinstance(keys, dict) else {"lm_head.weight": "model.embed_tokens.weight"}


def check_architecture(base: ModelHeader, other: ModelHeader, label: str) -> None:
    """One OpdError line naming `label`, its directory and how its architecture (config.json's
    model_type, architectures, tie_word_embeddings) differs from the base's."""
    if (other.model_type, other.architectures) != (base.model_type, base.architectures):
        raise OpdError(f"{label} ({other.path}) is a {list(other.architectures)} ({other.model_type}); the base "
                       f"({base.path}) is a {list(base.architectures)} ({base.model_type}): weight merging needs "
                       "one architecture")
    if other.tied != base.tied:
        raise OpdError(f"{label} ({other.path}): tie_word_embeddings is {other.tied}, the base's ({base.path}) is "
                       f"{base.tied}: a tied and an untied head cannot be merged tensor by tensor")


def check_tensors(base: ModelHeader, other: ModelHeader, label: str) -> None:
    """One OpdError line naming `label`, its directory and the tensors whose names or shapes differ
    from the base's (merge names: a tied head left out on both sides)."""
    mine, theirs = other.merge_names(), base.merge_names()
    missing = sorted(set(theirs) - set(mine))
    extra = sorted(set(mine) - set(theirs))
    shaped = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
    if missing or extra or shaped:
        parts = [f"{what} {ks[:3]}{' ...' if len(ks) > 3 else ''}" for what, ks in
                 (("missing", missing), ("not in the base", extra)) if ks]
        parts += [f"{k} is {list(mine[k])}, the base's {list(theirs[k])}" for k in shaped[:2]]
        raise OpdError(f"{label} ({other.path}): tensors missing or shaped unlike the base ({base.path}): "
                       f"{'; '.join(parts)}")


# -- content hashes, cached by the files' path, size and mtime ------------------------------------

def _cache_file() -> Path:
    return Path(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd")) / "content_hashes.json"


def _stat_key(files) -> list:
    out = []
    for f in sorted(Path(f).resolve() for f in files):
        st = f.stat()
        out.append([str(f), st.st_size, st.st_mtime_ns])
    return out


@contextlib.contextmanager
def _locked():
    path = _cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # several search workers may add entries at once
        yield path
    finally:
        os.close(fd)


def cached_hash(kind: str, directory: Path, files, compute):
    """`compute()` once per version of `files` (their absolute paths, sizes and mtimes), kept in
    $OPD_CACHE/content_hashes.json under `kind` and the directory (one entry each: a newer version
    replaces the older)."""
    key, stat = f"{kind}:{Path(directory).resolve()}", _stat_key(files)
    with _locked() as path:
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        hit = cache.get(key)
        if isinstance(hit, dict) and hit.get("files") == stat:
            return hit["hash"]
    value = compute()
    with _locked() as path:
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        cache[key] = {"files": stat, "hash": value}
        atomic_write_json(path, cache)
    return value


def weights_hash(header: ModelHeader) -> str:
    """The content hash of the weights in `header`'s files, streamed one tensor at a time: the value
    `opd.io.state_dict_hash` gives the model loaded in float32 (a tied head hashed as its embedding's
    alias), so a manifest-less copy of an opd expert hashes as its manifest says. Cached."""
    return cached_hash("weights", header.path, header.files, lambda: stream_weights_hash(header))


def stream_weights_hash(header: ModelHeader) -> str:
    """`weights_hash` without the cache: one tensor in memory at a time (float32, as loaded)."""
    where = {}  # state-dict name -> (file, stored name)
    handles = {}
    with contextlib.ExitStack() as stack:
        for f in header.files:
            h = handles[f] = stack.enter_context(safetensors.safe_open(str(f), "pt"))
            where.update({k: (f, k) for k in h.keys()})
        if header.tied:
            for alias, src in tied_aliases(header).items():
                if src in where:
                    where[alias] = where[src]
        digest = hashlib.sha256()
        for name in sorted(where):
            f, stored = where[name]
            t = handles[f].get_tensor(stored)
            if t.is_floating_point():
                t = t.to(torch.float32)  # as from_pretrained(dtype="float32") loads it
            t = t.contiguous()
            digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()[:16]


def tokenizer_content_hash(directory: Path, label: str) -> dict:
    """{"hash": `opd.io.tokenizer_hash` (every token's id, merges, added tokens), "ids": its size} of the
    tokenizer saved in `directory`: by content, never by path. Cached by the directory's non-weight files."""
    files = [f for f in Path(directory).iterdir() if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES)]

    def compute() -> str:
        from transformers import AutoTokenizer  # lazy: transformers is slow to import

        try:
            tok = AutoTokenizer.from_pretrained(directory)
        except Exception as e:  # OSError, ValueError, ...: no or a broken tokenizer
            first = (str(e).strip().splitlines() or [""])[0][:120]
            raise OpdError(f"{label} ({directory}): no usable tokenizer ({type(e).__name__}: {first}); save the "
                           "base's tokenizer beside the weights (tokenizer.save_pretrained)") from None
        return {"hash": tokenizer_hash(tok), "ids": len(tok)}

    return cached_hash("tokenizer", directory, files, compute)


# -- hub ids, for model cards ----------------------------------------------------------------------

_HUB_CACHE_DIR = re.compile(r"models--([\w.-]+)--([\w.-]+)$")


def hub_id(directory: str | os.PathLike, declared: str | None = None) -> str | None:
    """The Hub repo id a local model directory came from, or None: `declared` (a recipe field), a
    directory inside the HF hub cache (models--org--name/snapshots/<sha>), or config.json's
    `_name_or_path` when it names a repo id and not a local path. Offline: nothing is looked up."""
    # lazy: huggingface_hub is slow to import
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if declared:
        return declared
    p = Path(directory).resolve()
    for anc in (p, *p.parents):
        m = _HUB_CACHE_DIR.match(anc.name)
        if m:
            return f"{m.group(1)}/{m.group(2)}"
    try:
        name = json.loads((p / "config.json").read_text()).get("_name_or_path") or ""
    except (OSError, ValueError, AttributeError):
        return None
    if not name or name[0] in "/.~" or "\\" in name or name.count("/") != 1 or Path(name).exists():
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def write_model_card(out: str | os.PathLike, body: str, inputs: dict, tags: list[str]) -> None:
    """README.md of a model directory, written with huggingface_hub's ModelCard. `base_model` lists
    Hub ids only (inputs' `hub_id`: the Hub's model-card spec reserves it for them, and the Hub links
    the model tree through it); local paths stay in the body and the manifest."""
    from huggingface_hub import ModelCard, ModelCardData  # lazy: huggingface_hub is slow to import

    hub = list(dict.fromkeys(i["hub_id"] for i in [inputs["base"], *inputs.get("experts", {}).values(),
                                                    *inputs.get("teachers", {}).values()] if i.get("hub_id")))
    data = ModelCardData(library_name="transformers", tags=tags, base_model=hub or None)
    # ModelCard(content) keeps the text as given; its str is the front matter and the body
    # (huggingface_hub/repocard.py, RepoCard.__init__ and save)
    ModelCard(f"---\n{data.to_yaml()}\n---\n{body}").save(Path(out) / "README.md")


# -- experts: resolve, check against the base, give each a record ---------------------------------

_RECORDS: dict[str, ExpertManifest] = {}  # resolved directory -> record of an expert opened in this process


def expert_record(path: str | os.PathLike) -> ExpertManifest:
    """The record of the expert at `path`: the one `open_experts` gave it in this process (a BYO
    expert's, or an opd expert's with its recipe's tasks), else its manifest."""
    rec = _RECORDS.get(str(Path(path).resolve()))
    return rec if rec is not None else load_manifest(path)


def entry_name(entry: ExpertInput) -> str:
    """The name an expert entry goes by (before it is resolved: a plain string's last component)."""
    if isinstance(entry, ExpertEntry):
        return entry.name or Path(entry.path).resolve().name
    return Path(entry).name


def _resolve(entry: ExpertInput, experts_dir: Path) -> tuple[Path, ExpertEntry | None]:
    if isinstance(entry, ExpertEntry):
        return Path(entry.path), entry
    p = Path(entry)
    if (p / "config.json").is_file() and not (p / "manifest.json").exists():
        raise OpdError(f"expert {entry!r}: {p} has no opd manifest; list a model fine-tuned elsewhere as "
                       f"{{path: {entry}, tasks: [<the tasks it is an expert in>]}}")
    return resolve_expert(entry, experts_dir), None


def open_experts(entries: list[ExpertInput], base: str | os.PathLike, what: str = "expert",
                 experts_dir: str | os.PathLike = EXPERTS_DIR) -> dict[str, OpenedExpert]:
    """Resolve `entries`, check each against the base directory `base` (architecture, tensor names and
    shapes, tokenizer content: one OpdError line each, before any weight is read), then hash the
    BYO experts' weights (cached). Returns name -> OpenedExpert, in the entries' order."""
    base_header = read_header(base, "the base")
    resolved: dict[str, tuple[Path, ExpertEntry | None, bool]] = {}
    for e in entries:
        p, entry = _resolve(e, Path(experts_dir))
        p = p.resolve()
        name = (entry.name if entry and entry.name else None) or p.name
        label = f"{what} {name!r}"
        if name in resolved or name == "base":
            raise OpdError(f"{label} ({p}): the name {name!r} is used twice or reserved; give each {what} its own "
                           "name (an entry's name: field)")
        has_manifest = (p / "manifest.json").exists()
        if entry is not None and not has_manifest and not entry.tasks:
            raise OpdError(f"{label} ({p}): no opd manifest, so list the tasks it is an expert in: "
                           f"{{path: {entry.path}, tasks: [...]}}")
        resolved[name] = (p, entry, has_manifest)
    headers = {n: read_header(p, f"{what} {n!r}") for n, (p, _, _) in resolved.items()}
    want = tokenizer_content_hash(base_header.path, "the base")
    for n, h in headers.items():
        check_architecture(base_header, h, f"{what} {n!r}")
        # the tokenizer before the tensors: another vocabulary also reshapes the embedding, and is the cause
        got = tokenizer_content_hash(h.path, f"{what} {n!r}")
        if got["hash"] != want["hash"]:
            raise OpdError(f"tokenizer mismatch: {what} {n!r} ({h.path}: {got['ids']} ids, hash {got['hash']}) "
                           f"differs from the base's ({base_header.path}: {want['ids']} ids, hash {want['hash']}); "
                           "per-token scores and merges need one vocabulary")
        check_tensors(base_header, h, f"{what} {n!r}")
    out = {}
    for n, (p, entry, has_manifest) in resolved.items():
        hub = hub_id(p, entry.hub_id if entry else None)
        if has_manifest:
            rec = load_manifest(p)
            update = {"hub_id": hub or rec.hub_id}
            if entry is not None and entry.tasks:
                update["tasks"] = list(entry.tasks)
            rec = rec.model_copy(update=update)
        else:
            rec = ExpertManifest(kind=BYO, name=n, capability=entry.tasks[0], tasks=list(entry.tasks),
                                 content_hash=weights_hash(headers[n]), base=None, hub_id=hub)
        _RECORDS[str(p)] = rec
        out[n] = OpenedExpert(n, p, rec)
    return out
