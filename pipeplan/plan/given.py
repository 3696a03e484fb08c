"""A split someone chose, planned: the schedule, stages per rank, micro-batch size and
recomputation given, not searched (``pipeplan plan --layers-per-stage``, ``doctor``'s costing of
a launcher's own layout, the cluster search's fixed split)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pipeplan.errors import BadInputError
from pipeplan.facts.schedules import valid_virtual_stages
from pipeplan.formats.io import dump_model, file_sha256, load_profile
from pipeplan.formats.plan import Plan, PlanSettings
from pipeplan.plan.assemble import plan_given_split
from pipeplan.plan.graph import build_layer_graph
from pipeplan.plan.recompute import block_layers
from pipeplan.plan.search import with_profile_defaults

__all__ = ["plan_split", "megatron_layers_per_stage", "fixed_split_stages"]


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
    >>> from pipeplan.formats.plan import PlanSettings
    >>> plan = plan_split(prof, PlanSettings(stages=2, schedule="1f1b", global_batch=4), [3, 1])
    >>> [len(s.layers) for s in plan.stages], plan.predicted.iteration_ms
    ([3, 1], 36.000001)
    """
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
    return plan_given_split(profile, settings, build_layer_graph(profile, b, block_layers(settings)), stages, schedule=settings.schedule,
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
    return hashlib.sha256(dump_model(model).encode()).hexdigest()


def megatron_layers_per_stage(profile, stages: int) -> list[int]:
    """Megatron-LM's split over ``stages`` (virtual) stages: the blocks equally, the embedding on
    the first, the final norm and the head (and any other unit after the blocks) on the last
    (megatron-core's ``get_num_layers_to_build`` without the uneven-first/last options).

    Raises
    ------
    BadInputError
        Blocks that do not divide over the stages (Megatron-LM refuses them too).

    Examples
    --------
    >>> from types import SimpleNamespace as N
    >>> kinds = ["embedding"] + ["block"] * 4 + ["norm", "head"]
    >>> megatron_layers_per_stage(N(layers=[N(kind=k) for k in kinds]), 2)
    [3, 4]
    """
    kinds = [layer.kind for layer in profile.layers]
    blocks = kinds.count("block")
    if blocks == 0 or blocks % stages:
        raise BadInputError(f"layers_per_stage 'megatron': {blocks} blocks do not divide over {stages} "
                            f"(virtual) stages")
    first_block = kinds.index("block")
    counts = [blocks // stages] * stages
    counts[0] += first_block
    counts[-1] += len(kinds) - first_block - blocks
    return counts


def fixed_split_stages(settings: PlanSettings) -> PlanSettings:
    """With ``--layers-per-stage`` the pipeline degree is the split's: counts / stages per rank."""
    if settings.schedule == "auto":
        raise BadInputError("--layers-per-stage: a given split needs a named --schedule, not auto")
    v = settings.virtual_stages or valid_virtual_stages(settings.schedule)[0]
    counts = len(settings.layers_per_stage)
    if counts % v:
        raise BadInputError(f"--layers-per-stage: {counts} counts are not a whole number of pipeline ranks "
                            f"at {v} stages per rank")
    if settings.stages is not None and settings.stages * v != counts:
        raise BadInputError(f"--layers-per-stage: {counts} counts for --stages {settings.stages} x {v} stages "
                            f"per rank; give {settings.stages * v}")
    return settings.model_copy(update={"stages": counts // v, "virtual_stages": v})
