"""Progress with an ETA on stderr, so a long run is never a silent wait.

On a terminal it is a rich bar (elapsed and remaining time); otherwise (CI logs, `2> file`) a plain line at most
every `interval_s` seconds and one when each phase ends, so logs show the run is alive without flooding them.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def format_seconds(seconds: float) -> str:
    """12 s, 3 min 05 s."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


class PhaseProgress:
    """Phases of known size (a method's prefill layers, then its decode steps) reported as `update(label, done,
    total)`, starting with `done=0` when the phase starts. The ETA of a phase is its elapsed time scaled by what is
    left of it."""

    def __init__(self, console: Any = None, interval_s: float = 10.0, stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.enabled = enabled
        self._rich = None
        self._task = None
        self._label: str | None = None
        self._phase_start = self._last_line = time.monotonic()
        if enabled and console is not None and console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._rich = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                                  transient=True)

    def __enter__(self) -> PhaseProgress:
        if self._rich is not None:
            self._rich.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)

    def update(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if label != self._label:
            self._label, self._phase_start = label, now
            if self._rich is not None:
                if self._task is not None:
                    self._rich.remove_task(self._task)
                self._task = self._rich.add_task(label, total=total)
        if self._rich is not None:
            self._rich.update(self._task, completed=done, total=total)
            return
        if done == 0:  # a phase announced at its start: nothing measured yet
            return
        finished = done >= total
        if now - self._last_line >= self.interval_s or (finished and now - self._phase_start >= self.interval_s):
            self._last_line = now
            elapsed = now - self._phase_start
            eta = "done" if finished else (f"ETA {format_seconds(elapsed / done * (total - done))}" if done else
                                           "ETA unknown")
            print(f"{label}: {done}/{total}, {format_seconds(elapsed)} elapsed, {eta}", file=self.stream,
                  flush=True)
