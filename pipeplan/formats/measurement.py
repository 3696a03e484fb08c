"""The free-form ``measurement`` record of a profile: the keys pipeplan reads, checked by type.

A profile's ``measurement`` keeps whatever its maker recorded; the keys the planner, the exports
and ``run`` read are checked here (:func:`check_measurement`), as strictly as the fields are.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import StrictBool, TypeAdapter, ValidationError

from pipeplan.formats.limits import Bandwidth, Ms, Name, NonNegativeFloat, PositiveCount

__all__ = ["check_measurement"]


#: The ``measurement`` keys the planner, the exports and ``run`` read, with their types; the
#: rest of ``measurement`` is free-form record. A type here must be as strict as the fields'
#: (a string "1.5" or true is not a time), or ``validate`` passes what ``plan`` then crashes on.
_MEASUREMENT_TYPES: dict[str, Any] = {
    "action_overhead_ms": Ms,
    "device_type": Name,
    "fx_error": Optional[str],  # an exception's text: printed escaped (cli_common.one_line)
    "model_flops_per_token": Optional[NonNegativeFloat],
    "stage_builders": Optional[dict[str, Any]],
    "config_shape": Optional[dict[str, Any]],
    "gpu": Optional[dict[str, Any]],
}
_NESTED_TYPES: dict[tuple[str, str], Any] = {
    ("stage_builders", "units"): StrictBool,
    ("stage_builders", "traced"): StrictBool,
    ("stage_builders", "run_uses"): Optional[Name],
    ("stage_builders", "traced_error"): Optional[str],
    ("config_shape", "num_heads"): Optional[PositiveCount],
    ("config_shape", "num_kv_heads"): Optional[PositiveCount],
    ("gpu", "name"): Optional[Name],
    ("gpu", "hbm_bytes_per_s"): Optional[Bandwidth],
    ("gpu", "peak_flops"): Optional[dict[str, Bandwidth]],
}
_ADAPTERS: dict[Any, TypeAdapter] = {}


def _check_value(kind: Any, value: Any, where: str) -> None:
    adapter = _ADAPTERS.get(kind) or _ADAPTERS.setdefault(kind, TypeAdapter(kind))
    try:
        adapter.validate_python(value, strict=kind is StrictBool or None)
    except ValidationError as exc:
        message = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}: {message}") from None


def check_measurement(measurement: Optional[dict[str, Any]]) -> None:
    """Check the ``measurement`` keys pipeplan reads (``_MEASUREMENT_TYPES``); raise ValueError.

    >>> check_measurement({"action_overhead_ms": 0.5, "torch": "2.13"})
    >>> check_measurement({"action_overhead_ms": "1.5"})
    Traceback (most recent call last):
    ...
    ValueError: action_overhead_ms: expected a number, found the string '1.5'
    """
    if not measurement:
        return
    for key, kind in _MEASUREMENT_TYPES.items():
        if key in measurement:
            _check_value(kind, measurement[key], key)
    for (outer, key), kind in _NESTED_TYPES.items():
        table = measurement.get(outer)
        if isinstance(table, dict) and key in table:
            _check_value(kind, table[key], f"{outer}.{key}")
