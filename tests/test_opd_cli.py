"""The `opd` command: every stage under one entry point, in pipeline order; bad input is one line."""

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from cli_inprocess import run_main

from opd.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]


def opd(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "opd.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_entry_point_is_declared():
    eps = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert eps.get("opd") == "opd.cli:main"


def test_help_lists_the_stages_in_pipeline_order():
    r = opd("--help")
    assert r.returncode == 0
    listed = [ln.split()[0] for ln in r.stdout.splitlines() if ln.startswith("  ")]
    assert listed == ["lab", "base", "train-expert", "distill", "merge", "export", "report"] == list(COMMANDS)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_has_its_own_help(name, capsys):
    from opd.cli import main

    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"usage: opd {name}")


@pytest.mark.parametrize("args, says", [
    (["nosuch"], "unknown command 'nosuch'"),
    (["train-expert", "missing.yaml"], "missing.yaml"),
    (["distill", "missing.yaml"], "missing.yaml"),
    (["merge", "--recipe", "missing.yaml"], "missing.yaml"),
    (["export", "runs/merge/missing", "3"], "missing"),
    (["report", "runs/merge/missing"], "missing"),
    (["base", "--spec", "missing.yaml"], "missing.yaml"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    from opd.cli import main

    before = sorted(p.name for p in tmp_path.iterdir())
    # in this process (tests/cli_inprocess.py): the `opd` command itself runs as a subprocess in the help test
    # above; a fresh interpreter per case spent ~5 s importing torch
    r = run_main(main, args, tmp_path)
    assert r.returncode == 2, r.stderr[-1000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], r.stderr
    assert "Traceback" not in r.stderr and sorted(p.name for p in tmp_path.iterdir()) == before
