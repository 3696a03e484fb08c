"""The Python API behind each CLI command: one function per command, files in, files out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeplan.errors import BadInputError
from pipeplan.formats.io import file_sha256, load_json, load_plan, load_profile, write_json_atomic
from pipeplan.formats.plan import Plan, PlanSettings

__all__ = ["import_profile", "plan_profile", "plan_split", "compare_splits", "validate_file", "ComparisonRow"]


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
    """``pipeplan plan``: plan a profile file and write the plan atomically.

    ``PlanSettings`` has the CLI's defaults, so this makes the plan ``pipeplan plan`` makes
    from the same options, byte for byte.
    """
    from pipeplan.plan import make_plan

    profile = load_profile(profile_path)
    plan = make_plan(profile, settings, profile_sha256=file_sha256(profile_path), record_time=record_time)
    if output is not None:
        write_json_atomic(output, plan)
    return plan


def plan_split(profile, settings: PlanSettings, layers_per_stage: list[int], *,
               profile_sha256: str | None = None) -> Plan:
    """The plan of a given split: ``layers_per_stage[s]`` units, in profile order, for stage ``s``.

    The split is costed by the cost model and simulated exactly as any plan; the schedule,
    stages per rank, micro-batch size and recomputation are taken from ``settings``, not
    searched.

    Parameters
    ----------
    profile : Profile or path
        A profile, or a profile file (its sha256 is recorded).
    settings : PlanSettings
        ``schedule`` names a schedule (not ``auto``); ``virtual_stages`` defaults to the
        schedule's smallest; ``microbatch_size`` is required unless the profile has one size;
        ``recompute`` is ``none``, ``selective`` or ``all`` (``auto`` is read as ``none``).
    layers_per_stage : list of int
        One count per stage, ``stages x virtual_stages`` of them, virtual stages in pipeline
        order; each at least 1, summing to the profile's unit count.
    profile_sha256 : str, optional
        Recorded in the plan; default the file's sha256, or for a Profile object that of its
        canonical JSON.

    Returns
    -------
    Plan
        ``solver.method`` is ``given``; a note says so when a rank goes over the memory cap.

    Raises
    ------
    BadInputError
        Bad counts (naming the problem), an ``auto`` schedule, a micro-batch size that was
        not profiled or does not divide the global batch, or a schedule that refuses the
        numbers.

    Examples
    --------
    >>> from pipeplan.formats.profile import Profile
    >>> layers = [{"name": f"l{i}", "param_bytes": 4, "costs": [{"microbatch_size": 1, "forward_ms": 1,
    ...            "backward_ms": 2, "activation_bytes": 8, "output_bytes": 8}]} for i in range(4)]
    >>> prof = Profile.model_validate({"schema_version": 1, "model": "toy", "source": "analytic",
    ...                                "device": {"name": "cpu"}, "dtype": "fp32", "layers": layers})
    >>> plan = plan_split(prof, PlanSettings(stages=2, schedule="1f1b", global_batch=4), [3, 1])
    >>> [len(s.layers) for s in plan.stages], plan.predicted.iteration_ms
    ([3, 1], 36.000001)
    """
    from pipeplan.plan import build_layer_graph, valid_virtual_stages, with_profile_defaults

    if isinstance(profile, (str, Path)):
        path = profile
        profile = load_profile(path)
        sha = profile_sha256 or file_sha256(path)
    else:
        sha = profile_sha256 or _model_sha256(profile)
    settings = with_profile_defaults(profile, settings)
    if settings.schedule == "auto":
        raise BadInputError("schedule: a given split needs a named schedule, not 'auto'; "
                            "use one of gpipe, 1f1b, interleaved, zb, zbv, dualpipev")
    v = settings.virtual_stages or valid_virtual_stages(settings.schedule)[0]
    b = settings.microbatch_size
    if b is None:
        if len(profile.microbatch_sizes) != 1:
            raise BadInputError(f"microbatch_size: a given split needs one; the profile has "
                                f"{profile.microbatch_sizes}")
        b = profile.microbatch_sizes[0]
    if b not in profile.microbatch_sizes:
        raise BadInputError(f"microbatch_size: {b} was not profiled; the profile has {profile.microbatch_sizes}")
    if settings.global_batch % b:
        raise BadInputError(f"microbatch_size: {b} does not divide the global batch {settings.global_batch}")
    stages = _stages_from_counts(layers_per_stage, len(profile.layers), settings.stages, v)
    settings = settings.model_copy(update={"virtual_stages": v, "microbatch_size": b,
                                           "recompute": settings.recompute if settings.recompute in ("all", "selective")
                                           else "none"})
    from pipeplan.plan import plan_given_split

    return plan_given_split(profile, settings, build_layer_graph(profile, b), stages, schedule=settings.schedule,
                            virtual_stages=v, microbatch_size=b, num_microbatches=settings.global_batch // b,
                            profile_sha256=sha)


def _stages_from_counts(counts, num_units: int, ranks: int, v: int) -> list[list[int]]:
    counts = list(counts)
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        raise BadInputError(f"layers_per_stage: {counts} must be whole numbers")
    if len(counts) != ranks * v:
        raise BadInputError(f"layers_per_stage: {len(counts)} counts for {ranks} ranks x {v} stages per rank; "
                            f"give {ranks * v}")
    small = [s for s, c in enumerate(counts) if c < 1]
    if small:
        raise BadInputError(f"layers_per_stage: stage {small[0]} has {counts[small[0]]} units; every stage needs at least 1")
    if sum(counts) != num_units:
        raise BadInputError(f"layers_per_stage: the counts add up to {sum(counts)} but the profile has "
                            f"{num_units} units")
    stages, start = [], 0
    for c in counts:
        stages.append(list(range(start, start + c)))
        start += c
    return stages


def _model_sha256(model) -> str:
    import hashlib

    from pipeplan.formats.io import dump_model

    return hashlib.sha256(dump_model(model).encode()).hexdigest()


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

    Every row is a plan costed and simulated by the planner's own machinery
    (:func:`pipeplan.plan.baselines.compare_baselines`), at the optimal plan's micro-batch
    size and schedule, so the rows differ only in the split.
    """
    from pipeplan.plan.baselines import compare_baselines

    profile = load_profile(profile_path)
    optimal, baselines = compare_baselines(profile, settings, file_sha256(profile_path))
    cap = settings.memory_cap_bytes

    def row(name, description, costed):
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
    if optimal is not None:
        proven = ", proven" if optimal.solver.optimal else ""
        rows.append(row("optimal", f"pipeplan ({optimal.solver.method}{proven})", optimal))
    rows.extend(row(name, description, plan) for name, description, plan in baselines)
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
