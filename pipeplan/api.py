"""The Python API behind each CLI command: one function per command, files in, files out."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.formats.io import file_sha256, load_json, load_plan, load_profile, write_json_atomic
from pipeplan.formats.plan import Plan, PlanSettings

__all__ = ["import_profile", "plan_profile", "compare_splits", "validate_file", "ComparisonRow"]


def import_profile(source: str, path: str | Path, batch_size: int, output: str | Path, model: str | None = None):
    """``pipeplan import``: convert another tool's profile and write it atomically."""
    if source != "pipedream":
        raise BadInputError(f"import: unknown source {source!r}; supported: pipedream")
    from pipeplan.importers import import_pipedream

    profile = import_pipedream(path, batch_size, model=model)
    write_json_atomic(output, profile)
    return profile


def plan_profile(profile_path: str | Path, settings: PlanSettings, output: str | Path | None = None,
                 record_time: bool = False) -> Plan:
    """``pipeplan plan``: plan a profile file and write the plan atomically."""
    from pipeplan.plan.planner import make_plan

    profile = load_profile(profile_path)
    plan = make_plan(profile, settings, profile_sha256=file_sha256(profile_path), record_time=record_time)
    if output is not None:
        write_json_atomic(output, plan)
    return plan


@dataclass(frozen=True)
class ComparisonRow:
    """One split in ``pipeplan compare``."""

    name: str
    """``optimal`` or a baseline's name."""
    description: str
    stage_layers: tuple[int, ...]
    """Layers per stage."""
    bottleneck_ms: float
    iteration_ms: float
    samples_per_second: float
    peak_memory_bytes: int
    """The largest stage's predicted peak."""
    fits: bool
    """Whether every stage is within the memory cap."""


def compare_splits(profile_path: str | Path, settings: PlanSettings) -> list[ComparisonRow]:
    """``pipeplan compare``: the optimal plan beside the splits users make by hand.

    Every row is simulated by the planner's own machinery, at the optimal plan's micro-batch size
    and schedule (or, when nothing fits the cap, at the largest micro-batch size that divides the
    global batch), so the rows differ only in the split.
    """
    from pipeplan.plan.baselines import BASELINES, baseline_partition
    from pipeplan.plan.graph import build_layer_graph
    from pipeplan.plan.memory import stage_in_flight
    from pipeplan.plan.planner import (_problem, candidate_microbatch_sizes, make_plan, plan_from_partition,
                                       with_profile_defaults)

    if settings.schedule not in ("1f1b", "gpipe"):
        raise BadInputError(f"--schedule: compare takes gpipe or 1f1b (the schedules the baselines use), not {settings.schedule!r}")
    profile = load_profile(profile_path)
    sha = file_sha256(profile_path)
    fixed = with_profile_defaults(profile, settings).model_copy(update={"recompute": "none", "virtual_stages": 1})
    try:
        plan = make_plan(profile, fixed, profile_sha256=sha)
        b = plan.microbatch_size
    except InfeasibleError:
        plan = None
        b = max(candidate_microbatch_sizes(profile, fixed))
    m = settings.global_batch // b
    graph = build_layer_graph(profile, b)
    problem = _problem(profile, graph, fixed, stage_in_flight(settings.schedule, settings.stages, m))
    cap = settings.memory_cap_bytes

    def row(name, description, costed, method_plan):
        peaks = [r.peak_memory_bytes for r in costed.ranks] or [s.peak_memory_bytes for s in costed.stages]
        return ComparisonRow(
            name=name,
            description=description,
            stage_layers=tuple(len(s.layers) for s in costed.stages),
            bottleneck_ms=max(s.forward_ms + s.backward_ms + s.transfer_ms for s in costed.stages),
            iteration_ms=costed.predicted.iteration_ms,
            samples_per_second=costed.predicted.samples_per_second,
            peak_memory_bytes=int(max(peaks)),
            fits=cap is None or max(peaks) <= cap,
        )

    rows = []
    if plan is not None:
        rows.append(row("optimal", f"pipeplan ({plan.solver.method}{', proven' if plan.solver.optimal else ''})", plan, plan))
    for name, description in BASELINES.items():
        split = baseline_partition(problem, name)
        costed = plan_from_partition(profile, fixed, graph, problem, split, settings.schedule, b, m, sha, 0.0)
        rows.append(row(name, description, costed, None))
    return rows


def validate_file(path: str | Path) -> str:
    """``pipeplan validate``: check a profile, plan or run report; returns a one-line summary.

    Raises
    ------
    BadInputError
        With one line per problem.
    """
    data = load_json(path)
    if isinstance(data, dict) and (str(data.get("schema", "")).startswith("pipeplan-run-report")
                                   or ("ranks" in data and "measured" in data)):
        from pipeplan.formats.io import load_report

        report = load_report(path)
        return (f"{path}: valid run report: {report.schedule}, {len(report.ranks)} ranks, "
                f"{report.num_microbatches} x {report.microbatch_size}")
    if isinstance(data, dict) and "stages" in data and "predicted" in data:
        plan = load_plan(path)
        return (f"{path}: valid plan of {plan.profile.model}: {len(plan.stages)} stages, "
                f"{plan.schedule}, {plan.num_microbatches} x {plan.microbatch_size}")
    profile = load_profile(path)
    edges = "chain" if profile.edges is None else f"{len(profile.edges)} edges"
    degrees = profile.tensor_parallel_degrees
    return (f"{path}: valid profile of {profile.model}: {len(profile.layers)} layers, {edges}, "
            f"micro-batch sizes {profile.microbatch_sizes}"
            + (f", tensor-parallel degrees {degrees}" if degrees != [1] else ""))
