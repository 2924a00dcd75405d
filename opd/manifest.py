"""Expert manifests: what produced an expert and how it scores, next to its weights.

Layout: `experts/<name>/` is an HF model directory (config, safetensors weights, tokenizer) plus
`manifest.json`. `experts/<name>.yaml` is the spec that trains it (opd.expert), and the merges,
RegMean's Gram matrices and the distillation runs read the manifest back: it sits below all of them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from opd.errors import OpdError, format_validation_error
from opd.paths import PROJECT

EXPERTS_DIR = PROJECT / "experts"


class ScoreEntry(BaseModel):
    model_config = ConfigDict(frozen=True)
    score: float
    stderr: float
    n: int


class BaseRef(BaseModel):
    model_config = ConfigDict(frozen=True)
    path: str
    content_hash: str


class ExpertManifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")

    kind: str = Field("expert", description="'expert' (trained by opd) or 'byo' (a fine-tune opened without a "
                      "manifest, opd.model_inputs)")
    name: str
    capability: str = Field(description="the capability this expert was trained on (a BYO expert: its first task)")
    tasks: list[str] = Field(default_factory=list, description="the tasks it is an expert in, which route prompts "
                             "to it and measure retention (default: [capability])")
    version: int = 1
    content_hash: str = Field(description="opd.io.state_dict_hash of the weights")
    base: BaseRef | None = Field(None, description="the base it was trained from (none for a BYO expert: it is "
                                 "checked against the base by architecture, tensors and tokenizer instead)")
    hub_id: str | None = Field(None, description="the Hub repo the weights came from, when known (model cards)")
    reward: str = "exact"
    spec: dict = Field(default_factory=dict, description="the resolved expert spec")
    data: dict = Field(default_factory=dict, description="data seeds, split, difficulty")
    code_version: str = "unknown"
    # metrics[split][capability] -> ScoreEntry, for split in {"val", "test"}; every lab capability
    metrics: dict[str, dict[str, ScoreEntry]] = Field(default_factory=dict)
    train: dict = Field(default_factory=dict, description="training statistics (steps, seconds, best step)")

    @model_validator(mode="before")
    @classmethod
    def _default_tasks(cls, data):
        if isinstance(data, dict) and not data.get("tasks") and data.get("capability"):
            data = {**data, "tasks": [data["capability"]]}
        return data

    @model_validator(mode="after")
    def _base_known(self):
        if self.base is None and self.kind != "byo":
            raise ValueError("field 'base': an opd expert's manifest records the base it was trained from")
        return self

    def own_score(self, split: str = "test") -> float:
        return self.metrics[split][self.capability].score


def load_manifest(expert_dir: str | Path) -> ExpertManifest:
    path = Path(expert_dir) / "manifest.json"
    if not path.exists():
        raise OpdError(f"{path}: no expert manifest (train it with scripts/train_expert.py)")
    try:
        return ExpertManifest.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValidationError) as e:
        msg = format_validation_error(str(path), e) if isinstance(e, ValidationError) else f"{path}: {e}"
        raise OpdError(msg) from None


def resolve_expert(name_or_path: str, experts_dir: str | Path = EXPERTS_DIR) -> Path:
    """An expert by name (`experts/<name>/`) or by path."""
    p = Path(name_or_path)
    if (p / "manifest.json").exists():
        return p
    q = Path(experts_dir) / name_or_path
    if (q / "manifest.json").exists():
        return q
    known = sorted(d.name for d in Path(experts_dir).glob("*/") if (d / "manifest.json").exists())
    raise OpdError(f"expert {name_or_path!r} not found in {experts_dir}; trained experts: {known or 'none'}")


def code_version() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except Exception:
        return "unknown"
