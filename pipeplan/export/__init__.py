"""Launcher exports: a plan restated in the words of torchtitan, Megatron-LM, DeepSpeed and torch.

``export_plan(plan, profile, format)`` returns the files' texts keyed by file-name suffix, the
main file first; ``run_export`` is what ``pipeplan export`` does with files on disk. See
docs/launchers.md for one worked example per launcher.
"""

from __future__ import annotations

from pathlib import Path

from pipeplan.errors import BadInputError
from pipeplan.launchers.common import TORCH_SCHEDULE_NAME, check_profile_matches
from pipeplan.launchers.deepspeed.writer import export_deepspeed
from pipeplan.launchers.megatron.writer import export_megatron
from pipeplan.export.torch_pipelining import export_torch
from pipeplan.launchers.torchtitan.writer import export_torchtitan, schedule_csv
from pipeplan.formats.plan import Plan
from pipeplan.formats.io import (check_output_target, file_sha256, load_plan, load_profile, refuse_overwriting_input,
                                 write_files_atomic)

__all__ = ["FORMATS", "NEEDS_PROFILE", "export_plan", "run_export"]

#: Export formats, and the suffix of each one's main file.
FORMATS = {"torchtitan": ".toml", "megatron": ".sh", "deepspeed": ".json", "torch": ".json"}

#: Formats that need the profile (layer roles), not only the plan.
NEEDS_PROFILE = ("megatron",)

_CSV_SUFFIX = ".schedule.csv"


def export_plan(
    plan: Plan,
    profile=None,
    format: str = "torchtitan",
    *,
    profile_sha256: str | None = None,
    stem: str = "plan",
    with_schedule_csv: bool = False,
) -> dict[str, str]:
    """Restate a plan for a launcher.

    Parameters
    ----------
    plan : Plan
    profile : Profile, optional
        The profile the plan was made from; required by ``megatron``.
    format : {"torchtitan", "megatron", "deepspeed", "torch"}
    profile_sha256 : str, optional
        sha256 of the profile file, checked against ``plan.profile.sha256``.
    stem : str
        Path of the output without its suffix; the torchtitan TOML points at
        ``stem + ".schedule.csv"``.
    with_schedule_csv : bool
        torchtitan: also write the simulated per-rank action order as a CSV and point
        ``pipeline_parallel_schedule_csv`` at it (always done for a schedule torchtitan has no
        name for).

    Returns
    -------
    dict of str to str
        File-name suffix to text; the first entry is the main file.

    Raises
    ------
    BadInputError
        Unknown format, a missing or mismatched profile, or a plan the launcher cannot run.

    Examples
    --------
    >>> sorted(FORMATS)
    ['deepspeed', 'megatron', 'torch', 'torchtitan']
    """
    if format not in FORMATS:
        raise BadInputError(f"--format: {format!r} is not one of {', '.join(FORMATS)}")
    if profile is not None:
        check_profile_matches(plan, profile, profile_sha256)
    suffix = FORMATS[format]
    if format == "torchtitan":
        # one pipeline rank runs no schedule: no CSV
        csv = (with_schedule_csv or plan.schedule not in TORCH_SCHEDULE_NAME) and plan.settings.stages > 1
        files = {suffix: export_torchtitan(plan, schedule_csv_path=stem + _CSV_SUFFIX if csv else None,
                                           profile=profile)}
        if csv:
            files[_CSV_SUFFIX] = schedule_csv(plan)
        return files
    if format == "megatron":
        return {suffix: export_megatron(plan, profile, profile_sha256=profile_sha256)}
    if format == "deepspeed":
        return {suffix: export_deepspeed(plan, profile)}
    return {suffix: export_torch(plan, profile)}


def run_export(
    plan_path: str | Path,
    format: str,
    *,
    output: str | Path | None = None,
    profile_path: str | Path | None = None,
    with_schedule_csv: bool = False,
) -> tuple[str, list[Path]]:
    """Read a plan (and profile), export it, and write the files atomically.

    Parameters
    ----------
    plan_path : path
    format : str
        One of :data:`FORMATS`.
    output : path, optional
        Main output file; extra files go beside it (``<output without suffix>.schedule.csv``).
        Without it nothing is written and the main text is returned for printing.
    profile_path : path, optional
        The plan's profile; needed by ``megatron``, checked by sha256 when given.
    with_schedule_csv : bool
        See :func:`export_plan`.

    Returns
    -------
    text : str
        The main file's text.
    written : list of Path
        Files written (empty without ``output``).

    Raises
    ------
    BadInputError
        Bad files, a missing or mismatched profile, or extra files without ``output``.
    """
    if output is not None:
        check_output_target(output)
        refuse_overwriting_input(output, plan_path, profile_path)

    plan = load_plan(plan_path)
    if format not in FORMATS:
        raise BadInputError(f"--format: {format!r} is not one of {', '.join(FORMATS)}")
    profile = sha = None
    if profile_path is not None:
        profile = load_profile(profile_path)
        sha = file_sha256(profile_path)
    elif format in NEEDS_PROFILE:
        raise BadInputError(
            f"--format {format} needs the plan's profile: add --profile PATH (the profile of model "
            f"{plan.profile.model!r}, sha256 {plan.profile.sha256[:12]}...)"
        )
    output = Path(output) if output is not None else None
    stem = str(output.with_suffix("")) if output is not None else Path(plan_path).stem
    files = export_plan(plan, profile, format, profile_sha256=sha, stem=stem,
                        with_schedule_csv=with_schedule_csv)
    (main_suffix, main_text), *extras = files.items()
    if output is None:
        if extras:
            raise BadInputError(
                f"--format {format}: this export has more than one file ({', '.join(s for s, _ in extras)}); "
                f"give -o FILE to write them"
            )
        return main_text, []
    # The main file names its sidecars (the torchtitan TOML its CSV): all of them, or none.
    outputs = {output: main_text, **{Path(stem + suffix): text for suffix, text in extras}}
    return main_text, write_files_atomic(outputs, (plan_path, profile_path))
