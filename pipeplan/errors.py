"""The library's exceptions; the CLI maps each to one exit code.

``BadInputError`` (exit 2) is a problem with a file or option the user gave;
``InfeasibleError`` (exit 3) means nothing fits the request, and says what would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["PipeplanError", "BadInputError", "InfeasibleError", "format_validation_error"]


class PipeplanError(Exception):
    """Base class of every error pipeplan raises on purpose."""

    exit_code = 1


class BadInputError(PipeplanError):
    """A file or option is malformed; the message names the file, field and problem."""

    exit_code = 2


class InfeasibleError(PipeplanError):
    """No plan satisfies the request (like ``networkx.NetworkXUnfeasible``).

    The message says what would fit, e.g. the smallest memory cap or stage count.
    """

    exit_code = 3


def _location(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def format_validation_error(path: str | Path, error) -> str:
    """One line: ``file: field: problem``, the first problem of a pydantic ``ValidationError``, and how
    many others there are."""
    items = error.errors()
    if not items:
        return f"{path}: {error}"
    item = items[0]
    loc = _location(tuple(item["loc"]))
    message = item["msg"].removeprefix("Value error, ")
    if item["type"] == "missing":
        message = "missing field"
    line = f"{path}: {message}" if not item["loc"] else f"{path}: {loc}: {message}"
    if len(items) > 1:
        line += f" (and {len(items) - 1} more problem{'s' if len(items) > 2 else ''})"
    return line
