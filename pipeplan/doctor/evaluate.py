"""doctor's one door into the planner: cost a given split, and find the best plan a launcher can run.

Both go through the planner's own cost model and simulator, so a launcher config and a pipeplan
plan are compared like for like: the given split through ``pipeplan.api.plan_split``, the best
plan through ``make_plan`` with the schedule, stages per rank, micro-batch size and
recomputation the launcher can express.

Everything here is at the pipeline level: one data-parallel replica at tensor-parallel size 1.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.formats.plan import Plan, PlanSettings
from pipeplan.plan.given import plan_split
from pipeplan.facts.schedules import searched_virtual_stages
from pipeplan.plan import candidate_microbatch_sizes, make_plan

__all__ = ["cost_split", "best_plan"]


def cost_split(profile, settings: PlanSettings, stage_layers: list[list[int]], *, schedule: str,
               virtual_stages: int, microbatch_size: int, num_microbatches: int, recompute: str,
               profile_sha256: str) -> Plan:
    """The plan of a given split: predicted time by parts and memory per rank.

    Parameters
    ----------
    profile : Profile
    settings : PlanSettings
        Memory cap, optimizer, bandwidth and ranks (``stages``).
    stage_layers : list of list of int
        Profile layer positions of each stage, pipeline order (virtual-stage-major); none empty,
        each a run of consecutive positions.
    schedule : str
    virtual_stages, microbatch_size, num_microbatches : int
    recompute : {"none", "selective", "all"}
        What every stage recomputes (the launchers apply recomputation to all stages alike).
    profile_sha256 : str

    Raises
    ------
    BadInputError
        The micro-batch size was not profiled, the schedule refuses the numbers, or a stage's
        layers are not consecutive in the profile.
    """
    start = 0
    for s, positions in enumerate(stage_layers):
        if list(positions) != list(range(start, start + len(positions))):
            raise BadInputError(f"stage {s}: its layers are not the next run of the profile's layers; "
                                f"the launcher's split cannot be costed as a pipeline")
        start += len(positions)
    given = settings.model_copy(update={
        "schedule": schedule, "virtual_stages": virtual_stages, "microbatch_size": microbatch_size,
        "global_batch": microbatch_size * num_microbatches, "recompute": recompute})
    return plan_split(profile, given, [len(p) for p in stage_layers], profile_sha256=profile_sha256)


def best_plan(profile, settings: PlanSettings, schedules: tuple[str, ...], *,
              recompute_options=("none", "selective", "all"),
              refuse: Callable[[str, int, int, int], str | None] | None = None,
              profile_sha256: str) -> tuple[Plan | None, list[str]]:
    """The fastest plan that fits, among the schedules and recomputation a launcher can express.

    Parameters
    ----------
    schedules : tuple of str
        The pipeplan schedules the launcher runs.
    recompute_options : tuple of str
        Tried in order (``none``, ``selective``, ``all``) until one fits: the launchers apply
        recomputation to every stage alike, and more of it only adds work.
    refuse : callable, optional
        ``refuse(schedule, p, m, v)`` returns why the launcher refuses those numbers, or None;
        refused configurations are skipped (Megatron's interleaved micro-batch rule).

    Returns
    -------
    plan : Plan or None
        None when nothing fits.
    notes : list of str
        Configurations skipped because the launcher refuses them.

    Notes
    -----
    One planner call per (schedule, micro-batch size, recompute): the planner is exact for a
    fixed schedule, so the best of these calls is the best plan the launcher can run.
    """
    best, notes = None, []
    p = settings.stages
    try:
        sizes = candidate_microbatch_sizes(profile, settings.model_copy(update={"microbatch_size": None}))
    except BadInputError as exc:
        return None, [str(exc)]
    for schedule in schedules:
        for v in searched_virtual_stages(schedule, p, len(profile.layers)):
            for b in sizes:
                m = settings.global_batch // b
                why = refuse(schedule, p, m, v) if refuse else None
                if why:
                    notes.append(f"{schedule} v={v} with {m} micro-batches of {b}: {why}")
                    continue
                for recompute in recompute_options:
                    trial = settings.model_copy(update={"schedule": schedule, "virtual_stages": v,
                                                        "microbatch_size": b, "recompute": recompute})
                    try:
                        plan = make_plan(profile, trial, profile_sha256=profile_sha256)
                    except (InfeasibleError, BadInputError):
                        continue
                    if best is None or plan.predicted.iteration_ms < best.predicted.iteration_ms * (1 - 1e-9):
                        best = plan
                    # Recomputing everywhere only adds work: it can win only where nothing else fits.
                    break
    return best, notes
