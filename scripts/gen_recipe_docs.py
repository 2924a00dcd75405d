"""Write docs/reference/recipes.md from the pydantic models' field descriptions, so it cannot drift.

    python scripts/gen_recipe_docs.py

One table per model (field, type, default, description), recursing into the models it nests, plus
the strategies a merge recipe can search (from the strategy registry). tests/test_docs.py fails when
the committed file differs from what this prints; rerun it after changing a model's fields.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference" / "recipes.md"

# Constraint objects pydantic keeps in FieldInfo.metadata (annotated_types), shown after the type.
_BOUNDS = ((annotated_types.Gt, "gt", "> {}"), (annotated_types.Ge, "ge", ">= {}"),
           (annotated_types.Lt, "lt", "< {}"), (annotated_types.Le, "le", "<= {}"),
           (annotated_types.MinLen, "min_length", "at least {}"))


def _roots():
    """(heading, what file it reads, model): the user-facing files, in pipeline order."""
    from opd.distill.config import DistillRun
    from opd.expert.spec import ExpertSpec
    from opd.lab.base import BaseSpec
    from opd.lab.recipe import LabTraining
    from opd.merge.recipe import MergeRecipe

    return [
        ("Lab base spec", "`opd/lab/base.yaml`, which `opd base` builds (`key=value` overrides it)", BaseSpec),
        ("Expert spec", "`experts/<capability>.yaml`, which `opd train-expert` trains", ExpertSpec),
        ("Distillation run", "`merge_recipes/distill/*.yaml`, which `opd distill` runs", DistillRun),
        ("Merge recipe", "`merge_recipes/*.yaml`, which `opd merge` and `opd lab` run", MergeRecipe),
        ("Lab training", "`merge_recipes/*.yaml` again, their `train:` section: `opd lab` reads it, `opd merge` ignores it",
         LabTraining),
    ]


def _is_model(t) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _cell(text: str) -> str:
    # A `|` inside a table cell ends the cell unless escaped, code spans included (GFM).
    return text.replace("|", "\\|").replace("\n", " ")


def type_name(t) -> str:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(parts) + (" \\| null" if type(None) in args else "")
    if origin is tuple and args and args[-1] is not Ellipsis:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}" if args else "map"
    if _is_model(t):
        return f"[{t.__name__}](#{t.__name__.lower()})"
    if t is typing.Any:
        return "any"
    return getattr(t, "__name__", str(t))


def _bounds(field) -> str:
    out = []
    for meta in field.metadata:
        for cls, attr, fmt in _BOUNDS:
            if isinstance(meta, cls):
                out.append(fmt.format(getattr(meta, attr)))
        if getattr(meta, "pattern", None):
            out.append(f"matches `{meta.pattern}`")
    return ", ".join(out)


def _default(field) -> str:
    if field.is_required():
        return "required"
    try:
        value = field.get_default(call_default_factory=True, validated_data={})
    except Exception:  # a factory that reads other fields' values: no single default to show
        return "computed"
    if isinstance(value, BaseModel):
        return "its defaults"
    return f"`{json.dumps(value, default=str)}`"


def nested_models(t) -> list[type[BaseModel]]:
    """Models reachable from an annotation (inside unions, lists, dicts, Annotated)."""
    if _is_model(t):
        return [t]
    return [m for a in typing.get_args(t) for m in nested_models(a)]


def model_section(model: type[BaseModel]) -> list[str]:
    lines = [f"### {model.__name__}", ""]
    doc = (model.__doc__ or "").strip()
    if doc and not doc.startswith(("Usage docs", "!!! abstract")):
        lines += [" ".join(doc.split()), ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        typ = type_name(field.annotation)
        if bounds := _bounds(field):
            typ += f" ({bounds})"
        lines.append(f"| `{name}` | {typ} | {_cell(_default(field))} | {_cell(field.description or '')} |")
    return lines + [""]


def strategies_section() -> list[str]:
    from opd.merge.strategies import STRATEGIES
    from opd.merge.strategies.base import _UNLISTED

    def params(d: dict) -> str:
        return ", ".join(f"`{k}`" + ("" if v is None else f" ({json.dumps(v, default=str)})") for k, v in d.items())

    lines = ["## Strategies", "",
             "The keys of a merge recipe's `strategies:` map (`opd.merge.strategies`). A parameter is "
             "shared by all experts or set per expert; its default is in brackets, and a shared one without a "
             "default must be given by the recipe. A trained student's parameter that the recipe leaves unset "
             "takes the recipe's `distill:` value. A parameter takes a value, `[low, high]`, "
             "`{choices: [...]}` or `{range: [low, high], layer_groups: n}` (see [LayerRange](#layerrange)).",
             "", "| strategy | what | shared parameters | per expert |", "|---|---|---|---|"]
    for name, s in STRATEGIES.items():
        if name in _UNLISTED:
            continue
        lines.append(f"| `{name}` | {_cell(s.pretty)} | {_cell(params(s.shared))} | {_cell(params(s.per_model))} |")
    hybrids = sorted(n for n in STRATEGIES if n in _UNLISTED)
    if hybrids:
        lines += ["", f"`<method>+opd` ({len(hybrids)} of them, e.g. `{hybrids[0]}`): the weight-space method's "
                  "merge as the student's start, then OPD; it takes the method's parameters and `opd`'s, all "
                  "searchable together."]
    return lines + [""]


def render() -> str:
    lines = ["# Recipe and spec reference", "",
             "Generated by `python scripts/gen_recipe_docs.py` from the pydantic models' field descriptions; "
             "do not edit by hand (`tests/test_docs.py` checks it is current). Every model refuses unknown "
             "keys. `key=value` overrides on the command line use the same dotted names "
             "(`distill.steps=20`).", ""]
    seen: set[type] = set()
    for heading, source, root in _roots():
        lines += [f"## {heading}", "", f"The files {source}.", ""]
        queue = [root]
        while queue:
            model = queue.pop(0)
            if model in seen:
                continue
            seen.add(model)
            lines += model_section(model)
            queue += [m for f in model.model_fields.values() if not f.exclude
                      for m in nested_models(f.annotation) if m not in seen]
    lines += strategies_section()
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    text = render()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run from a checkout without an installed opd too
    sys.exit(main())
