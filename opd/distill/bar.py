"""An OPD student's section of the live display (opd.display): a warm-start bar (when the config has
one) that also names what the warm start does before its first step (its teachers sampling, then
scoring their samples), and an OPD bar (when the config has OPD steps) with the mean teacher KL and
the last val retention check."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from opd import display as live  # the module: `live.display` is read when a bar opens (tests swap it)
from opd.distill.config import DistillConfig


@contextmanager
def opd_bar(name: str, cfg: DistillConfig, enabled: bool = True) -> Iterator[Callable | None]:
    """Yields the `progress(state, rec)` callback for `opd.distill.loop.distill` (None when disabled);
    its `status(text)` attribute sets the warm-start bar's note."""
    if not enabled:
        yield None
        return
    bar = live.step_bar()
    warm = bar.add_task(f"{name} warm start", total=cfg.warmstart_steps, info="",
                        visible=cfg.warmstart_steps > 0)
    opd = bar.add_task(f"{name} OPD", total=cfg.steps, info="", visible=cfg.steps > 0)

    def progress(state, rec: dict | None) -> None:
        bar.update(warm, completed=state.warm_step)
        bar.update(opd, completed=state.step)
        if rec is None:  # a warm-start step, or a resumed run's first look
            return
        kls = [v for k, v in rec.items() if k.startswith("kl/")]
        info = f"KL {sum(kls) / len(kls):.3f}" if kls else ""
        if state.best_min_retention >= 0:  # after the first retention check
            info += f"  best val min retention {state.best_min_retention:.3f}@{state.best_step}"
        bar.update(opd, info=info)

    progress.status = lambda text: bar.update(warm, info=text)
    with live.display.section("opd", lambda: bar):
        yield progress
