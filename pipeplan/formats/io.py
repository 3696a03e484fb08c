"""Reading and writing the formats: one-line errors, atomic writes, stable bytes."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pipeplan.errors import BadInputError

__all__ = [
    "dump_model",
    "file_sha256",
    "format_validation_error",
    "load_json",
    "load_plan",
    "load_profile",
    "write_json_atomic",
    "write_text_atomic",
]

M = TypeVar("M", bound=BaseModel)


def _location(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def format_validation_error(path: str | Path, error: ValidationError) -> str:
    """One line per field: ``file: field: problem``."""
    lines = []
    for item in error.errors():
        loc = _location(tuple(item["loc"]))
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            message = "missing field"
        lines.append(f"{path}: {loc}: {message}")
    return "\n".join(lines)


def load_json(path: str | Path) -> Any:
    """Parse a JSON file, raising BadInputError with the file and position."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise BadInputError(f"{path}: is a directory, expected a JSON file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInputError(f"{path}: cannot read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInputError(
            f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None


def _load(path: str | Path, model: type[M], what: str, versions: tuple[int, ...] = (1,)) -> M:
    data = load_json(path)
    if not isinstance(data, dict):
        raise BadInputError(f"{path}: expected a JSON object ({what}), found {type(data).__name__}")
    if "schema_version" in data and data["schema_version"] not in versions:
        readable = " and ".join(str(v) for v in versions)
        raise BadInputError(
            f"{path}: schema_version: {data['schema_version']!r} is not supported; this pipeplan reads {readable}"
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadInputError(format_validation_error(path, exc)) from None


def load_profile(path: str | Path):
    """Read and check a profile file.

    Raises
    ------
    BadInputError
        If the file is missing, not JSON, or breaks a rule of the format.
    """
    from pipeplan.formats.profile import SCHEMA_VERSIONS, Profile

    return _load(path, Profile, "a profile", SCHEMA_VERSIONS)


def load_plan(path: str | Path):
    """Read and check a plan file."""
    from pipeplan.formats.plan import Plan

    return _load(path, Plan, "a plan")


def dump_model(model: BaseModel) -> str:
    """Stable JSON text: same model, same bytes."""
    data = model.model_dump(mode="json", exclude_none=True)
    return json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n"


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write through a temporary file in the same folder and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates 0600; give the file the mode a plain open() would (0666 less the umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_json_atomic(path: str | Path, model: BaseModel) -> None:
    """Write a model as stable JSON, atomically."""
    write_text_atomic(path, dump_model(model))


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
