"""Where training curves go: TensorBoard event files next to a run's output, W&B, trackio, or nowhere.

The `report_to` setting of an expert spec, a distillation config and the base spec names a tracker
(as TRL's `report_to` does). A loop logs each record it appends to its history with
`tracker.log(record, step)`; the run's entry point opens the tracker and closes it.

TensorBoard event files of the output `<parent>/<name>` go to `<parent>/tb/<name>/`, beside the run's
checkpoint `<parent>/.<name>.ckpt/`: `tensorboard --logdir runs` shows every run under runs/.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator

from opd.errors import OpdError

PROJECT = "opd"  # the W&B / trackio project every run logs to
REPORT_TO_HELP = ("where training curves go: 'tensorboard' (event files in <parent>/tb/<name>/ beside the "
                  "output), 'wandb' or 'trackio' (when installed), 'none'")


def scalars(record: Mapping, prefix: str = "") -> Iterator[tuple[str, float]]:
    """A history record as (tag, value) pairs: nested mappings join with '/', `step` and values that
    are not numbers (a phase name) are left out. {"val": {"add": 0.5}} -> ("val/add", 0.5)."""
    for k, v in record.items():
        tag = f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from scalars(v, f"{tag}/")
        elif isinstance(v, bool | int | float) and not (k == "step" and not prefix):
            yield tag, float(v)


class Tracker:
    """Logs scalar records by step; a context manager that closes it. The base class logs nothing
    (`report_to: none`, and the ranks of a data-parallel run other than 0)."""

    package: str | None = None  # the package it needs

    def __init__(self, log_dir: Path | None = None, name: str = "", config: dict | None = None):
        pass

    def log(self, record: Mapping, step: int) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorBoardTracker(Tracker):
    package = "tensorboard"

    def __init__(self, log_dir: Path, name: str = "", config: dict | None = None):
        self.log_dir, self.writer = Path(log_dir), None

    def log(self, record: Mapping, step: int) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # lazy: torch is slow to import

            # Opened at the first step logged: a run resumed from its checkpoint logs again from
            # there, and purge_step hides what the killed run had logged from that step on.
            self.writer = SummaryWriter(str(self.log_dir), purge_step=step, flush_secs=10)
        for tag, value in scalars(record):
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker(Tracker):
    package = "wandb"

    def __init__(self, log_dir: Path, name: str = "", config: dict | None = None):
        import wandb  # lazy: wandb is an optional dependency

        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        # One W&B run per output: a resumed run continues it (W&B drops steps it already has).
        id_file = log_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        id_file.write_text(run_id)
        self.run = wandb.init(project=PROJECT, name=name or None, id=run_id, resume="allow", dir=str(log_dir),
                              config=config)

    def log(self, record: Mapping, step: int) -> None:
        self.run.log(dict(scalars(record)), step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker(Tracker):
    package = "trackio"

    def __init__(self, log_dir: Path, name: str = "", config: dict | None = None):
        import trackio  # lazy: trackio is an optional dependency

        self.trackio = trackio
        trackio.init(project=PROJECT, name=name or None, config=config, resume="allow")

    def log(self, record: Mapping, step: int) -> None:
        # trackio's dashboard plots NaN as a gap; it cannot store one
        self.trackio.log({k: v for k, v in scalars(record) if not math.isnan(v)}, step=step)

    def close(self) -> None:
        self.trackio.finish()


TRACKERS: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                      "trackio": TrackioTracker, "none": Tracker}


def check_report_to(name: str) -> str:
    """`name` when its tracker can run here; otherwise one line saying what to install."""
    if name not in TRACKERS:
        raise OpdError(f"report_to {name!r}: unknown; choose one of {', '.join(TRACKERS)}")
    pkg = TRACKERS[name].package
    if pkg is not None and importlib.util.find_spec(pkg) is None:
        raise OpdError(f"report_to {name!r}: the {pkg} package is not installed (pip install {pkg}); "
                       "or choose tensorboard or none")
    return name


# The config field: a valid name whose package is installed (checked when the file is loaded).
ReportTo = Annotated[Literal["tensorboard", "wandb", "trackio", "none"], AfterValidator(check_report_to)]


def tracking_dir(out: str | Path) -> Path:
    """Where the tracker of the run writing `out` keeps its files: `<parent>/tb/<name>`."""
    out = Path(out)
    return out.parent / "tb" / out.name


def open_tracker(report_to: str, log_dir: Path, name: str = "", config: dict | None = None) -> Tracker:
    """The tracker `report_to` names, writing under `log_dir` (see `tracking_dir`)."""
    return TRACKERS[check_report_to(report_to)](log_dir, name, config)
