"""Train one expert from a spec and register it in experts/<name>/ with its manifest."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import torch

from opd.capabilities import get_capability
from opd.devices import dtype_tag, fp32_state, place
from opd.errors import OpdError
from opd.evaluation.api import evaluate
from opd.expert.spec import ExpertSpec
from opd.io import atomic_dir, atomic_write_json, state_dict_hash
from opd.manifest import EXPERTS_DIR, ExpertManifest, code_version
from opd.paths import history_dir, require_model_dir


def load_base(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """The base as (model, tokenizer), the model on `device` in `dtype` (read in float32, so a caller hashing
    the base's own weights hashes them before `place`); a clear error when it is missing or not a causal LM."""
    # lazy: transformers is slow to import
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    p = require_model_dir(path, "base", "build the lab base with `python scripts/build_base.py` or point "
                          "'base' at an HF model directory")
    try:
        config = AutoConfig.from_pretrained(p)
    except Exception as e:
        raise OpdError(f"base {p}: unreadable config.json ({e})") from None
    archs = config.architectures or []
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise OpdError(f"base {p}: architecture {archs or config.model_type!r} is not a causal LM "
                       "(GSPO needs *ForCausalLM, e.g. Qwen3ForCausalLM)")
    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(p)
    except Exception as e:
        raise OpdError(f"base {p}: could not be loaded ({type(e).__name__}: {e})") from None
    return place(model, torch.device(device), dtype), tok


def base_capabilities(base_dir: Path) -> list[str] | None:
    mf = Path(base_dir) / "manifest.json"
    if mf.exists():
        m = json.loads(mf.read_text())
        return m.get("capabilities") or m.get("spec", {}).get("capabilities")
    return None


def score_matrix(model, tok, caps: list[str], model_hash: str) -> dict:
    return {split: {c: s.__dict__ for c, s in evaluate(model, tok, caps, split, model_hash=model_hash).items()}
            for split in ("val", "test")}


def write_expert(spec: ExpertSpec, model, tok, state, base_dir: Path, base_hash: str,
                 out: Path, caps: list[str], log=print, extra: dict | None = None) -> dict:
    model.load_state_dict(state.best_model)
    model.eval()
    # the hash of the weights as a float32 reader loads them (the merge does), whatever dtype trained them
    h = state_dict_hash(fp32_state(model))
    log(f"scoring the kept checkpoint (step {state.best_step}) on {len(caps)} capabilities with lm-eval ...")
    metrics = score_matrix(model, tok, caps, h + dtype_tag(next(model.parameters()).dtype))
    cap = get_capability(spec.capability)
    manifest = {
        "kind": "expert", "name": spec.expert_name, "capability": spec.capability,
        "content_hash": h, "base": {"path": str(base_dir), "content_hash": base_hash},
        "reward": spec.reward, "spec": spec.model_dump(mode="json"),
        "data": {"seed": spec.seed, "split": "train", "difficulty": spec.difficulty or cap.default_difficulty,
                 "heldout": "val/test buckets of opd.capabilities.base.SPLIT_BUCKETS"},
        "code_version": code_version(), "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "metrics": metrics,
        "train": {"steps": state.step, "best_step": state.best_step, "best_val_screen": state.best_score,
                  "seconds": round(state.elapsed, 1), "history": state.history,
                  "device": str(next(model.parameters()).device),
                  "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")},
    }
    manifest.update(extra or {})  # e.g. the reward model a learned-reward expert trained on
    version_previous(out)
    manifest["version"] = _next_version(out)
    ExpertManifest.model_validate(manifest)  # what the merge engine will read back: fail here, not there
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / "manifest.json", manifest)
    return manifest


def version_previous(out: Path) -> None:
    """Keep an existing expert as an old version before a new one replaces it."""
    mf = out / "manifest.json"
    if not mf.exists():
        return
    old = json.loads(mf.read_text())
    dest = history_dir(out) / f"v{old.get('version', 1)}-{old['content_hash']}"
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)

        shutil.copytree(out, dest)


def _next_version(out: Path) -> int:
    h = history_dir(out)
    vs = [int(p.name[1:].split("-")[0]) for p in h.glob("v*-*")] if h.exists() else []
    return max(vs, default=0) + 1


def default_out(spec: ExpertSpec) -> Path:
    return EXPERTS_DIR / spec.expert_name
