"""Which teacher serves which prompt: the routing key is the prompt's capability (a teacher's tasks)."""

from __future__ import annotations

from collections.abc import Sequence

from opd.distill.config import TeacherRef
from opd.errors import OpdError

Routes = dict[str, dict[str, float]]  # capability -> {teacher: weight}, weights summing to 1


def capability_kl(record: dict, teachers: dict[str, float]) -> float | None:
    """A capability's reverse KL in one step's record: the `teachers`-weighted mean of their logged
    kl/<teacher> (teacher -> weight, a route's); None where none of them is in the record."""
    got = [(w, record[f"kl/{t}"]) for t, w in teachers.items() if f"kl/{t}" in record]
    return sum(w * v for w, v in got) / sum(w for w, _ in got) if got else None


def resolve_routes(teacher_caps: dict[str, str | Sequence[str]], routes: dict[str, list[TeacherRef]] | None = None,
                   weights: dict[str, float] | None = None) -> Routes:
    """Normalised routes. Default: each teacher serves its tasks (`teacher_caps`: teacher -> its
    capability or its list of tasks, from the manifests or a BYO entry's `tasks`), weighted by
    `weights` (default 1); a task several teachers list is served by all of them. `routes` replaces
    that table entirely.
    """
    table: dict[str, dict[str, float]] = {}
    if routes is None:
        for t, caps in teacher_caps.items():
            for cap in [caps] if isinstance(caps, str) else caps:
                table.setdefault(cap, {})[t] = (weights or {}).get(t, 1.0)
    else:
        for cap, refs in routes.items():
            for ref in refs:
                name = _match(ref.expert, teacher_caps)
                table.setdefault(cap, {})[name] = table.get(cap, {}).get(name, 0.0) + ref.weight
    out = {}
    for cap, ts in table.items():
        total = sum(ts.values())
        if total <= 0:
            raise OpdError(f"routes: the teachers of {cap!r} have no positive weight")
        out[cap] = {t: w / total for t, w in ts.items()}
    return out


def _match(ref: str, teachers: dict[str, str]) -> str:
    """A route's teacher by name, or by path whose last component is a teacher's name."""
    for name in (ref, ref.rstrip("/").rsplit("/", 1)[-1]):
        if name in teachers:
            return name
    raise OpdError(f"routes: teacher {ref!r} is not among the loaded teachers {sorted(teachers)}")


def prompt_mix(routes: Routes, mix: dict[str, float] | None = None,
               teacher_weights: dict[str, float] | None = None) -> dict[str, float]:
    """Share of prompts drawn from each routed capability, summing to 1.

    `mix` (capability -> share) wins; otherwise a capability's share is the summed raw weight of its
    teachers (`teacher_weights`, default 1 each), so weighting a teacher up also shows it more prompts.
    """
    if mix is not None:
        missing = sorted(set(routes) - set(mix))
        if missing:
            raise OpdError(f"mix: no share given for routed capabilities {missing}")
        raw = {c: mix[c] for c in routes}
    else:
        raw = {c: sum((teacher_weights or {}).get(t, 1.0) for t in ts) for c, ts in routes.items()}
    total = sum(raw.values())
    if total <= 0:
        raise OpdError("mix: the prompt shares sum to 0")
    return {c: v / total for c, v in raw.items()}


def require_routed(field: str, caps, routes: Routes) -> None:
    """Refuse capabilities named in the config field `field` that no teacher serves, in one line."""
    unrouted = sorted(set(caps) - set(routes))
    if unrouted:
        raise OpdError(f"{field}: {unrouted} not among the routed capabilities {sorted(routes)}")
