"""Where bash's words and statements end, in one logical line of a launch script: quotes,
brackets, ``${...}`` nesting, comments, the ``; && || |`` separators. Read only, never run
(:mod:`pipeplan.launchers.megatron.shell` reads the script with these)."""

from __future__ import annotations

from pipeplan.errors import BadInputError

__all__ = ["outside_quotes", "array_closed", "statements", "closing_brace"]


def outside_quotes(line: str) -> str:
    """``line`` with quoted text blanked (to find ``<<WORD`` only where bash sees it)."""
    out, quote = [], None
    for c in line:
        if quote:
            out.append(" ")
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
            out.append(" ")
        else:
            out.append(c)
    return "".join(out)


def array_closed(text: str) -> bool:
    """Whether the ``(`` that opens ``text``'s array has its ``)`` in it (quotes and comments skipped)."""
    depth, quote, i = 0, None, 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1] in " \t\n"):
            end = text.find("\n", i)
            if end < 0:
                break
            i = end
            continue
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return True
        i += 1
    return False


def statements(line: str):
    """Split a logical line at ; && || | outside quotes and brackets.

    Returns (statement, conditional) pairs: conditional when it follows ``&&``, ``||`` or ``|``
    (so it may not run, or runs in a subshell: an ``exit`` there does not end the script).
    """
    parts, current, quote, depth, i = [], [], None, 0, 0
    after: list[bool] = [False]
    while i < len(line):
        c = line[i]
        if quote:
            current.append(c)
            if c == "\\" and quote in ('"', "$'") and i + 1 < len(line):
                current.append(line[i + 1])
                i += 2
                continue
            if c == quote[-1]:
                quote = None
        elif c in "'\"":
            quote = "$'" if c == "'" and i and line[i - 1] == "$" else c  # $'...' takes \' inside
            current.append(c)
        elif c == "\\" and i + 1 < len(line):
            current.append(line[i:i + 2])
            i += 2
            continue
        elif c in "({":
            depth += 1
            current.append(c)
        elif c in ")}":
            depth = max(0, depth - 1)
            current.append(c)
        elif c == "#" and not depth and (i == 0 or line[i - 1] in " \t"):
            break
        elif not depth and (c == ";" or line.startswith("&&", i) or line.startswith("||", i) or c == "|"):
            parts.append("".join(current))
            after.append(c != ";")
            current = []
            i += 2 if line.startswith(("&&", "||"), i) else 1
            continue
        else:
            current.append(c)
        i += 1
    if quote:
        raise BadInputError(f"unterminated {quote} quote in: {line.strip()[:80]}")
    parts.append("".join(current))
    return list(zip(parts, after))


def closing_brace(text: str, start: int) -> int:
    """Index of the ``}`` closing the ``${`` at ``start`` (nested ``${...}`` inside), or -1."""
    depth, i = 0, start
    while i < len(text):
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1
