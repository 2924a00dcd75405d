"""Bad input: one line on stderr naming what to fix, exit code 2, no traceback, nothing written.

The entry points run in this process (tests/cli_inprocess.py); tests/test_fuzz_inputs.py runs each
script as a subprocess on malformed files."""

import json
from pathlib import Path

import pytest
from cli_inprocess import run_main

from opd.expert.cli import train_main
from opd.lab.cli import base_main

ROOT = Path(__file__).resolve().parents[1]
MAINS = {"scripts/build_base.py": base_main, "scripts/train_expert.py": train_main}


def run(args, cwd):
    """`python <script> <args>` in this process."""
    return run_main(MAINS[str(Path(args[0]).relative_to(ROOT))], args[1:], cwd)


def assert_user_error(r, *needles):
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("override,needles", [
    ("capabilities=[add,nope]", ["unknown capability 'nope'", "known: add"]),
    ("stepz=3", ["stepz", "unknown field"]),
    ("band=[0.9,0.1]", ["band"]),
])
def test_build_base_bad_overrides(tmp_path, override, needles):
    r = run([str(ROOT / "scripts/build_base.py"), "--out", str(tmp_path / "base"), override], tmp_path)
    assert_user_error(r, *needles)
    assert not any(tmp_path.iterdir())


def test_build_base_bad_spec_files(tmp_path):
    (tmp_path / "bad.yaml").write_text("steps: [1, 2\n")
    assert_user_error(run([str(ROOT / "scripts/build_base.py"), "--spec", "bad.yaml"], tmp_path), "bad.yaml", "YAML")
    assert_user_error(run([str(ROOT / "scripts/build_base.py"), "--spec", "missing.yaml"], tmp_path),
                      "missing.yaml", "not found")


def _spec(tmp_path, **fields):
    body = {"capability": "count", "steps": 1, **fields}
    p = tmp_path / "spec.yaml"
    p.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in body.items()) + "\n")
    return p


def test_train_expert_missing_base(tmp_path):
    spec = _spec(tmp_path, base=str(tmp_path / "nowhere"))
    r = run([str(ROOT / "scripts/train_expert.py"), str(spec), "--out", str(tmp_path / "out")], tmp_path)
    assert_user_error(r, "nowhere", "no config.json")
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_train_expert_unknown_capability_and_field(tmp_path):
    r = run([str(ROOT / "scripts/train_expert.py"), str(_spec(tmp_path, capability="nope"))], tmp_path)
    assert_user_error(r, "spec.yaml", "unknown capability 'nope'")
    r = run([str(ROOT / "scripts/train_expert.py"), str(_spec(tmp_path)), "gspo.eps_lo=0.1"], tmp_path)
    assert_user_error(r, "spec.yaml", "gspo.eps_lo", "unknown field")
    r = run([str(ROOT / "scripts/train_expert.py"), str(_spec(tmp_path)), "gspo.level=banana"], tmp_path)
    assert_user_error(r, "gspo.level", "sequence")


def test_train_expert_base_of_another_architecture(tmp_path):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16, vocab_size=60)).save_pretrained(tmp_path / "bert")
    spec = _spec(tmp_path, base=str(tmp_path / "bert"))
    r = run([str(ROOT / "scripts/train_expert.py"), str(spec), "--out", str(tmp_path / "out")], tmp_path)
    assert_user_error(r, "not a causal LM")
    assert not (tmp_path / "out").exists()
