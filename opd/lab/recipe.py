"""The lab's recipe: a merge recipe (opd.merge.recipe) plus the `train:` section that says how the lab
trains its experts. One YAML file holds both, as users write them in merge_recipes/: `opd merge`
reads it as a MergeRecipe and leaves `train:` unread; `opd lab` reads it as a LabRecipe."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from opd.cluster import ClusterSettings
from opd.config import apply_overrides
from opd.errors import OpdError, format_validation_error
from opd.expert.spec import ExpertSpec
from opd.lab.reward_models import reward_model_settings
from opd.merge.recipe import MergeRecipe, Scalar, load_recipe


class LabTraining(BaseModel):
    """How `opd lab` (`scripts/lab.py`) trains a recipe's experts: the `train:` section of a merge
    recipe; the merge search itself ignores it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    overrides: dict[str, Scalar] = Field(default_factory=dict, description="dotted expert-spec overrides "
                                         "applied to every experts/<name>.yaml, e.g. {max_minutes: 3}; list "
                                         "the experts as paths (experts/lab10/add) so that such experts get "
                                         "their own directory and never replace the default versions")
    jobs: int = Field(1, gt=0, description="experts trained at once, one process each (--jobs overrides)")
    cluster: ClusterSettings = Field(default_factory=ClusterSettings, description="where the experts train: "
                                     "{engine: local} (default, `jobs` at once) or {engine: ray, address: auto | "
                                     "ray://host:port | host:port} (one Ray task per expert; --ray overrides)")
    base: dict[str, Scalar] = Field(default_factory=dict, description="overrides of the lab's base spec "
                                    "(opd/lab/base.yaml) for the lab's base stage, which builds the recipe's "
                                    "`base` directory, e.g. {tokenizer: bpe} for a BPE lab; checked against "
                                    "the base spec when scripts/lab.py loads the recipe")

    reward_models: dict[str, dict[str, Scalar | dict[str, Scalar]]] = Field(
        default_factory=dict, description="per learned-reward capability, the settings its reward model is fitted "
        "with before the experts train (opd.capabilities.reward_model.RewardModelSettings, e.g. {anagram: {init: "
        "scratch}}); the lab fits each learned-reward expert's reward model that is missing or not up to date")

    @field_validator("reward_models")
    @classmethod
    def _valid_reward_models(cls, reward_models):
        for cap, settings in reward_models.items():
            try:
                reward_model_settings(cap, dict(settings))
            except ValidationError as e:
                err = e.errors()[0]
                raise ValueError(f"{cap}.{'.'.join(map(str, err['loc']))}: {err['msg']} (the settings are in "
                                 "opd/capabilities/reward_model.py RewardModelSettings)") from None
            except OpdError as e:
                raise ValueError(f"{cap}: {e}") from None
        return reward_models

    @field_validator("overrides")
    @classmethod
    def _valid_for_specs(cls, overrides):
        try:
            ExpertSpec.model_validate(apply_overrides({"capability": "count"}, dict(overrides)))
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"{'.'.join(map(str, err['loc']))!r}: {err['msg']} (an expert spec's fields "
                             "are in opd/expert/spec.py)") from None
        except OpdError as e:
            raise ValueError(str(e)) from None
        return overrides


class LabRecipe(BaseModel):
    """A merge recipe as the lab reads it: the merge search's part, and the lab's training part."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    merge: MergeRecipe = Field(description="the whole file as `opd merge` reads it")
    train: LabTraining = Field(default_factory=LabTraining, description="its `train:` section, checked")


def load_lab_recipe(path: str | Path, overrides: list[str] = ()) -> LabRecipe:
    """The file as a merge recipe (errors as `opd merge` gives them), then its `train:` section as the
    lab's training settings (an error names the file and the field under `train.`)."""
    merge = load_recipe(path, overrides)
    try:
        train = LabTraining.model_validate(merge.train)
    except ValidationError as e:
        raise OpdError(format_validation_error(str(path), e, prefix="train")) from None
    return LabRecipe(merge=merge, train=train)
