"""The finite range every quantity of the formats may take, as pydantic field types.

Every time, byte count and string a file holds is checked against one of these types, so that
what the planner computes from a valid file stays finite (no ``inf`` iteration, no NaN, no
overflow converting to float) and what the terminal prints is plain text.

Ranges (why these numbers):

- ``MAX_MS`` = 1e9 ms (about 11.6 days) per layer and micro-batch, and ``MIN_MS`` = 1e-6 ms
  (1 ns) the smallest non-zero one, so that a throughput (samples / time) stays finite too. A plan multiplies it by at
  most ``MAX_MICROBATCHES`` micro-batches and a few thousand layers, and squares it in the
  balancing DP; all of that stays far below float's 1.8e308.
- ``MAX_BYTES`` = 2**53 (8 PiB): the largest count a float holds exactly, so that memory sums in
  float and in int agree.
- ``MAX_MICROBATCHES`` = 4096 micro-batches per iteration: the simulator steps through every
  action, so planning time and memory grow with the count (gpt2-cpu at 4 stages, every schedule
  searched: 4096 micro-batches 3.9 s and 270 MB, 40,000 took 40 s and 2 GB); beyond it a request
  is refused with exit 2 and the limit (:func:`check_microbatch_count`).
- Names and other strings shown in the terminal: no control, format or bidirectional override
  characters (NUL, escape, U+202E), at most ``MAX_NAME_CHARS`` characters.

Examples
--------
>>> from pydantic import TypeAdapter, ValidationError
>>> TypeAdapter(Ms).validate_python(1.5)
1.5
>>> for kind, value in ((Ms, True), (Ms, 1e308), (Name, "blocks.0\\u202e")):
...     try:
...         TypeAdapter(kind).validate_python(value)
...     except ValidationError as exc:
...         print(exc.errors()[0]["msg"])
Value error, expected a number, found a boolean
Input should be less than or equal to 1000000000
Value error, contains the control character U+202E; names must be plain text
"""

from __future__ import annotations

import math
import unicodedata
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field
from pipeplan.errors import BadInputError

__all__ = [
    "MAX_MS",
    "MAX_BYTES",
    "MAX_COUNT",
    "MAX_MICROBATCHES",
    "MAX_NAME_CHARS",
    "MAX_NESTING",
    "Ms",
    "OptionalRatio",
    "Bytes",
    "PlanBytes",
    "PositiveBytes",
    "Bandwidth",
    "PlanMs",
    "Rate",
    "MIN_MS",
    "Count",
    "PositiveCount",
    "FiniteFloat",
    "Name",
    "Text",
    "plain_text_problem",
    "check_microbatch_count",
]

MAX_MS = 1e9
#: The finest time a profile may give (1 ns); below it, write 0.
MIN_MS = 1e-6
MAX_BYTES = 2**53
MAX_COUNT = 10**9
MAX_MICROBATCHES = 4096
MAX_NAME_CHARS = 1000
#: Deepest JSON nesting a file may have (the formats need 6; free-form ``measurement`` a few more).
MAX_NESTING = 64


def _number(value: Any) -> Any:
    # JSON true/false and "1.5" are not numbers; pydantic's lax mode would take them.
    if isinstance(value, bool):
        raise ValueError("expected a number, found a boolean")
    if isinstance(value, str):
        raise ValueError(f"expected a number, found the string {value[:40]!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number, found {value!r}")
    return value


def _integer(value: Any) -> Any:
    value = _number(value)
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise ValueError(f"expected a whole number, found {value!r}")
    return value


def plain_text_problem(text: str) -> str | None:
    """What makes ``text`` unfit to print in a terminal, or None.

    >>> plain_text_problem("layer.0"), plain_text_problem("a\\x00b")
    (None, 'contains the control character U+0000; names must be plain text')
    """
    for char in text:
        if unicodedata.category(char) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            return f"contains the control character U+{ord(char):04X}; names must be plain text"
    return None


def _plain_text(value: str) -> str:
    problem = plain_text_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _free_text(value: str) -> str:
    # Free text may span lines, but not carry terminal escapes or direction overrides.
    problem = plain_text_problem(value.replace("\n", " ").replace("\t", " "))
    if problem:
        raise ValueError(problem)
    return value


def _resolvable(value: float) -> float:
    if 0 < value < MIN_MS:
        raise ValueError(f"{value!r} ms is below {MIN_MS:g} ms (1 ns), the finest time pipeplan takes; write 0 "
                         f"or a larger time")
    return value


Ms = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False), BeforeValidator(_number),
               AfterValidator(_resolvable)]
"""A duration in milliseconds, 0 to MAX_MS."""
OptionalRatio = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False), BeforeValidator(_number)]
"""A non-negative ratio or coefficient (spread, fraction)."""
FiniteFloat = Annotated[float, Field(ge=-1e18, le=1e18, allow_inf_nan=False), BeforeValidator(_number)]
"""Any finite number of a sane size (predictions, bounds)."""
Rate = Annotated[float, Field(ge=0, allow_inf_nan=False), BeforeValidator(_number)]
"""A non-negative finite rate (samples per second)."""
PlanMs = Annotated[float, Field(ge=0, le=1e18, allow_inf_nan=False), BeforeValidator(_number)]
"""A duration a plan sums from many layers and micro-batches: finite, non-negative."""
PlanBytes = Annotated[int, Field(ge=0, le=2**63 - 1), BeforeValidator(_integer)]
"""A byte count a plan sums from many layers: up to a signed 64-bit integer."""
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES), BeforeValidator(_integer)]
"""A byte count, 0 to 2**53."""
PositiveBytes = Annotated[int, Field(gt=0, le=MAX_BYTES), BeforeValidator(_integer)]
"""A positive byte count (a memory cap)."""
Bandwidth = Annotated[float, Field(gt=0, le=1e18, allow_inf_nan=False), BeforeValidator(_number)]
"""Bytes per second, positive and finite (no bandwidth limit is null, not infinity)."""
Count = Annotated[int, Field(ge=0, le=MAX_COUNT), BeforeValidator(_integer)]
"""A non-negative count or index."""
PositiveCount = Annotated[int, Field(gt=0, le=MAX_COUNT), BeforeValidator(_integer)]
"""A positive count (samples, stages)."""
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_plain_text)]
"""A name printed in the terminal: plain text, no control characters."""
Text = Annotated[str, Field(max_length=100_000), AfterValidator(_free_text)]
"""Free text (descriptions, notes): lines allowed, terminal escapes not."""


def check_microbatch_count(global_batch: int, sizes: list[int], microbatch_size: int | None = None) -> None:
    """Refuse a request whose micro-batch count would pass ``MAX_MICROBATCHES``.

    The planner tries every profiled micro-batch size that divides the global batch (or the fixed
    one); the smallest gives the most micro-batches.

    Raises
    ------
    BadInputError
        Naming the limit and what to change.

    Examples
    --------
    >>> check_microbatch_count(1024, [1, 2, 4])
    >>> check_microbatch_count(10**12, [1, 2, 4])
    Traceback (most recent call last):
    ...
    pipeplan.errors.BadInputError: --global-batch: 1000000000000 makes 1000000000000 micro-batches of 1 sample; pipeplan plans at most 4096 micro-batches per iteration: give a smaller --global-batch or a larger --microbatch-size
    """
    if not isinstance(global_batch, int) or global_batch <= 0:
        return
    fitting = [microbatch_size] if microbatch_size else [b for b in sizes if global_batch % b == 0]
    if not fitting or not all(isinstance(b, int) and b > 0 for b in fitting):
        return
    smallest = min(fitting)
    count = global_batch // smallest
    if count > MAX_MICROBATCHES:
        raise BadInputError(
            f"--global-batch: {global_batch} makes {count} micro-batches of {smallest} sample"
            f"{'s' if smallest > 1 else ''}; pipeplan plans at most {MAX_MICROBATCHES} micro-batches per "
            f"iteration: give a smaller --global-batch or a larger --microbatch-size"
        )
