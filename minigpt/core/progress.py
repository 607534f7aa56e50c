"""A progress bar for the silent stretches: the steps between two log lines, and tokenising a
big file. On a terminal only: a bar in a pipe, a log file or a CI log is a stream of carriage
returns, so it is off when stdout or stderr is not a TTY, when $CI is set, and on every rank but 0
(eight ranks drawing eight bars over each other help no one)."""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO


def progress_enabled(
    rank: int | None = None, streams: tuple[TextIO, ...] | None = None, environ: dict | None = None
) -> bool:
    """Whether to draw a bar: rank 0 (default: $RANK, as torchrun sets it), both streams on a
    terminal, not under CI (which sets $CI), not a dumb terminal, and tqdm installed."""
    environ = os.environ if environ is None else environ
    rank = int(environ.get("RANK", "0") or 0) if rank is None else rank
    streams = (sys.stdout, sys.stderr) if streams is None else streams
    if rank != 0 or environ.get("CI") or environ.get("TERM") == "dumb":
        return False
    if not all(getattr(s, "isatty", lambda: False)() for s in streams):
        return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


class _ClearBeforeRecord(logging.Filter):
    """Clears the bar before a log record reaches the console, so the line is not torn; the
    bar is drawn again on the next update."""

    def __init__(self, progress: Progress):
        super().__init__()
        self.progress = progress

    def filter(self, record: logging.LogRecord) -> bool:
        self.progress.clear()
        return True


class Progress:
    """tqdm's bar on stderr when `enabled`, otherwise nothing at all (every method a no-op).
    It vanishes when closed (leave=False): the log lines are the record, the bar is a pulse."""

    def __init__(
        self,
        total: int | None,
        enabled: bool,
        desc: str = "",
        unit: str = "step",
        unit_scale: bool = False,
        file: TextIO | None = None,
    ):
        self.bar = None
        self._filter: tuple[logging.Logger, logging.Filter] | None = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                unit_scale=unit_scale,
                leave=False,
                dynamic_ncols=True,
                file=file or sys.stderr,
            )

    @property
    def enabled(self) -> bool:
        return self.bar is not None

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def reset(self, total: int | None = None) -> None:
        """Start again from zero, for the next interval between log lines."""
        if self.bar is not None:
            self.bar.reset(total=total)

    def clear(self) -> None:
        if self.bar is not None:
            self.bar.clear()

    def attach(self, logger: logging.Logger) -> Progress:
        """Clear the bar before each record the logger emits (its console lines stay whole)."""
        if self.bar is not None and self._filter is None:
            self._filter = (logger, _ClearBeforeRecord(self))
            logger.addFilter(self._filter[1])
        return self

    def close(self) -> None:
        if self._filter is not None:
            self._filter[0].removeFilter(self._filter[1])
            self._filter = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
