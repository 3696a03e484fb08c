"""Reading input files within bounds, before any model sees them: the size, integer digits,
nesting and array lengths of docs/formats.md's limits, with one-line errors naming the file.

The readers every format uses (:mod:`pipeplan.formats.io` offers them beside the models'
loaders); kept apart from the models so that a model module (the cluster spec) can read its own
files without importing the others.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

from pipeplan.errors import BadInputError
from pipeplan.formats.limits import MAX_ARRAY_ITEMS, MAX_FILE_BYTES, MAX_INT_DIGITS, MAX_NESTING

__all__ = ["check_structure", "check_integer_digits", "read_input_text", "parse_json_text", "load_json", "load_toml"]


def check_structure(data: Any, where: str | Path, kind: str = "JSON") -> Any:
    """Refuse parsed data nested deeper than MAX_NESTING or with an array or object longer than
    MAX_ARRAY_ITEMS (walked without recursion), before any model sees it.

    Raises
    ------
    BadInputError
        Naming ``where``, the path into the data and the limit.
    """
    stack = [(data, 1, "")]
    while stack:
        value, depth, at = stack.pop()
        if not isinstance(value, (list, dict)):
            continue
        if depth > MAX_NESTING:
            raise BadInputError(f"{where}: {kind} nested too deep (more than {MAX_NESTING} levels)")
        if len(value) > MAX_ARRAY_ITEMS:
            what = "array" if isinstance(value, list) else "table" if kind == "TOML" else "object"
            raise BadInputError(f"{where}: {at or '(top level)'}: {what} of {len(value)} items; pipeplan reads at "
                                f"most {MAX_ARRAY_ITEMS:,} items per {what}")
        if isinstance(value, dict):
            stack.extend((v, depth + 1, f"{at}.{k}" if at else str(k)) for k, v in value.items())
        else:
            stack.extend((v, depth + 1, f"{at}[{i}]") for i, v in enumerate(value))
    return data


#: An integer literal of more than MAX_INT_DIGITS digits (TOML allows ``_`` between digits);
#: not part of a float (a point or exponent after it) or of a longer word.
_LONG_INTEGER = re.compile(r"(?<![\w.])[0-9](?:_?[0-9]){%d,}(?![\w.])" % MAX_INT_DIGITS)


def check_integer_digits(text: str, where: str | Path) -> None:
    """Refuse a text holding an integer of more than MAX_INT_DIGITS digits, before parsing.

    >>> check_integer_digits("x = 12", "f")
    >>> check_integer_digits("x = " + "9" * 200, "f.toml")
    Traceback (most recent call last):
    ...
    pipeplan.errors.BadInputError: f.toml: line 1 column 5: an integer of 200 digits; pipeplan reads integers of at most 100 digits
    """
    match = _LONG_INTEGER.search(text)
    if match is None:
        return
    line = text.count("\n", 0, match.start()) + 1
    column = match.start() - (text.rfind("\n", 0, match.start()) + 1) + 1
    digits = sum(c.isdigit() for c in match.group())
    raise BadInputError(f"{where}: line {line} column {column}: an integer of {digits} digits; pipeplan reads "
                        f"integers of at most {MAX_INT_DIGITS} digits")


def read_input_text(path: str | Path, kind: str = "JSON", label: str | None = None) -> str:
    """A UTF-8 input file's text, at most MAX_FILE_BYTES, with no over-long integer.

    Reads at most one byte past the limit, so ``/dev/zero`` or a huge file is refused without
    being read whole.

    Raises
    ------
    BadInputError
        Missing, a folder, unreadable, too large, not UTF-8, or an integer too long.
    """
    path = Path(path)
    where = label or str(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise BadInputError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise BadInputError(f"{where}: is a directory, expected a {kind} file") from None
    except OSError as exc:
        raise BadInputError(f"{where}: cannot read: {exc.strerror or type(exc).__name__}") from None
    if len(data) > MAX_FILE_BYTES:
        raise BadInputError(f"{where}: larger than {MAX_FILE_BYTES // 2**20} MiB, the most pipeplan reads from a "
                            f"{kind} file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInputError(f"{where}: cannot read: not UTF-8 text (byte {exc.start})") from None
    check_integer_digits(text, where)
    return text


def parse_json_text(text: str, where: str | Path) -> Any:
    """Parse JSON text with one-line errors, and check its structure (:func:`check_structure`)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInputError(
            f"{where}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise BadInputError(f"{where}: JSON nested too deep (more than {MAX_NESTING} levels)") from None
    except ValueError as exc:  # an integer past Python's digit limit, should one get past the scan
        raise BadInputError(f"{where}: cannot read a number: {exc}") from None
    return check_structure(data, where)


def load_json(path: str | Path, label: str | None = None) -> Any:
    """Parse a JSON file, raising BadInputError with the file (or ``label``) and position."""
    return parse_json_text(read_input_text(path, "JSON", label), label or path)


def load_toml(path: str | Path, text: str | None = None, label: str | None = None) -> dict:
    """Parse a TOML file (or its ``text``, already read) with the same limits as JSON files."""
    where = label or str(path)
    if text is None:
        text = read_input_text(path, "TOML", label)
    else:
        check_integer_digits(text, where)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadInputError(f"{where}: not valid TOML: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise BadInputError(f"{where}: cannot read TOML: {exc}") from None
    return check_structure(data, where, "TOML")
