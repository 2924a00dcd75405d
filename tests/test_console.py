"""A quiet console: other libraries' progress bars and known-harmless warnings are off by default;
`-v` brings them back."""

from __future__ import annotations

import logging
import warnings

import pytest

from opd.console import quiet_third_party


@pytest.fixture
def console_state(monkeypatch):
    """Leave the process as it was: verbose (the libraries' own defaults) and OPD_VERBOSE unset."""
    monkeypatch.setenv("OPD_VERBOSE", "0")
    yield
    quiet_third_party(verbose=True)


def _shown(record_msg: str) -> bool:
    rec = logging.LogRecord("DeepSpeed", logging.WARNING, "real_accelerator.py", 213, record_msg, None, None)
    return logging.getLogger("DeepSpeed").filter(rec)


def _warned(message: str) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(message, FutureWarning, stacklevel=1)
    return bool(caught)


def test_quiet_by_default_and_verbose_brings_it_back(console_state):
    import mergekit.tokenizer.build as mergekit_tokenizer
    import tqdm
    from transformers.utils import logging as hf_logging

    accel = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    dtype = "`torch_dtype` is deprecated! Use `dtype` instead!"
    assert quiet_third_party(verbose=False) is False
    assert not hf_logging.is_progress_bar_enabled()  # "Loading weights", "Writing model shards"
    assert hf_logging.get_verbosity() == logging.ERROR  # its torch_dtype deprecation is a logger warning
    # mergekit's "Building tokenizer permutations" bar passes no `disable`
    assert mergekit_tokenizer.tqdm.tqdm(range(2), desc="Building tokenizer permutations").disable
    assert not tqdm.tqdm(range(2), disable=False).disable  # a bar someone asked for explicitly stays
    assert not _shown(accel) and _shown("a real DeepSpeed warning")
    assert not _warned(dtype) and _warned("another deprecation")

    assert quiet_third_party(verbose=True) is True
    assert hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == logging.WARNING
    assert not mergekit_tokenizer.tqdm.tqdm(range(2), desc="Building tokenizer permutations").disable
    assert _shown(accel) and _warned(dtype)


def test_verbose_flag_on_the_command_line_and_in_child_processes(console_state, capsys):
    import os

    from transformers.utils import logging as hf_logging

    from opd.distill.__main__ import main

    for argv, verbose in ((["missing.yaml"], False), (["missing.yaml", "-v"], True)):
        with pytest.raises(SystemExit):
            main(argv)
        assert hf_logging.is_progress_bar_enabled() is verbose, argv
        assert (os.environ["OPD_VERBOSE"] == "1") is verbose  # the lab's expert runs inherit it
    assert "missing.yaml" in capsys.readouterr().err
    # a verbose parent makes its children verbose without -v
    assert quiet_third_party(verbose=False) is True
