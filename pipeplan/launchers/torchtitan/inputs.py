"""The other ways torchtitan is given a job: a Python config registry and command-line overrides.

torchtitan's main branch defines jobs as Python functions that return a job config (a registry of
``module:function`` entries) instead of TOML files, and every torchtitan job takes command-line
overrides of single settings (``--parallelism.tensor_parallel_degree=8``, after
``--job.config_file``). doctor reads both into the same nested ``{section: {key: value}}`` that a
TOML job config gives, so :func:`pipeplan.launchers.torchtitan.reader.parse_torchtitan` reads them all alike.

The registry function is imported and called as torchtitan itself does: it is the user's own code,
run in this process, from the current directory.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import tomllib
from pathlib import Path
from typing import Any

from pipeplan.errors import BadInputError

__all__ = ["is_registry_spec", "registry_job", "apply_overrides"]


def is_registry_spec(text: str) -> bool:
    """``module:function`` (a dotted module, a function name), not a file that exists.

    Examples
    --------
    >>> is_registry_spec("my_jobs.llama3:llama3_8b"), is_registry_spec("job.toml")
    (True, False)
    """
    module, sep, name = str(text).partition(":")
    return (bool(sep) and name.isidentifier() and all(part.isidentifier() for part in module.split("."))
            and not Path(text).exists())


def _as_dict(value: Any, where: str) -> dict:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    for method in ("to_dict", "model_dump"):
        if callable(getattr(value, method, None)):
            return getattr(value, method)()
    if isinstance(value, dict):
        return value
    raise BadInputError(f"{where}: returned {type(value).__name__}, not a job config (a dataclass or a dict of "
                        f"sections)")


def registry_job(spec: str) -> dict:
    """Import ``module`` and call ``function()``: the job config it returns, as nested dicts.

    Raises
    ------
    BadInputError
        The module does not import, the function is missing or raises, or what it returns is not
        a job config (the message names ``spec``).
    """
    module_name, _, function_name = spec.partition(":")
    added = str(Path.cwd())
    if added not in sys.path:
        sys.path.insert(0, added)  # torchtitan runs from the user's checkout
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's code: any failure is theirs to see, in one line
        raise BadInputError(f"{spec}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise BadInputError(f"{spec}: {module_name} has no function {function_name}")
    try:
        job = function()
    except Exception as exc:
        raise BadInputError(f"{spec}: {function_name}() raised {type(exc).__name__}: {exc}") from None
    data = _as_dict(job, spec)
    if not all(isinstance(v, dict) for v in data.values()):
        data = {k: v for k, v in data.items() if isinstance(v, dict)}
    return data


def _value(text: str) -> Any:
    """An override's value as torchtitan's command line reads it: a TOML literal (number, bool,
    list, quoted string), else the bare word as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return {"True": True, "False": False}.get(text, text)


def apply_overrides(where: str, data: dict, overrides) -> dict:
    """``data`` with each ``section.key=value`` (or ``--section.key=value``) set, as torchtitan's
    command line sets it after the job config.

    Raises
    ------
    BadInputError
        An override that is not ``section.key=value``.

    Examples
    --------
    >>> apply_overrides("job", {"parallelism": {"tensor_parallel_degree": 1}},
    ...                 ["--parallelism.tensor_parallel_degree=8", "training.local_batch_size=4"])
    {'parallelism': {'tensor_parallel_degree': 8}, 'training': {'local_batch_size': 4}}
    """
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in data.items()}
    for item in overrides:
        name, sep, value = str(item).removeprefix("--").partition("=")
        parts = name.split(".")
        if not sep or len(parts) < 2 or not all(p.isidentifier() for p in parts):
            raise BadInputError(f"{where}: override {item!r} is not SECTION.KEY=VALUE "
                                f"(e.g. parallelism.pipeline_parallel_degree=4)")
        table = out
        for part in parts[:-2]:
            table = table.setdefault(part, {})
        section = table.setdefault(parts[-2], {})
        if not isinstance(section, dict):
            raise BadInputError(f"{where}: override {item!r}: {'.'.join(parts[:-1])} is not a table")
        section[parts[-1]] = _value(value)
    return out
