"""From a split to a plan file, and from a plan file back to the simulator.

- :func:`plan_from_partition`: a solved split and its simulation become a
  :class:`pipeplan.formats.plan.Plan`; each stage's numbers are the cost model's
  (:func:`pipeplan.plan.problem.stage_breakdowns`), the predictions the simulation's.
- :func:`plan_given_split`: cost and simulate a split someone chose (``plan_split``,
  ``balanced_plan``, the ``compare`` baselines) exactly as a planned one.
- :func:`plan_stage_costs` and :func:`plan_simulation`: a plan file simulated again from its
  own numbers (``show --timeline``, the run report's replay).
"""

from __future__ import annotations

import math
from typing import Optional

from pipeplan.errors import BadInputError
from pipeplan.facts.precision import plan_precision
from pipeplan.facts.training_state import StateMemory, precision_of, state_memory, training_state
from pipeplan.formats.plan import Plan, PlanProfileRef, PlanSettings, PlanStage, Predicted, RankSummary, SolverInfo
from pipeplan.plan.costmodel import CostModel
from pipeplan.plan.memory import stage_in_flight
from pipeplan.plan.recompute import full_mode
from pipeplan.plan.problem import Partition, PartitionProblem, build_problem, evaluate_split, stage_breakdowns
from pipeplan.facts.schedules import check_schedule
from pipeplan.plan.simulate import Simulation, StageCost, simulate
from pipeplan.quantities import format_bytes

__all__ = ["plan_from_partition", "plan_given_split", "plan_stage_costs", "plan_simulation", "plan_effective_settings",
           "plan_recompute_modes", "plan_cost_model", "stage_state_memory", "precision_update"]


def plan_from_partition(profile, settings, problem: PartitionProblem, partition: Partition, *, schedule: str,
                        virtual_stages: int, microbatch_size: int, num_microbatches: int, profile_sha256: str,
                        seconds: float = 0.0, alternatives=(), notes=(),
                        simulation: Simulation | None = None) -> Plan:
    """Assemble the plan file's model from a solved partition and its simulation.

    Parameters
    ----------
    simulation : Simulation, optional
        The split's simulation under ``schedule``; simulated here when absent.

    Notes
    -----
    Predicted time, bubble, per-rank busy/idle time and per-rank peak memory come from the
    simulation; per-stage numbers are the cost model's (static plus in-flight activations per
    stage, whose sum over a rank bounds the rank's simulated peak). The partition's notes
    (e.g. a failed ILP solve) come first among the plan's notes.
    """
    p = settings.stages
    breakdowns = stage_breakdowns(problem, partition)
    if simulation is None:
        simulation = simulate([b.stage_cost() for b in breakdowns], schedule, p, num_microbatches, virtual_stages)
    sim = simulation
    graph = problem.graph
    stages = []
    for b in breakdowns:
        t, m = b.time, b.memory
        layers = list(b.layers)
        stages.append(
            PlanStage(
                index=b.index,
                rank=sim.stage_ranks[b.index],
                layers=[graph.names[v] for v in layers],
                forward_ms=round(t.forward_ms, 6),
                backward_ms=round(t.backward_action_ms, 6),
                backward_input_ms=round(t.backward_input_action_ms, 6),
                backward_weight_ms=round(t.backward_weight_ms, 6),
                transfer_ms=round(t.transfer_ms, 6),
                send_bytes=int(b.out_bytes),
                param_bytes=int(graph.param_bytes[layers].sum() + m.tied_copy_param_bytes),
                activation_bytes=int(graph.activation_bytes[layers].sum()),
                in_flight=m.in_flight,
                recompute=b.recompute != "none",
                recompute_granularity="selective" if b.recompute == "selective" else None,
                selective_activation_bytes=int(graph.selective_activation_bytes[layers].sum())
                if b.recompute == "selective" else None,
                checkpoint_bytes=int(math.ceil(m.kept_bytes)) if b.recompute in ("full", "block") else None,
                peak_memory_bytes=int(math.ceil(m.peak_bytes)),
                working_bytes=int(math.ceil(m.working_bytes)) if m.working_bytes else None,
            )
        )
    times = partition.stage_times_ms
    bottleneck = max(range(len(times)), key=lambda s: (times[s], -s))
    iteration = sim.iteration_ms
    samples = settings.global_batch * 1000.0 / iteration if iteration > 0 else 0.0
    overhead_set = bool(settings.action_overhead_ms)
    ranks = [
        RankSummary(
            rank=r,
            stages=[s for s, owner in enumerate(sim.stage_ranks) if owner == r],
            busy_ms=round(sim.rank_busy_ms[r], 6),
            idle_ms=round(sim.rank_idle_ms[r], 6),
            peak_memory_bytes=int(sim.rank_peak_memory_bytes[r]),
            overhead_ms=round(sim.rank_overhead_ms[r], 6) if overhead_set else None,
        )
        for r in range(p)
    ]
    failure = "; ".join(partition.notes) or None
    return Plan(
        # checkpoint_bytes is a version-2 field: a plan that sets it says so.
        schema_version=2 if any(s.checkpoint_bytes is not None for s in stages) else 1,
        profile=PlanProfileRef(model=profile.model, sha256=profile_sha256),
        settings=settings,
        schedule=schedule,
        virtual_stages=virtual_stages,
        microbatch_size=microbatch_size,
        num_microbatches=num_microbatches,
        stages=stages,
        predicted=Predicted(
            iteration_ms=round(iteration, 6),
            bubble_fraction=round(sim.bubble_fraction, 6),
            samples_per_second=round(samples, 6),
            bottleneck_stage=bottleneck,
            compute_ms=round(sim.compute_ms, 6),
            # The rest of the rounded iteration, so that the file's parts add up to it exactly;
            # tests check it against the simulation's idle intervals (Simulation.bubble_ms).
            bubble_ms=round(round(iteration, 6) - round(sim.compute_ms, 6) - round(sim.transfer_ms, 6)
                            - round(sim.overhead_ms, 6), 6),
            transfer_ms=round(sim.transfer_ms, 6),
            overhead_ms=round(sim.overhead_ms, 6) if overhead_set else None,
        ),
        ranks=ranks,
        alternatives=list(alternatives),
        notes=[*partition.notes, *notes],
        solver=SolverInfo(method=partition.method, optimal=partition.optimal, seconds=round(seconds, 3),
                          lower_bound_ms=None if partition.lower_bound_ms is None else round(partition.lower_bound_ms, 6),
                          failure=failure),
    )


def plan_given_split(profile, settings, graph, stages, *, schedule: str, virtual_stages: int,
                     microbatch_size: int, num_microbatches: int, profile_sha256: str, method: str = "given",
                     notes=(), recompute=None) -> Plan:
    """The plan of a split someone chose, costed and simulated as the planner does.

    Parameters
    ----------
    profile : Profile
    settings : PlanSettings
        Recorded in the plan; its optimizer, bandwidth, cap and overhead cost the split.
    graph : LayerGraph
        At ``microbatch_size``.
    stages : sequence of sequence of int
        Layer positions per stage, ``ranks x virtual_stages`` of them, in pipeline order.
    recompute : sequence of str, optional
        Per stage; default from ``settings.recompute`` (``all``: every stage, else none).

    Raises
    ------
    BadInputError
        If the schedule refuses ``(p, m, v)`` or the stages are not a valid split.
    """
    p, v, m = settings.stages, virtual_stages, num_microbatches
    check_schedule(schedule, p, m, v)
    if len(stages) != p * v:
        raise BadInputError(f"{len(stages)} stages given for {p} ranks x {v} stages per rank; give {p * v}")
    in_flight = stage_in_flight(schedule, p, m, v)
    if recompute is None:
        recompute = ({"all": full_mode(settings), "selective": "selective"}.get(settings.recompute, "none"),) * (p * v)
    problem = build_problem(profile, graph, settings, in_flight, recompute)
    try:
        partition = evaluate_split(problem, stages, method=method)
    except ValueError as exc:
        raise BadInputError(f"the split is not valid: {exc}") from None
    breakdowns = stage_breakdowns(problem, partition)
    sim = simulate([b.stage_cost() for b in breakdowns], schedule, p, m, v)
    notes = list(notes)
    cap = settings.memory_cap_bytes
    if cap is not None and sim.peak_memory_bytes > cap:
        rank = max(range(p), key=lambda r: sim.rank_peak_memory_bytes[r])
        peak = sim.rank_peak_memory_bytes[rank]
        notes.append(f"over the memory cap: rank {rank} peaks at {format_bytes(peak)}, "
                     f"{format_bytes(peak - cap)} over {format_bytes(cap)}")
    return plan_from_partition(profile, settings, problem, partition, schedule=schedule, virtual_stages=v,
                               microbatch_size=microbatch_size, num_microbatches=m,
                               profile_sha256=profile_sha256, notes=notes, simulation=sim)


def plan_effective_settings(plan: Plan) -> PlanSettings:
    """The plan's settings with the degrees it chose: a cluster plan records the request (a ZeRO
    stage or ``d`` left to the search is null there) and its choice in ``parallelism``."""
    par = plan.parallelism
    if par is None:
        return plan.settings
    update = {"zero_stage": par.zero_stage, "data_parallel": par.data}
    if par.expert is not None:
        update["expert_data_parallel"] = par.expert_data
    return plan.settings.model_copy(update=update)


def plan_recompute_modes(plan: Plan) -> tuple[str, ...]:
    """Each stage's recompute mode (:data:`pipeplan.plan.costmodel.RECOMPUTE_MODES`), in stage order."""
    return tuple(("selective" if s.recompute_granularity == "selective" else "full") if s.recompute else "none"
                 for s in sorted(plan.stages, key=lambda s: s.index))


def plan_cost_model(plan: Plan, dtype_bytes: int, graph=None, *,
                    bandwidth_bytes_per_s: Optional[float] = None) -> CostModel:
    """The cost model of a plan: the one every consumer of a plan costs its stages with (the run
    report's replay, ``check``, ``doctor``, the exports), from the plan's settings and the degrees
    it chose (:func:`plan_effective_settings`); ``bandwidth_bytes_per_s`` replaces the plan's (a
    measured link)."""
    settings = plan_effective_settings(plan)
    if bandwidth_bytes_per_s is not None:
        settings = settings.model_copy(update={"bandwidth_bytes_per_s": bandwidth_bytes_per_s})
    return CostModel.from_settings(settings, dtype_bytes, graph)


def precision_update(profile, settings) -> dict:
    """``{"precision": the profile's}`` where ``settings`` do not record it yet, else ``{}``
    (:func:`pipeplan.facts.precision.plan_precision`: what a plan records, and its checks)."""
    precision = plan_precision(getattr(profile, "precision", None), settings.fp8_param_gather)
    return {} if settings.precision == precision else {"precision": precision}


def stage_state_memory(plan: Plan, stage: PlanStage, dtype_bytes: int) -> StateMemory:
    """A stage's training state by part (weights, gradients, optimizer state) under the plan's
    optimizer, ZeRO stage and data-parallel degree: what the cost model's static term counts,
    split as ZeRO shards it (:func:`pipeplan.facts.training_state.state_memory`)."""
    settings = plan_effective_settings(plan)
    return state_memory(stage.param_bytes / dtype_bytes, training_state(settings.optimizer, dtype_bytes, *precision_of(settings)),
                        settings.zero_stage or 0, settings.data_parallel or 1)


def plan_stage_costs(plan: Plan) -> list[StageCost]:
    """Each stage's :class:`StageCost` rebuilt from a plan file's own numbers, in stage order.

    The cost model's inverse (:meth:`pipeplan.plan.costmodel.CostModel.stage_cost_from_plan`):
    ``forward_ms``, the input and weight gradients (``backward_input_ms``, or half the
    backward in plans without it), ``send_bytes`` at the plan's bandwidth, and static and
    activation bytes from ``peak_memory_bytes``, ``in_flight`` and, for a fully recomputing
    stage, ``checkpoint_bytes`` (every layer's input; in plans without it, the previous stage's
    ``send_bytes``, the stage's input).
    """
    stages = sorted(plan.stages, key=lambda s: s.index)
    bandwidth = plan.settings.bandwidth_bytes_per_s
    model = CostModel(bandwidth_bytes_per_s=math.inf if bandwidth is None else float(bandwidth),
                      action_overhead_ms=float(plan.settings.action_overhead_ms or 0.0))
    return [model.stage_cost_from_plan(stage, stages[j - 1].send_bytes if j > 0 else 0, j + 1 == len(stages))
            for j, stage in enumerate(stages)]


def plan_simulation(plan: Plan) -> Simulation:
    """Simulate a plan file again from its own numbers (no profile needed), e.g. for its timeline.

    Returns
    -------
    Simulation
        Equal to the planner's own simulation up to the plan's rounding of times to 1 ns;
        per-rank peaks are equal.

    Examples
    --------
    >>> from pipeplan.formats.io import load_plan  # doctest: +SKIP
    >>> plan_simulation(load_plan("plan.json")).iteration_ms  # doctest: +SKIP
    """
    return simulate(plan_stage_costs(plan), plan.schedule, plan.settings.stages, plan.num_microbatches,
                    plan.virtual_stages)
