"""Rich renderings of plans and comparisons for the terminal."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from pipeplan.formats.plan import Plan
from pipeplan.quantities import format_bytes
from pipeplan.plan import plan_simulation
from pipeplan.cluster.tables import cluster_plan_tables

__all__ = ["plan_tables", "comparison_table", "simulation_from_plan", "stage_count_words", "recompute_modules_table",
           "runs_calibration_table", "runs_calibration_lines"]


def stage_count_words(plan: Plan) -> str:
    """Ranks and stages in words: a schedule with v stages per rank has v x ranks stages.

    >>> from types import SimpleNamespace as N
    >>> stage_count_words(N(stages=[0] * 16, virtual_stages=2, settings=N(stages=8)))
    '8 ranks x 2 stages each (16 stages)'
    >>> stage_count_words(N(stages=[0] * 4, virtual_stages=1, settings=N(stages=4)))
    '4 stages on 4 ranks'
    """
    ranks = plan.settings.stages
    if plan.virtual_stages > 1:
        return f"{ranks} rank{'s' if ranks != 1 else ''} x {plan.virtual_stages} stages each ({len(plan.stages)} stages)"
    return f"{len(plan.stages)} stage{'s' if len(plan.stages) != 1 else ''} on {ranks} rank{'s' if ranks != 1 else ''}"


def plan_tables(plan: Plan) -> Group:
    """Summary and per-stage tables of a plan."""
    if plan.parallelism is not None:
        table = recompute_modules_table(plan)
        return cluster_plan_tables(plan) if table is None else Group(cluster_plan_tables(plan), table)
    p = plan.predicted
    summary = Table(title=f"{plan.profile.model}: {stage_count_words(plan)}, {plan.schedule}", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    cap = plan.settings.memory_cap_bytes
    overhead = () if p.overhead_ms is None else (
        (f"  schedule's own work ({plan.settings.action_overhead_ms:g} ms/action)", f"{p.overhead_ms:.3f} ms"),)
    precision = plan.settings.precision
    for key, value in (
        *((("precision", f"{precision} GEMMs, bf16 elsewhere (weight copies in the peak memory)"),) if precision else ()),
        ("global batch", f"{plan.num_microbatches * plan.microbatch_size} samples"),
        ("micro-batches", f"{plan.num_microbatches} x {plan.microbatch_size} samples"),
        ("iteration", f"{p.iteration_ms:.3f} ms"),
        ("  compute (bottleneck rank)", f"{p.compute_ms:.3f} ms"),
        *overhead,
        ("  bubble (idle time of the bottleneck rank)", f"{p.bubble_ms:.3f} ms"),
        ("  exposed transfers", f"{p.transfer_ms:.3f} ms"),
        ("bubble fraction (idle share of all ranks' time)", f"{p.bubble_fraction:.1%}"),
        ("throughput", f"{p.samples_per_second:.2f} samples/s"),
        ("bottleneck stage", str(p.bottleneck_stage)),
        ("memory cap", format_bytes(cap) if cap else "none"),
        ("solver", f"{plan.solver.method}, {'optimal' if plan.solver.optimal else 'not proven optimal'}"),
    ):
        summary.add_row(key, value)
    stages = Table(title="stages")
    # The loss's working memory (pipeplan.facts.loss), part of the peak, where a stage has it.
    working = any(s.working_bytes for s in plan.stages)
    for column in ("stage", "rank", "layers", "first .. last", "fwd ms", "bwd ms", "xfer ms",
                   "send", "params", "in flight", *(("of it working",) if working else ()), "peak memory"):
        stages.add_column(column, justify="left" if column == "first .. last" else "right")
    for s in plan.stages:
        span = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
        stages.add_row(
            str(s.index), str(s.rank), str(len(s.layers)), span,
            f"{s.forward_ms:.3f}", f"{s.backward_ms:.3f}" + ((" (sel)" if s.recompute_granularity == "selective" else " (rc)") if s.recompute else ""),
            f"{s.transfer_ms:.3f}", format_bytes(s.send_bytes), format_bytes(s.param_bytes),
            str(s.in_flight), *((format_bytes(s.working_bytes or 0),) if working else ()),
            format_bytes(s.peak_memory_bytes),
        )
    parts = [summary, stages]
    if recompute_modules_table(plan) is not None:
        parts.append(recompute_modules_table(plan))
    if plan.alternatives:
        alt = Table(title="runners-up")
        for column in ("schedule", "v", "micro-batch", "recompute", "iteration ms", "why it lost"):
            alt.add_column(column)
        for a in plan.alternatives[:10]:
            alt.add_row(a.schedule, str(a.virtual_stages), str(a.microbatch_size), a.recompute,
                        "-" if a.iteration_ms is None else f"{a.iteration_ms:.3f}", a.reason)
        parts.append(alt)
    for note in plan.notes:
        parts.append(f"note: {note}")
    return Group(*parts)


def recompute_modules_table(plan: Plan) -> Table | None:
    """The selective recomputation's parts per stage and module (plans made with
    --recompute-modules): the time each module's forward adds to the backward and the bytes it
    frees, per micro-batch; None for other plans."""
    rows = [(s, m, part) for s in plan.stages for m, part in (s.recompute_modules or {}).items()]
    if not rows:
        return None
    table = Table(title="selective recomputation by module (per micro-batch)")
    for column in ("stage", "module", "recompute ms", "frees", "kept"):
        table.add_column(column, justify="left" if column == "module" else "right")
    for s, m, part in rows:
        table.add_row(str(s.index), m, f"{part.recompute_ms:.3f}", format_bytes(part.saved_bytes),
                      format_bytes(s.selective_activation_bytes or 0))
    return table


def comparison_table(rows, title: str, memory_cap_bytes: int | None = None) -> Table:
    """The optimal plan beside the hand-made splits; "fits cap" is "no cap" when none was given."""
    table = Table(title=title)
    for column in ("split", "how", "layers per stage", "bottleneck ms", "iteration ms",
                   "samples/s", "vs optimal", "peak memory", "fits cap"):
        table.add_column(column, justify="left" if column in ("split", "how", "layers per stage") else "right")
    best = rows[0].samples_per_second if rows and rows[0].name == "optimal" else None
    for r in rows:
        layers = ",".join(str(n) for n in r.stage_layers)
        if len(layers) > 40:
            layers = layers[:37] + "..."
        rel = "-" if best is None else f"{r.samples_per_second / best:.1%}"
        table.add_row(r.name, r.description, layers, f"{r.bottleneck_ms:.3f}", f"{r.iteration_ms:.3f}",
                      f"{r.samples_per_second:.2f}", rel, format_bytes(r.peak_memory_bytes),
                      "no cap" if memory_cap_bytes is None else ("yes" if r.fits else "NO"))
    return table


def simulation_from_plan(plan: Plan):
    """Re-simulate a plan's schedule from its own numbers (for the timeline)."""
    return plan_simulation(plan)


def runs_calibration_table(result, title: str) -> Table:
    """``calibrate --runs``: each run's measured seconds beside the prediction before and after the fit."""
    table = Table(title=f"{title}: fitted {', '.join(result.fitted_terms)}")
    for column in ("run", "role", "measured s", "before s", "error", "after s", "error", "measured peak",
                   "predicted peak"):
        table.add_column(column, justify="left" if column in ("run", "role") else "right")
    for row in result.rows:
        measured_peak = row.measured_peak_memory_bytes
        table.add_row(row.name, "held out" if row.held_out else "fit", f"{row.measured_s:.3f}", f"{row.before_s:.3f}",
                      f"{row.error_before:+.1%}", f"{row.after_s:.3f}", f"{row.error_after:+.1%}",
                      format_bytes(measured_peak) if measured_peak else "-",
                      format_bytes(row.predicted_peak_memory_bytes) + (" (over cap)" if row.over_cap else ""))
    return table


def runs_calibration_lines(result) -> list[str]:
    """The fitted terms, the residuals (rms log error) of the fitted and held-out runs, the fit's work."""
    efficiency = result.efficiency
    lines = ["fitted: " + ", ".join(f"{term} {getattr(efficiency, term):g}" for term in result.fitted_terms)]
    for held_out, label in ((False, "fitted runs"), (True, "held-out runs")):
        before, after = result.rms_log_error(held_out, False), result.rms_log_error(held_out, True)
        if before is not None:
            rows = [r for r in result.rows if r.held_out == held_out]
            mean_before = sum(abs(r.error_before) for r in rows) / len(rows)
            mean_after = sum(abs(r.error_after) for r in rows) / len(rows)
            lines.append(f"{label}: rms log error {before:.4f} -> {after:.4f}, mean |error| {mean_before:.1%} -> "
                         f"{mean_after:.1%}")
    lines.append(f"fit: {result.iterations} re-linearisations, {result.evaluations} evaluations (each plans every "
                 f"fitted run), {result.fit_seconds:.1f} s")
    for term in result.at_bounds:
        lines.append(f"note: {term} ended on its bound ({getattr(efficiency, term):g}): the runs ask more of it than "
                     f"it can give; the error they show is likely in another term")
    if any(r.over_cap for r in result.rows):
        names = ", ".join(r.name for r in result.rows if r.over_cap)
        lines.append(f"note: {names}: the memory model puts the run over its cap; planned without one")
    return lines
