"""GSPO's packed update layout (opd.rl.packed_logits) against the grouped one, on a pico model: the
same logits and gradients, and the GSPO step through either gives the same weights."""

import copy
import random

import torch

from opd.expert.settings import GSPOConfig
from opd.expert.trainer import gspo_step
from opd.rl.batch import group_rollouts, grouped_completion_logits
from opd.rl.packed_logits import PackedLogits
from opd.rollout.base import Rollout


def _rows(seed=0):
    """4 prompts x 3 completions of mixed lengths (some empty-but-one), rows shuffled as gspo_step does."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randrange(3, 9))] for _ in range(4)]
    rows = [(p, [rng.randrange(3, 40) for _ in range(rng.randrange(1, 6))]) for p in prompts for _ in range(3)]
    rng.shuffle(rows)
    return [p for p, _ in rows], [c for _, c in rows]


def test_packed_logits_and_grads_match_grouped(pico_model):
    P, C = _rows()
    batch = group_rollouts(P, C, pad_id=0)
    rows = torch.tensor([5, 0, 7, 2, 9])
    mask = batch.cmask[rows].bool()  # (b, Tc): real completion tokens
    grads = {}
    for name, fn in (("grouped", grouped_completion_logits), ("packed", PackedLogits(P, C, pad_id=0))):
        model = copy.deepcopy(pico_model)
        out = fn(model, batch, rows, n_grad=3)  # (b, Tc, V); rows 3.. without gradient
        grads[name] = out[mask]
        assert out[:3].requires_grad
        (out[:3][mask[:3]].logsumexp(-1).sum()).backward()
        grads[name + "_w"] = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(grads["packed"], grads["grouped"], atol=1e-5, rtol=1e-4)
    assert grads["packed_w"].keys() == grads["grouped_w"].keys()
    for k in grads["grouped_w"]:
        torch.testing.assert_close(grads["packed_w"][k], grads["grouped_w"][k], atol=1e-5, rtol=1e-3)


def test_gspo_step_same_update_either_layout(pico_model):
    P, C = _rows(1)
    groups = {}
    for p, c in zip(P, C):
        groups.setdefault(tuple(p), []).append(Rollout("", list(p), c, "", [0.0] * len(c)))
    kept = [(g, [float(i % 2) for i in range(len(g))]) for g in groups.values()]
    weights = {}
    for layout in ("grouped", "packed"):
        model = copy.deepcopy(pico_model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = GSPOConfig(group_size=3, updates_per_batch=2, eps_low=0.2, eps_high=0.28, layout=layout)
        torch.manual_seed(0)  # the same row shuffle
        stats = gspo_step(model, opt, None, kept, g, pad_id=0)
        assert stats["loss"] == stats["loss"]  # not NaN
        weights[layout] = model.state_dict()
    for k, v in weights["grouped"].items():
        torch.testing.assert_close(weights["packed"][k], v, atol=1e-5, rtol=1e-4)


def test_group_minibatches_hold_whole_groups(pico_model, monkeypatch):
    import opd.expert.trainer as trainer

    seen = []

    class Recording(PackedLogits):
        def __call__(self, model, batch=None, rows=None, n_grad=None):
            rows_ = list(range(len(self.prompts))) if rows is None else rows.tolist()
            seen.append([self.prompts[r] for r in rows_[: len(rows_) if n_grad is None else n_grad]])
            return super().__call__(model, batch, rows, n_grad)

    monkeypatch.setattr(trainer, "PackedLogits", Recording)
    P, C = _rows(2)
    groups = {}
    for p, c in zip(P, C):
        groups.setdefault(tuple(p), []).append(Rollout("", list(p), c, "", [0.0] * len(c)))
    kept = [(g, [float(i % 2) for i in range(len(g))]) for g in groups.values()]
    for minibatch, whole in (("groups", True), ("rows", False)):
        seen.clear()
        g = GSPOConfig(group_size=3, updates_per_batch=4, layout="packed", minibatch=minibatch)
        torch.manual_seed(3)
        gspo_step(copy.deepcopy(pico_model), torch.optim.AdamW(pico_model.parameters()), None, kept, g, pad_id=0)
        assert len(seen) == 4  # one call per minibatch (the first also scores the rest without gradient)
        counts = [sorted({p: mb.count(p) for p in mb}.values()) for mb in seen]
        assert (counts == [[3]] * 4) == whole  # 4 prompts x 3: each minibatch one whole group, or not
