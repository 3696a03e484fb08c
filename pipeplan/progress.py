"""Progress of long work (the cluster search, the pipeline search), for a terminal to show.

The library never prints: a search opens a :func:`task` and advances it; without a reporter
(the default, and always in pipes, JSON output and ``--quiet``) every call is a no-op that costs
a dictionary lookup. The CLI installs a reporter for a command's length with :func:`reporting`
(``pipeplan.cli_common.terminal_progress``: rich, on stderr, only when stderr is a terminal).

Examples
--------
>>> with task("searching layouts", total=3) as t:   # no reporter: nothing shown
...     t.advance(note="best 12.0 ms")
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Protocol

__all__ = ["Reporter", "Task", "reporting", "task"]


class Task(Protocol):
    """One piece of long work: ``advance`` by steps done, with a short note (the best so far)."""

    def advance(self, steps: int = 1, note: str = "") -> None: ...

    def close(self) -> None: ...


class Reporter(Protocol):
    """What shows tasks (the CLI's terminal display)."""

    def task(self, description: str, total: Optional[int]) -> Task: ...


class _Silent:
    def advance(self, steps: int = 1, note: str = "") -> None:
        pass

    def close(self) -> None:
        pass


_SILENT = _Silent()
_reporter: contextvars.ContextVar[Optional[Reporter]] = contextvars.ContextVar("pipeplan_progress", default=None)


@contextmanager
def reporting(reporter: Optional[Reporter]) -> Iterator[None]:
    """Show the tasks opened inside the block on ``reporter`` (None: show nothing)."""
    token = _reporter.set(reporter)
    try:
        yield
    finally:
        _reporter.reset(token)


@contextmanager
def task(description: str, total: Optional[int] = None) -> Iterator[Any]:
    """A task on the current reporter, closed at the end of the block; a silent one without."""
    reporter = _reporter.get()
    current = _SILENT if reporter is None else reporter.task(description, total)
    try:
        yield current
    finally:
        current.close()
