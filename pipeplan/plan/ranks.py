"""What a split gives each rank: its work, lower bounds on when it ends, its peak memory, and a
second split for ``v > 1`` balanced by rank.

With several stages per rank (interleaved, zb, zbv, dualpipev) a rank's work is the sum of its
stages', so the split that minimises the slowest *stage* (:mod:`pipeplan.plan.chain`) can leave
one rank far busier than another: under zbv's V, rank 0 holds the first and the last stage, and
a split whose middle stages are the large ones loads rank 1 with both. :func:`balance_ranks`
starts from that split and moves one stage boundary by one unit at a time, steepest first,
while the rank loads improve: the largest first, then the next largest and so on (the loads
sorted in decreasing order, compared lexicographically); where no such move helps, it tries a
boundary of the busiest rank's stages moved together with one of the nearest two on either
side. Every stage stays non-empty and within the problem's per-stage memory cap, and the stages
stay runs of the layer order (the order the search splits along, and the one a traced model
runs in). The planner simulates both splits
and keeps the faster (:func:`try_balanced`; ties keep the min-max-stage split).

The result is a local optimum of those moves, not a proven one: against the brute-force best
largest rank load of small chains (tests/test_rank_balance.py) it is exact in 93 of 120
transformer-like chains (within 2.8% in all) and 81 of 120 lumpy ones (within 1.44 x).
"""

from __future__ import annotations

import numpy as np

from pipeplan.plan.candidates import Candidate
from pipeplan.plan.chain import order_cut_bytes, stage_fit_matrix
from pipeplan.plan.costmodel import prefix_sums
from pipeplan.plan.memo import memoised
from pipeplan.plan.memory import rank_peak_bytes
from pipeplan.plan.problem import Partition, PartitionProblem, evaluate_split, stage_cost_at, stage_costs, stage_fits
from pipeplan.facts.schedules import stage_ranks
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

#: Up to this many (start, end) entries the stage costs are looked up in whole matrices (as the
#: chain DP builds them, which it does up to the same size); beyond, costed one stage at a time.
MATRIX_MAX_ENTRIES = 4_000_000


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
        The rank of each stage (:func:`pipeplan.facts.schedules.stage_ranks`).

    Returns
    -------
    Partition or None
        ``method`` ``rank-balanced``, not optimal, with ``partition``'s lower bound on the
        bottleneck (still a bound: it holds for every split). None when a rank holds one stage,
        when ``partition`` is not a prefix split, or when no move improves the rank loads.

    Examples
    --------
    >>> from pipeplan.plan.graph import LayerGraph
    >>> import networkx as nx, numpy as np
    >>> f = np.array([0.5] + [4.0] * 12 + [30.0])     # an embedding, 12 blocks, a large head
    >>> g = LayerGraph(names=tuple(map(str, range(14))), forward_ms=f, backward_ms=2 * f,
    ...                backward_input_ms=f, backward_weight_ms=f, backward_split_measured=True,
    ...                param_bytes=np.ones(14), activation_bytes=np.ones(14), output_bytes=np.ones(14),
    ...                graph=nx.path_graph(14, nx.DiGraph), chain=True)
    >>> problem = PartitionProblem(graph=g, num_stages=4, in_flight=(4, 3, 2, 1))
    >>> old = evaluate_split(problem, [range(0, 5), range(5, 9), range(9, 13), range(13, 14)])
    >>> rank_loads_ms(stage_costs(problem, old), [0, 1, 1, 0])      # zbv on 2 ranks
    [139.5, 96.0]
    >>> new = balance_ranks(problem, old, [0, 1, 1, 0])
    >>> [len(s) for s in new.stages], rank_loads_ms(stage_costs(problem, new), [0, 1, 1, 0])
    ([3, 6, 4, 1], [115.5, 120.0])

    Notes
    -----
    Each step tries the ``2 (k - 1)`` moves of one boundary by one unit (when none helps, the
    ``O(v)`` boundaries of the busiest rank's stages paired with their near neighbours), each in
    O(p log p) with stage costs looked up in whole matrices, and takes the best; the loads' sorted
    tuple falls strictly at every step, so it ends, after at most ``n k`` steps.
    """
    key = (id(problem.graph), problem.num_stages, problem.in_flight, problem.recompute, problem.cost,
           problem.memory_cap_bytes, partition.stages, tuple(placement))
    return memoised("balance_ranks", key, (problem.graph,),
                    lambda: _balance(problem, partition, list(placement)))


def _matrix_lookup(problem: PartitionProblem):
    """``busy(j, l, r)`` from whole (start, end) matrices: the busy time on prefix sums, and the
    chain DP's own memory test (:func:`pipeplan.plan.chain.stage_fit_matrix`); None if too long."""
    graph, cost, cap = problem.graph, problem.cost, problem.cap_with_tolerance
    n = graph.num_layers
    if (n + 1) ** 2 > MATRIX_MAX_ENTRIES:
        return None

    def busy_matrix(mode):
        lo, hi = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
        between = prefix_sums(graph)(lo, hi)
        recompute = cost.recompute_ms(between, mode)
        backward = np.minimum(between.backward_ms + recompute,
                              between.backward_input_ms + recompute + between.backward_weight_ms)
        return (between.forward_ms + backward + 2 * cost.action_overhead_ms).tolist()

    # Per graph, cost model and cap: busy matrices by mode, fit matrices by (in-flight, mode).
    busy_by_mode, fits_by_kind, by_problem = memoised("rank_matrices", (id(graph), cost, cap), (graph,),
                                                      lambda: ({}, {}, {}))
    kinds = (problem.in_flight, problem.recompute)
    if kinds not in by_problem:
        for j, kind in enumerate(zip(*kinds)):
            if kind[1] not in busy_by_mode:
                busy_by_mode[kind[1]] = busy_matrix(kind[1])
            if kind not in fits_by_kind:
                fits_by_kind[kind] = stage_fit_matrix(problem, j)
        by_problem[kinds] = [(busy_by_mode[mode], fits_by_kind[in_flight, mode]) for in_flight, mode in zip(*kinds)]
    tables = by_problem[kinds]

    def busy(j: int, start: int, end: int) -> float | None:
        times, fits = tables[j]
        return times[start][end] if fits[start, end] else None

    return busy


def _scalar_lookup(problem: PartitionProblem, cut_bytes):
    """``busy(j, l, r)`` one stage at a time, for chains too long for the matrices."""
    k = problem.num_stages
    table: dict[tuple[int, int, int], float | None] = {}

    def busy(j: int, start: int, end: int) -> float | None:
        if (j, start, end) not in table:
            layers = tuple(range(start, end))
            in_bytes = cut_bytes[start] if j > 0 else 0
            out_bytes = cut_bytes[end] if j < k - 1 else 0
            table[j, start, end] = (stage_busy_ms(stage_cost_at(problem, j, layers, in_bytes, out_bytes))
                                    if stage_fits(problem, j, layers, in_bytes) else None)
        return table[j, start, end]

    return busy


def _balance(problem: PartitionProblem, partition: Partition, placement: list[int]) -> Partition | None:
    # Function length (about 80 lines): one local search loop (single moves, then pair moves) over
    # one shared state; split further, the state would travel through every call.
    n, k = problem.graph.num_layers, problem.num_stages
    if max(placement) + 1 == k:
        return None
    cuts = _prefix_cuts(partition, n)
    if cuts is None:
        return None
    cut_bytes = [int(b) for b in np.rint(order_cut_bytes(problem))]
    # Stage j holding layers l .. r - 1: its busy time, None where it does not fit.
    busy = _matrix_lookup(problem) or _scalar_lookup(problem, cut_bytes)
    stage_ms = [busy(j, cuts[j], cuts[j + 1]) for j in range(k)]
    if any(t is None for t in stage_ms):
        return None
    loads = [0.0] * (max(placement) + 1)
    for j, t in enumerate(stage_ms):
        loads[placement[j]] += t
    tolerance = BALANCE_TOLERANCE * max(1.0, max(loads))
    current = tuple(sorted(loads, reverse=True))
    start_cuts = list(cuts)

    def best_of(moves):
        # Each move: ((cut index, new position), ...) applied together; the best that improves, or None.
        best, target = None, current
        for move in moves:
            new = dict(move)
            changed = {}
            for i, _ in move:
                for j in (i - 1, i):
                    if j in changed:
                        continue
                    lo, hi = new.get(j, cuts[j]), new.get(j + 1, cuts[j + 1])
                    t = busy(j, lo, hi) if lo < hi else None
                    if t is None:
                        break
                    changed[j] = t
                else:
                    continue
                break
            else:
                moved = list(loads)
                for j, t in changed.items():
                    moved[placement[j]] += t - stage_ms[j]
                if max(moved) > target[0] + tolerance:
                    continue
                ranked = tuple(sorted(moved, reverse=True))
                if _better(ranked, target, tolerance):
                    best, target = (ranked, new, changed, moved), ranked
        return best

    def best_single():
        # best_of for the moves of one boundary by one unit, without its bookkeeping (most calls).
        best, target = None, current
        for i in range(1, k):
            before, after, lo, hi = placement[i - 1], placement[i], cuts[i - 1], cuts[i + 1]
            for cut in (cuts[i] - 1, cuts[i] + 1):
                if not lo < cut < hi:
                    continue
                left = busy(i - 1, lo, cut)
                right = None if left is None else busy(i, cut, hi)
                if right is None:
                    continue
                moved = list(loads)
                moved[before] += left - stage_ms[i - 1]
                moved[after] += right - stage_ms[i]
                if max(moved) > target[0] + tolerance:
                    continue
                ranked = tuple(sorted(moved, reverse=True))
                if _better(ranked, target, tolerance):
                    best, target = (ranked, {i: cut}, {i - 1: left, i: right}, moved), ranked
        return best

    for _ in range(n * k):
        best = best_single()
        if best is None:
            # Stuck: move a boundary of the busiest rank's stages together with one of the two on either side.
            top = loads.index(max(loads))
            own = sorted({i for j in range(k) if placement[j] == top for i in (j, j + 1) if 0 < i < k})
            best = best_of(((a, cuts[a] + da), (b, cuts[b] + db)) for a in own
                           for b in range(max(1, a - 2), min(k, a + 3)) if b != a for da in (-1, 1) for db in (-1, 1))
        if best is None:
            break
        current, new, changed, loads = best
        for i, cut in new.items():
            cuts[i] = cut
        for j, t in changed.items():
            stage_ms[j] = t
    if cuts == start_cuts:
        return None
    # Every stage was tested when a move changed it, with the memory rule the chain DP applies
    # (on the same prefix-sum matrices) or split_fits' own (one stage at a time).
    return evaluate_split(problem, [tuple(range(cuts[j], cuts[j + 1])) for j in range(k)], method="rank-balanced",
                          lower_bound_ms=partition.bottleneck_ms if partition.optimal else partition.lower_bound_ms)


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
