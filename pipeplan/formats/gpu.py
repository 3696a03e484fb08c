"""The GPU spec file (``--gpu-spec my.toml``, format in :mod:`pipeplan.facts.gpus`), read with
the bounded readers of :mod:`pipeplan.formats.io`; a GPU by name or by file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from pydantic import ValidationError

from pipeplan.errors import BadInputError, format_validation_error
from pipeplan.facts.gpus import GPUS, GpuSpec, get_gpu
from pipeplan.formats.io import load_toml
from pipeplan.quantities import parse_bandwidth, parse_bytes

__all__ = ["load_gpu_spec", "resolve_gpu"]


def _quantity(value: Any, parse, option: str) -> Any:
    return parse(value, option) if isinstance(value, str) else value


def load_gpu_spec(path: Union[str, Path]) -> GpuSpec:
    """Read a GPU spec from TOML (see the module docstring); errors name the file and field."""
    path = Path(path)
    data = load_toml(path)
    data = dict(data.get("gpu", data))
    renames = {"memory": "memory_bytes", "hbm_bandwidth": "hbm_bytes_per_s", "link_bandwidth": "link_bytes_per_s"}
    try:
        for old, new in renames.items():
            if old in data:
                parse = parse_bytes if old == "memory" else parse_bandwidth
                data[new] = _quantity(data.pop(old), parse, f"{path}: {old}")
        return GpuSpec.model_validate(data)
    except BadInputError:
        raise
    except ValidationError as exc:
        raise BadInputError(format_validation_error(path, exc)) from None


def resolve_gpu(gpu: Optional[str], gpu_spec: Optional[Union[str, Path]]) -> GpuSpec:
    """``--gpu NAME`` or ``--gpu-spec FILE`` (exactly one)."""
    if gpu and gpu_spec:
        raise BadInputError("--gpu and --gpu-spec: give one, not both")
    if gpu_spec:
        return load_gpu_spec(gpu_spec)
    if not gpu:
        raise BadInputError(f"--gpu: needed with --analytic; known: {', '.join(GPUS)} (or --gpu-spec FILE)")
    return get_gpu(gpu)
