"""The planner: profile and settings in, the fastest plan that fits out.

For every configuration in the search space (schedule, stages per rank ``v``, micro-batch
size, which stages recompute their activations) it splits the layer graph into ``p * v``
stages with the exact partitioners of :mod:`pipeplan.plan.partition`, then simulates the
schedule with :func:`pipeplan.plan.simulate.simulate`. The simulator is the single source of
truth: the plan's predicted time, bubble, per-rank busy and idle time and per-rank peak
memory are the simulation's, and a configuration whose simulated per-rank peak exceeds the
memory cap is never returned.

Search
------
- ``--schedule auto`` tries every schedule of :data:`pipeplan.formats.plan.SCHEDULES` with
  every ``v`` it accepts (:func:`pipeplan.plan.schedules.valid_virtual_stages`) where the
  schedule's class accepts ``(p, m, v)``; a named schedule fixes it, ``--virtual-stages``
  fixes ``v``.
- Micro-batch sizes: every profiled size that divides the global batch (or the fixed one).
- Recomputation (``--recompute auto``): stages are ranked by the micro-batches they hold in
  flight (the early stages first); the candidates are prefixes of that ranking: none, the
  fewest stages that make the split fit the cap, a few more while that still shortens the
  slowest stage, and the fewest with which no rank can exceed the cap (see below).
- Each configuration is simulated once (``O(p m v)``, up to ~80 ms at 16 ranks), not once
  per candidate split: the partitioner picks the split, the simulator checks it.
- Branch and bound: a rank cannot finish sooner than its own work, so ``m`` times its
  per-micro-batch compute bounds the iteration from below; configurations are simulated in
  the order of that bound, and those whose bound exceeds the best simulated time so far are
  skipped (listed among the alternatives with the bound).

Memory with ``v > 1``
---------------------
The partitioners constrain each stage; a rank holds ``v`` stages whose peaks need not
coincide. The split is first solved with the whole cap per stage and checked by simulation;
when a rank goes over, the per-stage cap shrinks in proportion (three tries), and finally to
``cap / v``, at which the sum of the rank's stage peaks (an upper bound of its peak) fits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.formats.plan import (
    SCHEDULES,
    Alternative,
    Plan,
    PlanProfileRef,
    PlanSettings,
    PlanStage,
    Predicted,
    RankSummary,
    SolverInfo,
)
from pipeplan.plan.graph import build_layer_graph
from pipeplan.cluster.memory import state_bytes_per_param_byte
from pipeplan.plan.memory import rank_peak_bytes, stage_in_flight
from pipeplan.plan.partition import (
    IDEALS_DP_MAX_IDEALS,
    Partition,
    PartitionProblem,
    chain_bottleneck_ms,
    count_ideals,
    fits_along_order,
    partition_along_orders,
    partition_chain,
    partition_ideals,
    stage_memory_bytes,
)
from pipeplan.plan.schedules import check_schedule, stage_ranks, valid_virtual_stages
from pipeplan.plan.simulate import Simulation, StageCost, simulate
from pipeplan.quantities import format_bytes

__all__ = [
    "make_plan",
    "solve_partition",
    "candidate_microbatch_sizes",
    "plan_from_partition",
    "stage_costs",
    "plan_simulation",
    "plan_stage_costs",
    "with_profile_defaults",
    "PLANNER_SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
]

#: Schedules the planner can plan (all of them); ``auto`` searches these, in this order of
#: preference on ties (1F1B before GPipe: same time, less memory).
PLANNER_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb", "zbv", "dualpipev")
assert set(PLANNER_SCHEDULES) == set(SCHEDULES)

#: Schedules that run the input and weight gradients as separate actions, so their
#: prediction depends on the profile's B/W split.
SPLIT_BACKWARD_SCHEDULES = ("zb", "zbv", "dualpipev")

#: Beyond this many layers the recompute candidates are not searched: the chain DP that
#: models recomputation is quadratic in the layers (the bisection solver does not model it).
RECOMPUTE_SEARCH_MAX_LAYERS = 2000

#: Most runners-up recorded in a plan.
MAX_ALTERNATIVES = 24

_TOLERANCE = 1e-9


def candidate_microbatch_sizes(profile, settings: PlanSettings) -> list[int]:
    """Profiled micro-batch sizes that divide the global batch (or the fixed one).

    Raises
    ------
    BadInputError
        If none qualifies.
    """
    sizes = profile.microbatch_sizes
    if settings.microbatch_size is not None:
        b = settings.microbatch_size
        if b not in sizes:
            raise BadInputError(f"--microbatch-size: {b} was not profiled; the profile has {sizes}")
        if settings.global_batch % b:
            raise BadInputError(
                f"--microbatch-size: {b} does not divide --global-batch {settings.global_batch}; "
                f"choose a divisor"
            )
        return [b]
    chosen = [b for b in sizes if settings.global_batch % b == 0]
    if not chosen:
        raise BadInputError(
            f"--global-batch: {settings.global_batch} is not a multiple of any profiled "
            f"micro-batch size {sizes}; use a multiple of one of them"
        )
    return chosen


def _cap(settings: PlanSettings) -> float:
    return math.inf if settings.memory_cap_bytes is None else float(settings.memory_cap_bytes)


def _problem(profile, graph, settings: PlanSettings, in_flight, recompute=(), memory_cap_bytes=None):
    return PartitionProblem(
        graph=graph,
        num_stages=len(in_flight),
        in_flight=tuple(in_flight),
        recompute=tuple(recompute),
        bandwidth_bytes_per_s=(
            math.inf if settings.bandwidth_bytes_per_s is None else settings.bandwidth_bytes_per_s
        ),
        static_bytes_per_param_byte=state_bytes_per_param_byte(
            settings.optimizer, profile.dtype_bytes, settings.zero_stage or 0, settings.data_parallel or 1),
        memory_cap_bytes=_cap(settings) if memory_cap_bytes is None else float(memory_cap_bytes),
        action_overhead_ms=settings.action_overhead_ms or 0.0,
    )


def solve_partition(problem: PartitionProblem, solver: str = "auto") -> Partition:
    """Dispatch to the exact solver that fits the graph; see ``_solve``."""
    found = _solve(problem, solver)
    if not found.optimal and found.lower_bound_ms is not None and found.bottleneck_ms <= found.lower_bound_ms * (1 + 1e-9):
        # The split meets a proven lower bound, so it is optimal whatever found it.
        found = Partition(**{**found.__dict__, "optimal": True})
    return found


def _solve(problem: PartitionProblem, solver: str) -> Partition:
    """Dispatch to the exact solver that fits the graph.

    Raises
    ------
    InfeasibleError
        If nothing fits the memory cap.
    """
    from pipeplan.plan.ilp import ILP_AUTO_MAX_BINARIES, count_binaries, partition_ilp

    if problem.graph.chain and solver in ("auto", "dp"):
        return partition_chain(problem)
    if solver == "dp" or (
        solver == "auto" and count_ideals(problem.graph.graph, IDEALS_DP_MAX_IDEALS) <= IDEALS_DP_MAX_IDEALS
    ):
        return partition_ideals(problem)
    try:
        seed = partition_along_orders(problem)
    except InfeasibleError:
        seed = None
    if solver == "auto" and seed is not None and count_binaries(problem, seed) > ILP_AUTO_MAX_BINARIES:
        # Too large to prove in seconds: keep the best split along several orders, with its
        # lower bound, rather than a result that depends on a wall-clock limit.
        return seed
    return partition_ilp(problem, upper_bound=seed)


def _search_solve(problem: PartitionProblem) -> Partition | None:
    """The split used while searching: the optimal split along the profile's layer order.

    Exact for chains; for DAGs a split into prefixes of the topological order (costed
    exactly), and the search's winner is solved again exactly (:func:`solve_partition`).
    """
    try:
        return partition_chain(problem)
    except InfeasibleError:
        return None


# ----------------------------------------------------------------------------------------
# From a split to the simulator


def stage_costs(problem: PartitionProblem, partition: Partition) -> list[StageCost]:
    """The simulator's per-stage costs of a split.

    A recomputing stage runs its forward again before its input gradient, keeps only its
    input per micro-batch in flight, and holds one micro-batch's full activations while it
    recomputes (counted with its static bytes, as :func:`stage_memory_bytes` does).
    Bytes are rounded up, so the simulated peak never undercuts the partitioner's model.
    """
    g = problem.graph
    spb = problem.seconds_per_byte_ms
    out = []
    last = problem.num_stages - 1
    for j, layers in enumerate(partition.stages):
        layers = list(layers)
        forward = float(g.forward_ms[layers].sum())
        b_input = float(g.backward_input_ms[layers].sum())
        b_weight = float(g.backward_weight_ms[layers].sum())
        b_full = float(g.backward_ms[layers].sum())
        static = math.ceil(problem.static_bytes_per_param_byte * float(g.param_bytes[layers].sum()))
        activations = math.ceil(float(g.activation_bytes[layers].sum()))
        in_bytes = partition.boundary_bytes[j - 1] if j > 0 else 0
        if problem.recompute[j]:
            b_input += forward
            b_full += forward
            static += activations
            activations = int(in_bytes)
        out.append(
            StageCost(
                forward_ms=forward,
                backward_input_ms=b_input,
                backward_weight_ms=b_weight,
                full_backward_ms=b_full,
                send_ms=partition.boundary_bytes[j] * spb if j < last else 0.0,
                static_memory_bytes=int(static),
                activation_bytes=int(activations),
                action_overhead_ms=problem.action_overhead_ms,
            )
        )
    return out


def _busy_lower_bound_ms(costs: list[StageCost], placement: list[int], num_microbatches: int) -> float:
    """A lower bound of the simulated iteration.

    Rank ``r`` cannot start before the first micro-batch's forward has reached its first
    stage, and then has all its own work to do, with the schedule's own time before each of
    its at least two actions per stage and micro-batch (but the first, which may overlap the
    wait); no iteration is shorter than one micro-batch's trip forward and back either.
    """
    ranks = max(placement) + 1
    busy = [0.0] * ranks
    first = [None] * ranks
    trip = 0.0
    for stage, (cost, rank) in enumerate(zip(costs, placement)):
        # Whichever way the schedule runs the backward (whole, or split at some cost).
        backward = min(cost.backward_ms, cost.backward_input_ms + cost.backward_weight_ms)
        busy[rank] += cost.forward_ms + backward + 2 * cost.action_overhead_ms
        # A split schedule runs no input pass on stage 0.
        trip += cost.forward_ms + (0.0 if stage == 0 else min(cost.backward_input_ms, backward))
        if first[rank] is None:
            first[rank] = stage
    head = [0.0]
    for stage, cost in enumerate(costs):
        crossing = cost.send_ms if stage + 1 < len(costs) and placement[stage + 1] != placement[stage] else 0.0
        head.append(head[-1] + cost.forward_ms + crossing)
    return max(trip, max(head[first[r]] + num_microbatches * busy[r] - costs[first[r]].action_overhead_ms
                         for r in range(ranks)))


def _rank_peaks(problem: PartitionProblem, partition: Partition, schedule: str, p: int, m: int, v: int):
    """Exact simulated per-rank peaks of a split (memory depends on the order only)."""
    costs = stage_costs(problem, partition)
    return rank_peak_bytes(schedule, p, m, v, [c.static_memory_bytes for c in costs],
                           [c.activation_bytes for c in costs])


def plan_simulation(plan: Plan) -> Simulation:
    """Simulate a plan file again from its own numbers (no profile needed), e.g. for its timeline.

    Rebuilds each stage's :class:`StageCost` from the plan: ``forward_ms``, the input and
    weight gradients (``backward_input_ms``, or half the backward in plans without it),
    ``send_bytes`` at the plan's bandwidth, and static and activation bytes from
    ``peak_memory_bytes``, ``in_flight`` and, for a recomputing stage, the previous stage's
    ``send_bytes`` (its input, the only thing it keeps per micro-batch).

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


def plan_stage_costs(plan: Plan) -> list[StageCost]:
    """Each stage's :class:`StageCost` rebuilt from a plan file's own numbers, in stage order
    (see :func:`plan_simulation`)."""
    stages = sorted(plan.stages, key=lambda s: s.index)
    bandwidth = plan.settings.bandwidth_bytes_per_s
    ms_per_byte = 0.0 if bandwidth is None or math.isinf(bandwidth) else 1000.0 / bandwidth
    costs = []
    for j, stage in enumerate(stages):
        if stage.backward_input_ms is not None:
            b_input = stage.backward_input_ms
        elif stage.recompute:
            b_input = stage.forward_ms + (stage.backward_ms - stage.forward_ms) / 2
        else:
            b_input = stage.backward_ms / 2
        if stage.recompute:
            kept = stages[j - 1].send_bytes if j > 0 else 0
        else:
            kept = stage.activation_bytes
        if stage.backward_weight_ms is not None:
            b_weight = stage.backward_weight_ms
        else:
            b_weight = max(0.0, stage.backward_ms - b_input)
        costs.append(StageCost(
            forward_ms=stage.forward_ms,
            backward_input_ms=b_input,
            backward_weight_ms=b_weight,
            full_backward_ms=stage.backward_ms,
            send_ms=stage.send_bytes * ms_per_byte if j + 1 < len(stages) else 0.0,
            static_memory_bytes=max(0, stage.peak_memory_bytes - stage.in_flight * kept),
            activation_bytes=int(kept),
            action_overhead_ms=plan.settings.action_overhead_ms or 0.0,
        ))
    return costs


def plan_from_partition(profile, settings, graph, problem, partition: Partition, schedule: str,
                        microbatch_size: int, num_microbatches: int, profile_sha256: str,
                        seconds: float, alternatives=(), notes=(), *, virtual_stages: int = 1,
                        simulation: Simulation | None = None) -> Plan:
    """Assemble the plan file's model from a solved partition and its simulation.

    Parameters
    ----------
    simulation : Simulation, optional
        The split's simulation under ``schedule``; simulated here when absent.

    Notes
    -----
    Predicted time, bubble, per-rank busy/idle time and per-rank peak memory come from the
    simulation; per-stage peaks are the partitioner's model (static plus in-flight
    activations), whose sum over a rank bounds the rank's simulated peak.
    """
    p = settings.stages
    if simulation is None:
        simulation = simulate(stage_costs(problem, partition), schedule, p, num_microbatches, virtual_stages)
    sim = simulation
    spb = problem.seconds_per_byte_ms
    stages = []
    for j, layers in enumerate(partition.stages):
        layers = list(layers)
        in_b = partition.boundary_bytes[j - 1] if j > 0 else 0
        out_b = partition.boundary_bytes[j] if j < problem.num_stages - 1 else 0
        forward = float(graph.forward_ms[layers].sum())
        backward = float(graph.backward_ms[layers].sum())
        b_input = float(graph.backward_input_ms[layers].sum())
        b_weight = float(graph.backward_weight_ms[layers].sum())
        if problem.recompute[j]:
            backward += forward
            b_input += forward
        stages.append(
            PlanStage(
                index=j,
                rank=sim.stage_ranks[j],
                layers=[graph.names[v] for v in layers],
                forward_ms=round(forward, 6),
                backward_ms=round(backward, 6),
                backward_input_ms=round(b_input, 6),
                backward_weight_ms=round(b_weight, 6),
                transfer_ms=round((in_b + out_b) * spb, 6),
                send_bytes=int(out_b),
                param_bytes=int(graph.param_bytes[layers].sum()),
                activation_bytes=int(graph.activation_bytes[layers].sum()),
                in_flight=problem.in_flight[j],
                recompute=bool(problem.recompute[j]),
                peak_memory_bytes=int(math.ceil(stage_memory_bytes(problem, j, layers, in_b))),
            )
        )
    times = partition.stage_times_ms
    bottleneck = max(range(len(times)), key=lambda s: (times[s], -s))
    iteration = sim.iteration_ms
    samples = settings.global_batch * 1000.0 / iteration if iteration > 0 else 0.0
    ranks = [
        RankSummary(
            rank=r,
            stages=[s for s, owner in enumerate(sim.stage_ranks) if owner == r],
            busy_ms=round(sim.rank_busy_ms[r], 6),
            idle_ms=round(sim.rank_idle_ms[r], 6),
            peak_memory_bytes=int(sim.rank_peak_memory_bytes[r]),
            overhead_ms=round(sim.rank_overhead_ms[r], 6) if settings.action_overhead_ms else None,
        )
        for r in range(p)
    ]
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
            iteration_ms=round(iteration, 6),
            bubble_fraction=round(sim.bubble_fraction, 6),
            samples_per_second=round(samples, 6),
            bottleneck_stage=bottleneck,
            compute_ms=round(sim.compute_ms, 6),
            # The rest of the rounded iteration, so that the parts add up to it.
            bubble_ms=round(round(iteration, 6) - round(sim.compute_ms, 6) - round(sim.transfer_ms, 6)
                            - round(sim.overhead_ms, 6), 6),
            transfer_ms=round(sim.transfer_ms, 6),
            overhead_ms=round(sim.overhead_ms, 6) if settings.action_overhead_ms else None,
        ),
        ranks=ranks,
        alternatives=list(alternatives),
        notes=list(notes),
        solver=SolverInfo(method=partition.method, optimal=partition.optimal, seconds=round(seconds, 3),
                          lower_bound_ms=None if partition.lower_bound_ms is None else round(partition.lower_bound_ms, 6)),
    )


# ----------------------------------------------------------------------------------------
# The search


@dataclass
class _Candidate:
    """One configuration: schedule, v, micro-batch size and recompute set, with its split."""

    schedule: str
    virtual_stages: int
    microbatch_size: int
    num_microbatches: int
    recompute: tuple[bool, ...]
    problem: PartitionProblem | None = None
    partition: Partition | None = None
    lower_bound_ms: float = math.inf
    simulation: Simulation | None = None
    status: str = "new"
    """new, fits, over (simulated over the cap), nosplit (no split fits), pruned, refused."""
    over_bytes: int = 0
    peak_bytes: int | None = None
    reason: str = ""
    seconds: float = 0.0
    order: int = 0

    @property
    def recompute_count(self) -> int:
        return sum(self.recompute)

    @property
    def iteration_ms(self) -> float:
        return self.simulation.iteration_ms if self.simulation is not None else math.inf

    def label(self) -> str:
        return (f"{self.schedule} v={self.virtual_stages} micro-batch {self.microbatch_size} "
                f"recompute {_recompute_text(self.recompute)}")


def _recompute_text(recompute) -> str:
    chosen = [j for j, r in enumerate(recompute) if r]
    if not chosen:
        return "none"
    if len(chosen) == len(recompute):
        return "all"
    runs, start = [], chosen[0]
    for a, b in zip(chosen, chosen[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return "stages " + ",".join(runs)


def _schedule_space(settings: PlanSettings, num_layers: int) -> list[tuple[str, int]]:
    """(schedule, v) pairs to try, in order of preference on ties."""
    p = settings.stages
    if settings.schedule == "auto":
        schedules = PLANNER_SCHEDULES
    elif settings.schedule in PLANNER_SCHEDULES:
        schedules = (settings.schedule,)
    else:
        raise BadInputError(
            f"--schedule: {settings.schedule!r} is not a schedule; use auto or one of {', '.join(PLANNER_SCHEDULES)}"
        )
    space = []
    for schedule in schedules:
        allowed = valid_virtual_stages(schedule)
        vs = allowed if settings.virtual_stages is None else tuple(v for v in allowed if v == settings.virtual_stages)
        if not vs and settings.schedule != "auto":
            raise BadInputError(
                f"--virtual-stages: {schedule} takes {' or '.join(map(str, allowed))} stages per rank, "
                f"not {settings.virtual_stages}; use one of those or leave it unset"
            )
        for v in vs:
            if p * v <= num_layers:
                space.append((schedule, v))
            elif settings.schedule != "auto" and settings.virtual_stages is not None:
                raise BadInputError(
                    f"--virtual-stages: {p} ranks x {v} stages per rank = {p * v} stages but the profile "
                    f"has only {num_layers} layers; use fewer stages per rank or ranks"
                )
    if not space:
        raise BadInputError(
            f"--schedule {settings.schedule}: no stages-per-rank value fits {p} ranks and "
            f"{num_layers} layers (each stage needs a layer); use fewer ranks"
        )
    return space


def _recompute_order(in_flight: tuple[int, ...]) -> list[int]:
    """Stages ranked for recomputation: most micro-batches in flight first, then earliest."""
    return sorted(range(len(in_flight)), key=lambda s: (-in_flight[s], s))


def _prefix(order: list[int], k: int, num_stages: int) -> tuple[bool, ...]:
    chosen = set(order[:k])
    return tuple(s in chosen for s in range(num_stages))


def _recompute_sets(profile, graph, settings, schedule, m, v, exact=False) -> list[tuple[tuple[bool, ...], Partition | None]]:
    """The recompute sets worth simulating for one (schedule, v, b), with their splits.

    See the module docstring. Feasibility is taken to be monotone in the prefix length
    (more recomputation, less memory); the stages that hold one micro-batch come last,
    where recomputing saves nothing.
    """
    p = settings.stages
    in_flight = stage_in_flight(schedule, p, m, v)
    num_stages = len(in_flight)
    none = (False,) * num_stages
    cap = _cap(settings)

    def solve(recompute):
        problem = _problem(profile, graph, settings, in_flight, recompute)
        if not exact:
            return _search_solve(problem)
        try:
            return solve_partition(problem, settings.solver)
        except InfeasibleError:
            return None

    if settings.recompute == "all":
        everything = (True,) * num_stages
        return [(everything, solve(everything))]
    base = solve(none)
    if (settings.recompute == "none" or math.isinf(cap)
            or graph.num_layers > RECOMPUTE_SEARCH_MAX_LAYERS):
        return [(none, base)]
    order = _recompute_order(in_flight)
    problem0 = _problem(profile, graph, settings, in_flight, none)
    if base is not None:
        free = _search_solve(_problem(profile, graph, settings, in_flight, none, memory_cap_bytes=math.inf))
        binding = free is not None and base.bottleneck_ms > free.bottleneck_ms * (1 + _TOLERANCE)
        if not binding and max(_rank_peaks(problem0, base, schedule, p, m, v)) <= cap:
            return [(none, base)]
    found: dict[int, Partition | None] = {0: base}

    def at(k):
        if k not in found:
            found[k] = solve(_prefix(order, k, num_stages))
        return found[k]

    def safe(k):
        part = at(k)
        if part is None:
            return False
        problem = _problem(profile, graph, settings, in_flight, _prefix(order, k, num_stages))
        return max(_rank_peaks(problem, part, schedule, p, m, v)) <= cap

    def smallest(test, lo):
        # Smallest k in [lo, num_stages] passing ``test``, or None.
        if not test(num_stages):
            return None
        hi = num_stages
        while lo < hi:
            mid = (lo + hi) // 2
            if test(mid):
                hi = mid
            else:
                lo = mid + 1
        return hi

    def fits(k):
        # Feasibility alone: the cheaper bottleneck-only DP for chains.
        if k in found or not graph.chain:
            return at(k) is not None
        return math.isfinite(chain_bottleneck_ms(
            _problem(profile, graph, settings, in_flight, _prefix(order, k, num_stages))))

    keep = [0]  # listed even when nothing fits: it shows why recomputation is needed
    first = smallest(fits, 1)
    if first is not None:
        keep.append(first)
        k = first
        # A little more recomputation can buy a better balance; stop once it stops paying.
        while k + 1 <= num_stages and at(k + 1) is not None and at(k + 1).bottleneck_ms < at(k).bottleneck_ms * (1 - _TOLERANCE):
            k += 1
            keep.append(k)
        # With one stage per rank the partitioner's memory is the rank's: what fits is safe.
        sure = first if v == 1 else smallest(safe, first)
        if sure is not None:
            keep.append(sure)
    if first is None:
        return [(none, base), ((True,) * num_stages, None)]
    return [(_prefix(order, k, num_stages), at(k)) for k in sorted(set(keep))]


def _evaluate(profile, graph, settings, cand: _Candidate, in_flight) -> None:
    """Check a candidate's per-rank peaks (for ``v > 1`` shrinking the per-stage cap until its
    ranks fit), then simulate it once."""
    cap = _cap(settings)
    p, v, m = settings.stages, cand.virtual_stages, cand.num_microbatches
    share = 1.0
    for attempt in range(5):
        peaks = _rank_peaks(cand.problem, cand.partition, cand.schedule, p, m, v)
        peak = max(peaks)
        if peak <= cap:
            cand.simulation = simulate(stage_costs(cand.problem, cand.partition), cand.schedule, p, m, v)
            cand.status = "fits"
            return
        cand.status = "over"
        cand.over_bytes = int(peak - cap)
        cand.peak_bytes = int(peak)
        rank = peaks.index(peak)
        cand.reason = (f"over the cap by {format_bytes(peak - cap)}: rank {rank} peaks at "
                       f"{format_bytes(peak)} (cap {format_bytes(cap)})")
        if v == 1 or share <= 1.0 / v:
            return
        share = max(1.0 / v, share * cap / peak * (1 - 1e-6)) if attempt < 3 else 1.0 / v
        problem = _problem(profile, graph, settings, in_flight, cand.recompute, memory_cap_bytes=share * cap)
        partition = _search_solve(problem)
        if partition is None:
            return
        cand.problem, cand.partition = problem, partition


def _tie_key(cand: _Candidate, space):
    """Between equally fast configurations: fewer recomputing stages, larger micro-batches,
    lower peak memory, then the schedule order."""
    peak = cand.simulation.peak_memory_bytes if cand.simulation is not None else 0
    return (cand.recompute_count, -cand.microbatch_size, peak, space.index((cand.schedule, cand.virtual_stages)))


def with_profile_defaults(profile, settings: PlanSettings) -> PlanSettings:
    """``settings`` with what the profile knows filled in where the user gave nothing: the
    schedule's own time per action that a calibrated profile carries from its run
    (``measurement.action_overhead_ms``, written by ``pipeplan calibrate``)."""
    measured_ms = (profile.measurement or {}).get("action_overhead_ms")
    if settings.action_overhead_ms is None and measured_ms:
        return settings.model_copy(update={"action_overhead_ms": max(0.0, float(measured_ms))})
    return settings


def make_plan(profile, settings: PlanSettings, *, profile_sha256: str, record_time: bool = False) -> Plan:
    """The fastest plan of ``profile`` that fits ``settings``, as simulated.

    Parameters
    ----------
    profile : Profile
    settings : PlanSettings
        Ranks (``stages``), global batch, memory cap, optimizer, bandwidth, schedule
        (``auto`` searches), stages per rank, recompute (``auto``, ``none``, ``all``), solver,
        the schedule's own time per action (unset: the profile's
        ``measurement.action_overhead_ms``, which ``pipeplan calibrate`` writes, else none).
    profile_sha256 : str
        Recorded in the plan so that ``check`` can tell which profile it came from.
    record_time : bool
        Record the solver's wall time (plans are then no longer byte-identical across runs).

    Returns
    -------
    Plan
        Predicted time, bubble and per-rank memory from the simulator; ``alternatives`` lists
        the runners-up with why they lost; ``notes`` says why this one won and what was assumed.

    Raises
    ------
    BadInputError
        Settings that contradict the profile (more stages than layers, unprofiled sizes), or
        a fixed schedule whose class refuses every micro-batch count on offer.
    InfeasibleError
        Nothing fits the memory cap; the message says what would (a cap, more ranks, or
        recomputation).

    Notes
    -----
    With a fixed ``1f1b`` or ``gpipe`` and no recomputation the split of each micro-batch size
    is the exact min-max optimum (the partitioners' model of those schedules' memory is exact).
    The search solves one partition per (schedule, v, micro-batch size, recompute set) and
    simulates each at most a few times; see the module docstring.
    """
    started = time.perf_counter()
    n = len(profile.layers)
    if settings.stages > n:
        raise BadInputError(
            f"--stages: {settings.stages} stages but the profile has only {n} "
            f"layers; use at most {n}"
        )
    settings = with_profile_defaults(profile, settings)
    space = _schedule_space(settings, n)
    sizes = candidate_microbatch_sizes(profile, settings)
    p, cap = settings.stages, _cap(settings)
    graphs = {b: build_layer_graph(profile, b) for b in sizes}

    # A fixed one-stage-per-rank schedule without recomputation is a small search: solve each
    # micro-batch size's split exactly, so its choice is among exact optima.
    exact = len(space) == 1 and space[0][1] == 1 and settings.recompute == "none"
    candidates: list[_Candidate] = []
    refusals: list[str] = []
    for schedule, v in space:
        for b in sizes:
            m = settings.global_batch // b
            try:
                check_schedule(schedule, p, m, v)
            except BadInputError as error:
                refusals.append(str(error))
                candidates.append(_Candidate(schedule, v, b, m, (False,) * (p * v), status="refused",
                                             reason=f"refused: {error}"))
                continue
            in_flight = stage_in_flight(schedule, p, m, v)
            placement = stage_ranks(schedule, p, v)
            for recompute, partition in _recompute_sets(profile, graphs[b], settings, schedule, m, v, exact):
                problem = _problem(profile, graphs[b], settings, in_flight, recompute)
                cand = _Candidate(schedule, v, b, m, recompute, problem, partition)
                if partition is None:
                    cand.status = "nosplit"
                    cand.reason = "over the memory cap at every split"
                else:
                    cand.lower_bound_ms = _busy_lower_bound_ms(stage_costs(problem, partition), placement, m)
                candidates.append(cand)
    for index, cand in enumerate(candidates):
        cand.order = index
    if refusals and all(c.status == "refused" for c in candidates):
        raise BadInputError(refusals[0] if len(set(refusals)) == 1 else "; ".join(sorted(set(refusals))))

    # Branch and bound on the busy-rank lower bound: simulate in its order.
    best: _Candidate | None = None
    pending = sorted((c for c in candidates if c.status == "new"),
                     key=lambda c: (c.lower_bound_ms, _tie_key(c, space)))
    for cand in pending:
        if best is not None and cand.lower_bound_ms > best.iteration_ms:
            cand.status = "pruned"
            continue
        _evaluate(profile, graphs[cand.microbatch_size], settings, cand,
                  cand.problem.in_flight)
        if cand.status == "fits" and (best is None or (cand.iteration_ms, _tie_key(cand, space))
                                      < (best.iteration_ms, _tie_key(best, space))):
            best = cand
    if best is None:
        raise InfeasibleError(_infeasible_message(profile, settings, space, sizes, candidates))

    graph = graphs[best.microbatch_size]
    partition, simulation, problem = best.partition, best.simulation, best.problem
    notes = []
    if not exact and (not graph.chain or settings.solver == "ilp"):
        # The search split DAGs along a few orders; solve the winner exactly.
        try:
            exact = solve_partition(problem, settings.solver)
        except InfeasibleError:
            exact = None
        if exact is not None:
            exact_sim = simulate(stage_costs(problem, exact), best.schedule, p, best.num_microbatches,
                                 best.virtual_stages)
            if exact_sim.peak_memory_bytes <= cap:
                partition, simulation = exact, exact_sim
            else:
                notes.append("the exact split goes over the cap on some rank when simulated; "
                             "kept the best split along the layer orders")
    notes.extend(_explain(best, simulation, candidates, settings, space, graph, profile))
    alternatives = _alternatives(best, simulation, candidates)
    seconds = time.perf_counter() - started if record_time else 0.0
    return plan_from_partition(
        profile, settings, graph, problem, partition, best.schedule,
        best.microbatch_size, best.num_microbatches, profile_sha256, seconds, alternatives, notes,
        virtual_stages=best.virtual_stages, simulation=simulation,
    )


def _explain(best: _Candidate, sim: Simulation, candidates, settings, space, graph, profile) -> list[str]:
    notes = []
    cap = _cap(settings)
    evaluated = [c for c in candidates if c.status in ("fits", "over")]
    fitting = [c for c in evaluated if c.status == "fits"]
    chosen = (f"{best.schedule}, {best.virtual_stages} stage(s) per rank, micro-batch size "
              f"{best.microbatch_size} ({best.num_microbatches} micro-batches), recompute "
              f"{_recompute_text(best.recompute)}")
    if len(space) > 1 or len(candidates) > 1:
        runner = min((c for c in fitting if c is not best),
                     key=lambda c: (c.iteration_ms, _tie_key(c, space)), default=None)
        counts = {}
        for c in candidates:
            counts[c.status] = counts.get(c.status, 0) + 1
        others = [f"{counts[k]} {label}" for k, label in (
            ("pruned", "slower by their lower bound alone"), ("over", "over the cap"),
            ("nosplit", "without a split under the cap"), ("refused", "refused by the schedule")) if counts.get(k)]
        text = (f"chose {chosen}: the fastest of {len(fitting)} simulated configurations that fit"
                + (f"; {', '.join(others)}" if others else "") + f" ({len(candidates)} considered)")
        if runner is not None:
            gap = runner.iteration_ms - sim.iteration_ms
            text += (f"; the runner-up ({runner.label()}) is {gap:.3f} ms "
                     f"({100 * gap / sim.iteration_ms:.1f}%) slower")
        notes.append(text)
    else:
        notes.append(f"chose {chosen}")
    if best.recompute_count:
        same = [c for c in candidates if (c.schedule, c.virtual_stages, c.microbatch_size)
                == (best.schedule, best.virtual_stages, best.microbatch_size) and not c.recompute_count]
        why = "without it this configuration does not fit the cap"
        if same and same[0].status == "over":
            why = f"without it this configuration is {same[0].reason}"
        elif same and same[0].status == "fits":
            why = (f"it allows a better-balanced split: without it this configuration takes "
                   f"{same[0].iteration_ms:.3f} ms")
        elif best.virtual_stages == 1 and not math.isinf(cap) and graph.chain:
            need = _smallest_cap_without_recompute(profile, graph, settings, best.problem.in_flight)
            if need is not None:
                why = (f"without it no split fits: the smallest per-rank peak is "
                       f"{format_bytes(need)}, over the {format_bytes(cap)} cap")
                if same:
                    same[0].reason = (f"over the cap at every split: its smallest per-rank peak is "
                                      f"{format_bytes(need)}, {format_bytes(need - cap)} over")
                    same[0].over_bytes = int(need - cap)
        notes.append(
            f"recomputation on {_recompute_text(best.recompute)} (they keep only their input per "
            f"micro-batch in flight and run the forward again before the backward): {why}"
        )
    if best.schedule in SPLIT_BACKWARD_SCHEDULES and not graph.backward_split_measured:
        notes.append(
            f"{best.schedule} runs input and weight gradients apart, but the profile lacks "
            f"backward_input_ms/backward_weight_ms: the split was estimated as half of backward_ms "
            f"each, so the prediction depends on that estimate"
        )
    if not graph.chain:
        notes.append(
            "branchy layer graph: stages are ideals of the DAG; a boundary sends every tensor crossing it"
        )
    if profile.source == "imported":
        notes.append("imported profile: activation_bytes approximated by each layer's output size")
    notes.append("time and per-rank memory predicted by the event simulator of the schedule "
                 "(docs/schedules.md, docs/cost-model.md)")
    return notes


def _alternatives(best: _Candidate, sim: Simulation, candidates) -> list[Alternative]:
    """Runners-up ranked: simulated and fitting by time, then pruned by bound, then over the cap."""
    rank = {"fits": 0, "pruned": 2, "over": 3, "nosplit": 4, "refused": 5}
    own = (best.schedule, best.virtual_stages, best.microbatch_size)

    def group(c):
        # The winner without its recomputation shows why it recomputes.
        if c.status != "fits" and not c.recompute_count and (c.schedule, c.virtual_stages, c.microbatch_size) == own:
            return 1
        return rank[c.status]

    others = [c for c in candidates if c is not best]
    others.sort(key=lambda c: (
        group(c),
        c.iteration_ms if c.status == "fits" else (c.lower_bound_ms if c.status == "pruned" else c.over_bytes),
        c.order,
    ))
    out = []
    for c in others[:MAX_ALTERNATIVES]:
        iteration = None
        peak = None
        if c.status == "fits":
            gap = c.iteration_ms - sim.iteration_ms
            reason = f"slower by {gap:.3f} ms ({100 * gap / sim.iteration_ms:.1f}%)"
            iteration, peak = c.iteration_ms, c.simulation.peak_memory_bytes
        elif c.status == "pruned":
            gap = c.lower_bound_ms - sim.iteration_ms
            reason = (f"slower by at least {gap:.3f} ms: its busiest rank alone needs "
                      f"{c.lower_bound_ms:.3f} ms (not simulated)")
        elif c.status == "over":
            reason = c.reason
            peak = c.peak_bytes
        else:
            reason = c.reason
        out.append(Alternative(
            schedule=c.schedule, virtual_stages=c.virtual_stages, microbatch_size=c.microbatch_size,
            recompute=_recompute_text(c.recompute),
            iteration_ms=None if iteration is None else round(iteration, 6),
            peak_memory_bytes=peak, reason=reason,
        ))
    return out


# ----------------------------------------------------------------------------------------
# What would fit


def _smallest_cap(fits, relative_tolerance: float) -> float | None:
    """Smallest cap in bytes for which ``fits(cap)`` holds (monotone): doubling, then bisection."""
    hi = 1.0
    while not fits(hi):
        hi *= 2
        if hi > 1e18:
            return None
    lo = hi / 2
    while hi - lo > hi * relative_tolerance:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _smallest_cap_without_recompute(profile, graph, settings, in_flight) -> float | None:
    """Bisection on the cap with the along-order feasibility test (exact for chains)."""
    def fits(cap):
        return fits_along_order(_problem(profile, graph, settings, in_flight, memory_cap_bytes=cap))

    return _smallest_cap(fits, relative_tolerance=1e-4)


def _smallest_cap_with_recompute(profile, graph, settings, in_flight) -> float | None:
    """Bisection on the cap with every stage recomputing (chains only)."""
    recompute = (True,) * len(in_flight)

    def fits(cap):
        return _search_solve(_problem(profile, graph, settings, in_flight, recompute, memory_cap_bytes=cap)) is not None

    if not graph.chain or graph.num_layers > RECOMPUTE_SEARCH_MAX_LAYERS:
        return None
    return _smallest_cap(fits, relative_tolerance=1e-3)


def _smallest_fitting_stages(profile, settings, sizes) -> int | None:
    n = len(profile.layers)
    for p in range(settings.stages + 1, min(n, 8 * settings.stages) + 1):
        for b in sizes:
            m = settings.global_batch // b
            schedule = "1f1b" if m >= p else "gpipe"
            if settings.schedule == "gpipe":
                schedule = "gpipe"
            graph = build_layer_graph(profile, b)
            in_flight = stage_in_flight(schedule, p, m, 1)
            if fits_along_order(_problem(profile, graph, settings, in_flight)):
                return p
    return None


def _infeasible_message(profile, settings, space, sizes, candidates) -> str:
    cap = _cap(settings)
    schedules = sorted({s for s, _ in space}, key=PLANNER_SCHEDULES.index)
    head = (
        f"nothing fits --memory-cap {format_bytes(cap)} with {settings.stages} ranks "
        f"(schedules {', '.join(schedules)}; micro-batch sizes {sizes}; recompute {settings.recompute})"
    )
    over = [c for c in candidates if c.status == "over"]
    hints = []
    least = min(over, key=lambda c: (c.over_bytes, c.order)) if over else None
    # The smallest caps with the most frugal v = 1 schedule: 1F1B where it runs, else GPipe.
    best_plain, best_recompute = None, None
    for b in sizes:
        m = settings.global_batch // b
        schedule = "1f1b" if m >= settings.stages else "gpipe"
        if settings.schedule not in ("auto", schedule):
            schedule = settings.schedule if settings.schedule in ("1f1b", "gpipe") else schedule
        try:
            in_flight = stage_in_flight(schedule, settings.stages, m, 1)
        except BadInputError:
            continue
        graph = build_layer_graph(profile, b)
        need = _smallest_cap_without_recompute(profile, graph, settings, in_flight)
        if need is not None and (best_plain is None or need < best_plain[0]):
            best_plain = (need, b, schedule)
        if settings.recompute != "none":
            need = _smallest_cap_with_recompute(profile, graph, settings, in_flight)
            if need is not None and (best_recompute is None or need < best_recompute[0]):
                best_recompute = (need, b, schedule)
    smallest_cap = min((x[0] for x in (best_plain, best_recompute) if x is not None), default=math.inf)
    if least is not None and least.peak_bytes is not None and least.peak_bytes < smallest_cap:
        hints.append(f"closest: {least.label()} is {least.reason}")
    if best_plain is not None:
        exact = "" if profile.edges is None else " or less"
        hints.append(
            f"a cap of {format_bytes(math.ceil(best_plain[0]))}{exact} fits {best_plain[2]} at micro-batch "
            f"size {best_plain[1]} without recomputation"
        )
    if best_recompute is not None and (best_plain is None or best_recompute[0] < best_plain[0]):
        hints.append(
            f"a cap of {format_bytes(math.ceil(best_recompute[0]))} fits {best_recompute[2]} at micro-batch "
            f"size {best_recompute[1]} with every stage recomputing"
        )
    elif settings.recompute == "none":
        hints.append("--recompute auto may fit (stages keep only their inputs)")
    more = _smallest_fitting_stages(profile, settings, sizes)
    if more is not None:
        hints.append(f"{more} ranks fit under this cap without recomputation "
                     f"({'gpipe' if settings.schedule == 'gpipe' else '1f1b'})")
    if not hints:
        hints.append("no cap fits: a single layer exceeds it; split that layer or use a smaller micro-batch")
    return head + "; " + "; ".join(hints)
