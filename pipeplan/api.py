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

    Every row is costed by the same model at the optimal plan's micro-batch size and schedule.
    """
    from pipeplan.plan.baselines import BASELINES, baseline_partition
    from pipeplan.plan.graph import build_layer_graph
    from pipeplan.plan.memory import in_flight_microbatches, static_bytes_per_param_byte
    from pipeplan.plan.partition import PartitionProblem, split_fits, stage_memory_bytes
    from pipeplan.plan.planner import make_plan

    profile = load_profile(profile_path)
    try:
        plan = make_plan(profile, settings, profile_sha256=file_sha256(profile_path))
        b, m, schedule = plan.microbatch_size, plan.num_microbatches, plan.schedule
    except InfeasibleError:
        plan = None
        b = (settings.microbatch_size or max(s for s in profile.microbatch_sizes if settings.global_batch % s == 0)
             if any(settings.global_batch % s == 0 for s in profile.microbatch_sizes) else None)
        if b is None:
            raise
        m, schedule = settings.global_batch // b, ("gpipe" if settings.schedule == "gpipe" else "1f1b")
    graph = build_layer_graph(profile, b)
    problem = PartitionProblem(
        graph=graph,
        num_stages=settings.stages,
        in_flight=in_flight_microbatches(schedule, settings.stages, m),
        bandwidth_bytes_per_s=math.inf if settings.bandwidth_bytes_per_s is None else settings.bandwidth_bytes_per_s,
        static_bytes_per_param_byte=static_bytes_per_param_byte(settings.optimizer, profile.dtype_bytes),
        memory_cap_bytes=math.inf if settings.memory_cap_bytes is None else float(settings.memory_cap_bytes),
    )
    rows = []
    if plan is not None:
        rows.append(
            ComparisonRow(
                name="optimal",
                description=f"pipeplan ({plan.solver.method}{', proven' if plan.solver.optimal else ''})",
                stage_layers=tuple(len(s.layers) for s in plan.stages),
                bottleneck_ms=max(s.forward_ms + s.backward_ms + s.transfer_ms for s in plan.stages),
                iteration_ms=plan.predicted.iteration_ms,
                samples_per_second=plan.predicted.samples_per_second,
                peak_memory_bytes=max(s.peak_memory_bytes for s in plan.stages),
                fits=True,
            )
        )
    for name, description in BASELINES.items():
        split = baseline_partition(problem, name)
        times = split.stage_times_ms
        iteration = sum(times) + (m - 1) * max(times)
        peaks = [
            stage_memory_bytes(problem, j, layers, split.boundary_bytes[j - 1] if j else 0)
            for j, layers in enumerate(split.stages)
        ]
        rows.append(
            ComparisonRow(
                name=name,
                description=description,
                stage_layers=tuple(len(s) for s in split.stages),
                bottleneck_ms=split.bottleneck_ms,
                iteration_ms=iteration,
                samples_per_second=settings.global_batch * 1000.0 / iteration,
                peak_memory_bytes=int(max(peaks)),
                fits=split_fits(problem, split),
            )
        )
    return rows


def validate_file(path: str | Path) -> str:
    """``pipeplan validate``: check a profile or plan; returns a one-line summary.

    Raises
    ------
    BadInputError
        With one line per problem.
    """
    data = load_json(path)
    if isinstance(data, dict) and "stages" in data and "predicted" in data:
        plan = load_plan(path)
        return (f"{path}: valid plan of {plan.profile.model}: {len(plan.stages)} stages, "
                f"{plan.schedule}, {plan.num_microbatches} x {plan.microbatch_size}")
    profile = load_profile(path)
    edges = "chain" if profile.edges is None else f"{len(profile.edges)} edges"
    return (f"{path}: valid profile of {profile.model}: {len(profile.layers)} layers, {edges}, "
            f"micro-batch sizes {profile.microbatch_sizes}")
