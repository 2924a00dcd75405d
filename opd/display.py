"""One live display per process. Long stages add a section to it while they run: the lab's experts
table, the merge search's bar and best candidates, an OPD student's bar. On a terminal the sections
show as one block that updates in place (one rich `Live`; rich allows one at a time, so stages share
this one instead of opening their own). Off a terminal (CI, nohup) the same sections print as plain
text every `OPD_DISPLAY_EVERY` seconds (default 30), so a log shows progress instead of nothing.

    with display.section("search", lambda: board):   # any rich renderable, rendered on demand
        ...

`LiveBoard` is such a section for a search: a bar over trials and a table of the best so far.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

EVERY_ENV = "OPD_DISPLAY_EVERY"
console = Console(stderr=True)


class Display:
    """Named sections, rendered in the order they were added, shown while at least one is open."""

    def __init__(self, out: Console = console, every: float | None = None):
        self.console = out
        self.every = every if every is not None else float(os.environ.get(EVERY_ENV, "30"))
        self._sections: dict[str, Callable[[], RenderableType]] = {}
        self._lock = threading.RLock()
        self._live = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return bool(self._sections)

    def render(self) -> Group:
        with self._lock:
            renders = list(self._sections.values())
        return Group(*(r() for r in renders))

    @contextmanager
    def section(self, name: str, render: Callable[[], RenderableType]) -> Iterator[None]:
        """Show `render()` under `name` until the block ends; the first open section starts the display
        and the last one to close stops it."""
        with self._lock:
            key, i = name, 1
            while key in self._sections:  # two bars of one kind (nested OPD runs) both show
                i += 1
                key = f"{name}#{i}"
            self._sections[key] = render
            if len(self._sections) == 1:
                self._start()
        try:
            yield
        finally:
            with self._lock:
                self._sections.pop(key, None)
                if not self._sections:
                    self._halt()

    def _start(self) -> None:
        if self.console.is_terminal:
            self._live = Live(get_renderable=self.render, console=self.console, refresh_per_second=2,
                              transient=True)
            self._live.start()
        elif self.every > 0:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._print_every, args=(self._stop,), daemon=True)
            self._thread.start()

    def _print_every(self, stop: threading.Event) -> None:
        while not stop.wait(self.every):
            with self._lock:
                if not self._sections:
                    return
                self.console.file.write(self._plain())
                self.console.file.flush()

    def _plain(self) -> str:
        """The sections as plain text for a log, which has no width to fit: wide enough that bars and
        counts are not squeezed to "…" (a console off a terminal assumes 80 columns)."""
        out = Console(file=io.StringIO(), width=max(self.console.width, 160), force_terminal=False,
                      color_system=None)
        out.print(self.render())
        return "\n".join(line.rstrip() for line in out.file.getvalue().splitlines()) + "\n"

    def _halt(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._stop is not None:
            self._stop.set()
            self._stop = self._thread = None


display = Display()


def step_bar():
    """A rich Progress for a loop's section: each task's description, bar, steps done of total, elapsed
    time and an `info` field (add tasks with `info=""`)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"))


class LiveBoard:
    """A search's section of the display: a progress bar over its trials and a table of the best
    candidates so far. `table()` is rebuilt by `advance`, after each trial, never from the display's
    refresh thread (which would query the study's storage twice a second). Disabled (--no-live, a log
    file), `advance` gives `log` one plain line per finished trial instead."""

    def __init__(self, title: str, total: int | None, done: int, table: Callable[[], RenderableType], *,
                 enabled: bool = True, log: Callable[[str], object] | None = None):
        self.title, self.total, self.done, self.table = title, total, done, table
        self.enabled, self.log = enabled, log

    def __enter__(self) -> LiveBoard:
        if not self.enabled:
            return self
        self.progress = Progress(TextColumn(self.title), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        # a resumed search starts its bar where the study had got to
        self.task = self.progress.add_task("trials", total=self.total, completed=self.done)
        self._shown = self.table()
        self._section = display.section(self.title, lambda: Group(self.progress, self._shown))
        self._section.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._section.__exit__(*exc)

    def advance(self, line: Callable[[], str]) -> None:
        """One more trial finished: the bar moves and the table is rebuilt, or (disabled) `log` gets `line()`."""
        if not self.enabled:
            if self.log is not None:
                self.log(line())
            return
        self.progress.advance(self.task)
        self._shown = self.table()
