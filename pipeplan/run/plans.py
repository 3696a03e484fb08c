"""Plans for any schedule, split evenly and predicted by the simulator (for runs and tests).

The planner (:func:`pipeplan.plan.make_plan`) searches splits for the schedules it
supports. To run every schedule the simulator knows (interleaved, zero-bubble, V-shapes) on a
real model, :func:`balanced_plan` builds a plan directly: it cuts the profile's layer chain into
``ranks * virtual_stages`` contiguous stages of near-equal compute (the chain DP on compute
alone) and hands the split to the planner's own costing and simulation
(:func:`pipeplan.plan.plan_given_split`). :func:`simulate_plan` predicts any plan with the same
cost model. No torch needed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

from pipeplan.errors import BadInputError
from pipeplan.formats.plan import Plan, PlanSettings
from pipeplan.plan.assemble import plan_cost_model, plan_recompute_modes, plan_simulation
from pipeplan.plan.costmodel import CostModel
from pipeplan.plan.graph import build_layer_graph
from pipeplan.plan.problem import PartitionProblem, evaluate_split
from pipeplan.plan.problem import stage_costs as split_stage_costs
from pipeplan.plan.simulate import simulate
from pipeplan.facts.schedules import check_schedule, valid_virtual_stages

__all__ = ["balanced_plan", "simulate_plan", "stage_costs"]


def _positions(profile: Any, graph: Any, stages: Sequence[Sequence[str]]) -> list[list[int]]:
    """Layer positions of a split given by layer names.

    Raises
    ------
    BadInputError
        A layer name the profile does not have.
    """
    index = {name: i for i, name in enumerate(graph.names)}
    for number, layers in enumerate(stages):
        unknown = [name for name in layers if name not in index]
        if unknown:
            raise BadInputError(
                f"stage {number}: layer {unknown[0]!r} is not in the profile of {profile.model}; "
                f"its layers are {', '.join(graph.names)}"
            )
    return [[index[name] for name in layers] for layers in stages]


def stage_costs(profile: Any, stages: Sequence[Sequence[str]], microbatch_size: int,
                optimizer: str = "adam", bandwidth_bytes_per_s: Optional[float] = None,
                latency_ms: float = 0.0, action_overhead_ms: Optional[float] = None, *,
                recompute: Sequence[str] = (), cost: Any = None) -> list:
    """One :class:`pipeplan.plan.simulate.StageCost` per stage, from the profile's layers, by
    the cost model (:class:`pipeplan.plan.costmodel.CostModel`), as the planner costs them.

    Parameters
    ----------
    profile : Profile
    stages : sequence of sequence of str
        Layer names per stage, in pipeline order.
    microbatch_size : int
        A profiled size.
    optimizer : {'adam', 'adam-fp32-grads', 'sgd', 'none'}
        Sets the static bytes per parameter byte.
    bandwidth_bytes_per_s : float, optional
        Point-to-point bandwidth; None means transfers are free.
    latency_ms : float
        Fixed time per transfer, added to ``bytes / bandwidth``.
    action_overhead_ms : float, optional
        The schedule's own time per action (see :class:`pipeplan.plan.simulate.StageCost`).
    recompute : sequence of str, optional
        Each stage's recompute mode; empty: none.
    cost : CostModel, optional
        The cost model to use instead of the one the three settings above make (a plan's own:
        :func:`pipeplan.plan.assemble.plan_cost_model`).

    Raises
    ------
    BadInputError
        A layer name the profile does not have.
    """
    graph = build_layer_graph(profile, microbatch_size)
    positions = _positions(profile, graph, stages)
    if cost is None:
        settings = PlanSettings(stages=len(stages), optimizer=optimizer, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                                action_overhead_ms=action_overhead_ms)
        cost = CostModel.from_settings(settings, profile.dtype_bytes, graph)
    problem = PartitionProblem(graph=graph, num_stages=len(stages), in_flight=(1,) * len(stages),
                               recompute=tuple(recompute), cost=cost)
    partition = evaluate_split(problem, positions)
    last = len(stages) - 1
    return [replace(c, send_ms=c.send_ms + latency_ms) if j < last else c
            for j, c in enumerate(split_stage_costs(problem, partition))]


def simulate_plan(plan: Plan, profile: Any, *, bandwidth_bytes_per_s: Optional[float] = None,
                  latency_ms: float = 0.0) -> Any:
    """Simulate ``plan``'s schedule with its stages' costs taken from ``profile``, by the plan's
    own cost model (:func:`pipeplan.plan.assemble.plan_cost_model`: its optimizer, ZeRO stage and
    data-parallel degree) and each stage's recomputation.

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
    ordered = sorted(plan.stages, key=lambda s: s.index)
    par = getattr(plan, "parallelism", None)
    if par is not None and (par.tensor > 1 or (par.expert or 1) > 1):
        # A rank of a tensor- or expert-parallel plan holds 1/t of each layer and 1/E of its
        # experts and waits on their collectives: the whole-model profile is not what it runs,
        # and the plan's own stage numbers (the cluster view's) are.
        return plan_simulation(plan)
    graph = build_layer_graph(profile, plan.microbatch_size)
    cost = plan_cost_model(plan, profile.dtype_bytes, graph, bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    costs = stage_costs(profile, [s.layers for s in ordered], plan.microbatch_size, latency_ms=latency_ms,
                        recompute=plan_recompute_modes(plan), cost=cost)
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
        Any of :data:`pipeplan.facts.schedules.SCHEDULES`.
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
        largest stage's compute (ties toward balance), not the simulated iteration.

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
    from pipeplan.plan import PartitionProblem, build_layer_graph, partition_chain, plan_given_split
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
    # Compute alone (the default cost model: free transfers, no memory), split by the chain DP.
    compute_only = PartitionProblem(graph=graph, num_stages=num_stages, in_flight=(1,) * num_stages)
    split = partition_chain(compute_only, method="direct").stages
    settings = PlanSettings(stages=ranks, global_batch=microbatch_size * num_microbatches,
                            microbatch_size=microbatch_size, optimizer=optimizer, schedule=schedule,
                            virtual_stages=virtual_stages, bandwidth_bytes_per_s=None, recompute="none")
    return plan_given_split(
        profile, settings, graph, split, schedule=schedule, virtual_stages=virtual_stages,
        microbatch_size=microbatch_size, num_microbatches=num_microbatches, profile_sha256=profile_sha256,
        method="balanced",
        notes=["split by pipeplan.run.plans.balanced_plan: near-equal compute per stage, "
               "predicted by the event simulator"])
