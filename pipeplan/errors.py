"""The library's exceptions; the CLI maps each to one exit code.

``BadInputError`` (exit 2) is a problem with a file or option the user gave;
``InfeasibleError`` (exit 3) means nothing fits the request, and says what would.
"""

from __future__ import annotations

__all__ = ["PipeplanError", "BadInputError", "InfeasibleError"]


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
