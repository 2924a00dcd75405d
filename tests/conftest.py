"""Shared fixtures: tiny real Qwen3 models built on the CPU in milliseconds."""

from __future__ import annotations

import os

import pytest
import torch

from opd.lab.model import build_model
from opd.lab.pico import PICO, build_trained_pico
from opd.lab.tokenizer import build_char_tokenizer


@pytest.fixture(scope="session", autouse=True)
def _output_root(tmp_path_factory):
    """pytest's temp directory is an allowed output root (opd.paths) for the whole session, so module-
    and session-scoped fixtures (set up before any function-scoped one) may write there too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPD_OUTPUT_ROOTS", str(tmp_path_factory.getbasetemp()))
        yield


@pytest.fixture(autouse=True)
def _isolated(tmp_path, tmp_path_factory, monkeypatch):
    """Each test gets its own eval cache and one torch thread (the CI box has 2 cores); pytest's temp
    directory is an allowed output root (opd.paths), so tests write their artifacts there."""
    monkeypatch.setenv("OPD_CACHE", str(tmp_path / "opd-cache"))
    monkeypatch.setenv("OPD_OUTPUT_ROOTS", str(tmp_path_factory.getbasetemp()))
    torch.set_num_threads(1)


@pytest.fixture
def scored(monkeypatch):
    """Every lm-eval run as (model hash, split, limit): what the content-hash cache did not answer."""
    import opd.evaluation.api as api
    from opd.io import state_dict_hash

    calls = []
    real = api._run_lm_eval

    def counting(model, tokenizer, capabilities, split, limit, batch_size, **kw):
        calls.append((state_dict_hash(model), split, limit))
        return real(model, tokenizer, capabilities, split, limit, batch_size, **kw)

    monkeypatch.setattr(api, "_run_lm_eval", counting)
    return calls


def skip_missing(reason: str) -> None:
    """Skip a test for a missing system dependency, except under CI (`OPD_CI=1`, set by .ci/run),
    where what CI is meant to run must run: there it fails instead."""
    if os.environ.get("OPD_CI"):
        pytest.fail(f"CI is meant to run this test: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def pico_model(tokenizer):
    """A 2-layer, hidden-32 Qwen3 with the lab tokenizer (random weights, seed 0)."""
    return build_model(PICO, tokenizer, seed=0)


@pytest.fixture
def pico_dir(tmp_path, tokenizer):
    """The pico model saved as an HF model directory with its tokenizer."""
    model = build_model(PICO, tokenizer, seed=0)
    d = tmp_path / "pico"
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def trained_pico_dir(tmp_path_factory, tokenizer):
    """A pico model trained for a few seconds on `count` (see opd.lab.pico.build_trained_pico)."""
    torch.set_num_threads(1)
    d = build_trained_pico(tmp_path_factory.mktemp("trained") / "pico-count")
    return d


@pytest.fixture(scope="module")
def lab3(tmp_path_factory):
    """A fake lab (test_merge_fakes) with experts add, rev and sort, and the merge-key state dicts of
    its base and experts: {"base": sd, "add": sd, ...}."""
    from test_merge_fakes import build_fake_lab
    from transformers import AutoModelForCausalLM

    from opd.weights.merge import merge_keys

    lab = build_fake_lab(tmp_path_factory.mktemp("lab"), ("add", "rev", "sort"))
    sds = {n: merge_keys(AutoModelForCausalLM.from_pretrained(p).state_dict()) for n, p in
           [("base", lab["base"]), *lab["experts"].items()]}
    return lab, sds
