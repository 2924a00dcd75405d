"""OPD teachers on actors (`teachers_on: ray`): each actor holds one or more teachers (on its own GPU
where its resources ask for one), scores the rows the student routes to it and returns what the
estimator needs; the student gathers the answers and updates as with in-process teachers.

- sampled estimator: each teacher's engine is a `RemoteEngine`, whose `score` splits the rows between
  the actors holding that teacher and returns the sampled tokens' log-probs (B x T floats);
- the KL warm start with `warmstart_topk` K: the engine's `top_logprobs` runs `teacher_targets` on the
  actors holding the teacher and returns its K most likely tokens and log-probs at each completion token;
- full and top-k: a `RemoteBank` in place of the in-process `TeacherBank`: each actor runs a stacked
  bank over its own teachers on its share of the rows and returns sum_k w_k log pi_k over the whole
  vocabulary (the unnormalised mixture) and the sampled tokens' log-probs; the student adds the
  actors' parts and normalises, which is the in-process bank's target to float rounding.

Where actors live is the cluster layer's business (opd.cluster.Actors): this module never names Ray.
"""

from __future__ import annotations

import torch

from opd.cluster import Actors
from opd.distill.config import TeacherActors
from opd.distill.teacher_bank import TeacherBank
from opd.distill.teachers import Teacher, embedded_teacher, teacher_targets
from opd.errors import OpdError


class TeacherHost:
    """What runs on one actor: its teachers (frozen, on the actor's GPU if it was given one)."""

    def __init__(self, models: dict[str, tuple[str, torch.nn.Module]], tokenizer, dtype: torch.dtype | None):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # Ray shows an actor only its own GPUs
        self.teachers = {n: embedded_teacher(n, cap, m.to(self.device), tokenizer) for n, (cap, m) in models.items()}
        self.names = sorted(models)
        self.bank = TeacherBank(self.teachers, self.names, dtype)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def score(self, name: str, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        return self.teachers[name].engine.score(prompt_ids, completion_ids)

    def generate(self, name: str, prompts: list[str], n: int, params):
        return self.teachers[name].engine.generate(prompts, n, params)

    def top_logprobs(self, name: str, prompt_ids: list[list[int]], completion_ids: list[list[int]], k: int):
        """As `SGLangEngine.top_logprobs`: per completion, its teacher's k most likely tokens and their
        log-probs at each of its tokens (`teacher_targets` on this actor)."""
        top = teacher_targets(self.teachers[name], list(zip(prompt_ids, completion_ids)), self.pad_id, topk=k)
        out, at = [], 0
        for c in completion_ids:
            out.append((top.ids[at: at + len(c)].tolist(), top.logprobs[at: at + len(c)].tolist()))
            at += len(c)
        return out

    @torch.no_grad()
    def score_bank(self, ids, attn, plen, targets, weights) -> tuple[torch.Tensor, torch.Tensor]:
        """`TeacherBank.score` on this actor's rows, weights (K_a, b) over its own teachers. Returns the
        unnormalised mixture sum_k w_k log pi_k (b, T, V) and teacher_lp (K_a, b, T), on the CPU."""
        d = self.device
        target, log_z, teacher_lp = self.bank.score(ids.to(d), attn.to(d), plen.to(d), targets.to(d), weights.to(d))
        return (target + log_z[..., None]).cpu(), teacher_lp.cpu()


class TeacherPool:
    """The actors and which of them hold each teacher."""

    def __init__(self, actors: Actors, groups: list[list[str]]):
        self.actors, self.groups = actors, groups
        self.holders = {n: [a for a, g in enumerate(groups) if n in g] for g in groups for n in g}

    def split(self, name: str, rows: list[int]) -> list[tuple[int, list[int]]]:
        """`rows` of teacher `name` dealt round-robin to the actors holding it: [(actor, its rows)]."""
        hs = self.holders[name]
        parts = [(a, rows[i::len(hs)]) for i, a in enumerate(hs)]
        return [(a, r) for a, r in parts if r]


class RemoteEngine:
    """One teacher's engine (opd.rollout's protocol) whose calls run on the actors holding it."""

    def __init__(self, pool: TeacherPool, name: str):
        self.pool, self.name = pool, name

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        return self._split_call("score", prompt_ids, completion_ids)

    def top_logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], k: int):
        return self._split_call("top_logprobs", prompt_ids, completion_ids, k)

    def _split_call(self, method: str, prompt_ids, completion_ids, *args) -> list:
        """`method` on the actors holding this teacher, its rows split between them, answers in row order."""
        parts = self.pool.split(self.name, list(range(len(prompt_ids))))
        handles = [self.pool.actors.submit(a, method, self.name, [prompt_ids[i] for i in rows],
                                           [completion_ids[i] for i in rows], *args) for a, rows in parts]
        out: list = [None] * len(prompt_ids)
        for (_, rows), got in zip(parts, self.pool.actors.gather(handles)):
            for i, lps in zip(rows, got):
                out[i] = lps
        return out

    def generate(self, prompts: list[str], n: int, params):
        a = self.pool.holders[self.name][0]  # one actor: the seeded samples are the in-process teacher's
        return self.pool.actors.gather([self.pool.actors.submit(a, "generate", self.name, prompts, n, params)])[0]

    def sync_weights(self, model) -> None:
        raise RuntimeError("teachers are frozen: a remote teacher's weights are never synced")


class RemoteBank:
    """The in-process `TeacherBank`'s `score` (the padded layout) served by the pool's actors."""

    def __init__(self, pool: TeacherPool, names: list[str]):
        self.pool, self.names = pool, list(names)

    def fits(self, rows_per_teacher: int, T: int) -> bool:
        return True  # each actor holds only its own rows' (b, T, V) answer

    def fits_tokens(self, pair_tokens: int) -> bool:
        return False  # the packed layout's teachers score on the padded rows here (same targets)

    @torch.no_grad()
    def score(self, ids, attn, plen, targets, weights):
        """As `TeacherBank.score`: (target (B, T, V), log_z (B, T), teacher_lp (K, B, T))."""
        K, B = weights.shape
        share = torch.zeros(len(self.pool.groups), K, B)  # (A, K, B): each (teacher, row) pair on one actor
        for k, name in enumerate(self.names):
            for a, rows in self.pool.split(name, weights[k].nonzero().squeeze(1).tolist()):
                share[a, k, rows] = weights[k, rows].cpu()
        calls = []
        for a, group in enumerate(self.pool.groups):
            rows = share[a].sum(0).nonzero().squeeze(1)
            if len(rows):
                ks = [self.names.index(n) for n in group]
                calls.append((rows, ks, self.pool.actors.submit(
                    a, "score_bank", ids[rows].cpu(), attn[rows].cpu(), plen[rows].cpu(), targets[rows].cpu(),
                    share[a][ks][:, rows])))
        answers = self.pool.actors.gather([c[2] for c in calls])
        mixed = teacher_lp = None
        for (rows, ks, _), (part, lp) in zip(calls, answers):
            if mixed is None:
                mixed = torch.zeros(B, targets.shape[1], part.shape[-1])
                teacher_lp = torch.zeros(K, B, targets.shape[1])
            mixed.index_add_(0, rows, part)
            for j, k in enumerate(ks):
                teacher_lp[k, rows] += lp[j]
        log_z = torch.logsumexp(mixed, -1)  # (B, T)
        dev = weights.device
        return (mixed - log_z[..., None]).to(dev), log_z.to(dev), teacher_lp.to(dev)


def remote_teachers(cfg, teachers: dict[str, Teacher], routed: list[str], tokenizer, dtype: torch.dtype | None
                    ) -> tuple[dict[str, Teacher], RemoteBank | None]:
    """The routed teachers moved onto actors (cfg.teacher_actors): teachers whose engines run there,
    and for the full and top-k estimators a bank that gives their targets (None for sampled)."""
    settings = cfg.teacher_actors or TeacherActors()
    missing = [n for n in routed if teachers[n].model is None]
    if missing:
        raise OpdError(f"distill.teachers_on {cfg.teachers_on!r}: teacher(s) {missing} have no weights here "
                       "(served by SGLang); give them to the actors as model directories instead")
    chunks = [routed[i:i + settings.per_actor] for i in range(0, len(routed), settings.per_actor)]
    groups = []
    for chunk in chunks:  # an over-provisioned capability's teachers get more than one actor
        copies = max(settings.replicas.get(teachers[n].capability, 1) for n in chunk)
        groups += [chunk] * copies
    args = [({n: (teachers[n].capability, teachers[n].model) for n in g}, tokenizer, dtype) for g in groups]
    pool = TeacherPool(Actors(cfg.teachers_on, TeacherHost, args, dict(settings.resources), settings.address,
                              "distill.teacher_actors.address"), groups)
    remote = {**teachers, **{n: Teacher(n, teachers[n].capability, RemoteEngine(pool, n)) for n in routed}}
    # full and topk read the whole vocabulary from the actors; sampled and teacher_topk the engines' answers
    bank = RemoteBank(pool, routed) if cfg.estimator in ("full", "topk") else None
    return remote, bank
