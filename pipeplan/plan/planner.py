"""The planner: profile and settings in, the fastest plan that fits out.

For each candidate micro-batch size it builds the layer graph, solves the partition problem
exactly (chain DP for chains; ILP, seeded with the best split along the topological order, for
DAGs; the ideal-lattice DP on request), predicts the iteration, and keeps the fastest feasible.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.formats.plan import (
    Plan,
    PlanProfileRef,
    PlanSettings,
    PlanStage,
    Predicted,
    RankSummary,
    SolverInfo,
    Alternative,
)
from pipeplan.plan.cost import estimate_iteration
from pipeplan.plan.graph import build_layer_graph
from pipeplan.plan.memory import in_flight_microbatches, static_bytes_per_param_byte
from pipeplan.plan.partition import (
    Partition,
    PartitionProblem,
    IDEALS_DP_MAX_IDEALS,
    count_ideals,
    fits_along_order,
    partition_along_orders,
    partition_chain,
    partition_ideals,
    stage_memory_bytes,
)
from pipeplan.quantities import format_bytes

__all__ = ["make_plan", "solve_partition", "candidate_microbatch_sizes", "plan_from_partition", "PLANNER_SCHEDULES"]

#: Schedules this planner predicts with the closed-form model (the simulator adds the rest).
PLANNER_SCHEDULES = ("1f1b", "gpipe")


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


def _problem(profile, graph, settings: PlanSettings, schedule: str, num_microbatches: int, memory_cap_bytes=None, num_stages=None):
    p = num_stages or settings.stages
    cap = settings.memory_cap_bytes if memory_cap_bytes is None else memory_cap_bytes
    return PartitionProblem(
        graph=graph,
        num_stages=p,
        in_flight=in_flight_microbatches(schedule, p, num_microbatches),
        bandwidth_bytes_per_s=(
            math.inf if settings.bandwidth_bytes_per_s is None else settings.bandwidth_bytes_per_s
        ),
        static_bytes_per_param_byte=static_bytes_per_param_byte(settings.optimizer, profile.dtype_bytes),
        memory_cap_bytes=math.inf if cap is None else float(cap),
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


def _check_schedule(settings: PlanSettings, schedule: str, m: int) -> str | None:
    if schedule == "1f1b" and m < settings.stages:
        return (
            f"1f1b needs at least as many micro-batches as stages ({m} < {settings.stages})"
        )
    return None


def plan_from_partition(profile, settings, graph, problem, partition: Partition, schedule: str,
                        microbatch_size: int, num_microbatches: int, profile_sha256: str,
                        seconds: float, alternatives=(), notes=()) -> Plan:
    """Assemble the plan file's model from a solved partition."""
    spb = problem.seconds_per_byte_ms
    stages, compute, transfer = [], [], []
    for j, layers in enumerate(partition.stages):
        layers = list(layers)
        in_b = partition.boundary_bytes[j - 1] if j > 0 else 0
        out_b = partition.boundary_bytes[j] if j < problem.num_stages - 1 else 0
        forward = float(graph.forward_ms[layers].sum())
        backward = float(graph.backward_ms[layers].sum())
        if problem.recompute[j]:
            backward += forward
        stage_transfer = (in_b + out_b) * spb
        compute.append(forward + backward)
        transfer.append(stage_transfer)
        stages.append(
            PlanStage(
                index=j,
                rank=j,
                layers=[graph.names[v] for v in layers],
                forward_ms=round(forward, 6),
                backward_ms=round(backward, 6),
                transfer_ms=round(stage_transfer, 6),
                send_bytes=int(out_b),
                param_bytes=int(graph.param_bytes[layers].sum()),
                activation_bytes=int(graph.activation_bytes[layers].sum()),
                in_flight=problem.in_flight[j],
                recompute=bool(problem.recompute[j]),
                peak_memory_bytes=int(stage_memory_bytes(problem, j, layers, in_b)),
            )
        )
    estimate = estimate_iteration(compute, transfer, num_microbatches)
    samples = settings.global_batch * 1000.0 / estimate.iteration_ms if estimate.iteration_ms > 0 else 0.0
    ranks = []
    for stage, c, t in zip(stages, compute, transfer):
        busy = num_microbatches * (c + t)
        ranks.append(
            RankSummary(
                rank=stage.rank,
                stages=[stage.index],
                busy_ms=round(busy, 6),
                idle_ms=round(estimate.iteration_ms - busy, 6),
                peak_memory_bytes=stage.peak_memory_bytes,
            )
        )
    return Plan(
        schema_version=1,
        profile=PlanProfileRef(model=profile.model, sha256=profile_sha256),
        settings=settings,
        schedule=schedule,
        virtual_stages=1,
        microbatch_size=microbatch_size,
        num_microbatches=num_microbatches,
        stages=stages,
        predicted=Predicted(
            iteration_ms=round(estimate.iteration_ms, 6),
            bubble_fraction=round(estimate.bubble_fraction, 6),
            samples_per_second=round(samples, 6),
            bottleneck_stage=estimate.bottleneck_stage,
            compute_ms=round(estimate.compute_ms, 6),
            bubble_ms=round(estimate.bubble_ms, 6),
            transfer_ms=round(estimate.transfer_ms, 6),
        ),
        ranks=ranks,
        alternatives=list(alternatives),
        notes=list(notes),
        solver=SolverInfo(method=partition.method, optimal=partition.optimal, seconds=round(seconds, 3),
                          lower_bound_ms=None if partition.lower_bound_ms is None else round(partition.lower_bound_ms, 6)),
    )


@dataclass
class _Candidate:
    schedule: str
    microbatch_size: int
    num_microbatches: int
    graph: object
    problem: PartitionProblem
    partition: Partition | None
    iteration_ms: float | None
    reason: str | None
    seconds: float


def _smallest_fitting_cap(profile, settings, schedule, sizes) -> tuple[float, int] | None:
    """Bisection on the cap with the along-order feasibility test: (cap, micro-batch size)."""
    best = None
    for b in sizes:
        m = settings.global_batch // b
        if _check_schedule(settings, schedule, m):
            continue
        graph = build_layer_graph(profile, b)
        hi = None
        probe = 1.0
        while probe < 1e16:
            if fits_along_order(_problem(profile, graph, settings, schedule, m, memory_cap_bytes=probe)):
                hi = probe
                break
            probe *= 2
        if hi is None:
            continue
        lo = hi / 2
        while hi - lo > hi * 1e-4:
            mid = (lo + hi) / 2
            if fits_along_order(_problem(profile, graph, settings, schedule, m, memory_cap_bytes=mid)):
                hi = mid
            else:
                lo = mid
        if best is None or hi < best[0]:
            best = (hi, b)
    return best


def _smallest_fitting_stages(profile, settings, schedule, sizes) -> int | None:
    n = len(profile.layers)
    for p in range(settings.stages + 1, min(n, 8 * settings.stages) + 1):
        for b in sizes:
            m = settings.global_batch // b
            if schedule == "1f1b" and m < p:
                continue
            graph = build_layer_graph(profile, b)
            if fits_along_order(_problem(profile, graph, settings, schedule, m, num_stages=p)):
                return p
    return None


def _infeasible_message(profile, settings, schedule, sizes) -> str:
    cap = settings.memory_cap_bytes
    head = (
        f"nothing fits --memory-cap {format_bytes(cap)} with {settings.stages} stages "
        f"({schedule}, micro-batch sizes {sizes})"
    )
    hints = []
    smallest = _smallest_fitting_cap(profile, settings, schedule, sizes)
    if smallest is not None:
        exact = "" if build_layer_graph(profile, smallest[1]).chain else " or less"
        hints.append(
            f"a cap of {format_bytes(math.ceil(smallest[0]))}{exact} fits at micro-batch size {smallest[1]}"
        )
    more = _smallest_fitting_stages(profile, settings, schedule, sizes)
    if more is not None:
        hints.append(f"{more} stages fit under this cap")
    if not hints:
        hints.append("no cap fits: a single layer exceeds it; split that layer or use a smaller micro-batch")
    return head + "; " + "; ".join(hints)


def make_plan(profile, settings: PlanSettings, *, profile_sha256: str, record_time: bool = False) -> Plan:
    """The fastest plan of ``profile`` that fits ``settings``.

    Parameters
    ----------
    profile : Profile
    settings : PlanSettings
        Stages, global batch, memory cap, optimizer, bandwidth, schedule, solver.
    profile_sha256 : str
        Recorded in the plan so that ``check`` can tell which profile it came from.
    record_time : bool
        Record the solver's wall time (plans are then no longer byte-identical across runs).

    Returns
    -------
    Plan

    Raises
    ------
    BadInputError
        Settings that contradict the profile (more stages than layers, unprofiled sizes).
    InfeasibleError
        Nothing fits the memory cap; the message says the smallest cap or stage count that does.
    """
    if settings.stages > len(profile.layers):
        raise BadInputError(
            f"--stages: {settings.stages} stages but the profile has only {len(profile.layers)} "
            f"layers; use at most {len(profile.layers)}"
        )
    schedules = PLANNER_SCHEDULES if settings.schedule == "auto" else (settings.schedule,)
    for schedule in schedules:
        if schedule not in PLANNER_SCHEDULES:
            raise BadInputError(
                f"--schedule: {schedule!r} is not supported by this planner; use one of "
                f"{', '.join(PLANNER_SCHEDULES)} or auto"
            )
    sizes = candidate_microbatch_sizes(profile, settings)
    candidates: list[_Candidate] = []
    for schedule in schedules:
        for b in sizes:
            m = settings.global_batch // b
            graph = build_layer_graph(profile, b)
            problem = _problem(profile, graph, settings, schedule, m)
            reason = _check_schedule(settings, schedule, m)
            partition, iteration, started = None, None, time.perf_counter()
            if reason is None:
                try:
                    partition = solve_partition(problem, settings.solver)
                except InfeasibleError:
                    reason = "over the memory cap at every split"
            if partition is not None:
                times = partition.stage_times_ms
                iteration = sum(times) + (m - 1) * max(times)
            candidates.append(
                _Candidate(schedule, b, m, graph, problem, partition, iteration, reason,
                           time.perf_counter() - started)
            )
    feasible = [c for c in candidates if c.partition is not None]
    if not feasible:
        raise InfeasibleError(_infeasible_message(profile, settings, schedules[0], sizes))
    # Fastest per sample; ties go to the larger micro-batch (fewer, fuller kernels), then schedule order.
    feasible.sort(key=lambda c: (c.iteration_ms, -c.microbatch_size, schedules.index(c.schedule)))
    best = feasible[0]
    alternatives = []
    for c in candidates:
        if c is best:
            continue
        if c.partition is None:
            reason = c.reason
        else:
            reason = f"slower: {c.iteration_ms:.3f} ms per iteration vs {best.iteration_ms:.3f} ms"
        alternatives.append(
            Alternative(
                schedule=c.schedule, virtual_stages=1, microbatch_size=c.microbatch_size,
                recompute="none", iteration_ms=None if c.iteration_ms is None else round(c.iteration_ms, 6),
                reason=reason,
            )
        )
    alternatives.sort(key=lambda a: (a.iteration_ms is None, a.iteration_ms or 0.0, a.microbatch_size))
    notes = []
    if not best.graph.chain:
        notes.append(
            "branchy layer graph: stages are ideals of the DAG; a boundary sends every tensor crossing it"
        )
    if profile.source == "imported":
        notes.append("imported profile: activation_bytes approximated by each layer's output size")
    seconds = sum(c.seconds for c in candidates) if record_time else 0.0
    return plan_from_partition(
        profile, settings, best.graph, best.problem, best.partition, best.schedule,
        best.microbatch_size, best.num_microbatches, profile_sha256, seconds, alternatives, notes,
    )
