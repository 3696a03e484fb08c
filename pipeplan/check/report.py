"""Reports of ``pipeplan check`` and ``pipeplan diff``: rich tables, Markdown, JUnit XML.

The table is for people at a terminal, Markdown for a pull-request comment, JUnit XML for CI
test reports (one test case per baseline). Every renderer is a pure function of the report, so
the same report gives the same bytes.
"""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from typing import Iterable

from pipeplan.check.diff import PlanDiff, ProfileDiff
from pipeplan.check.regress import BaselineCheck, CheckReport, moved_layers, rank_peaks
from pipeplan.quantities import format_bytes

__all__ = ["FORMATS", "render_rich", "check_renderables", "render_check", "check_junit", "diff_renderables", "render_diff"]

#: Output formats of ``check`` and ``diff``.
FORMATS = ("table", "markdown")


def _pct(change: float | None) -> str:
    return "-" if change is None else f"{100 * change:+.2f}%"


def _num(value) -> str:
    return "-" if value is None else f"{value:.6g}"


def _bytes(value) -> str:
    return "-" if value is None else format_bytes(value)


def _check_row(check: BaselineCheck) -> list[str]:
    base = check.baseline.predicted.samples_per_second
    now = check.current.predicted.samples_per_second if check.current else None
    peaks = rank_peaks(check.current) if check.current else {}
    peak = max(peaks.values()) if peaks else None
    if check.current is None:
        boundary = "-"
    else:
        moved = len(moved_layers(check.baseline, check.current))
        boundary = f"{moved} layers moved" if moved else "same"
    return [
        check.name,
        check.model + (" (changed)" if check.profile_changed else ""),
        f"{_num(base)} -> {_num(now)}",
        _pct(check.throughput_change),
        f"{_bytes(peak)} / {_bytes(check.memory_cap_bytes) if check.memory_cap_bytes else 'no cap'}",
        boundary,
        "FAIL" if check.failed else "pass",
    ]


_CHECK_HEADER = ["baseline", "model", "samples/s (baseline -> now)", "change", "peak / cap", "stages", "result"]


def _summary(report: CheckReport) -> str:
    failed = sum(c.failed for c in report.checks)
    total = len(report.checks)
    verdict = f"{failed} of {total} baselines failed" if failed else f"all {total} baselines pass"
    return f"pipeplan check: {verdict} (tolerance {100 * report.tolerance:.3g}%)"


def check_renderables(report: CheckReport) -> list:
    """Rich objects for a terminal: a summary line, the table, then each finding.

    Returns
    -------
    list
        Things to pass to ``rich.console.Console.print`` in order.
    """
    from rich.table import Table
    from rich.text import Text

    table = Table(title=_summary(report), title_justify="left")
    for column in _CHECK_HEADER:
        table.add_column(column, justify="right" if column in ("change",) else "left")
    for check in report.checks:
        row = _check_row(check)
        style = "bold red" if check.failed else "green"
        table.add_row(*row[:-1], Text(row[-1], style=style))
    out: list = [table]
    for check in report.checks:
        for finding in check.findings:
            marker = Text("FAIL " if finding.severity == "fail" else "note ",
                          style="bold red" if finding.severity == "fail" else "dim")
            out.append(Text.assemble(marker, f"{check.name}: {finding.message}"))
    for path in report.updated:
        out.append(Text(f"updated {path}", style="yellow"))
    return out


def render_rich(renderables: Iterable, width: int = 160) -> str:
    """Rich objects as plain text (no colour codes), ``width`` characters wide."""
    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=False, color_system=None, no_color=True)
    for item in renderables:
        console.print(item)
    return buffer.getvalue()


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in rows]
    return lines


def render_check(report: CheckReport, format: str = "table") -> str:
    """The check report as plain text (``table``) or Markdown (``markdown``).

    Raises
    ------
    ValueError
        For another format (the CLI checks it first).
    """
    if format == "table":
        return render_rich(check_renderables(report))
    if format != "markdown":
        raise ValueError(f"format {format!r} is not one of {FORMATS}")
    lines = [f"### {_summary(report)}", ""]
    rows = []
    for check in report.checks:
        row = _check_row(check)
        row[-1] = "**FAIL**" if check.failed else "pass"
        rows.append(row)
    lines += _md_table(_CHECK_HEADER, rows)
    details = [(c, f) for c in report.checks for f in c.findings]
    if details:
        lines += [""]
        for check, finding in details:
            mark = "**FAIL**" if finding.severity == "fail" else "note"
            lines.append(f"- {mark} `{check.name}`: {finding.message}")
    for path in report.updated:
        lines.append(f"- updated `{path}`")
    return "\n".join(lines) + "\n"


def check_junit(report: CheckReport) -> str:
    """The check report as JUnit XML: one test case per baseline, failures with their findings.

    Examples
    --------
    >>> from pipeplan.check.regress import CheckReport
    >>> print(check_junit(CheckReport(checks=[], tolerance=0.02)).splitlines()[1])
    <testsuites name="pipeplan check" tests="0" failures="0" errors="0">
    """
    failures = sum(c.failed for c in report.checks)
    root = ET.Element("testsuites", {
        "name": "pipeplan check", "tests": str(len(report.checks)),
        "failures": str(failures), "errors": "0",
    })
    suite = ET.SubElement(root, "testsuite", {
        "name": "pipeplan check", "tests": str(len(report.checks)),
        "failures": str(failures), "errors": "0", "skipped": "0",
    })
    for check in report.checks:
        case = ET.SubElement(suite, "testcase", {
            "classname": "pipeplan.check", "name": check.name, "file": check.baseline_path,
        })
        fails = [f for f in check.findings if f.severity == "fail"]
        if fails:
            failure = ET.SubElement(case, "failure", {"message": fails[0].message, "type": fails[0].topic})
            failure.text = "\n".join(f.message for f in fails)
        notes = [f.message for f in check.findings if f.severity != "fail"]
        row = _check_row(check)
        out = ET.SubElement(case, "system-out")
        out.text = "\n".join([f"profile {check.profile_path}",
                              f"samples/s {row[2]} ({row[3]}); peak / cap {row[4]}"] + notes)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# --------------------------------------------------------------------------- diff


def _plan_summary_rows(d: PlanDiff) -> list[list[str]]:
    pa, pb = d.a.predicted, d.b.predicted

    def change(a, b):
        return "-" if not a else f"{100 * (b / a - 1):+.2f}%"

    return [
        ["samples/s", _num(pa.samples_per_second), _num(pb.samples_per_second),
         change(pa.samples_per_second, pb.samples_per_second)],
        ["iteration ms", _num(pa.iteration_ms), _num(pb.iteration_ms), change(pa.iteration_ms, pb.iteration_ms)],
        ["bubble", f"{100 * pa.bubble_fraction:.2f}%", f"{100 * pb.bubble_fraction:.2f}%", "-"],
        ["bottleneck stage", str(pa.bottleneck_stage), str(pb.bottleneck_stage), "-"],
        ["schedule", d.a.schedule, d.b.schedule, "-"],
        ["micro-batch x count", f"{d.a.microbatch_size} x {d.a.num_microbatches}",
         f"{d.b.microbatch_size} x {d.b.num_microbatches}", "-"],
        ["max rank peak", _bytes(max((p for _, p, _ in d.rank_peaks if p is not None), default=None)),
         _bytes(max((p for _, _, p in d.rank_peaks if p is not None), default=None)), "-"],
    ]


def _stage_rows(d: PlanDiff) -> list[list[str]]:
    return [[str(r.index), f"{r.layers[0]} -> {r.layers[1]}", f"{r.compute_ms[0]:.4g} -> {r.compute_ms[1]:.4g}",
             f"{_bytes(r.peak_memory_bytes[0])} -> {_bytes(r.peak_memory_bytes[1])}"] for r in d.stages]


def _moved_lines(d: PlanDiff, limit: int = 20) -> list[str]:
    lines = [f"{name}: stage {a} -> {b}" for name, a, b in d.moved[:limit]]
    if len(d.moved) > limit:
        lines.append(f"... and {len(d.moved) - limit} more")
    if d.only_in_a:
        lines.append(f"only in A: {', '.join(d.only_in_a[:limit])}")
    if d.only_in_b:
        lines.append(f"only in B: {', '.join(d.only_in_b[:limit])}")
    return lines or ["no layer changed stage"]


def _layer_rows(d: ProfileDiff, limit: int = 25) -> list[list[str]]:
    def pair(values, fmt):
        a, b = values
        return f"{fmt(a)} -> {fmt(b)}"

    rows = []
    for delta in d.changed[:limit]:
        rows.append([
            delta.name,
            pair(delta.forward_ms, _num), pair(delta.backward_ms, _num),
            f"{delta.time_change_ms:+.4g}",
            pair(delta.activation_bytes, _bytes), pair(delta.param_bytes, _bytes),
        ])
    return rows


_LAYER_HEADER = ["layer", "forward ms", "backward ms", "change ms", "activations", "params"]
_STAGE_HEADER = ["stage", "layers", "fwd+bwd ms", "peak"]
_SUMMARY_HEADER = ["", "A", "B", "change"]


def diff_renderables(diff) -> list:
    """Rich objects for a terminal, for a :class:`PlanDiff` or :class:`ProfileDiff`."""
    from rich.table import Table
    from rich.text import Text

    def table(title, header, rows):
        t = Table(title=title, title_justify="left")
        for column in header:
            t.add_column(column)
        for row in rows:
            t.add_row(*row)
        return t

    out: list = []
    plan_diff = diff if isinstance(diff, PlanDiff) else diff.plan_diff
    if isinstance(diff, ProfileDiff):
        title = (f"profiles {diff.model[0]} -> {diff.model[1]} at micro-batch {diff.microbatch_size}: "
                 f"{len(diff.changed)} layers changed, {diff.unchanged} unchanged")
        out.append(table(title, _LAYER_HEADER, _layer_rows(diff)))
        if len(diff.changed) > 25:
            out.append(Text(f"... and {len(diff.changed) - 25} more changed layers"))
        for error in diff.plan_errors:
            out.append(Text(f"cannot plan {error}", style="bold red"))
        if plan_diff is None and not diff.plan_errors:
            out.append(Text("give --stages and --global-batch (or --settings-from PLAN) to see the effect on the plan",
                            style="dim"))
    if plan_diff is not None:
        out.append(table("plans: A beside B", _SUMMARY_HEADER, _plan_summary_rows(plan_diff)))
        out.append(table("stages", _STAGE_HEADER, _stage_rows(plan_diff)))
        out.append(Text("moved layers:\n  " + "\n  ".join(_moved_lines(plan_diff))))
    return out


def render_diff(diff, format: str = "table") -> str:
    """A diff as plain text (``table``) or Markdown (``markdown``)."""
    if format == "table":
        return render_rich(diff_renderables(diff))
    if format != "markdown":
        raise ValueError(f"format {format!r} is not one of {FORMATS}")
    lines: list[str] = []
    plan_diff = diff if isinstance(diff, PlanDiff) else diff.plan_diff
    if isinstance(diff, ProfileDiff):
        lines += [f"### Profiles {diff.model[0]} -> {diff.model[1]} (micro-batch {diff.microbatch_size})", "",
                  f"{len(diff.changed)} layers changed, {diff.unchanged} unchanged.", ""]
        if diff.changed:
            lines += _md_table(_LAYER_HEADER, _layer_rows(diff)) + [""]
        lines += [f"- cannot plan {e}" for e in diff.plan_errors]
    if plan_diff is not None:
        lines += ["### Plans: A beside B", ""] + _md_table(_SUMMARY_HEADER, _plan_summary_rows(plan_diff))
        lines += ["", "#### Stages", ""] + _md_table(_STAGE_HEADER, _stage_rows(plan_diff))
        lines += ["", "#### Moved layers", ""] + [f"- {line}" for line in _moved_lines(plan_diff)]
    return "\n".join(lines) + "\n"
