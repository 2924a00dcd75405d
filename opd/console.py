"""What the console shows of other libraries: their progress bars and known-harmless warnings are
silenced unless the user asks for them (`-v/--verbose` on every entry point)."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from functools import partialmethod

# Set by a verbose entry point, so the processes it starts (the lab's expert runs) are verbose too.
VERBOSE_ENV = "OPD_VERBOSE"
# Known-harmless messages: DeepSpeed says which accelerator it picked (a CPU machine is expected
# here); transformers' `torch_dtype` rename is called by libraries we do not control.
_DEEPSPEED_NOTES = ("Setting accelerator to", "Setting ds_accelerator to")
_TORCH_DTYPE = r".*`?torch_dtype`? is deprecated"


class _DropNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_DEEPSPEED_NOTES)


_DROP_NOTES = _DropNotes()
_TQDM_INIT = None  # tqdm's own __init__ while it is replaced by a silent one
_QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
_ENV_SET: list[str] = []  # the switches this module set (verbose removes them again)


def add_verbose_flag(ap) -> None:
    """The `-v/--verbose` option of every entry point (an argparse parser); pass its value to
    `quiet_third_party`."""
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="show other libraries' progress bars and warnings (silenced by default)")


def quiet_third_party(verbose: bool = False) -> bool:
    """Silence transformers' progress bars and warnings (its "Loading weights" and "Writing model
    shards" bars, the `torch_dtype` deprecation), every tqdm bar (mergekit's "Building tokenizer
    permutations" ignores its own quiet option) and DeepSpeed's accelerator note; `verbose` (or
    OPD_VERBOSE=1 from a verbose parent) restores them all. Returns whether the run is verbose."""
    verbose = verbose or os.environ.get(VERBOSE_ENV) == "1"
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    _tqdm(verbose)
    _transformers(verbose)
    ds = logging.getLogger("DeepSpeed")  # the logger DeepSpeed creates on import keeps this filter
    (ds.removeFilter if verbose else ds.addFilter)(_DROP_NOTES)
    warnings.filterwarnings("default" if verbose else "ignore", message=_TORCH_DTYPE)
    return verbose


def _tqdm(verbose: bool) -> None:
    """tqdm reads no switch at run time (TQDM_DISABLE only when it is imported), so its constructor
    gets disable=True as a default; a caller passing disable=False still shows its bar."""
    global _TQDM_INIT
    import tqdm  # lazy: every command's --help runs this module; tqdm would add ~0.1 s to it

    if verbose and _TQDM_INIT is not None:
        tqdm.tqdm.__init__, _TQDM_INIT = _TQDM_INIT, None
    elif not verbose and _TQDM_INIT is None:
        _TQDM_INIT = tqdm.tqdm.__dict__["__init__"]
        tqdm.tqdm.__init__ = partialmethod(_TQDM_INIT, disable=True)


def _transformers(verbose: bool) -> None:
    """Once transformers is imported its logging module is told directly; before, its environment
    switches are enough (importing it here would cost a second on every command, a bad input too)."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging  # lazy: only once loaded (see above)

        if verbose:
            hf_logging.set_verbosity_warning()
            hf_logging.enable_progress_bar()
        else:
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        return
    if verbose:
        while _ENV_SET:
            os.environ.pop(_ENV_SET.pop(), None)
    else:
        for key, value in _QUIET_ENV.items():
            if key not in os.environ:
                os.environ[key] = value
                _ENV_SET.append(key)
    if "huggingface_hub" in sys.modules:  # it read its switch on import; transformers will ask it
        from huggingface_hub import utils as hub  # lazy: only once loaded, as above

        (hub.enable_progress_bars if verbose else hub.disable_progress_bars)()
