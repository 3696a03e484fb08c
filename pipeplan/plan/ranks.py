"""What a split gives each rank: its work, lower bounds on when it ends, its peak memory, and a
second split for ``v > 1`` balanced by rank.

With several stages per rank (interleaved, zb, zbv, dualpipev) a rank's work is the sum of its
stages', so the split that minimises the slowest *stage* (:mod:`pipeplan.plan.chain`) can leave
one rank far busier than another: under zbv's V, rank 0 holds the first and the last stage, and
a split whose middle stages are the large ones loads rank 1 with both. :func:`balance_ranks`
starts from that split and moves one stage boundary by one unit at a time, steepest first,
while the rank loads improve: the largest first, then the next largest and so on (the loads
sorted in decreasing order, compared lexicographically). Every stage stays non-empty and within
the problem's per-stage memory cap, and the stages stay runs of the layer order (the order the
search splits along, and the one a traced model runs in). The planner simulates both splits
and keeps the faster (:func:`try_balanced`; ties keep the min-max-stage split).

The result is a local optimum of single-unit moves, not a proven one: on small chains it
matches the brute-force best largest rank load in most but not all cases
(tests/test_rank_balance.py measures how often).
"""

from __future__ import annotations

import numpy as np

from pipeplan.plan.candidates import Candidate
from pipeplan.plan.chain import order_cut_bytes
from pipeplan.plan.memo import memoised
from pipeplan.plan.memory import rank_peak_bytes
from pipeplan.plan.problem import (Partition, PartitionProblem, evaluate_split, split_fits, stage_cost_at, stage_costs,
                                   stage_fits)
from pipeplan.plan.schedules import stage_ranks
from pipeplan.plan.simulate import StageCost, simulate

__all__ = [
    "stage_busy_ms",
    "rank_loads_ms",
    "busy_lower_bound_ms",
    "rank_end_lower_bounds_ms",
    "rank_peaks",
    "balance_ranks",
    "try_balanced",
    "balanced_note",
    "BALANCE_TOLERANCE",
]

#: Relative change in a rank load below which a move does not count as an improvement (rounding).
BALANCE_TOLERANCE = 1e-9


def stage_busy_ms(cost) -> float:
    """What one micro-batch of a stage keeps its rank busy: forward, backward (whole, or split,
    whichever is less: the schedule decides), and the schedule's own time before each of the two.

    Transfers are not counted: in the simulator they never occupy a rank
    (:mod:`pipeplan.plan.simulate`).
    """
    backward = min(cost.backward_ms, cost.backward_input_ms + cost.backward_weight_ms)
    return cost.forward_ms + backward + 2 * cost.action_overhead_ms


def rank_loads_ms(costs, placement) -> list[float]:
    """Per rank, the sum of :func:`stage_busy_ms` of its stages (``placement[s]``: the rank of stage ``s``).

    Examples
    --------
    >>> from pipeplan.plan.simulate import StageCost
    >>> costs = [StageCost(f, f, f) for f in (14.2, 28.4, 28.4, 19.0)]
    >>> [round(x, 1) for x in rank_loads_ms(costs, [0, 1, 1, 0])]   # zbv on 2 ranks
    [99.6, 170.4]
    """
    loads = [0.0] * (max(placement) + 1)
    for cost, rank in zip(costs, placement):
        loads[rank] += stage_busy_ms(cost)
    return loads


def busy_lower_bound_ms(costs: list[StageCost], placement: list[int], num_microbatches: int) -> float:
    """A lower bound of the simulated iteration.

    Rank ``r`` cannot start before the first micro-batch's forward has reached its first
    stage, and then has all its own work to do, with the schedule's own time before each of
    its at least two actions per stage and micro-batch (but the first, which may overlap the
    wait); no iteration is shorter than one micro-batch's trip forward and back either.
    """
    trip, ranks = rank_end_lower_bounds_ms(costs, placement, num_microbatches)
    return max(trip, max(ranks))


def rank_end_lower_bounds_ms(costs: list[StageCost], placement: list[int],
                             num_microbatches: int) -> tuple[float, list[float]]:
    """One micro-batch's trip forward and back, and per rank the earliest its last action can end
    (see :func:`busy_lower_bound_ms`, their maximum)."""
    ranks = max(placement) + 1
    # Each stage's forward and backward, whichever way the schedule runs the backward.
    busy = rank_loads_ms(costs, placement)
    first = [placement.index(r) for r in range(ranks)]
    # A split schedule runs no input pass on stage 0.
    trip = sum(cost.forward_ms + (0.0 if stage == 0 else min(cost.backward_input_ms, cost.backward_ms,
                                                            cost.backward_input_ms + cost.backward_weight_ms))
               for stage, cost in enumerate(costs))
    head = [0.0]
    for stage, cost in enumerate(costs):
        crossing = cost.send_ms if stage + 1 < len(costs) and placement[stage + 1] != placement[stage] else 0.0
        head.append(head[-1] + cost.forward_ms + crossing)
    return trip, [head[first[r]] + num_microbatches * busy[r] - costs[first[r]].action_overhead_ms
                  for r in range(ranks)]


def rank_peaks(problem: PartitionProblem, partition: Partition, schedule: str, p: int, m: int, v: int):
    """Exact simulated per-rank peaks of a split (memory depends on the order only)."""
    costs = stage_costs(problem, partition)
    return rank_peak_bytes(schedule, p, m, v, [c.static_memory_bytes for c in costs],
                           [c.activation_bytes for c in costs])


def _prefix_cuts(partition: Partition, n: int) -> list[int] | None:
    """The cuts ``0 = c_0 < ... < c_k = n`` if every stage is a run of the layer order, else None."""
    cuts = [0]
    for layers in partition.stages:
        if tuple(layers) != tuple(range(cuts[-1], cuts[-1] + len(layers))):
            return None
        cuts.append(cuts[-1] + len(layers))
    return cuts if cuts[-1] == n else None


def _better(new: tuple, old: tuple, tolerance: float) -> bool:
    """Whether sorted loads ``new`` beat ``old``: lower at the first place they differ by more than ``tolerance``."""
    for a, b in zip(new, old):
        if a < b - tolerance:
            return True
        if a > b + tolerance:
            return False
    return False


def balance_ranks(problem: PartitionProblem, partition: Partition, placement) -> Partition | None:
    """The split ``partition`` improved toward equal work per rank, or None if no move improves it.

    Parameters
    ----------
    problem : PartitionProblem
        The problem ``partition`` was solved for (its per-stage cap, in-flight counts, recompute
        modes and cost model apply to every move).
    partition : Partition
        A split whose stages are runs of the layer order (the search's splits are); any other
        (a DAG split from the exact solvers) gives None.
    placement : sequence of int
        The rank of each stage (:func:`pipeplan.plan.schedules.stage_ranks`).

    Returns
    -------
    Partition or None
        ``method`` ``rank-balanced``, not optimal, with ``partition``'s lower bound on the
        bottleneck (still a bound: it holds for every split). None when a rank holds one stage,
        when ``partition`` is not a prefix split, or when no single-unit move improves the rank
        loads.

    Notes
    -----
    Each step tries the ``2 (k - 1)`` moves of one boundary by one unit, at O(k) each (stage
    costs are remembered inside :func:`pipeplan.plan.memo.planning_cache`), and takes the best;
    the loads' sorted tuple falls strictly at every step, so it ends. At most ``n k`` steps.
    """
    key = (id(problem.graph), problem.num_stages, problem.in_flight, problem.recompute, problem.cost,
           problem.memory_cap_bytes, partition.stages, tuple(placement))
    return memoised("balance_ranks", key, (problem.graph,),
                    lambda: _balance(problem, partition, list(placement)))


def _balance(problem: PartitionProblem, partition: Partition, placement: list[int]) -> Partition | None:
    n, k = problem.graph.num_layers, problem.num_stages
    if max(placement) + 1 == k:
        return None
    cuts = _prefix_cuts(partition, n)
    if cuts is None:
        return None
    cut_bytes = [int(b) for b in np.rint(order_cut_bytes(problem))]
    table: dict[tuple[int, int, int], float | None] = {}

    def busy(j: int, start: int, end: int) -> float | None:
        # Stage j holding layers start .. end - 1: its busy time, None where it does not fit.
        if (j, start, end) not in table:
            layers = tuple(range(start, end))
            in_bytes = cut_bytes[start] if j > 0 else 0
            out_bytes = cut_bytes[end] if j < k - 1 else 0
            table[j, start, end] = (stage_busy_ms(stage_cost_at(problem, j, layers, in_bytes, out_bytes))
                                    if stage_fits(problem, j, layers, in_bytes) else None)
        return table[j, start, end]

    stage_ms = [busy(j, cuts[j], cuts[j + 1]) for j in range(k)]
    if any(t is None for t in stage_ms):
        return None
    loads = [0.0] * (max(placement) + 1)
    for j, t in enumerate(stage_ms):
        loads[placement[j]] += t
    tolerance = BALANCE_TOLERANCE * max(1.0, max(loads))
    current = tuple(sorted(loads, reverse=True))
    start_cuts = list(cuts)
    for _ in range(n * k):
        best = None
        for i in range(1, k):
            for step in (-1, 1):
                cut = cuts[i] + step
                if not cuts[i - 1] < cut < cuts[i + 1]:
                    continue
                left, right = busy(i - 1, cuts[i - 1], cut), busy(i, cut, cuts[i + 1])
                if left is None or right is None:
                    continue
                moved = list(loads)
                moved[placement[i - 1]] += left - stage_ms[i - 1]
                moved[placement[i]] += right - stage_ms[i]
                sorted_loads = tuple(sorted(moved, reverse=True))
                if _better(sorted_loads, current if best is None else best[0], tolerance):
                    best = (sorted_loads, i, cut, left, right, moved)
        if best is None:
            break
        current, i, cut, left, right, loads = best
        cuts[i], stage_ms[i - 1], stage_ms[i] = cut, left, right
    if cuts == start_cuts:
        return None
    found = evaluate_split(problem, [tuple(range(cuts[j], cuts[j + 1])) for j in range(k)], method="rank-balanced",
                           lower_bound_ms=partition.bottleneck_ms if partition.optimal else partition.lower_bound_ms)
    # The problem's own rule on the final split (the moves tested each stage they changed).
    return found if split_fits(problem, found) else None


def try_balanced(cand: Candidate, cap: float, p: int, best_ms: float) -> None:
    """Simulate ``cand``'s split balanced by rank and keep it if its ranks fit ``cap`` and it is
    strictly faster than ``cand``'s own (or that one went over the cap).

    ``cand`` has been evaluated (:func:`pipeplan.plan.search.evaluate_candidate`); ``best_ms`` is
    the best simulated so far: a balanced split whose lower bound is above it is not simulated.
    """
    m, v = cand.num_microbatches, cand.virtual_stages
    placement = stage_ranks(cand.schedule, p, v)
    balanced = balance_ranks(cand.problem, cand.partition, placement)
    if balanced is None:
        return
    costs = stage_costs(cand.problem, balanced)
    bound = busy_lower_bound_ms(costs, placement, m)
    if bound > best_ms or (cand.status == "fits" and bound >= cand.iteration_ms):
        return  # it cannot win
    if max(rank_peaks(cand.problem, balanced, cand.schedule, p, m, v)) > cap:
        return
    simulation = simulate(costs, cand.schedule, p, m, v)
    if cand.status == "fits" and simulation.iteration_ms >= cand.iteration_ms:
        return  # ties keep the min-max-stage split
    cand.unbalanced, cand.unbalanced_ms = cand.partition, (cand.iteration_ms if cand.status == "fits" else None)
    cand.partition, cand.simulation, cand.status, cand.reason = balanced, simulation, "fits", ""


def balanced_note(cand: Candidate, problem: PartitionProblem, partition: Partition, p: int) -> str:
    """The plan's note where the split balanced by rank won: both splits' rank loads, and the other's time."""
    placement = stage_ranks(cand.schedule, p, cand.virtual_stages)

    def loads(split):
        return ", ".join(f"{x:.1f}" for x in rank_loads_ms(stage_costs(problem, split), placement))

    old = cand.unbalanced
    versus = ("did not fit" if cand.unbalanced_ms is None else f"simulates {cand.unbalanced_ms:.3f} ms")
    return (f"split balanced by rank ({cand.virtual_stages} stages per rank): per micro-batch the ranks work "
            f"{loads(partition)} ms, against {loads(old)} ms for the min-max-stage split, which {versus}")
