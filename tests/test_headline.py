"""The report's headline: retention and gain kept per capability, minima, best per strategy (by hand)."""

from __future__ import annotations

import pytest

from opd.merge.headline import capability_rows, gain_kept, headline_md, minima, strategy_rows


def _cell(cand, cap, score, stderr, reference):
    return {"candidate": cand, "capability": cap, "score": score, "stderr": stderr,
            "retention": score / reference if reference else 1.0}


# add: base 0.10, expert 0.50 (z = 0.40 / sqrt(0.03^2 + 0.02^2) = 11.1); rev: base 0.30, expert 0.33
# (z = 0.03 / sqrt(0.03^2 + 0.03^2) = 0.71: not significant, so no gain kept)
CELLS = [
    _cell("base", "add", 0.10, 0.02, 0.50), _cell("base", "rev", 0.30, 0.03, 0.33),
    _cell("expert a", "add", 0.50, 0.03, 0.50), _cell("expert a", "rev", 0.20, 0.03, 0.33),
    _cell("expert r", "add", 0.05, 0.01, 0.50), _cell("expert r", "rev", 0.33, 0.03, 0.33),
    _cell("#1 opd", "add", 0.42, 0.03, 0.50), _cell("#1 opd", "rev", 0.33, 0.03, 0.33),
    _cell("#2 ties", "add", 0.20, 0.02, 0.50), _cell("#2 ties", "rev", 0.11, 0.02, 0.33),
    _cell("#3 ties", "add", 0.30, 0.02, 0.50), _cell("#3 ties", "rev", 0.22, 0.02, 0.33),
]
EXPERTS = {"add": "expert a", "rev": "expert r"}


def test_gain_kept_by_hand():
    assert gain_kept(0.42, 0.10, 0.50) == pytest.approx(0.32 / 0.40)  # 0.8
    assert gain_kept(0.05, 0.10, 0.50) == pytest.approx(-0.125)  # below the base: negative


def test_capability_rows_and_minima():
    rows = {r.capability: r for r in capability_rows(CELLS, "#1 opd", EXPERTS)}
    assert rows["add"].retention == pytest.approx(0.84) and rows["add"].gain_kept == pytest.approx(0.8)
    assert rows["add"].expert_gain_z == pytest.approx(0.40 / (0.03**2 + 0.02**2) ** 0.5)
    assert rows["rev"].gain_kept is None and rows["rev"].retention == pytest.approx(1.0)
    m = minima(list(rows.values()))
    assert m["min_retention"] == pytest.approx(0.84) and m["weakest"] == "add"
    assert m["mean_retention"] == pytest.approx(0.84) and m["min_gain_kept"] == pytest.approx(0.8)
    assert m["gain_capabilities"] == 1 and m["min_retention_all"] == pytest.approx(0.84)


def test_minima_leave_out_an_expert_that_does_not_beat_the_base():
    """#2 ties keeps 0.11/0.33 of rev, whose expert is no better than the base (z 0.71): the minimum
    counts add only (0.20/0.50), and the minimum over all capabilities is reported beside it."""
    m = minima(capability_rows(CELLS, "#2 ties", EXPERTS))
    assert m["min_retention"] == pytest.approx(0.4) and m["weakest"] == "add"
    assert m["min_retention_all"] == pytest.approx(0.11 / 0.33) and m["weakest_all"] == "rev"
    md = headline_md("#2 ties", capability_rows(CELLS, "#2 ties", EXPERTS), [], {})
    assert "min retention 0.40" in md and "1 of 2 capabilities" in md and "over all 2: min retention 0.33 (rev)" in md


def test_search_objectives_count_only_experts_that_beat_the_base():
    from opd.merge.search import aggregate_retention

    ret = {"add": 0.9, "rev": 0.0, "sort": 0.7}
    assert aggregate_retention(ret, ["add", "sort"]) == pytest.approx({"min": 0.7, "mean": 0.8})
    assert aggregate_retention(ret, None) == pytest.approx({"min": 0.0, "mean": 1.6 / 3})
    assert aggregate_retention(ret, []) == pytest.approx({"min": 0.0, "mean": 1.6 / 3})


def test_strategy_rows_keep_each_strategys_best_by_min_retention():
    final = {"#1 opd": {"candidate": {"strategy": "opd"}}, "#2 ties": {"candidate": {"strategy": "ties"}},
             "#3 ties": {"candidate": {"strategy": "ties"}}}
    rows = strategy_rows(CELLS, final, EXPERTS)
    assert [r["strategy"] for r in rows] == ["opd", "ties"]
    assert rows[1]["candidate"] == "#3 ties" and rows[1]["min_retention"] == pytest.approx(0.30 / 0.50)  # add is its weakest
    md = headline_md("#1 opd", capability_rows(CELLS, "#1 opd", EXPERTS), rows, {"base": 3.0, "OPD": 2.5})
    assert "min retention 0.84" in md and "min gain kept 0.80" in md and "(total 5.5)" in md
    assert "| rev | 0.300 | 0.330 | 0.330 | 1.00 | n/a | 0.7 |" in md


def test_references_count_capabilities_whose_expert_beats_the_base_on_val():
    """score_references with a scorer that returns fixed scores: the `shift` expert scores what the
    base scores (it learnt nothing), so only `add` is counted."""
    from types import SimpleNamespace

    from opd.evaluation.api import Score
    from opd.merge.references import score_references

    table = {"base": {"add": 0.1, "shift": 0.01}, "a": {"add": 0.6, "shift": 0.0}, "s": {"add": 0.1, "shift": 0.01}}

    class FakeScorer:
        base_sd = "base"

        def score(self, sd, split, limit=None, caps=None):
            return {c: Score(v, 0.02, 200) for c, v in table[sd].items() if caps is None or c in caps}

    inputs = SimpleNamespace(capabilities=["add", "shift"], expert_sds={"a": "a", "s": "s"},
                             manifests={"a": SimpleNamespace(capability="add", tasks=["add"]),
                                        "s": SimpleNamespace(capability="shift", tasks=["shift"])})
    refs = score_references(inputs, FakeScorer(), None)
    assert refs.counted == ["add"] and refs.val == {"add": 0.6, "shift": 0.01}


def test_every_recipe_strategy_appears_with_the_reason_it_was_not_rescored():
    from opd.merge.headline import missing_strategies

    rescored = [{"strategy": "opd"}]
    trials = [{"candidate": {"strategy": "ties"}, "stage": "screen", "min_retention": 0.23},
              {"candidate": {"strategy": "ties"}, "stage": "screen", "min_retention": 0.11},
              {"candidate": {"strategy": "sce"}, "stage": "full", "min_retention": 0.4}]
    got = {m["strategy"]: m["reason"] for m in missing_strategies(["opd", "ties", "sce", "karcher"], rescored, trials)}
    assert set(got) == {"ties", "sce", "karcher"}
    assert "screened out: best min retention 0.23" in got["ties"] and "(2 trials)" in got["ties"]
    assert "full val (best min retention 0.40)" in got["sce"] and "no trial finished" in got["karcher"]
    md = headline_md("#1 opd", capability_rows(CELLS, "#1 opd", EXPERTS), [], {}, missing=[
        {"strategy": "ties", "reason": got["ties"]}])
    assert "| ties | — | — | — | — | not re-scored on test: screened out" in md


def test_a_shortfall_is_a_loss_only_beyond_two_stderr_of_the_difference():
    """#1 opd trails add's expert by 0.08 at stderr sqrt(0.03^2 + 0.03^2) = 0.042 (z -1.9: within noise);
    #3 ties trails it by 0.20 at sqrt(0.02^2 + 0.03^2) = 0.036 (z -5.5: lost for certain)."""
    opd = {r.capability: r for r in capability_rows(CELLS, "#1 opd", EXPERTS)}
    assert opd["add"].vs_expert_z == pytest.approx(-0.08 / (2 * 0.03**2) ** 0.5)
    assert opd["rev"].vs_expert_z == pytest.approx(0.0)
    assert minima(list(opd.values()))["losses"] == []
    ties = minima(capability_rows(CELLS, "#3 ties", EXPERTS))
    assert [c for c, _ in ties["losses"]] == ["add"] and ties["losses"][0][1] == pytest.approx(-0.2 / 0.0013**0.5)
    assert ties["weakest_z"] == pytest.approx(-0.2 / 0.0013**0.5)
    assert minima(capability_rows(CELLS, "#3 ties", EXPERTS), min_z=6.0)["losses"] == []  # the threshold is a setting
    md = headline_md("#1 opd", list(opd.values()), [], {})
    assert "No capability is lost for certain" in md and "The weakest, add, is at z -1.9" in md
    md = headline_md("#3 ties", capability_rows(CELLS, "#3 ties", EXPERTS),
                     strategy_rows(CELLS, {"#3 ties": {"candidate": {"strategy": "ties"}}}, EXPERTS), {})
    assert "**Lost for certain**" in md and "add (-5.5)" in md and "| -5.5 |" in md
    assert md.rstrip().endswith("| ties | #3 ties | 0.60 | 0.60 | 0.50 | add | 1 of 1 |")


def test_headline_places_a_perfect_copy_of_the_experts_on_these_splits():
    """With the splits' sizes in the matrix, the headline says where a student with exactly its experts'
    accuracy lands (opd.merge.noise): near 1 on huge splits, well below on small ones; without them, nothing."""
    from opd.merge.noise import Split, copy_minima

    assert "exactly its experts' accuracy" not in headline_md("#1 opd", capability_rows(CELLS, "#1 opd", EXPERTS), [], {})
    for n, near_one in ((1_000_000, True), (50, False)):
        cells = [{**c, "n": n} for c in CELLS]
        md = headline_md("#1 opd", capability_rows(cells, "#1 opd", EXPERTS), [], {})
        c = copy_minima([Split("add", n, 0.10, 0.50)])
        assert f"min retention of {c['retention_median']:.2f} ({c['retention_lo']:.2f}-{c['retention_hi']:.2f}" in md
        assert (c["retention_lo"] > 0.99) == near_one
    small = copy_minima([Split("add", 50, 0.10, 0.50)])
    # Bin(50, 0.5): 5th percentile 19 of 25 expected, so retention 0.76; by hand within a draw's rounding
    assert small["retention_lo"] == pytest.approx(19 / 25, abs=0.05) and small["retention_median"] == pytest.approx(1.0)
    assert copy_minima([Split("add", 50, 0.1, 0.5)], seed=3) == copy_minima([Split("add", 50, 0.1, 0.5)], seed=3)
