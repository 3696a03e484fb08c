"""Plans for any schedule, split evenly and predicted by the simulator (for runs and tests).

The planner (:func:`pipeplan.plan.planner.make_plan`) searches splits for the schedules it
supports. To run every schedule the simulator knows (interleaved, zero-bubble, V-shapes) on a
real model, :func:`balanced_plan` builds a plan directly: it cuts the profile's layer chain into
``ranks * virtual_stages`` contiguous stages of near-equal compute and hands the split to the
planner's own costing and simulation (:func:`pipeplan.plan.planner.plan_from_partition`).
:func:`simulate_plan` predicts any plan the same way. No torch needed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional, Sequence

from pipeplan.errors import BadInputError
from pipeplan.formats.plan import Plan, PlanSettings

__all__ = ["balanced_plan", "simulate_plan", "stage_costs"]


def _split(profile: Any, graph: Any, stages: Sequence[Sequence[str]], settings: PlanSettings,
           in_flight: Sequence[int], method: str = "given") -> tuple[Any, Any]:
    """The planner's ``(problem, partition)`` for a split given by layer names, on the profile's
    layer graph at one micro-batch size (:func:`pipeplan.plan.graph.build_layer_graph`).

    Raises
    ------
    BadInputError
        A layer name the profile does not have.
    """
    from pipeplan.plan.partition import evaluate_split
    from pipeplan.plan.planner import _problem

    index = {name: i for i, name in enumerate(graph.names)}
    for number, layers in enumerate(stages):
        unknown = [name for name in layers if name not in index]
        if unknown:
            raise BadInputError(
                f"stage {number}: layer {unknown[0]!r} is not in the profile of {profile.model}; "
                f"its layers are {', '.join(graph.names)}"
            )
    problem = _problem(profile, graph, settings, in_flight)
    partition = evaluate_split(problem, [[index[name] for name in layers] for layers in stages], method=method)
    return problem, partition


def stage_costs(profile: Any, stages: Sequence[Sequence[str]], microbatch_size: int,
                optimizer: str = "adam", bandwidth_bytes_per_s: Optional[float] = None,
                latency_ms: float = 0.0, action_overhead_ms: Optional[float] = None) -> list:
    """One :class:`pipeplan.plan.simulate.StageCost` per stage, from the profile's layers, as
    the planner costs them (:func:`pipeplan.plan.planner.stage_costs`).

    Parameters
    ----------
    profile : Profile
    stages : sequence of sequence of str
        Layer names per stage, in pipeline order.
    microbatch_size : int
        A profiled size.
    optimizer : {'adam', 'sgd', 'none'}
        Sets the static bytes per parameter byte (:mod:`pipeplan.plan.memory`).
    bandwidth_bytes_per_s : float, optional
        Point-to-point bandwidth; None means transfers are free.
    latency_ms : float
        Fixed time per transfer, added to ``bytes / bandwidth``.
    action_overhead_ms : float, optional
        The schedule's own time per action (see :class:`pipeplan.plan.simulate.StageCost`).

    Raises
    ------
    BadInputError
        A layer name the profile does not have.
    """
    from pipeplan.plan import planner
    from pipeplan.plan.graph import build_layer_graph

    settings = PlanSettings(stages=1, global_batch=microbatch_size, optimizer=optimizer,
                            bandwidth_bytes_per_s=bandwidth_bytes_per_s, action_overhead_ms=action_overhead_ms)
    graph = build_layer_graph(profile, microbatch_size)
    problem, partition = _split(profile, graph, stages, settings, [1] * len(stages))
    last = len(stages) - 1
    return [replace(cost, send_ms=cost.send_ms + latency_ms) if j < last else cost
            for j, cost in enumerate(planner.stage_costs(problem, partition))]


def _balanced_cuts(weights: Sequence[float], parts: int) -> list[int]:
    """Contiguous split of ``weights`` into ``parts`` non-empty runs minimising the largest sum.

    Exact DP, ``O(parts * n^2)``; returns the end index (exclusive) of each run.
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], back[k][j] = value, i
    cuts, j = [], n
    for k in range(parts, 0, -1):
        cuts.append(j)
        j = back[k][j]
    return cuts[::-1]


def simulate_plan(plan: Plan, profile: Any, *, bandwidth_bytes_per_s: Optional[float] = None,
                  latency_ms: float = 0.0) -> Any:
    """Simulate ``plan``'s schedule with its stages' costs taken from ``profile``.

    Parameters
    ----------
    plan : Plan
    profile : Profile
    bandwidth_bytes_per_s, latency_ms : optional
        A measured link instead of the plan's bandwidth setting (and no latency).

    Returns
    -------
    pipeplan.plan.simulate.Simulation
    """
    from pipeplan.plan.simulate import simulate

    ordered = sorted(plan.stages, key=lambda s: s.index)
    bandwidth = bandwidth_bytes_per_s if bandwidth_bytes_per_s is not None else plan.settings.bandwidth_bytes_per_s
    costs = stage_costs(profile, [s.layers for s in ordered], plan.microbatch_size,
                        plan.settings.optimizer, bandwidth, latency_ms, plan.settings.action_overhead_ms)
    num_ranks = 1 + max(s.rank for s in ordered)
    return simulate(costs, plan.schedule, num_ranks, plan.num_microbatches, plan.virtual_stages)


def balanced_plan(profile: Any, *, schedule: str, ranks: int, microbatch_size: int,
                  num_microbatches: int, virtual_stages: Optional[int] = None,
                  optimizer: str = "adam", profile_sha256: str = "0" * 64) -> Plan:
    """A plan of ``schedule`` with stages of near-equal compute, predicted by the simulator.

    Parameters
    ----------
    profile : Profile
        Layers in order (a chain).
    schedule : str
        Any of :data:`pipeplan.plan.schedules.SCHEDULES`.
    ranks : int
        Pipeline ranks ``p``.
    microbatch_size, num_microbatches : int
        ``b`` (a profiled size) and ``m``.
    virtual_stages : int, optional
        Stages per rank; default the smallest the schedule takes (2 for interleaved, zbv and
        dualpipev, 1 otherwise).
    optimizer : {'adam', 'sgd', 'none'}
    profile_sha256 : str
        Recorded in the plan.

    Returns
    -------
    Plan
        ``solver.method`` is ``balanced`` and ``solver.optimal`` False: the split minimises the
        largest stage's compute, not the simulated iteration.

    Raises
    ------
    BadInputError
        If the schedule refuses ``(p, m, v)`` or there are fewer layers than stages.

    Examples
    --------
    >>> from pipeplan.formats.profile import Profile
    >>> layers = [{"name": f"l{i}", "param_bytes": 4, "costs": [{"microbatch_size": 1, "forward_ms": 1,
    ...            "backward_ms": 2, "activation_bytes": 8, "output_bytes": 8}]} for i in range(4)]
    >>> prof = Profile.model_validate({"schema_version": 1, "model": "toy", "source": "analytic",
    ...                                "device": {"name": "cpu"}, "dtype": "fp32", "layers": layers})
    >>> plan = balanced_plan(prof, schedule="zbv", ranks=2, microbatch_size=1, num_microbatches=4)
    >>> [(s.rank, s.layers) for s in plan.stages]
    [(0, ['l0']), (1, ['l1']), (1, ['l2']), (0, ['l3'])]
    """
    from pipeplan.plan.graph import build_layer_graph
    from pipeplan.plan.planner import plan_from_partition
    from pipeplan.plan.planner import stage_costs as planner_stage_costs
    from pipeplan.plan.schedules import check_schedule, valid_virtual_stages
    from pipeplan.plan.simulate import simulate

    if virtual_stages is None:
        virtual_stages = valid_virtual_stages(schedule)[0]
    check_schedule(schedule, ranks, num_microbatches, virtual_stages)
    num_stages = ranks * virtual_stages
    names = [layer.name for layer in profile.layers]
    if num_stages > len(names):
        raise BadInputError(
            f"{schedule} with {ranks} ranks x {virtual_stages} virtual stages needs {num_stages} stages "
            f"but the profile has only {len(names)} layers; use fewer ranks or a deeper model"
        )
    graph = build_layer_graph(profile, microbatch_size)
    cuts = _balanced_cuts(list(graph.forward_ms + graph.backward_ms), num_stages)
    groups = [names[start:end] for start, end in zip([0, *cuts[:-1]], cuts)]
    settings = PlanSettings(stages=ranks, global_batch=microbatch_size * num_microbatches,
                            microbatch_size=microbatch_size, optimizer=optimizer, schedule=schedule,
                            virtual_stages=virtual_stages)
    # The schedule decides how many micro-batches each stage holds: simulate once to learn it,
    # then cost the split with those counts.
    problem, partition = _split(profile, graph, groups, settings, [1] * num_stages)
    sim = simulate(planner_stage_costs(problem, partition), schedule, ranks, num_microbatches, virtual_stages)
    problem, partition = _split(profile, graph, groups, settings, sim.stage_peak_in_flight, method="balanced")
    return plan_from_partition(
        profile, settings, graph, problem, partition, schedule, microbatch_size, num_microbatches,
        profile_sha256, 0.0, virtual_stages=virtual_stages, simulation=sim,
        notes=["split by pipeplan.run.plans.balanced_plan: near-equal compute per stage, "
               "predicted by the event simulator"])
