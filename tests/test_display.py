"""The one live display: stages add sections to it; a terminal sees one block, a log plain text."""

import io
import time

from rich.console import Console

from opd.display import Display


def _text(display: Display) -> str:
    out = Console(file=io.StringIO(), width=200)
    out.print(display.render())
    return out.file.getvalue()


def test_sections_show_together_in_order_and_close_independently():
    d = Display(Console(file=io.StringIO(), force_terminal=True, width=200), every=0)
    with d.section("experts", lambda: "add: running | step 3"):
        assert d._live is not None and d._live.is_started  # the first section starts the display
        with d.section("search", lambda: "merge search 2/8"), d.section("search", lambda: "second search"):
            text = _text(d)
            assert text.index("add: running") < text.index("merge search") < text.index("second search")
        assert "merge search" not in _text(d) and "add: running" in _text(d)
        assert d._live is not None
    assert not d.active and d._live is None  # the last section stops it


def test_off_a_terminal_sections_print_as_plain_text_every_n_seconds():
    buf = io.StringIO()
    d = Display(Console(file=buf, force_terminal=False, width=200), every=0.1)
    with d.section("opd", lambda: "trial-3 opd OPD 5/10"):
        time.sleep(0.45)
    printed = buf.getvalue().count("trial-3 opd OPD 5/10")
    assert printed >= 2, buf.getvalue()
    time.sleep(0.3)
    assert buf.getvalue().count("trial-3 opd OPD 5/10") == printed  # nothing after the section closed
    assert "\x1b[" not in buf.getvalue()  # plain text, no cursor movement


def test_search_and_opd_bars_share_the_process_display(monkeypatch):
    """The merge search's board and an OPD student's bars are sections of one display, not two
    rich Live displays (rich refuses a second)."""
    import optuna

    from opd import display as display_mod
    from opd.display import LiveBoard
    from opd.distill.bar import opd_bar
    from opd.distill.config import DistillConfig
    from opd.merge.report import best_table

    shared = Display(Console(file=io.StringIO(), force_terminal=True, width=200), every=0)
    monkeypatch.setattr(display_mod, "display", shared)
    study = optuna.create_study(directions=["maximize"])
    cfg = DistillConfig(steps=10, warmstart_steps=4)
    with LiveBoard("merge search", 8, 3, lambda: best_table(study)), opd_bar("trial-3 merge_opd", cfg) as progress:
        class S:
            warm_step, step, best_min_retention, best_step = 4, 6, 0.91, 5

        progress(S, {"kl/add": 0.2, "kl/rev": 0.4})
        text = _text(shared)
    assert "merge search" in text and "3/8" in text
    assert "trial-3 merge_opd warm start" in text and "4/4" in text
    assert "trial-3 merge_opd OPD" in text and "6/10" in text and "KL 0.300" in text and "0.910@5" in text
    assert not shared.active and shared._live is None


def test_a_warm_start_alone_shows_its_notes_and_no_opd_bar(monkeypatch):
    """steps 0 (the offpolicy strategy): no empty OPD bar; the warm-start bar carries the note that
    `progress.status` sets while the teachers sample and score, before its first step."""
    from opd import display as display_mod
    from opd.distill.bar import opd_bar
    from opd.distill.config import DistillConfig

    shared = Display(Console(file=io.StringIO(), force_terminal=True, width=200), every=0)
    monkeypatch.setattr(display_mod, "display", shared)
    with opd_bar("trial-1 offpolicy", DistillConfig(steps=0, warmstart_steps=30)) as progress:
        progress.status("teachers sampling: add (1/12)")
        text = _text(shared)
        progress.status("")
        after = _text(shared)
    assert "trial-1 offpolicy warm start" in text and "0/30" in text
    assert "teachers sampling: add (1/12)" in text and "teachers sampling" not in after
    assert "trial-1 offpolicy OPD" not in text
