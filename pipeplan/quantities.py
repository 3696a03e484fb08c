"""Parsing quantities users type: memory sizes and bandwidths."""

from __future__ import annotations

import math
import re

from pipeplan.errors import BadInputError

__all__ = ["parse_bytes", "parse_bandwidth", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
#: The formats' largest byte count (pipeplan.formats.limits.MAX_BYTES).
_MAX_BYTES = 2**53
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, option: str = "--memory-cap") -> int:
    """``'80GiB'``, ``'16e9'``, ``'512MB'`` to bytes.

    Examples
    --------
    >>> parse_bytes("16GiB")
    17179869184
    >>> parse_bytes("16e9")
    16000000000
    """
    match = _PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise BadInputError(
            f"{option}: {text!r} is not a size; write e.g. 80GiB, 16GB or 16e9 (bytes)"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise BadInputError(f"{option}: {text!r} must be positive")
    if not math.isfinite(value) or value > _MAX_BYTES:
        raise BadInputError(f"{option}: {text!r} is more than 2**53 bytes (8 PiB), the largest size pipeplan takes")
    return int(value)


def parse_bandwidth(text: str, option: str = "--bandwidth") -> float:
    """``'25GB/s'`` to bytes per second; ``'inf'`` to ``math.inf``.

    Examples
    --------
    >>> parse_bandwidth("25GB/s")
    25000000000.0
    >>> parse_bandwidth("inf")
    inf
    """
    text = str(text).strip()
    if text.lower() in ("inf", "infinite", "infinity"):
        return math.inf
    body = text[:-2] if text.lower().endswith("/s") else text
    try:
        return float(parse_bytes(body, option))
    except BadInputError as exc:
        if "2**53" in str(exc):
            raise BadInputError(f"{option}: {text!r} is more than 2**53 bytes/s; write inf to ignore transfers") from None
        raise BadInputError(
            f"{option}: {text!r} is not a bandwidth; write e.g. 25GB/s (bytes per second) or inf"
        ) from None


def format_bytes(value: float) -> str:
    """Human-readable binary size, e.g. ``'15.2 GiB'``."""
    value = float(value)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"
