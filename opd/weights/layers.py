"""Layer-wise merge parameters: one value for the embeddings, a few for the blocks, one for the head.

A layer-wise value becomes the mergekit parameter setting a user would write by hand:

    density:
      - {filter: model.embed_tokens.weight, value: 0.3}   # mergekit's pre-weights (embeddings)
      - {filter: model.norm.weight, value: 0.7}           # its post-weights (final norm, lm_head)
      - {filter: lm_head.weight, value: 0.7}
      - {value: [0.2, 0.5, 0.9]}                          # a gradient over the blocks

mergekit gives block i of L the gradient at t = i / (L - 1), interpolating linearly between the
listed points, and reads the pre- and post-weights at t = 0, hence the filters. Which tensors are
pre-weights, post-weights and blocks is mergekit's architecture definition for the model, so the
in-memory merge resolves each tensor's value with mergekit's own `evaluate_setting` at the same t
as `run_merge`: both paths see the same float, tensor for tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from opd.errors import OpdError


class LayerValues(BaseModel):
    """A parameter's value per layer group (a candidate holds this instead of a scalar)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    embed: float = Field(description="mergekit's pre-weights: the token embeddings")
    blocks: tuple[float, ...] = Field(min_length=1, description="evenly spaced points from the first block "
                                      "to the last; mergekit interpolates the blocks between them")
    head: float = Field(description="mergekit's post-weights: the final norm and an untied lm_head")

    def label(self) -> str:
        return f"[{self.embed:.3g}|{','.join(f'{b:.3g}' for b in self.blocks)}|{self.head:.3g}]"


class LayerLayout(BaseModel):
    """Where each tensor sits, from mergekit's architecture definition of the model."""

    model_config = ConfigDict(frozen=True)
    pre: tuple[str, ...]
    post: tuple[str, ...]
    layer: dict[str, int]  # block tensor name -> its layer index
    num_layers: int

    def t(self, name: str) -> float:
        """The gradient position mergekit's planner gives tensor `name` (plan_slice, plan_module)."""
        if name not in self.layer:
            return 0.0  # pre- and post-weights are planned at t = 0
        return self.layer[name] / (self.num_layers - 1) if self.num_layers > 1 else 1.0


@functools.lru_cache(maxsize=8)
def layout_for(model_dir: str) -> LayerLayout:
    """The layer layout of the model in `model_dir` (its config.json), as mergekit plans it."""
    # lazy: peft (imported by mergekit.architecture and .config), ~160 MiB resident; only layer-wise settings need it
    from mergekit.architecture import arch_info_for_config
    from transformers import (
        AutoConfig,  # lazy: transformers' Auto classes add ~0.45 s; only a layer-wise setting reads the config
    )

    config = AutoConfig.from_pretrained(model_dir)
    arch = arch_info_for_config(config)
    if arch is None or len(arch.modules) != 1:
        raise OpdError(f"layer-wise parameters need mergekit's architecture definition of {config.architectures} "
                       f"({Path(model_dir)}); mergekit has none with one module for it: search scalars instead")
    module = next(iter(arch.modules.values()))
    prefix = module.weight_prefix or ""
    info = module.architecture
    n = info.num_layers(config)
    layer = {prefix + w.name: i for i in range(n) for w in info.layer_weights(i, config)}
    pre = tuple(prefix + w.name for w in info.pre_weights(config))
    post = tuple(prefix + w.name for w in info.post_weights(config))
    # mergekit matches a filter as a substring of the tensor name: an end's filter must not catch a block.
    for f in pre + post:
        caught = [b for b in layer if f in b]
        if caught:
            raise OpdError(f"layer-wise parameters: the filter {f!r} would also match block tensor {caught[0]!r}")
    return LayerLayout(pre=pre, post=post, layer=layer, num_layers=n)


def setting(value: LayerValues, layout: LayerLayout) -> list[dict[str, Any]]:
    """The mergekit parameter setting (filters for the ends, a gradient for the blocks)."""
    return ([{"filter": name, "value": value.embed} for name in layout.pre]
            + [{"filter": name, "value": value.head} for name in layout.post]
            + [{"value": list(value.blocks)}])


def resolve(value: Any, name: str, layout: LayerLayout | None, validate: Callable[[Any], Any]) -> Any:
    """The value `run_merge` gives tensor `name` for this (scalar or layer-wise) value."""
    if not isinstance(value, LayerValues):
        return value

    if layout is None:
        raise ValueError("a layer-wise value needs the model's LayerLayout")
    if name not in layout.layer and name not in layout.pre and name not in layout.post:
        raise OpdError(f"layer-wise parameters: tensor {name!r} is not in mergekit's architecture definition")
    from mergekit.config import (
        ConditionalParameter,  # lazy: imports peft, see layout_for; only layer-wise values reach here
        evaluate_setting,
    )

    cond = [ConditionalParameter.model_validate(c) for c in setting(value, layout)]
    return evaluate_setting(name, cond, layout.t(name), validate=validate)
