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
    "MAX_FILE_BYTES",
    "MAX_PARALLEL_DEGREE",
    "MAX_ARRAY_ITEMS",
    "MAX_INT_DIGITS",
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
    "Fraction",
    "NonNegativeFloat",
    "MicrobatchCount",
    "Name",
    "MAX_GPUS_PER_NODE",
    "NodeGpus",
    "LinkBandwidth",
    "LatencyUs",
    "Efficiency",
    "Share",
    "Text",
    "plain_text_problem",
    "check_microbatch_count",
    "check_option_range",
    "MODEL_OPTION_LIMITS",
    "MAX_TIMELINE_WIDTH",
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
#: Largest pipeline, tensor, data or context degree (and p x v) a launcher config may give doctor.
MAX_PARALLEL_DEGREE = 65_536
#: Largest file pipeplan reads (JSON, TOML, launch script, graph.txt): 64 MiB, checked before parsing.
MAX_FILE_BYTES = 64 * 2**20
#: Most items one JSON/TOML array or object may hold (a 50,000-node PipeDream graph needs ~100,000).
MAX_ARRAY_ITEMS = 200_000
#: Most digits an integer in a file may have, checked before parsing: every count and byte count
#: fits in 20 digits; Python refuses to convert past 4,300 anyway (an internal error before).
MAX_INT_DIGITS = 100


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


def _toml_integer(value: Any) -> Any:
    # A TOML file says 8 or 8.0 or "8" on purpose: only the first is a count.
    value = _number(value)
    if isinstance(value, float):
        raise ValueError(f"expected a whole number, found the float {value!r}; write it without a point")
    return value


def plain_text_problem(text: str) -> str | None:
    """What makes ``text`` unfit to print in a terminal, or None.

    >>> plain_text_problem("layer.0"), plain_text_problem("a\\x00b")
    (None, 'contains the control character U+0000; names must be plain text')
    """
    if text.isascii() and text.isprintable():
        return None  # the common case, without a category look-up per character (50,000-layer profiles)
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
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False), BeforeValidator(_number)]
"""A share, 0 to 1 (``Field(ge=...)`` beside an annotated type does not narrow it: its own bounds win)."""
NonNegativeFloat = Annotated[float, Field(ge=0, le=1e18, allow_inf_nan=False), BeforeValidator(_number)]
"""A finite number of a sane size, not negative (seconds, throughputs)."""
MicrobatchCount = Annotated[int, Field(gt=0, le=MAX_MICROBATCHES), BeforeValidator(_integer)]
"""Micro-batches per iteration, 1 to MAX_MICROBATCHES."""
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
#: Most GPUs one node of a cluster spec may have (NVL72 racks have 72).
MAX_GPUS_PER_NODE = 4096
NodeGpus = Annotated[int, Field(gt=0, le=MAX_GPUS_PER_NODE), BeforeValidator(_toml_integer)]
"""GPUs in one node of a cluster spec: a whole number, 1 to MAX_GPUS_PER_NODE."""
LinkBandwidth = Annotated[float, Field(ge=1e6, le=1e15, allow_inf_nan=False), BeforeValidator(_number)]
"""A link's bytes per second, 1 MB/s to 1 PB/s (beyond, the collective times stop being finite or sane)."""
LatencyUs = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False), BeforeValidator(_number)]
"""A link latency, 0 to 1e6 us (one second)."""
Efficiency = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False), BeforeValidator(_number)]
"""A share of a bandwidth achieved, above 0 and at most 1."""
Share = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False), BeforeValidator(_number)]
"""A share added on top, 0 to below 1 (fragmentation)."""
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_plain_text)]
"""A name printed in the terminal: plain text, no control characters."""
Text = Annotated[str, Field(max_length=100_000), AfterValidator(_free_text)]
"""Free text (descriptions, notes): lines allowed, terminal escapes not."""


#: The sizes a model option may take (``profile``, ``run``): beyond them building or estimating the
#: model runs for hours or out of memory (``--layers 1000000`` built a million blocks).
MODEL_OPTION_LIMITS = {"--layers": 10_000, "--hidden": 1_000_000, "--heads": 10_000, "--vocab": 10_000_000,
                       "--seq-len": 10_000_000}
#: Widest timeline ``show --timeline`` draws, in characters.
MAX_TIMELINE_WIDTH = 10_000


def check_option_range(option: str, value: Any, low: int = 1, high: int | None = None) -> None:
    """Refuse an option outside ``low..high`` (``high`` defaults to ``MODEL_OPTION_LIMITS[option]``).

    >>> check_option_range("--layers", 12)
    >>> check_option_range("--layers", 1000000)
    Traceback (most recent call last):
    ...
    pipeplan.errors.BadInputError: --layers: 1000000 is more than 10,000, the most pipeplan takes
    """
    if value is None:
        return
    high = MODEL_OPTION_LIMITS[option] if high is None else high
    if value < low:
        raise BadInputError(f"{option}: {value} must be at least {low}")
    if value > high:
        raise BadInputError(f"{option}: {value} is more than {high:,}, the most pipeplan takes")


def check_microbatch_count(global_batch: int, sizes: list[int], microbatch_size: int | None = None,
                           replicas: int = 1) -> None:
    """Refuse a request whose micro-batch count per replica would pass ``MAX_MICROBATCHES``.

    The planner tries every profiled micro-batch size that divides the global batch (or the fixed
    one); the smallest gives the most micro-batches. The limit is per pipeline: with ``replicas``
    data-parallel replicas (the most a cluster search may use), each runs ``1 / replicas`` of them.

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
    replicas = max(1, int(replicas))
    count = global_batch // (smallest * replicas)
    if count > MAX_MICROBATCHES:
        per = f" per replica ({replicas} data-parallel replicas)" if replicas > 1 else ""
        raise BadInputError(
            f"--global-batch: {global_batch} makes {count} micro-batches of {smallest} sample"
            f"{'s' if smallest > 1 else ''}{per}; pipeplan plans at most {MAX_MICROBATCHES} micro-batches per "
            f"iteration{' of a replica' if replicas > 1 else ''}: give a smaller --global-batch or a larger "
            f"--microbatch-size"
        )
