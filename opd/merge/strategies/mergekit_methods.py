"""mergekit's merge methods as strategies, keyed by mergekit's name: one `MergeStrategy` each.

A merge's weights are a function of the inputs' weights alone: `build` merges in memory
(opd.weights.merge), the model card carries the mergekit YAML that rebuilds it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergekit import merge_methods as mm
from pydantic import ValidationError

from opd.errors import OpdError
from opd.merge.strategies.base import BuildContext, MergeInputs, ModelCard, Strategy
from opd.weights.lazy import state_dict_bytes
from opd.weights.merge import BASE_ID, Candidate, Method, merge_candidate, mergekit_config, methods


@dataclass(frozen=True, kw_only=True)
class MergeStrategy(Strategy):
    """A weight-space merge method: its candidate is a mergekit merge of the base and the experts."""

    native: bool = True  # shipped with mergekit: a plain `mergekit-yaml` rebuilds it

    weight_space = True

    @classmethod
    def of(cls, m: Method) -> MergeStrategy:
        return cls(name=m.name, inputs=m.inputs, shared=dict(m.shared), per_model=dict(m.per_model), pretty=m.pretty,
                   layerwise=m.floats, native=m.native)

    def merge_part(self, cand: Candidate) -> Candidate | None:
        return cand

    def check_inputs(self, n_experts: int) -> None:
        ids = [f"e{i}" for i in range(n_experts)]
        if self.inputs == "pair":
            if n_experts not in (1, 2):
                raise OpdError(f"strategy {self.name!r} merges exactly two models (base + 1 expert, or 2 experts);"
                               f" the recipe has {n_experts} experts")
            return
        base = BASE_ID if self.inputs == "base+experts" else None
        try:
            mm.get(self.name).spec.contract.validate_ids(ids + ([BASE_ID] if base else []), base)
        except ValueError as e:
            raise OpdError(f"strategy {self.name!r} cannot merge {n_experts} experts: {e}") from None

    def check_params(self, params: dict[str, Any], distill) -> None:
        """Refuse a value the method's mergekit parameter does not take (a fixed value, either end of a
        range, a choice), as mergekit would at the first merge (e.g. wudi's `solver`, `data` >= 0)."""
        specs = {p.name: p for p in mm.get(self.name).spec.parameters}
        for p, spec in params.items():
            for v in _values(spec):
                try:
                    specs[p].validate(v)
                except ValidationError as e:
                    raise ValueError(f"strategy {self.name!r}: {p!r} = {v!r}: {e.errors()[0]['msg']}") from None

    def build(self, inputs: MergeInputs, cand: Candidate, ctx: BuildContext | None = None
              ) -> tuple[dict, dict[str, Any]]:
        """The merge's weights; a merge needs no context and records nothing."""
        paths = {e: str(p) for e, p in inputs.expert_paths.items()}
        out = None
        budget = getattr(inputs, "memory_budget", None)
        if budget is not None and state_dict_bytes(inputs.base_sd) > budget:
            # over the budget: streamed to disk, scored from there (the search's Scorer reads it tensor by
            # tensor); one candidate at a time, so the previous one's directory is replaced
            spill = inputs.spill_dir or Path(tempfile.gettempdir()) / f"opd-spill-{os.getpid()}"
            out = Path(spill) / "candidate"
            shutil.rmtree(out, ignore_errors=True)
        return merge_candidate(cand, str(inputs.base_path), paths, inputs.base_sd, inputs.expert_sds, out), {}

    def card(self, cand: Candidate, base_path: str, expert_paths: dict[str, str], ctx: BuildContext) -> ModelCard:
        if self.native:
            reproduce = f"Reproduce the weights with `mergekit-yaml mergekit.yaml OUT --random-seed {cand.seed}`:"
        else:
            reproduce = (f"`{cand.strategy}` is opd's own mergekit method, which a plain `mergekit-yaml` does not "
                         f"know: reproduce the weights with `python -m opd.merge export {ctx.out_dir} {ctx.number}`, "
                         "which runs mergekit's `run_merge` on this YAML with opd's methods registered:")
        return ModelCard("merged", "mergekit.yaml", mergekit_config(cand, base_path, expert_paths),
                         f"with mergekit's `{cand.strategy}`", reproduce)


def _values(spec) -> list:
    """The values a recipe's parameter spec (opd.merge.recipe.ParamSpec) can give: a fixed value, a
    range's ends, its choices, a per-layer-group range's ends."""
    if isinstance(spec, tuple):
        return list(spec)
    if hasattr(spec, "choices"):
        return list(spec.choices)
    if hasattr(spec, "range"):
        return list(spec.range)
    return [spec]


# mergekit's own methods; opd's own (opd_methods) are registered after them.
MERGEKIT_METHODS = [MergeStrategy.of(m) for m in methods() if m.native]
