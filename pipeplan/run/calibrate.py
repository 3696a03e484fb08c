"""``pipeplan calibrate``: scale a profile's per-layer times by what a run measured.

A profile times each unit alone; a pipelined run times the same units inside the schedule
(other kernels on the core, the stage's own bookkeeping, cache effects). For every rank of the
run, the ratio of the measured compute to the profile's prediction for that rank's layers,

    forward_factor  = measured forward (and loss) ms per iteration / (m x sum of the layers' forward_ms)
    backward_factor = measured backward + weight-gradient ms        / (m x sum of the layers' backward_ms)

multiplies those layers' forward and backward times (and the B/W parts) at every profiled
micro-batch size. The run's schedule's own time per action (posting transfers, bookkeeping:
the report's ``measured.action_overhead_ms``) goes into ``measurement.action_overhead_ms``,
which the planner counts before every action. The next plan made from the calibrated profile
then uses the times the run saw. What neither absorbs (time a rank spends waiting inside the
schedule beyond the simulated bubble) is left in the next run's ratio.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

from pipeplan.errors import BadInputError
from pipeplan.errors import format_validation_error
from pipeplan.formats.report import RunReport
from pipeplan.formats.io import file_sha256, load_plan, load_profile, load_report, refuse_overwriting_input, write_json_atomic

__all__ = ["calibrate_profile", "calibrate_files", "calibration_table"]


def _scale(cost: Any, forward: float, backward: float) -> Any:
    data = cost.model_dump()
    data["forward_ms"] = round(cost.forward_ms * forward, 4)
    data["backward_ms"] = round(cost.backward_ms * backward, 4)
    if cost.backward_input_ms is not None:
        data["backward_input_ms"] = round(cost.backward_input_ms * backward, 4)
        data["backward_weight_ms"] = round(cost.backward_weight_ms * backward, 4)
    return type(cost).model_validate(data)


def calibrate_profile(plan: Any, report: dict[str, Any], profile: Any,
                      source: Optional[dict[str, str]] = None) -> tuple[Any, list[dict[str, Any]]]:
    """The profile with each rank's layers scaled by that rank's measured/predicted compute.

    Parameters
    ----------
    plan : Plan
        The plan that was run.
    report : RunReport or dict
        Its run report (:func:`pipeplan.run.report.build_report`); a dict is checked against
        :class:`pipeplan.formats.report.RunReport`.
    profile : Profile
        The profile the plan was made from.
    source : dict, optional
        File names to record in ``measurement.calibration``.

    Returns
    -------
    (Profile, list of dict)
        The calibrated profile, and per rank its layers and the two factors.

    Raises
    ------
    BadInputError
        A report that breaks the format, a report of another plan (schedule, micro-batches,
        ranks), a plan layer the profile lacks, or a rank with no measured time.

    Examples
    --------
    >>> from pipeplan.formats.profile import Profile
    >>> from pipeplan.run.plans import balanced_plan
    >>> layers = [{"name": n, "param_bytes": 4, "costs": [{"microbatch_size": 1, "forward_ms": 1,
    ...            "backward_ms": 2, "activation_bytes": 8, "output_bytes": 8}]} for n in "ab"]
    >>> prof = Profile.model_validate({"schema_version": 1, "model": "toy", "source": "measured",
    ...                                "device": {"name": "cpu"}, "dtype": "fp32", "layers": layers})
    >>> plan = balanced_plan(prof, schedule="gpipe", ranks=2, microbatch_size=1, num_microbatches=2)
    >>> report = {"schedule": "gpipe", "num_microbatches": 2, "microbatch_size": 1, "ranks": [
    ...     {"rank": 0, "forward_ms": 3.0, "loss_ms": 0.0, "backward_ms": 4.0, "weight_ms": 0.0},
    ...     {"rank": 1, "forward_ms": 2.0, "loss_ms": 0.0, "backward_ms": 4.0, "weight_ms": 0.0}]}
    >>> new, factors = calibrate_profile(plan, report, prof)
    >>> [(c.forward_ms, c.backward_ms) for layer in new.layers for c in layer.costs]
    [(1.5, 2.0), (1.0, 2.0)]
    """
    report = _as_report(report)
    for key, value in (("schedule", plan.schedule), ("num_microbatches", plan.num_microbatches),
                       ("microbatch_size", plan.microbatch_size)):
        if getattr(report, key) != value:
            raise BadInputError(
                f"report: {key} is {getattr(report, key)!r} but the plan's is {value!r}; give the report of a run "
                f"of this plan"
            )
    size = plan.microbatch_size
    if size not in profile.microbatch_sizes:
        raise BadInputError(
            f"profile: micro-batch size {size} of the plan was not profiled (it has {profile.microbatch_sizes}); "
            f"give the profile the plan was made from"
        )
    by_name = {layer.name: layer for layer in profile.layers}
    # With data parallelism, each pipeline rank's replicas are pooled (the mean of their times).
    replicas: dict[int, list[Any]] = {}
    for row in report.ranks:
        replicas.setdefault(row.rank if row.pipeline_rank is None else row.pipeline_rank, []).append(row)
    m = plan.num_microbatches
    stage_ranks = {s.index: s.rank for s in plan.stages}
    factors = []
    scale: dict[str, tuple[float, float]] = {}
    for rank in sorted(set(stage_ranks.values())):
        if rank not in replicas:
            raise BadInputError(f"report: no measurement of rank {rank}; give the report of a run of this plan")
        layers = [name for s in sorted(plan.stages, key=lambda s: s.index) if s.rank == rank for name in s.layers]
        missing = [name for name in layers if name not in by_name]
        if missing:
            raise BadInputError(
                f"profile: layer {missing[0]!r} of the plan is not in the profile of {profile.model}; give the "
                f"profile the plan was made from"
            )
        rows = replicas[rank]
        predicted_forward = m * sum(by_name[n].cost_at(size).forward_ms for n in layers)
        predicted_backward = m * sum(by_name[n].cost_at(size).backward_ms for n in layers)
        measured_forward = sum(row.forward_ms + (row.loss_ms or 0.0) for row in rows) / len(rows)
        measured_backward = sum(row.backward_ms + (row.weight_ms or 0.0) for row in rows) / len(rows)
        shares = [row.cpu_share for row in rows if row.cpu_share is not None]
        if measured_forward <= 0 or measured_backward <= 0:
            raise BadInputError(f"report: rank {rank} has no measured compute time; rerun with more --steps")
        forward = measured_forward / predicted_forward if predicted_forward > 0 else 1.0
        backward = measured_backward / predicted_backward if predicted_backward > 0 else 1.0
        for name in layers:
            scale[name] = (forward, backward)
        factors.append({"rank": rank, "layers": layers, "forward_factor": round(forward, 4),
                        "backward_factor": round(backward, 4),
                        "measured_forward_ms": round(measured_forward, 4),
                        "predicted_forward_ms": round(predicted_forward, 4),
                        "measured_backward_ms": round(measured_backward, 4),
                        "predicted_backward_ms": round(predicted_backward, 4),
                        "cpu_share": min(shares) if shares else None})
    data = profile.model_dump()
    new_layers = []
    for layer in profile.layers:
        f, b = scale.get(layer.name, (1.0, 1.0))
        new_layers.append(layer.model_copy(update={"costs": [_scale(c, f, b) for c in layer.costs]}))
    measurement = copy.deepcopy(profile.measurement or {})
    measurement["calibration"] = {
        **(source or {}),
        "method": "per rank: measured compute in the pipelined run / the profile's prediction for the rank's "
                  "layers, forward and backward apart, applied at every micro-batch size",
        "microbatch_size": size,
        "factors": factors,
    }
    overhead_ms = report.measured.action_overhead_ms
    if overhead_ms is not None:
        # The planner counts it before every action of a plan made from this profile.
        measurement["action_overhead_ms"] = round(float(overhead_ms), 4)
        measurement["calibration"]["action_overhead_ms"] = round(float(overhead_ms), 4)
    data["layers"] = [layer.model_dump() for layer in new_layers]
    data["measurement"] = measurement
    return type(profile).model_validate(data), factors


def _as_report(report: Any) -> Any:
    from pydantic import ValidationError

    if isinstance(report, RunReport):
        return report
    if not isinstance(report, dict):
        raise BadInputError(f"report: expected a run report object, found {type(report).__name__}")
    try:
        return RunReport.model_validate(report)
    except ValidationError as exc:
        raise BadInputError(format_validation_error("report", exc)) from None


def calibrate_files(plan_path: str | Path, report_path: str | Path, output: str | Path,
                    profile_path: Optional[str | Path] = None) -> tuple[Any, list[dict[str, Any]]]:
    """``pipeplan calibrate``: read the plan, the run report and the profile; write the new profile.

    ``profile_path`` defaults to the profile the report names (``pipeplan run --profile``).
    """
    plan = load_plan(plan_path)
    report = load_report(report_path)
    if profile_path is None:
        profile_path = report.profile_path
        if profile_path is None:
            raise BadInputError(
                f"{report_path} names no profile (the run had no --profile); give --profile PROFILE.json"
            )
    refuse_overwriting_input(output, plan_path, report_path, profile_path)
    profile = load_profile(profile_path)
    sha = file_sha256(profile_path)
    if sha != plan.profile.sha256:
        raise BadInputError(
            f"{profile_path}: sha256 {sha[:12]}... is not the plan's profile.sha256 {plan.profile.sha256[:12]}...; "
            f"give the profile {plan_path} was made from (--profile)"
        )
    calibrated, factors = calibrate_profile(
        plan, report, profile,
        source={"plan": str(plan_path), "report": str(report_path), "profile": str(profile_path)},
    )
    write_json_atomic(output, calibrated)
    return calibrated, factors


def calibration_table(factors: list[dict[str, Any]]) -> Any:
    """A rich table of the per-rank factors."""
    from rich.table import Table

    table = Table(title="calibration: measured / profiled compute per rank")
    for column in ("rank", "layers", "forward ms", "profiled", "factor", "backward ms", "profiled", "factor"):
        table.add_column(column, justify="left" if column == "layers" else "right")
    for f in factors:
        layers = f["layers"]
        names = ", ".join(layers) if len(layers) <= 3 else f"{layers[0]} .. {layers[-1]} ({len(layers)})"
        table.add_row(str(f["rank"]), names, f"{f['measured_forward_ms']:.1f}", f"{f['predicted_forward_ms']:.1f}",
                      f"{f['forward_factor']:.2f}", f"{f['measured_backward_ms']:.1f}",
                      f"{f['predicted_backward_ms']:.1f}", f"{f['backward_factor']:.2f}")
    shares = [f["cpu_share"] for f in factors if f.get("cpu_share") is not None]
    if shares and min(shares) < 0.9:
        table.caption = (f"the run's ranks got {min(shares):.0%} of a core at worst: other work shared the "
                         f"machine and these factors include it; calibrate from a run on a quiet machine")
    return table
