"""Build the lab's base model: pre-train from scratch on a capability mix, keep a *mediocre* checkpoint.

The base must leave room for RL experts, so the kept checkpoint is the one with the most
capabilities inside the target band on the validation split (not the best or the last one).
Resumable: a checkpoint is written at every evaluation; rerunning continues from it.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from opd.capabilities import get_capability
from opd.config import load_yaml_model
from opd.devices import DeviceName, DtypeName, fp32_state, place, resolve_device, resolve_dtype
from opd.errors import OpdError
from opd.evaluation.api import evaluate
from opd.io import (
    atomic_dir,
    atomic_torch_save,
    atomic_write_json,
    load_checkpoint,
    state_dict_hash,
    tokenizer_hash,
)
from opd.lab.data import MixtureStream, encode_sft
from opd.lab.model import ModelShape, build_model
from opd.lab.tokenizer import BPE_CORPUS_ITEMS, SPECIALS, build_char_tokenizer, train_bpe_tokenizer
from opd.schedule import lr_at
from opd.tracking import REPORT_TO_HELP, ReportTo, open_tracker, tracking_dir

DEFAULT_SPEC = Path(__file__).with_name("base.yaml")


class BaseSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("lab-base", description="name written into the model card")
    seed: int = Field(0, description="seed for weights init and the data stream")
    shape: ModelShape = Field(default_factory=ModelShape)
    tokenizer: Literal["char", "bpe"] = Field("char", description="'char': one id per character; 'bpe': a "
                                               "byte-level BPE trained on this spec's mixture stream")
    bpe_vocab_size: int = Field(512, gt=len(SPECIALS) + 256, le=4096,
                                description="ids of the BPE (4 specials + 256 bytes + merges); unused with 'char'")
    bpe_split: Literal["qwen2", "gpt2"] = Field("qwen2", description="the BPE's pre-tokenizer split: 'qwen2' "
                                                 "(Qwen2/3's regex: every digit its own word, as Qwen and "
                                                 "Llama split numbers) or 'gpt2' (digit runs merge, e.g. "
                                                 "'124' -> '12','4'); unused with 'char'")
    capabilities: list[str] = Field(description="capabilities screened on validation to choose the kept checkpoint")
    scored: list[str] | None = Field(None, description="the lab's capabilities: what experts and reports score "
                                     "(default: capabilities); tasks that stay at chance are left out here")
    mixture: dict[str, float] = Field(description="pre-training mixture weights per capability")
    difficulty: dict[str, int] = Field(default_factory=dict, description="difficulty overrides per capability")
    steps: int = Field(3000, gt=0, description="optimizer steps (upper bound; see patience)")
    patience: int | None = Field(None, gt=0, description="stop after this many validation screenings in a row "
                                 "that did not beat the kept checkpoint (None: train all `steps`); the kept "
                                 "checkpoint is the same as a full run's unless a later one would have beaten it")
    batch_size: int = Field(64, gt=0)
    lr: float = Field(2e-3, gt=0, description="peak learning rate (AdamW)")
    warmup: int = Field(100, ge=0)
    lr_floor: float = Field(0.1, ge=0, le=1, description="final lr as a fraction of the peak (cosine)")
    weight_decay: float = Field(0.0, ge=0)
    eval_every: int = Field(250, gt=0, description="steps between validation screenings")
    eval_limit: int = Field(100, gt=0, description="validation items per capability when screening")
    band: tuple[float, float] = Field((0.12, 0.55), description="target score band for the kept base")
    threads: int = Field(2, gt=0, description="torch CPU threads")
    device: DeviceName = Field("auto", description="where the base trains: 'auto' (the GPU when there is one, "
                               "else the CPU), 'cpu', 'cuda' or 'cuda:N' (not part of the build's identity)")
    dtype: DtypeName = Field("auto", description="the weights while training: 'float32', 'bfloat16' or 'auto' "
                             "(bfloat16 on a GPU that computes in it, else float32)")
    report_to: ReportTo = Field("tensorboard", description=REPORT_TO_HELP)

    @model_validator(mode="after")
    def _check(self):
        for c in list(self.capabilities) + list(self.mixture) + list(self.difficulty) + list(self.scored or []):
            get_capability(c)
        bad = sorted(c for c, d in self.difficulty.items() if d < 0)
        if bad:
            raise ValueError(f"difficulty of {bad}: must be >= 0")
        if not 0 <= self.band[0] < self.band[1] <= 1:
            raise ValueError("band must be (low, high) with 0 <= low < high <= 1")
        return self


    @property
    def lab_capabilities(self) -> list[str]:
        return list(self.scored or self.capabilities)

    def training_fields(self) -> dict:
        """The fields that determine the weights (reporting fields excluded): the build cache key."""
        # threads, device: how fast, not what (a base built on 1 thread is reused on 2, and resumes there).
        # dtype: recorded only where it is not float32, so a build keyed before the field existed keeps its key.
        exclude = {"scored", "report_to", "threads", "device", "dtype"} | (
            {"bpe_vocab_size", "bpe_split"} if self.tokenizer == "char" else set())
        fields = self.model_dump(mode="json", exclude=exclude)
        dtype = resolve_dtype(self.dtype, resolve_device(self.device))
        return fields if dtype == torch.float32 else {**fields, "dtype": str(dtype).removeprefix("torch.")}


def build_tokenizer(spec: BaseSpec):
    """The spec's tokenizer; a BPE learns from items of the spec's own mixture (a stream seeded apart
    from the training stream's, so building it draws nothing from that one)."""
    if spec.tokenizer == "char":
        return build_char_tokenizer()
    items = MixtureStream(spec.mixture, spec.difficulty, seed=f"bpe|{spec.seed}").next_batch(BPE_CORPUS_ITEMS)
    return train_bpe_tokenizer(items, spec.bpe_vocab_size, split=spec.bpe_split)


def same_training(stored: dict | None, spec: BaseSpec) -> bool:
    """Whether recorded training fields are `spec`'s; a field added since takes its default."""
    try:
        # recorded fields hold no dtype where it was float32 (and before the field existed)
        return stored is not None and \
            BaseSpec.model_validate({"dtype": "float32", **stored}).training_fields() == spec.training_fields()
    except Exception:
        return False


def load_base_spec(path: str | Path = DEFAULT_SPEC, **overrides) -> BaseSpec:
    return load_yaml_model(path, BaseSpec, "base spec", overrides)


def band_key(scores: dict[str, float], band: tuple[float, float]) -> tuple:
    """Rank checkpoints: most capabilities in band, then mean closest to the band's middle."""
    lo, hi = band
    inside = sum(lo <= s <= hi for s in scores.values())
    mean = sum(scores.values()) / max(1, len(scores))
    return (inside, -abs(mean - (lo + hi) / 2))


def _out_of_patience(state: dict, spec: BaseSpec) -> bool:
    """Whether the last `spec.patience` screenings all came after the kept checkpoint."""
    if spec.patience is None or state["best"] is None:
        return False
    return sum(h["step"] > state["best"]["step"] for h in state["history"]) >= spec.patience


def build_base(spec: BaseSpec, out: str | Path, *, progress=None, log=print) -> dict:
    """Train (or resume) the base; write the kept checkpoint to `out` as an HF model directory."""
    out = Path(out)
    ckpt_path = out.parent / f".{out.name}.ckpt" / "state.pt"
    torch.set_num_threads(spec.threads)
    tok = build_tokenizer(spec)
    device = resolve_device(spec.device)
    model = place(build_model(spec.shape, tok, spec.seed), device, resolve_dtype(spec.dtype, device))
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95))
    stream = MixtureStream(spec.mixture, spec.difficulty, seed=spec.seed)
    torch.manual_seed(spec.seed)
    state = {"step": 0, "best": None, "history": [], "elapsed": 0.0}
    ck = load_checkpoint(ckpt_path, log)
    if ck is not None:
        if not same_training(ck.get("spec"), spec):
            raise OpdError(f"{ckpt_path}: checkpoint was made by another spec; delete it to start over")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        stream.load_state(ck["stream"])
        torch.set_rng_state(ck["torch_rng"])
        state = ck["state"]
        log(f"resuming base build at step {state['step']}")
        if progress:  # the bar starts where the run had got to
            progress(state["step"], spec.steps, float("nan"))
    t0 = time.time() - state["elapsed"]
    model.train()
    with open_tracker(spec.report_to, tracking_dir(out), spec.name, spec.model_dump(mode="json")) as tracker:
        while state["step"] < spec.steps and not _out_of_patience(state, spec):
            step = state["step"]
            for g in opt.param_groups:
                g["lr"] = lr_at(step, spec.steps, spec.lr, spec.warmup, spec.lr_floor)
            batch = {k: v.to(device) for k, v in encode_sft(tok, stream.next_batch(spec.batch_size)).items()}
            loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            state["step"] = step + 1
            tracker.log({"loss": loss.item(), "lr": opt.param_groups[0]["lr"]}, state["step"])
            if progress:
                progress(state["step"], spec.steps, loss.item())
            if state["step"] % spec.eval_every == 0 or state["step"] == spec.steps:
                scores = {c: s.score for c, s in evaluate(model, tok, spec.capabilities, "val", limit=spec.eval_limit).items()}
                key = band_key(scores, spec.band)
                state["history"].append({"step": state["step"], "loss": loss.item(), "val": scores,
                                         "in_band": key[0], "time": time.time() - t0})
                tracker.log({"val": scores, "in_band": key[0]}, state["step"])
                if state["best"] is None or key > tuple(state["best"]["key"]):
                    state["best"] = {"key": list(key), "step": state["step"], "val": scores,
                                     "model": copy.deepcopy(model.state_dict())}
                log(f"step {state['step']}: loss {loss.item():.3f}, in band {key[0]}/{len(scores)} "
                    + " ".join(f"{c}={s:.2f}" for c, s in scores.items()))
                if _out_of_patience(state, spec):
                    log(f"stopping at step {state['step']}: {spec.patience} screenings without a better checkpoint "
                        f"than step {state['best']['step']} (patience)")
                state["elapsed"] = time.time() - t0
                atomic_torch_save({"spec": spec.training_fields(), "model": model.state_dict(),
                                   "optim": opt.state_dict(), "stream": stream.state(),
                                   "torch_rng": torch.get_rng_state(), "state": state}, ckpt_path, keep_previous=True)
    best = state["best"]
    model.load_state_dict(best["model"])
    model.eval()
    manifest = {
        "kind": "base", "name": spec.name, "spec": spec.training_fields(), "capabilities": spec.lab_capabilities,
        "kept_step": best["step"], "val_screen": best["val"], "history": state["history"],
        "content_hash": state_dict_hash(fp32_state(model)), "tokenizer": spec.tokenizer, "tokenizer_hash": tokenizer_hash(tok),
        "train_seconds": state["elapsed"],
    }
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / "manifest.json", manifest)
    return manifest
