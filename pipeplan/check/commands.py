"""What ``pipeplan check`` and ``pipeplan diff`` do, as library calls (the CLI stays thin)."""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeplan.check.diff import diff_files, diff_settings
from pipeplan.check.regress import CheckReport, check_profiles
from pipeplan.check.report import FORMATS, check_junit, render_check, render_diff
from pipeplan.errors import BadInputError
from pipeplan.formats.io import write_text_atomic
from pipeplan.quantities import parse_bytes
from pipeplan.check.report import check_renderables, render_rich
from pipeplan.check.report import diff_renderables

__all__ = ["run_check", "run_diff"]


def _width() -> int:
    # A terminal's width when there is one; CI logs get a wide table instead of wrapped cells.
    return max(100, shutil.get_terminal_size((160, 24)).columns)


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise BadInputError(f"--format: {format!r} is not one of {', '.join(FORMATS)}")


def run_check(
    profiles_dir: str | Path,
    baseline_dir: str | Path,
    *,
    tolerance: float = 0.02,
    memory_cap: str | None = None,
    format: str = "table",
    junit_path: str | Path | None = None,
    update: bool = False,
) -> tuple[CheckReport, str]:
    """Run the check, write the JUnit file if asked, and render the report.

    Parameters
    ----------
    profiles_dir, baseline_dir : path
    tolerance : float
        Largest allowed relative throughput drop.
    memory_cap : str, optional
        A size such as ``"40GiB"`` overriding every baseline's cap.
    format : {"table", "markdown"}
    junit_path : path, optional
        Where to write JUnit XML (atomically).
    update : bool
        Rewrite the baselines with the re-made plans.

    Returns
    -------
    report : CheckReport
        ``report.exit_code`` is the command's exit status.
    text : str
        The rendered report.

    Raises
    ------
    BadInputError
        See :func:`pipeplan.check.regress.check_profiles`; also a bad format or size.
    """
    _check_format(format)
    cap = parse_bytes(memory_cap) if memory_cap is not None else None
    report = check_profiles(profiles_dir, baseline_dir, tolerance=tolerance, memory_cap_bytes=cap, update=update)
    if junit_path is not None:
        write_text_atomic(junit_path, check_junit(report))
    text = render_check(report, format) if format == "markdown" else _render_table(report)
    return report, text


def _render_table(report: CheckReport) -> str:
    return render_rich(check_renderables(report), width=_width())


def run_diff(
    path_a: str | Path,
    path_b: str | Path,
    *,
    format: str = "table",
    settings_from: str | Path | None = None,
    microbatch_size: int | None = None,
    **settings,
) -> str:
    """Diff two plans or two profiles and render the result.

    Parameters
    ----------
    path_a, path_b : path
    format : {"table", "markdown"}
    settings_from : path, optional
        Plan file whose settings plan both profiles.
    microbatch_size : int, optional
        Profiles: the size whose costs to compare.
    **settings
        PlanSettings fields (``stages``, ``global_batch``, ``memory_cap`` as a size string,
        ``schedule``, ...) to plan both profiles with; None values are ignored.

    Returns
    -------
    str
    """
    _check_format(format)
    cap = settings.pop("memory_cap", None)
    if cap is not None:
        settings["memory_cap_bytes"] = parse_bytes(cap)
    plan_settings = diff_settings(settings_from, **settings)
    diff = diff_files(path_a, path_b, settings=plan_settings, microbatch_size=microbatch_size)
    if format == "markdown":
        return render_diff(diff, "markdown")
    return render_rich(diff_renderables(diff), width=_width())
