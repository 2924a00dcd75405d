"""Malformed recipes, specs and distillation run files, generated: every one is refused with an
OpdError, one line naming the file.

The bulk runs in-process through the four loaders (merge recipes, expert specs, base specs, OPD
runs); a few go through the real CLIs to check exit code 2, one stderr line, no traceback and
nothing written.
Each generator is built so that its output is certainly invalid: a valid document plus exactly one
defect (unknown key, wrong type, value out of range, broken YAML, a top level that is not a mapping).
"""

import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opd.distill.config import load_run
from opd.errors import OpdError
from opd.expert.spec import load_expert_spec
from opd.lab.base import load_base_spec
from opd.merge.recipe import load_recipe
from opd.paths import NAME_PATTERN

ROOT = Path(__file__).resolve().parents[1]

VALID = {
    "merge": {"base": "runs/base", "experts": ["add", "rev"], "strategies": {"ties": {"density": [0.3, 1.0]}},
              "budget": {"n_trials": 4}, "screening": {"limit": 10}, "objectives": {"aggregates": ["min"]}},
    "expert": {"capability": "count", "steps": 3, "gspo": {"group_size": 4, "lr": 1e-3}},
    "base": {"capabilities": ["add", "count"], "mixture": {"add": 1.0, "count": 1.0}, "steps": 10,
             "shape": {"hidden_size": 36}, "band": [0.1, 0.5]},
    "distill": {"teachers": ["add", "rev"], "distill": {"steps": 2, "lr": 1e-3, "eval_every": 1}, "threads": 1},
}
LOADERS = {"merge": load_recipe, "expert": load_expert_spec, "base": load_base_spec, "distill": load_run}
# Mapping-valued sections that refuse unknown keys, per kind ("" is the top level).
SECTIONS = {"merge": ["", "budget", "screening", "objectives"], "expert": ["", "gspo"], "base": ["", "shape"],
            "distill": ["", "distill"]}

# (dotted field, values of a type it can never take); pydantic's lax mode turns "3" into 3, so
# scalars get containers and containers get scalars of the wrong kind.
CONTAINERS = st.one_of(st.lists(st.integers(), min_size=1, max_size=3),
                       st.dictionaries(st.text("abc", min_size=1, max_size=3), st.integers(), min_size=1, max_size=2))
NOT_A_LIST = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(),
                       st.dictionaries(st.text("xyz", min_size=1, max_size=3), st.integers(), min_size=1, max_size=2))
NOT_A_DICT = st.one_of(st.integers(), st.lists(st.integers(), min_size=1, max_size=3), st.text("xyz", min_size=1))
WRONG_TYPES = {
    "merge": {"name": CONTAINERS, "base": CONTAINERS, "seed": CONTAINERS, "final_candidates": CONTAINERS,
              "threads": CONTAINERS, "experts": NOT_A_LIST, "strategies": NOT_A_DICT, "budget": NOT_A_DICT,
              "budget.n_trials": CONTAINERS, "screening.margin": CONTAINERS, "objectives.aggregates": NOT_A_LIST},
    "expert": {"capability": CONTAINERS, "base": CONTAINERS, "steps": CONTAINERS, "max_minutes": CONTAINERS,
               "gspo": NOT_A_DICT, "gspo.lr": CONTAINERS, "gspo.group_size": CONTAINERS,
               "gspo.drop_zero_variance": CONTAINERS, "engine_args": NOT_A_DICT, "score_capabilities": NOT_A_LIST,
               "deepspeed": st.one_of(st.integers(), st.lists(st.integers(), min_size=1)), "threads": CONTAINERS},
    "base": {"name": CONTAINERS, "seed": CONTAINERS, "shape": NOT_A_DICT, "shape.hidden_size": CONTAINERS,
             "capabilities": NOT_A_LIST, "mixture": NOT_A_DICT, "difficulty": NOT_A_DICT, "lr": CONTAINERS,
             "band": st.one_of(st.integers(), st.text("xyz", min_size=1)), "batch_size": CONTAINERS},
    "distill": {"name": CONTAINERS, "base": CONTAINERS, "teachers": NOT_A_LIST, "student": CONTAINERS,
                "student_merge": st.one_of(st.integers(), st.lists(st.integers(), min_size=1)),
                "distill": NOT_A_DICT, "distill.steps": CONTAINERS, "distill.lr": CONTAINERS,
                "distill.routes": NOT_A_DICT, "distill.mix": NOT_A_DICT, "teacher_servers": NOT_A_DICT,
                "threads": CONTAINERS, "out": CONTAINERS},
}
NON_POSITIVE = st.integers(max_value=0)
UNKNOWN_NAME = st.text("qwxz", min_size=3, max_size=8)  # no capability, method or strategy is spelled so
BAD_VALUES = {
    "merge": {"experts": st.just([]), "split": st.just("test"),
              "sampler": st.sampled_from(["grid", "cmaes", ""]), "final_candidates": NON_POSITIVE,
              "budget.n_trials": NON_POSITIVE, "budget.timeout_s": st.floats(max_value=0),
              "screening.margin": st.floats(max_value=-1e-3, allow_infinity=False),
              "objectives.aggregates": st.just(["max"]), "capabilities": UNKNOWN_NAME.map(lambda s: [s]),
              "strategies.ties": st.builds(lambda k: {k: 1.0}, UNKNOWN_NAME),
              "strategies.slerp": st.just({"t": [0.9, 0.1]}),
              "strategies.nearswap": st.just({}),  # its t has no default: it must be given
              "strategies": st.just({}) | UNKNOWN_NAME.map(lambda s: {s: {}})},
    "expert": {"capability": UNKNOWN_NAME, "steps": NON_POSITIVE, "eval_every": NON_POSITIVE,
               "max_minutes": st.floats(max_value=0), "reward": st.sampled_from(["exact", "", "Verifier"]),
               "engine": st.sampled_from(["vllm", "hf", ""]), "gspo.group_size": st.integers(max_value=1),
               "gspo.level": st.sampled_from(["seq", "tokens", "banana"]), "gspo.lr": st.floats(max_value=0),
               "gspo.min_informative": st.floats(min_value=1.001, max_value=1e6),
               "gspo.eps_low": st.floats(max_value=-1e-9, allow_infinity=False),
               "score_capabilities": UNKNOWN_NAME.map(lambda s: ["count", s])},
    "base": {"capabilities": UNKNOWN_NAME.map(lambda s: ["add", s]), "mixture": UNKNOWN_NAME.map(lambda s: {s: 1.0}),
             "difficulty": UNKNOWN_NAME.map(lambda s: {s: 2}), "steps": NON_POSITIVE, "batch_size": NON_POSITIVE,
             "lr_floor": st.floats(min_value=1.001, max_value=10), "band": st.just([0.9, 0.1]),
             "warmup": st.integers(max_value=-1)},
    "distill": {"teachers": st.just([]), "distill.steps": st.integers(max_value=-1),
                "distill.lr": st.floats(max_value=0), "distill.estimator": st.sampled_from(["exact", "", "Full"]),
                "distill.prompts_per_step": st.one_of(NON_POSITIVE, st.integers(min_value=4097)),
                "distill.group_size": NON_POSITIVE, "distill.checkpoint_every": NON_POSITIVE,
                "distill.lr_min_ratio": st.floats(min_value=1.001, max_value=10),
                "distill.lr_schedule": st.sampled_from(["linear", "", "Cosine"]),
                "distill.reward_weight": st.floats(max_value=-1e-9, allow_infinity=False),
                "threads": NON_POSITIVE, "distill.eval_limit": NON_POSITIVE,
                "distill.adaptive_mix": st.floats(max_value=-1e-9, allow_infinity=False)},
}
# Appended as a line of their own, each breaks any YAML document.
YAML_BREAKS = ["key: [1, 2", "key: {a: 1", "key: 'unclosed", "key: *undefined_alias", "a: b: c",
               "\tkey: 1", "key: !!python/object:os.system {}", "key: !!binary 'not base64 ???'", "- item"]
NON_MAPPINGS = st.one_of(st.lists(st.integers(), min_size=1), st.integers(min_value=1), st.floats(min_value=0.5),
                         st.text("abc ", min_size=1).filter(str.strip), st.just(True))


def _set(doc: dict, dotted: str, value) -> dict:
    *parents, leaf = dotted.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return doc


def _fields(kind: str, section: str) -> set[str]:
    from opd.distill.config import DistillConfig, DistillRun
    from opd.expert.settings import GSPOConfig
    from opd.expert.spec import ExpertSpec
    from opd.lab.base import BaseSpec
    from opd.lab.model import ModelShape
    from opd.merge.recipe import Budget, MergeRecipe, Objectives, Screening

    models = {("merge", ""): MergeRecipe, ("merge", "budget"): Budget, ("merge", "screening"): Screening,
              ("merge", "objectives"): Objectives, ("expert", ""): ExpertSpec, ("expert", "gspo"): GSPOConfig,
              ("base", ""): BaseSpec, ("base", "shape"): ModelShape, ("distill", ""): DistillRun,
              ("distill", "distill"): DistillConfig}
    return set(models[kind, section].model_fields)


@st.composite
def malformed(draw, kind: str) -> tuple[str, str | bytes]:
    """(defect, file content) for one certainly-invalid document of `kind`."""
    doc = yaml.safe_load(yaml.safe_dump(VALID[kind]))  # a deep copy
    defect = draw(st.sampled_from(["unknown_key", "wrong_type", "bad_value", "broken_yaml", "non_mapping"]))
    if defect == "unknown_key":
        section = draw(st.sampled_from(SECTIONS[kind]))
        key = draw(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
                   .filter(lambda k: k not in _fields(kind, section)))
        _set(doc, f"{section}.{key}" if section else key, draw(st.integers() | st.text(max_size=5)))
    elif defect == "wrong_type":
        field, values = draw(st.sampled_from(sorted(WRONG_TYPES[kind].items())))
        _set(doc, field, draw(values))
    elif defect == "bad_value":
        field, values = draw(st.sampled_from(sorted(BAD_VALUES[kind].items())))
        _set(doc, field, draw(values))
    elif defect == "broken_yaml":
        return defect, yaml.safe_dump(doc) + draw(st.sampled_from(YAML_BREAKS)) + "\n"
    else:
        return defect, yaml.safe_dump(draw(NON_MAPPINGS))
    return defect, yaml.safe_dump(doc)


_names = itertools.count()
_dir = Path(tempfile.mkdtemp(prefix="opd-fuzz-"))


def _refused(kind: str, content: str | bytes) -> OpdError:
    path = _dir / f"{kind}-{next(_names)}.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(OpdError) as info:
        LOADERS[kind](path)
    msg = str(info.value)
    assert "\n" not in msg.strip(), msg
    assert str(path) in msg, msg
    return info.value


# No example database: the run writes nothing into the checkout and is the same every time.
FUZZ = settings(max_examples=80, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(malformed("merge"))
def test_malformed_merge_recipes_are_refused(case):
    _refused("merge", case[1])


@FUZZ
@given(malformed("expert"))
def test_malformed_expert_specs_are_refused(case):
    _refused("expert", case[1])


@FUZZ
@given(malformed("base"))
def test_malformed_base_specs_are_refused(case):
    _refused("base", case[1])


@FUZZ
@given(malformed("distill"))
def test_malformed_distill_runs_are_refused(case):
    _refused("distill", case[1])


@pytest.mark.parametrize("kind", sorted(VALID))
def test_valid_documents_load(kind, tmp_path):
    """The generators' starting points are valid: the defect, not the base document, is refused."""
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(VALID[kind]))
    LOADERS[kind](path)


@pytest.mark.parametrize("kind", sorted(VALID))
def test_empty_or_missing_file_is_refused(kind, tmp_path):
    _refused(kind, "")  # an empty file misses required fields (experts, capability, mixture)
    with pytest.raises(OpdError, match="missing.yaml"):
        LOADERS[kind](tmp_path / "missing.yaml")


@pytest.mark.parametrize("kind", sorted(VALID))
def test_non_utf8_file_is_refused(kind):
    # A stray Latin-1 byte (a file saved by another editor) is not UTF-8.
    _refused(kind, yaml.safe_dump(VALID[kind]).encode() + b"# caf\xe9\n")


@pytest.mark.parametrize("kind", sorted(VALID))
def test_directory_is_refused(kind, tmp_path):
    with pytest.raises(OpdError, match=str(tmp_path)):
        LOADERS[kind](tmp_path)


CLI_CASES = [
    (["scripts/train_expert.py", "{f}"], "capability: count\nsteps: [1, 2\n"),
    (["scripts/train_expert.py", "{f}", "--out", "out"], "capability: count\ngspo: {lr: -1}\n"),
    (["scripts/train_expert.py", "{f}"], "- capability\n- count\n"),
    (["scripts/build_base.py", "--spec", "{f}", "--out", "out"], "capabilities: [add]\nmixture: [add]\n"),
    (["scripts/build_base.py", "--spec", "{f}", "--out", "out"], "capabilities: [add]\nmixture: {add: 1}\nsteps: 0\n"),
    (["-m", "opd.merge", "--recipe", "{f}", "--no-live"], "experts: [a]\nstrategies: {ties: {}}\nsplit: test\n"),
    (["-m", "opd.merge", "--recipe", "{f}", "--no-live"], "experts: [a]\nstrategies: {nope: {}}\n"),
    (["-m", "opd.distill", "{f}"], "teachers: [add]\ndistill: {steps: -1}\n"),
    (["-m", "opd.distill", "{f}"], "teachers: add\n"),
    (["-m", "opd.distill", "{f}"], "teachers: [add\n"),
]


@pytest.mark.parametrize("args,content", CLI_CASES, ids=[f"{a[0].split('/')[-1]}-{i}" for i, (a, _) in
                                                        enumerate(CLI_CASES)])
def test_cli_refuses_malformed_file(tmp_path, args, content):
    spec = tmp_path / "bad.yaml"
    spec.write_text(content)
    argv = [a if a.startswith("-") or a == "{f}" else (str(ROOT / a) if a.endswith(".py") else a) for a in args]
    r = subprocess.run([sys.executable, *[str(spec) if a == "{f}" else a for a in argv]], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "bad.yaml" in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # nothing written


# --- Hostile names and output paths -------------------------------------------------------------
# A name is one path component; an output lies under runs/ or experts/ (of the project, of the
# working directory, or of a root in OPD_OUTPUT_ROOTS) and replaces only an artifact of its own kind.

BAD_NAMES = st.one_of(
    st.sampled_from(["../runs/somedir", "..", ".", "/etc", "/tmp/x", "a/b", "a\\b/c", ".history", ".hidden",
                     "", " ", "a b", "x\n", "~", "runs/../..", "-/x", "ä/ö"]),
    st.text(min_size=1, max_size=12).filter(lambda s: re.fullmatch(NAME_PATTERN, s) is None),
)
NAMED = {"merge": (VALID["merge"], load_recipe),
         "expert": (VALID["expert"], load_expert_spec),
         "distill": ({"teachers": ["add"], "distill": {"steps": 2}}, load_run)}


@FUZZ
@given(st.sampled_from(sorted(NAMED)), BAD_NAMES)
def test_names_that_are_not_one_path_component_are_refused(kind, name):
    doc, loader = NAMED[kind]
    path = _dir / f"{kind}-{next(_names)}.yaml"
    path.write_text(yaml.safe_dump({**doc, "name": name}))
    with pytest.raises(OpdError) as info:
        loader(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and "'name'" in msg, msg


def _tree(*roots: Path) -> dict[str, str]:
    """Every path under `roots` (not following symlinks) -> what it is: file bytes' hash, link target, dir."""
    out = {}
    for root in roots:
        for p in [root, *root.rglob("*")]:
            if p.is_symlink():
                out[str(p)] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[str(p)] = "dir"
            elif p.exists():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """A project directory (the working directory) with runs/ and experts/ full of things that are not
    the artifact a command writes, and a victim directory outside it. Only runs/ and experts/ of this
    directory (and of the repository) are allowed roots."""
    project, victim = tmp_path / "project", tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    for d in ("runs/data", "runs/merge/notes", "experts/add", "experts/.history/add/v1-x", "runs/base"):
        (project / d).mkdir(parents=True)
        (project / d / "file.txt").write_text(d)
    (project / "experts/add/manifest.json").write_text(json.dumps({"kind": "base"}))  # not an expert
    (project / "runs/base/manifest.json").write_text("{not json")
    (project / "runs/file.txt").write_text("a file, not a directory")
    (project / "runs/link").symlink_to(victim)
    (project / "experts/link").symlink_to(victim / "precious.txt")
    monkeypatch.chdir(project)
    monkeypatch.delenv("OPD_OUTPUT_ROOTS", raising=False)
    return project, victim


def hostile_paths(project: Path, victim: Path) -> list[str]:
    return [str(victim), str(victim / "new"), "/", "/tmp", str(project), "..", "../victim", "../victim/new",
            "runs", "experts", "runs/../../victim", "experts/../../victim", "runs/../x", "runs/link",
            "runs/link/new", "experts/link", "runs/data", "runs/merge/notes", "experts/add", "runs/base",
            "runs/file.txt", "experts/.history/add", "runs/.base.ckpt", "runs/.x/y", "~/runs/x",
            str(project / "runs/data"), str(project / "experts/link"), "runs/data/.."]


def _writers():
    """Each command's entry point, called with a hostile output: (label, call)."""
    from opd.distill.config import DistillRun
    from opd.distill.run import run_distill
    from opd.expert.run import run_expert
    from opd.expert.spec import ExpertSpec
    from opd.lab.run import build_and_report
    from opd.merge import run_recipe
    from opd.merge.recipe import MergeRecipe

    return {
        "expert --out": lambda out: run_expert(ExpertSpec(capability="count", threads=1), out=Path(out)),
        "distill out": lambda out: run_distill(DistillRun(name="x", teachers=["add"], out=out)),
        "merge out": lambda out: run_recipe(MergeRecipe.model_validate({**VALID["merge"], "name": "x", "out": out})),
        "base --out": lambda out: build_and_report(None, out),
    }


@pytest.mark.parametrize("writer", ["expert --out", "distill out", "merge out", "base --out"])
def test_hostile_output_paths_are_refused_and_nothing_changes(hostile, writer):
    project, victim = hostile
    call = _writers()[writer]
    paths = hostile_paths(project, victim)
    if writer == "base --out":
        paths.remove("experts/add")  # its manifest says base: a base build may replace it
    before = _tree(project, victim)
    for out in paths:
        with pytest.raises(OpdError) as info:
            call(out)
        msg = str(info.value)
        assert "\n" not in msg, msg
        assert _tree(project, victim) == before, (writer, out)


def test_an_existing_artifact_of_the_same_kind_may_be_replaced(hostile):
    from opd.paths import check_output

    project, _ = hostile
    (project / "experts/count").mkdir()
    (project / "experts/count/manifest.json").write_text(json.dumps({"kind": "expert"}))
    assert check_output("experts/count", "--out", kind="expert") == Path("experts/count")
    assert check_output("runs/new/deep", "out", kind="distilled") == Path("runs/new/deep")
    assert check_output("runs/merge/empty", "out", markers=("results.json",))  # does not exist yet: fine
    with pytest.raises(OpdError, match="does not hold an opd distilled"):
        check_output("experts/count", "out", kind="distilled")  # an OPD run never overwrites an expert


def test_replaced_expert_is_kept_under_experts_history(tmp_path):
    from opd.paths import history_dir

    assert history_dir(tmp_path / "experts" / "add") == (tmp_path / "experts" / ".history" / "add").resolve()
    assert history_dir(tmp_path / "experts" / "lab10" / "add") == \
        (tmp_path / "experts" / ".history" / "lab10" / "add").resolve()


HOSTILE_CLI = [
    (["scripts/train_expert.py", "{f}", "--out", "../victim"], "capability: count\n"),
    (["-m", "opd.distill", "{f}"], "teachers: [add]\nout: /tmp\n"),
    (["-m", "opd.merge", "--recipe", "{f}", "--no-live"], "experts: [a]\nstrategies: {ties: {}}\nout: runs/link\n"),
    (["-m", "opd.distill", "{f}"], "teachers: [add]\nbase: nowhere\n"),  # a missing model: no hub call
]


@pytest.mark.parametrize("args,content", HOSTILE_CLI, ids=[str(i) for i in range(len(HOSTILE_CLI))])
def test_cli_refuses_hostile_output(hostile, args, content):
    project, victim = hostile
    spec = project / "bad.yaml"
    spec.write_text(content)
    before = _tree(project, victim)
    argv = [str(ROOT / a) if a.endswith(".py") else a for a in args]
    env = {k: v for k, v in os.environ.items() if k != "OPD_OUTPUT_ROOTS"}
    env.update(HF_HUB_OFFLINE="0", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, *[str(spec) if a == "{f}" else a for a in argv]], cwd=project, env=env,
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "bad.yaml" in lines[0], lines[0]
    assert _tree(project, victim) == before


def test_storage_password_is_never_written_or_printed(tmp_path):
    """A postgresql URL with a password: dumps (results.json, best/manifest.json, the model card all
    take the recipe's dump) and errors carry '***' instead."""
    from opd.merge.study import open_study

    path = tmp_path / "r.yaml"
    url = "postgresql+psycopg://opd:hunter2@127.0.0.1:9/db"
    path.write_text(yaml.safe_dump({**VALID["merge"], "storage": url, "out": str(tmp_path / "out")}))
    recipe = load_recipe(path)
    assert recipe.storage_url == url  # the connection itself still has it
    assert "hunter2" not in json.dumps(recipe.model_dump(mode="json")) + recipe.storage_label
    with pytest.raises(OpdError) as info:
        open_study(recipe, 1, resume=False, worker=False)
    assert "hunter2" not in str(info.value) and "opd:***@" in str(info.value)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert all(b"hunter2" not in p.read_bytes() for p in written if p != path)
