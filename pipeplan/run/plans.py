"""Plans for any schedule, split evenly and predicted by the simulator (for runs and tests).

The planner (:func:`pipeplan.plan.planner.make_plan`) searches splits for the schedules it
supports. To run every schedule the simulator knows (interleaved, zero-bubble, V-shapes) on a
real model, :func:`balanced_plan` builds a plan directly: it cuts the profile's layer chain into
``ranks * virtual_stages`` contiguous stages of near-equal compute, places them with
:func:`pipeplan.plan.schedules.stage_ranks`, and fills ``predicted`` and ``ranks`` from
:func:`pipeplan.plan.simulate.simulate`. :func:`simulate_plan` predicts any plan the same way.
No torch needed.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from pipeplan.errors import BadInputError
from pipeplan.formats.plan import (
    Plan,
    PlanProfileRef,
    PlanSettings,
    PlanStage,
    Predicted,
    RankSummary,
    SolverInfo,
)

__all__ = ["balanced_plan", "simulate_plan", "stage_costs"]


def _layer_costs(profile: Any, microbatch_size: int) -> dict[str, tuple[float, float, float, int, int, int]]:
    """Per layer: forward, input-gradient, weight-gradient ms; output, activation, param bytes."""
    if microbatch_size not in profile.microbatch_sizes:
        raise BadInputError(
            f"micro-batch size {microbatch_size} was not profiled; the profile has {profile.microbatch_sizes}"
        )
    out = {}
    for layer in profile.layers:
        c = layer.cost_at(microbatch_size)
        b_in = c.backward_input_ms if c.backward_input_ms is not None else c.backward_ms
        b_w = c.backward_weight_ms if c.backward_weight_ms is not None else 0.0
        out[layer.name] = (c.forward_ms, b_in, b_w, c.output_bytes, c.activation_bytes, layer.param_bytes)
    return out


def stage_costs(profile: Any, stages: Sequence[Sequence[str]], microbatch_size: int,
                optimizer: str = "adam", bandwidth_bytes_per_s: Optional[float] = None,
                latency_ms: float = 0.0) -> list:
    """One :class:`pipeplan.plan.simulate.StageCost` per stage, from the profile's layers.

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

    Raises
    ------
    BadInputError
        A layer name the profile does not have.
    """
    from pipeplan.plan.memory import static_bytes_per_param_byte
    from pipeplan.plan.simulate import StageCost

    costs = _layer_costs(profile, microbatch_size)
    static_per_byte = static_bytes_per_param_byte(optimizer, profile.dtype_bytes)
    out = []
    for index, layers in enumerate(stages):
        unknown = [name for name in layers if name not in costs]
        if unknown:
            raise BadInputError(
                f"stage {index}: layer {unknown[0]!r} is not in the profile of {profile.model}; "
                f"its layers are {', '.join(costs)}"
            )
        rows = [costs[name] for name in layers]
        send_bytes = rows[-1][3]
        send_ms = latency_ms
        if bandwidth_bytes_per_s and math.isfinite(bandwidth_bytes_per_s):
            send_ms += send_bytes / bandwidth_bytes_per_s * 1000.0
        out.append(StageCost(
            forward_ms=sum(r[0] for r in rows),
            backward_input_ms=sum(r[1] for r in rows),
            backward_weight_ms=sum(r[2] for r in rows),
            send_ms=send_ms,
            static_memory_bytes=int(static_per_byte * sum(r[5] for r in rows)),
            activation_bytes=int(sum(r[4] for r in rows)),
        ))
    return out


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
                        plan.settings.optimizer, bandwidth, latency_ms)
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
    from pipeplan.plan.schedules import check_schedule, stage_ranks, valid_virtual_stages

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
    costs = _layer_costs(profile, microbatch_size)
    cuts = _balanced_cuts([costs[n][0] + costs[n][1] + costs[n][2] for n in names], num_stages)
    groups, start = [], 0
    for end in cuts:
        groups.append(names[start:end])
        start = end
    placement = stage_ranks(schedule, ranks, virtual_stages)
    settings = PlanSettings(stages=ranks, global_batch=microbatch_size * num_microbatches,
                            microbatch_size=microbatch_size, optimizer=optimizer, schedule=schedule,
                            virtual_stages=virtual_stages)
    stage_cost = stage_costs(profile, groups, microbatch_size, optimizer)
    from pipeplan.plan.simulate import simulate

    sim = simulate(stage_cost, schedule, ranks, num_microbatches, virtual_stages)
    stages = []
    for index, (layers, cost) in enumerate(zip(groups, stage_cost)):
        stages.append(PlanStage(
            index=index,
            rank=placement[index],
            layers=list(layers),
            forward_ms=round(cost.forward_ms, 6),
            backward_ms=round(cost.backward_ms, 6),
            send_bytes=int(costs[layers[-1]][3]) if index < num_stages - 1 else 0,
            param_bytes=int(sum(costs[n][5] for n in layers)),
            activation_bytes=cost.activation_bytes,
            in_flight=int(sim.stage_peak_in_flight[index]),
            peak_memory_bytes=int(cost.static_memory_bytes
                                  + sim.stage_peak_in_flight[index] * cost.activation_bytes),
        ))
    samples = settings.global_batch * 1000.0 / sim.iteration_ms if sim.iteration_ms > 0 else 0.0
    return Plan(
        schema_version=1,
        profile=PlanProfileRef(model=profile.model, sha256=profile_sha256),
        settings=settings,
        schedule=schedule,
        virtual_stages=virtual_stages,
        microbatch_size=microbatch_size,
        num_microbatches=num_microbatches,
        stages=stages,
        predicted=Predicted(
            iteration_ms=round(sim.iteration_ms, 6),
            bubble_fraction=round(sim.bubble_fraction, 6),
            samples_per_second=round(samples, 6),
            bottleneck_stage=max(range(num_stages), key=lambda s: (
                stage_cost[s].forward_ms + stage_cost[s].backward_ms, -s)),
            compute_ms=round(sim.compute_ms, 6),
            bubble_ms=round(sim.bubble_ms, 6),
            transfer_ms=round(sim.transfer_ms, 6),
        ),
        ranks=[
            RankSummary(rank=r, stages=[s for s in range(num_stages) if placement[s] == r],
                        busy_ms=round(sim.rank_busy_ms[r], 6), idle_ms=round(sim.rank_idle_ms[r], 6),
                        peak_memory_bytes=int(sim.rank_peak_memory_bytes[r]))
            for r in range(ranks)
        ],
        notes=["split by pipeplan.run.plans.balanced_plan: near-equal compute per stage, "
               "predicted by the event simulator"],
        solver=SolverInfo(method="balanced", optimal=False, seconds=0.0),
    )
