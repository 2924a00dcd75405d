"""Domain balancing of multi-teacher OPD: DN-MOPD's per-domain loss weights and D3-MOPD's KL-scheduled
prompt mix, by hand and in a two-capability run on a pico student."""

from __future__ import annotations

import pytest
import torch
from test_merge_fakes import PICO

from opd.distill import DistillConfig, distill, embedded_teacher, resolve_routes
from opd.distill.loop import kl_scheduled_mix, run_identity, step_mix
from opd.lab.model import build_model
from opd.rl.estimators import EstimatorSettings, FullKL, Minibatch, domain_norm_weights


def test_domain_norm_weights_by_hand():
    # domain 0's terms spread widely (std 2), domain 1's narrowly (std 0.5); all tokens together std s_all
    v0, v1 = torch.tensor([0.0, 4.0, 2.0, 2.0]), torch.tensor([1.0, 2.0, 1.5, 1.5])
    values = torch.cat([v0, v1])
    tok_dom = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    row_dom = torch.tensor([0, 1])
    s_all = float(values.std())
    raw = [min(4, max(0.25, s_all / float(v0.std()))), min(4, max(0.25, s_all / float(v1.std())))]
    w = domain_norm_weights(values, tok_dom, row_dom)
    assert w.tolist() == pytest.approx([raw[0] / (sum(raw) / 2), raw[1] / (sum(raw) / 2)])
    assert w[1] > w[0]  # the narrow domain's loss counts more, the wide one's less
    assert float(w.mean()) == pytest.approx(1.0)
    # the clip: a domain 100x narrower than the whole gets 4, not 100
    tight = torch.cat([torch.tensor([0.0, 10.0, 5.0]), torch.tensor([1.0, 1.01, 1.02])])
    w = domain_norm_weights(tight, torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 1]))
    raw0 = min(4, max(0.25, float(tight.std() / tight[:3].std())))
    assert w.tolist() == pytest.approx([raw0 / ((raw0 + 4) / 2), 4 / ((raw0 + 4) / 2)])
    # one domain alone: weight 1; a constant domain: weight 1 (no division by zero)
    assert domain_norm_weights(v0, torch.zeros(4, dtype=torch.long), torch.tensor([0, 0])).tolist() == [1.0, 1.0]
    const = domain_norm_weights(torch.tensor([1.0, 1.0, 0.0, 3.0]), tok_dom[2:6], torch.tensor([0, 1]))
    assert torch.isfinite(const).all()


def test_domain_norm_changes_the_full_estimator_loss_only_when_set():
    torch.manual_seed(0)
    b, T, H, V = 2, 3, 4, 5
    h = torch.randn(b * T, H)
    W = torch.randn(V, H)
    target = torch.log_softmax(torch.randn(b * T, V), -1)

    class Out:  # the TeacherOutputs fields the full estimator reads with a stacked target
        names, weights = ["t0", "t1"], torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    Out.target, Out.log_z = target, torch.zeros(b * T)
    mb = Minibatch(torch.arange(b), torch.ones(b, T), h, W, None, None, torch.arange(b * T), torch.ones(b), None,
                   torch.tensor([0, 1]))
    plain, _ = FullKL(EstimatorSettings()).loss(mb, Out)
    dn, _ = FullKL(EstimatorSettings(domain_norm=True)).loss(mb, Out)
    kl, _ = FullKL(EstimatorSettings()).per_token(mb, Out)
    w = domain_norm_weights(kl.detach(), torch.tensor([0] * T + [1] * T), torch.tensor([0, 1]))
    assert float(plain) == pytest.approx(float(kl.reshape(b, T).mean(1).mean()), rel=1e-5)
    assert float(dn) == pytest.approx(float((kl.reshape(b, T).mean(1) * w).mean()), rel=1e-5)
    assert float(dn) != pytest.approx(float(plain), rel=1e-3)


def test_kl_scheduled_mix_by_hand():
    mix = {"a": 0.5, "b": 0.25, "c": 0.25}
    routes = {"a": {"ta": 1.0}, "b": {"tb1": 0.5, "tb2": 0.5}, "c": {"tc": 1.0}}
    assert kl_scheduled_mix(mix, [], routes) == mix  # before the first step
    history = [{"step": 1, "kl/ta": 0.2, "kl/tb1": 0.4, "kl/tb2": 0.8, "kl/tc": 100.0}]
    # KL: a 0.2, b 0.6, c 100; mean 33.6: a 0.25 and b 0.25 (clipped from 0.006 and 0.018), c 100 / 33.6
    raw = {"a": 0.5 * 0.25, "b": 0.25 * 0.25, "c": 0.25 * 100 / 33.6}
    got = kl_scheduled_mix(mix, history, routes)
    assert got == pytest.approx({c: v / sum(raw.values()) for c, v in raw.items()})
    # the upper clip: with six capabilities one KL can exceed 4 x the mean
    six = {f"x{i}": 1 / 6 for i in range(6)}
    got = kl_scheduled_mix(six, [{"kl/x0": 1e4, **{f"kl/x{i}": 1.0 for i in range(1, 6)}}],
                           {c: {c: 1.0} for c in six})
    assert got["x0"] == pytest.approx(4 / (4 + 5 * 0.25))
    history = [{"step": 1, "kl/ta": 1.0, "kl/tb1": 2.0, "kl/tb2": 2.0, "kl/tc": 3.0}, {"step": 2, "loss": 0.1}]
    raw = {"a": 0.5 * 0.5, "b": 0.25 * 1.0, "c": 0.25 * 1.5}  # the latest record with KLs counts
    assert kl_scheduled_mix(mix, history, routes) == pytest.approx({c: v / sum(raw.values()) for c, v in raw.items()})
    cfg = DistillConfig()
    assert step_mix(cfg, mix, history, routes) == mix  # domain_balance: none leaves the mix alone
    assert step_mix(cfg.model_copy(update={"domain_balance": "d3"}), mix, history, routes) != mix


def test_domain_balance_is_part_of_the_run_identity_only_when_set():
    cfg = DistillConfig()
    assert "domain_balance" not in run_identity(cfg)  # runs from before the setting still resume
    assert run_identity(cfg.model_copy(update={"domain_balance": "dn"}))["domain_balance"] == "dn"
    with pytest.raises(ValueError, match="domain_balance"):
        DistillConfig(domain_balance="equal")


@pytest.mark.parametrize("balance", ["dn", "d3"])
def test_two_capability_run_with_domain_balance(trained_pico_dir, tokenizer, balance):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    other = build_model(PICO, tokenizer, seed=3)  # an untrained teacher: a KL far from the trained one's
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer),
                "rev": embedded_teacher("rev", "rev", other, tokenizer)}
    routes = resolve_routes({"count": "count", "rev": "rev"})
    cfg = DistillConfig(steps=3, prompts_per_step=8, group_size=1, estimator="full", domain_balance=balance)
    drawn: list[dict] = []
    import opd.distill.loop as loop

    real = loop.step_mix

    def spy(*a):
        drawn.append(real(*a))
        return drawn[-1]

    loop.step_mix = spy
    try:
        state = distill(cfg, build_model(PICO, tokenizer, seed=0), tokenizer, teachers, routes, log=lambda *_: None)
    finally:
        loop.step_mix = real
    assert len(state.history) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in state.history)
    assert all(f"kl/{t}" in state.history[0] for t in teachers)
    if balance == "d3":  # after the first step the mix follows the KLs: the larger KL draws more prompts
        assert drawn[0] == pytest.approx({"count": 0.5, "rev": 0.5})
        last = state.history[-2]
        hi, lo = sorted(teachers, key=lambda t: last[f"kl/{t}"], reverse=True)
        assert drawn[-1][hi] > drawn[-1][lo]


def test_an_opd_strategy_sets_domain_balance(tmp_path):
    from test_merge_fakes import write_recipe

    from opd.errors import OpdError
    from opd.merge import load_recipe
    from opd.merge.strategies.distill import opd_settings
    from opd.weights.merge import Candidate

    lab = {"base": "b", "experts": {"add": "add"}}
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out",
                                      strategies={"opd": {"domain_balance": {"choices": ["none", "d3"]}}}))
    assert recipe.strategies["opd"]["domain_balance"].choices == ["none", "d3"]
    cfg, _ = opd_settings(DistillConfig(), Candidate(strategy="opd", shared={"domain_balance": "d3"}))
    assert cfg.domain_balance == "d3"
    with pytest.raises(OpdError, match="domain_balance"):
        load_recipe(write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out",
                                 strategies={"opd": {"domain_balance": "equal"}}))
