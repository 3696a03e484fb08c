"""Reading and writing the formats: one-line errors, atomic writes, stable bytes."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from pipeplan.errors import BadInputError, format_validation_error
from pipeplan.formats.plan import PLAN_SCHEMA_VERSIONS, Plan
from pipeplan.formats.profile import SCHEMA_VERSIONS, Profile
# The bounded readers, offered here beside the models' loaders (every format reads through them).
from pipeplan.formats.reading import check_structure, load_json, load_toml, parse_json_text, read_input_text
from pipeplan.formats.report import RunReport

__all__ = [
    "dump_model",
    "file_sha256",
    "check_structure",
    "load_json",
    "load_toml",
    "parse_json_text",
    "read_input_text",
    "load_plan",
    "load_profile",
    "load_report",
    "refuse_overwriting_input",
    "check_output_target",
    "write_bytes_atomic",
    "write_files_atomic",
    "write_json_atomic",
    "write_text_atomic",
]

M = TypeVar("M", bound=BaseModel)


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
    if isinstance(version, bool) or ("schema_version" in data and type(version) is not int):
        # true == 1 in Python: without this, `schema_version: true` read as version 1.
        raise BadInputError(f"{path}: schema_version: {json.dumps(version)[:40]} is not a whole number")
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


_KINDS = ((stat.S_ISDIR, "is a directory"), (stat.S_ISCHR, "is a character device"),
          (stat.S_ISBLK, "is a block device"), (stat.S_ISFIFO, "is a FIFO (named pipe)"),
          (stat.S_ISSOCK, "is a socket"))


def check_output_target(path: str | Path, option: str = "-o") -> Path:
    """Refuse an output path that names something other than a regular file (or nothing yet).

    The atomic rename would replace a device (``/dev/null`` as root), a FIFO or a socket by a
    regular file; a folder cannot be replaced at all. A name longer than the file system takes
    is refused here too, before any work.

    Raises
    ------
    BadInputError
        Naming the option, the path and what it is (exit 2).
    """
    path = Path(path)
    if not str(path).strip() or str(path) in (".", ".."):
        raise BadInputError(f"{option} {str(path)!r}: give a file name to write")
    if len(path.name.encode("utf-8", "surrogateescape")) > _MAX_NAME_BYTES:
        raise BadInputError(f"{option} {path.name[:40]}...: the file name is longer than "
                            f"{_MAX_NAME_BYTES} bytes; give a shorter name")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise BadInputError(f"{option} {path}: cannot write: {exc.strerror or type(exc).__name__}") from None
    if not stat.S_ISREG(mode):
        what = next((text for test, text in _KINDS if test(mode)), "is not a regular file")
        hint = "give a file name to write" if stat.S_ISDIR(mode) else "pipeplan writes regular files only"
        raise BadInputError(f"{option} {path}: {what}; {hint}")
    return path


#: Longest output file name: the file system's 255 bytes less what the temporary file adds
#: (a leading dot, a dot, 8 random characters and ``.tmp``).
_MAX_NAME_BYTES = 255 - len("..") - 8 - len(".tmp")


def _write_temp(path: Path, data: bytes) -> str:
    """The data in a temporary file beside ``path`` (flushed to disk, the plain-open mode)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates 0600.
        os.chmod(tmp, 0o666 & ~_umask())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(path: str | Path | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _backup(path: Path) -> str | None:
    """A hard link to the file ``path`` replaces, to put back if a later rename fails."""
    if not path.exists():
        return None
    name = tempfile.mktemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent)
    try:
        os.link(path, name)
    except OSError:
        return None
    return name


def write_files_atomic(files: Mapping[str | Path, bytes | str], inputs: Iterable[str | Path | None] = (),
                       option: str = "-o") -> list[Path]:
    """Write several files all or nothing: every temporary file first, then the renames.

    Each target is checked first (a regular file or nothing, not one of ``inputs``, not named
    twice); if any write or rename fails, the files renamed so far get their old contents back
    (or are removed if they were new) and no temporary file is left.

    Parameters
    ----------
    files : mapping of path to bytes or str
        Text is written as UTF-8.
    inputs : paths
        The command's input files, which no output may replace.
    option : str
        The option that named the outputs, for messages.

    Returns
    -------
    list of Path
        The files written, in the order given.

    Raises
    ------
    BadInputError
        If a target is not a regular file, equals an input or another output, or cannot be
        written (exit 2, one line); nothing is written then.
    """
    inputs = list(inputs)
    targets: list[tuple[Path, bytes]] = []
    for name, data in files.items():
        path = check_output_target(name, option)
        refuse_overwriting_input(path, *inputs, option=option)
        refuse_overwriting_input(path, *(p for p, _ in targets), option=option, what="another output")
        targets.append((path, data.encode("utf-8") if isinstance(data, str) else bytes(data)))
    temps: list[str] = []
    done: list[tuple[Path, str | None, bool]] = []
    current = targets[0][0] if targets else Path()
    try:
        for current, data in targets:
            temps.append(_write_temp(current, data))
        for (current, _), tmp in zip(targets, temps):
            existed = current.exists()
            backup = _backup(current)
            os.replace(tmp, current)
            done.append((current, backup, existed))
    except BaseException as exc:
        for path, backup, existed in reversed(done):
            if backup is not None:
                try:
                    os.replace(backup, path)
                except OSError:
                    pass
            elif not existed:
                _unlink(path)
        for tmp in temps:
            _unlink(tmp)
        if isinstance(exc, OSError):
            reason = exc.strerror or type(exc).__name__
            raise BadInputError(f"{current}: cannot write: {reason}") from None
        raise
    for _, backup, _ in done:
        _unlink(backup)
    return [path for path, _ in targets]


def write_bytes_atomic(path: str | Path, data: bytes, inputs: Iterable[str | Path | None] = (),
                       option: str = "-o") -> None:
    """Write through a temporary file in the same folder and rename it into place.

    The file gets the mode a plain ``open()`` would give it (0666 less the umask); a reader sees
    the old file or the whole new one, never a part (:func:`write_files_atomic` with one file).

    Raises
    ------
    BadInputError
        If the path is a folder, a device, a FIFO or one of ``inputs``, or its folder cannot be
        made or written (exit 2, one line).
    """
    write_files_atomic({path: data}, inputs, option)


def write_text_atomic(path: str | Path, text: str, inputs: Iterable[str | Path | None] = (),
                      option: str = "-o") -> None:
    """Write UTF-8 text atomically (:func:`write_bytes_atomic`)."""
    write_bytes_atomic(path, text.encode("utf-8"), inputs, option)


def refuse_overwriting_input(output: str | Path | None, *inputs: str | Path | None, option: str = "-o",
                             what: str = "the input file") -> None:
    """Raise BadInputError if ``output`` is one of the input files (``-o`` equal to the input).

    >>> refuse_overwriting_input("plan.json", "profile.json")
    >>> refuse_overwriting_input("./p.json", "p.json")
    Traceback (most recent call last):
    ...
    pipeplan.errors.BadInputError: -o p.json: is the input file p.json; write the output to another file
    """
    if output is None:
        return
    out = check_output_target(output, option)
    for source in inputs:
        if source is None:
            continue
        src = Path(source)
        try:
            same = out.resolve() == src.resolve() or (out.exists() and src.exists() and os.path.samefile(out, src))
        except (OSError, RuntimeError):
            same = False
        if same:
            raise BadInputError(f"{option} {out}: is {what} {src}; write the output to another file")


def write_json_atomic(path: str | Path, model: BaseModel) -> None:
    """Write a model as stable JSON, atomically."""
    write_text_atomic(path, dump_model(model))


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
