"""Rich renderings of plans and comparisons for the terminal."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from pipeplan.formats.plan import Plan
from pipeplan.quantities import format_bytes
from pipeplan.plan import plan_simulation
from pipeplan.cluster.tables import cluster_plan_tables

__all__ = ["plan_tables", "comparison_table", "simulation_from_plan", "stage_count_words"]


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
        return cluster_plan_tables(plan)
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
    for column in ("stage", "rank", "layers", "first .. last", "fwd ms", "bwd ms", "xfer ms",
                   "send", "params", "in flight", "peak memory"):
        stages.add_column(column, justify="left" if column == "first .. last" else "right")
    for s in plan.stages:
        span = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
        stages.add_row(
            str(s.index), str(s.rank), str(len(s.layers)), span,
            f"{s.forward_ms:.3f}", f"{s.backward_ms:.3f}" + ((" (sel)" if s.recompute_granularity == "selective" else " (rc)") if s.recompute else ""),
            f"{s.transfer_ms:.3f}", format_bytes(s.send_bytes), format_bytes(s.param_bytes),
            str(s.in_flight), format_bytes(s.peak_memory_bytes),
        )
    parts = [summary, stages]
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
