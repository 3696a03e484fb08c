"""Reading and writing the formats: one-line errors, atomic writes, stable bytes."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pipeplan.errors import BadInputError, format_validation_error
from pipeplan.formats.limits import MAX_NESTING
from pipeplan.formats.profile import Profile, SCHEMA_VERSIONS
from pipeplan.formats.plan import PLAN_SCHEMA_VERSIONS, Plan
from pipeplan.formats.report import RunReport

__all__ = [
    "dump_model",
    "file_sha256",
    "load_json",
    "load_plan",
    "load_profile",
    "load_report",
    "refuse_overwriting_input",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]

M = TypeVar("M", bound=BaseModel)


def _nesting(data: Any) -> int:
    """The depth of nested lists and objects, without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (list, dict)):
            deepest = max(deepest, depth)
            if depth > MAX_NESTING:
                break
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


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
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInputError(
            f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise BadInputError(f"{path}: JSON nested too deep (more than {MAX_NESTING} levels)") from None
    if _nesting(data) > MAX_NESTING:
        raise BadInputError(f"{path}: JSON nested too deep (more than {MAX_NESTING} levels)")
    return data


def _kind(data: dict) -> str | None:
    """What a JSON object looks like: ``plan``, ``profile``, ``report`` or None."""
    if "stages" in data and "predicted" in data:
        return "plan"
    if "layers" in data and "stages" not in data:
        return "profile"
    if str(data.get("schema", "")).startswith("pipeplan-run-report") or ("ranks" in data and "measured" in data):
        return "report"
    return None


_ARTICLE = {"plan": "a plan", "profile": "a profile", "report": "a run report"}


def _load(path: str | Path, model: type[M], what: str, versions: tuple[int, ...] = (1,)) -> M:
    data = load_json(path)
    if not isinstance(data, dict):
        raise BadInputError(f"{path}: expected a JSON object ({what}), found {type(data).__name__}")
    kind = _kind(data)
    if kind is not None and _ARTICLE[kind] != what:
        raise BadInputError(f"{path}: this is {_ARTICLE[kind]}, not {what}")
    version = data.get("schema_version")
    if isinstance(version, str):
        raise BadInputError(f"{path}: schema_version: {version!r} is a string; write the number without quotes")
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
    return _load(path, Profile, "a profile", SCHEMA_VERSIONS)


def load_plan(path: str | Path):
    """Read and check a plan file."""
    return _load(path, Plan, "a plan", PLAN_SCHEMA_VERSIONS)


def load_report(path: str | Path):
    """Read and check a run report (``pipeplan run --report``)."""
    return _load(path, RunReport, "a run report")


def dump_model(model: BaseModel) -> str:
    """Stable JSON text: same model, same bytes."""
    data = model.model_dump(mode="json", exclude_none=True)
    return json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n"


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write through a temporary file in the same folder and rename it into place.

    The file gets the mode a plain ``open()`` would give it (0666 less the umask); a reader sees
    the old file or the whole new one, never a part.

    Raises
    ------
    BadInputError
        If the path is a folder, or its folder cannot be made or written (exit 2, one line).
    """
    path = Path(path)
    if path.is_dir():
        raise BadInputError(f"{path}: is a directory; give a file name to write")
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates 0600.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(exc, OSError):
            reason = exc.strerror or type(exc).__name__
            raise BadInputError(f"{path}: cannot write: {reason}") from None
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write UTF-8 text atomically (:func:`write_bytes_atomic`)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def refuse_overwriting_input(output: str | Path | None, *inputs: str | Path | None) -> None:
    """Raise BadInputError if ``output`` is one of the input files (``-o`` equal to the input).

    >>> refuse_overwriting_input("plan.json", "profile.json")
    >>> refuse_overwriting_input("./p.json", "p.json")
    Traceback (most recent call last):
    ...
    pipeplan.errors.BadInputError: -o p.json: is the input file p.json; write the output to another file
    """
    if output is None:
        return
    out = Path(output)
    for source in inputs:
        if source is None:
            continue
        src = Path(source)
        try:
            same = out.resolve() == src.resolve() or (out.exists() and src.exists() and os.path.samefile(out, src))
        except OSError:
            same = False
        if same:
            raise BadInputError(f"-o {out}: is the input file {src}; write the output to another file")


def write_json_atomic(path: str | Path, model: BaseModel) -> None:
    """Write a model as stable JSON, atomically."""
    write_text_atomic(path, dump_model(model))


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
