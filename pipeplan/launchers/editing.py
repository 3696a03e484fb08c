"""Text edits that keep a user's launcher file (``doctor --fix``): where a line's comment starts,
and what a plan recomputes in the one word a launcher setting takes.

Each launcher's home edits its own file (``pipeplan.launchers.<name>.fix``) with these.
"""

from __future__ import annotations

from pipeplan.errors import BadInputError
from pipeplan.formats.plan import Plan

__all__ = ["code_part", "recompute_mode"]


def code_part(line: str) -> int:
    """Index where a line's comment starts (outside quotes), or its length."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1] in " \t"):
            return i
    return len(line)


def recompute_mode(plan: Plan) -> str:
    """``none``, ``selective`` or ``full``: what the plan's stages recompute (the same on all)."""
    modes = {("selective" if s.recompute_granularity == "selective" else "full") if s.recompute else "none"
             for s in plan.stages}
    if len(modes) != 1:
        raise BadInputError("--fix: the best plan recomputes on some stages only, which the launcher cannot say")
    return modes.pop()
