"""Exact splits along the layer order: the chain DP (direct and bisection).

For a chain of layers the result is the optimal split; for a DAG it is the best split into
prefixes of its topological order (costed exactly: a tensor crosses every cut between its
producer and its last consumer). Stage times and memory come from
:class:`pipeplan.plan.costmodel.CostModel`, evaluated on differences of prefix sums for every
(start, end) at once. Ties are broken toward balance (smallest sum of squared stage times).
"""

from __future__ import annotations

import math

import numpy as np

from pipeplan.errors import InfeasibleError
from pipeplan.plan.costmodel import prefix_sums
from pipeplan.plan.memo import memoised
from pipeplan.plan.problem import CAP_TOLERANCE, Partition, PartitionProblem, evaluate_split

__all__ = ["partition_chain", "chain_bottleneck_ms", "fits_along_order", "order_cut_bytes", "stage_fit_matrix", "DIRECT_DP_MAX_WORK"]

#: Above this many (layer pairs x stages) the chain solver bisects on the bottleneck instead
#: of running the direct DP (which also breaks ties toward balance).
DIRECT_DP_MAX_WORK = 4_000_000

#: The matrix form of the direct DP holds a few (n + 1) x (n + 1) arrays; above this many
#: entries it falls back to a loop over stage ends (same result, slower).
_DIRECT_MATRIX_MAX_ENTRIES = 4_000_000
#: Masked time matrices kept at once per chain (the fit masks are all kept; see _matrices).
#: 1,000 layers, 8 stages, --schedule auto: 1 kept 0.49 GB peak, 4 kept 0.63 GB, all 1.13 GB.
_MASKED_KEPT = 1


class _Chain:
    """Prefix sums along the layer order: ``between(l, r)`` sums layers ``l .. r - 1``.

    ``cut_bytes[i]`` is every tensor crossing the cut after ``i`` layers: a layer's output
    crosses each cut between it and its last consumer, so a split of a DAG along its
    topological order is costed exactly too.
    """

    def __init__(self, problem: PartitionProblem):
        g = problem.graph
        n = g.num_layers
        self.between = prefix_sums(g)
        delta = np.zeros(n + 2)
        for u in range(n):
            succ = list(g.graph.successors(u))
            if succ:
                last = max(succ)
                delta[u + 1] += g.output_bytes[u]
                delta[last + 1] -= g.output_bytes[u]
        self.cut_bytes = np.cumsum(delta)[: n + 1]


def _chain_of(problem: PartitionProblem) -> _Chain:
    """The graph's :class:`_Chain` (remembered inside :func:`pipeplan.plan.memo.planning_cache`)."""
    return memoised("chain", id(problem.graph), (problem.graph,), lambda: _Chain(problem))


def order_cut_bytes(problem: PartitionProblem) -> np.ndarray:
    """Per cut ``i`` of the layer order (after ``i`` layers, ``0 <= i <= n``), the bytes crossing
    it: every layer output with a consumer at or after the cut (what a prefix split's boundary
    sends; :func:`pipeplan.plan.problem.evaluate_split` costs the same)."""
    return _chain_of(problem).cut_bytes


def _stage_vectors(problem: PartitionProblem, chain: _Chain, j: int, r: int):
    """Vectors over every start ``l < r`` of stage ``j`` ending at cut ``r``: time and fit."""
    l = np.arange(r)
    sums = chain.between(l, r)
    cut = chain.cut_bytes
    mode = problem.recompute[j]
    time = problem.cost.stage_time_ms(sums, cut[l], cut[r], mode)
    memory = problem.cost.stage_memory_bytes(sums, cut[l], problem.in_flight[j], mode)
    return time, memory <= problem.cap_with_tolerance


def _two_pass(run, n: int, k: int, bottleneck_only: bool = False, first_pass=None):
    """Run a chain DP twice: min-max for the bottleneck, then most balanced at it; backtrack.

    ``run(None)`` gives the min-max table, ``run(limit)`` the sum-of-squares table over splits
    whose stages stay within ``limit``; both return ``(best, arg)`` indexed ``[stage, end]``.
    ``first_pass(compute)``, if given, may return a remembered bottleneck instead of
    ``compute()`` (the first pass's only output that the second needs).
    """
    def bottleneck_of():
        best, _ = run(None)
        return float(best[k - 1, n])

    bottleneck = bottleneck_of() if first_pass is None else first_pass(bottleneck_of)
    if bottleneck_only:
        return float(bottleneck)
    if not math.isfinite(bottleneck):
        return None
    best, arg = run(bottleneck * (1 + CAP_TOLERANCE) + 1e-12)
    cuts = [n]
    for j in range(k - 1, 0, -1):
        cuts.append(int(arg[j, cuts[-1]]))
    cuts.append(0)
    cuts.reverse()
    return [tuple(range(cuts[j], cuts[j + 1])) for j in range(k)]


def _matrices(problem: PartitionProblem, chain: _Chain):
    """``times(mode)`` and ``masked(j)`` over every (start, end) at once (see :func:`_direct`)."""
    n = problem.graph.num_layers
    inf = math.inf
    cap = problem.cap_with_tolerance
    cost = problem.cost
    # Entry [l, r] is the stage holding layers l .. r - 1: the cost model's terms on the
    # differences of prefix sums, as in _stage_vectors, so both forms agree bit for bit.
    cut_in, cut_out = chain.cut_bytes[:, None], chain.cut_bytes[None, :]

    def tables():
        upper = np.arange(n + 1)[:, None] < np.arange(n + 1)[None, :]
        return upper, chain.between(np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]), {}, {}

    # The matrices depend on the graph, the cost model and the cap only: problems that differ in
    # stage count, in-flight counts or recomputation share them within one search.
    upper, sums, times_cache, fits_cache = memoised("chain_matrices", (id(problem.graph), cost, cap),
                                                    (problem.graph, chain), tables)

    def times(mode):
        if mode not in times_cache:
            times_cache[mode] = cost.stage_time_ms(sums, cut_in, cut_out, mode)
        return times_cache[mode]

    def masked(j):
        # Stage j's times where it fits (and l < r), inf elsewhere; and their squares likewise:
        # an entry that does not fit then loses to any that does without a mask per step.
        # Every (in-flight, recompute) key keeps its fit mask (1 byte an entry); only the last
        # one keeps the two float matrices (16 bytes an entry): at 1,000 layers, interleaved and
        # zero-bubble searches met dozens of keys and held 1.1 GB of them (now 0.49 GB peak for
        # `--schedule auto`, no slower: the DP asks for one key many times in a row).
        key = (problem.in_flight[j], problem.recompute[j])
        masks = fits_cache.setdefault("ok", {})
        recent = fits_cache.setdefault("recent", {})
        if key in recent:
            recent[key] = recent.pop(key)  # most recently used last
            return recent[key]
        if key not in masks:
            memory = cost.stage_memory_bytes(sums, cut_in, problem.in_flight[j], problem.recompute[j])
            masks[key] = (memory <= cap) & upper
        ok, time = masks[key], times(problem.recompute[j])
        recent[key] = (np.where(ok, time, inf), np.where(ok, time * time, inf))
        while len(recent) > _MASKED_KEPT:
            del recent[next(iter(recent))]
        return recent[key]

    return times, masked


def stage_fit_matrix(problem: PartitionProblem, j: int) -> np.ndarray | None:
    """Whether stage ``j`` holding layers ``l .. r - 1`` fits the cap, for every ``(l, r)``: the
    chain DP's own test, on its own matrices (None above :data:`_DIRECT_MATRIX_MAX_ENTRIES`)."""
    n = problem.graph.num_layers
    if (n + 1) * (n + 1) > _DIRECT_MATRIX_MAX_ENTRIES:
        return None
    _, masked = _matrices(problem, _chain_of(problem))
    return np.isfinite(masked(j)[0])


def _direct(problem: PartitionProblem, chain: _Chain, bottleneck_only: bool = False):
    """Min-max DP, then a second DP for the most balanced split at that bottleneck.

    O(k n^2) time. Up to :data:`_DIRECT_MATRIX_MAX_ENTRIES` it works on whole (start, end)
    matrices, one numpy step per stage (the planner runs it for many schedules and
    recompute sets); beyond, one step per (stage, end) pair.
    """
    n = problem.graph.num_layers
    if (n + 1) * (n + 1) > _DIRECT_MATRIX_MAX_ENTRIES:
        return _direct_loop(problem, chain)
    k = problem.num_stages
    inf = math.inf
    cap = problem.cap_with_tolerance
    cost = problem.cost
    times, masked = _matrices(problem, chain)

    def run(limit):
        best = np.full((k, n + 1), inf)
        arg = np.zeros((k, n + 1), dtype=int)
        for j in range(k):
            # Stage j ends at a cut r in [lo, hi] and starts at a cut l in [j, hi - 1]
            # (stage 0 starts at 0): only that block of the matrices matters.
            lo, hi = j + 1, n - (k - 1 - j)
            if lo > hi:
                continue
            first, last = (0, 1) if j == 0 else (j, hi)
            rows, cols = slice(first, last), slice(lo, hi + 1)
            prev = np.zeros((1, 1)) if j == 0 else best[j - 1, rows][:, None]
            time_or_inf, square_or_inf = masked(j)
            # An unreachable start has prev = inf, so its value is inf as well.
            if limit is None:
                value = np.maximum(prev, time_or_inf[rows, cols])
            else:
                value = np.where(times(problem.recompute[j])[rows, cols] <= limit,
                                 prev + square_or_inf[rows, cols], inf)
                arg[j, cols] = np.argmin(value, axis=0) + first
            best[j, cols] = value.min(axis=0)
        return best, arg

    # The ladder tests a recompute set's bottleneck alone, then often splits the same problem:
    # remember the min-max pass's value so that the split runs only the balancing pass.
    key = (id(problem.graph), cost, cap, problem.in_flight, problem.recompute, k)
    return _two_pass(run, n, k, bottleneck_only,
                     first_pass=lambda compute: memoised("chain_bottleneck", key, (problem.graph,), compute))


def _direct_loop(problem: PartitionProblem, chain: _Chain):
    """:func:`_direct` one stage end at a time, for chains too long for the matrix form.

    O(k n^2) time, vectorized over stage starts; O(k n) memory.
    """
    n, k = problem.graph.num_layers, problem.num_stages
    inf = math.inf

    def run(limit):
        # best[j][r]: value for the first r layers in j + 1 stages; arg[j][r]: start of stage j.
        best = np.full((k, n + 1), inf)
        arg = np.zeros((k, n + 1), dtype=int)
        for j in range(k):
            for r in range(j + 1, n - (k - 1 - j) + 1):
                time, fits = _stage_vectors(problem, chain, j, r)
                if j == 0:
                    prev = np.full(r, inf)
                    prev[0] = 0.0
                else:
                    prev = best[j - 1, :r]
                ok = fits & np.isfinite(prev)
                if limit is None:
                    value = np.where(ok, np.maximum(prev, time), inf)
                else:
                    ok &= time <= limit
                    value = np.where(ok, prev + time * time, inf)
                pick = int(np.argmin(value))
                best[j, r], arg[j, r] = value[pick], pick
        return best, arg

    return _two_pass(run, n, k)


def chain_bottleneck_ms(problem: PartitionProblem) -> float:
    """The optimal bottleneck along the layer order, without the split (``inf``: nothing fits).

    Half the work of :func:`partition_chain` (no tie-break pass, no split to cost): the
    planner uses it to test which recompute sets fit.

    Notes
    -----
    O(k n^2); for a chain the value is exact, for a DAG an upper bound.
    """
    chain = _chain_of(problem)
    n = problem.graph.num_layers
    if (n + 1) * (n + 1) > _DIRECT_MATRIX_MAX_ENTRIES:
        split = _direct_loop(problem, chain)
        return math.inf if split is None else evaluate_split(problem, split).bottleneck_ms
    return _direct(problem, chain, bottleneck_only=True)


def _range_min(values: np.ndarray):
    """Sparse table for O(1) range-minimum queries over ``values``."""
    table = [values]
    width = 1
    while 2 * width <= len(values):
        prev = table[-1]
        table.append(np.minimum(prev[:-width], prev[width:]))
        width *= 2

    def query(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Minimum of values[lo..hi] inclusive; inf where lo > hi."""
        out = np.full(len(lo), math.inf)
        valid = lo <= hi
        lo_v, hi_v = lo[valid], hi[valid]
        level = np.floor(np.log2(hi_v - lo_v + 1)).astype(int)
        result = np.empty(len(lo_v))
        for lev in np.unique(level):
            sel = level == lev
            row = table[lev]
            result[sel] = np.minimum(row[lo_v[sel]], row[hi_v[sel] - (1 << lev) + 1])
        out[valid] = result
        return out

    return query


def _memory_window(problem: PartitionProblem, chain: _Chain, j: int, ends: np.ndarray, cap: float) -> np.ndarray:
    """Per end ``r``, the least start ``l <= r`` whose stage ``j`` over ``l .. r - 1`` fits ``cap``
    (``r`` where none does): O(n log n), the memory being non-increasing in ``l``."""
    lo, hi = np.zeros_like(ends), ends.copy()
    while (lo < hi).any():
        mid = (lo + hi) // 2
        memory = problem.cost.stage_memory_bytes(chain.between(mid, ends), 0.0, problem.in_flight[j], "none")
        fits = (memory <= cap) | (mid >= ends)
        hi, lo = np.where(fits, mid, hi), np.where(fits, lo, mid + 1)
    return lo


def _feasibility(problem: PartitionProblem, chain: _Chain):
    """A test ``feasible(limit) -> split or None``: is there a split with bottleneck <= limit?

    O(k n log n) per call: the starts that fit in memory form a window, and a range-minimum
    query over reachable starts answers each end at once. Both rest on the cost model being
    a difference of prefix values without recomputation (memory falls as the start rises,
    the time is ``load[r] + cut[r] x ms_per_byte + (cut[l] x ms_per_byte - load[l])``); a
    recomputing stage keeps its input, which breaks the window, so it is refused.

    A tied weight's copy breaks it too: a stage holding a later user of a tied weight but not its
    first keeps a copy, so its memory jumps up as the start passes the first user; under a finite
    cap such a problem is refused (the direct DP costs the copies exactly).

    Raises
    ------
    ValueError
        If a stage recomputes, or a tied weight's copy may count against a finite cap.
    """
    if problem.any_recompute:
        raise ValueError("the bisection solver does not model recomputation; use the direct DP")
    if problem.tied_copies_bind:
        raise ValueError("the bisection solver does not model tied weights' copies under a memory cap; "
                         "use the direct DP")
    n, k = problem.graph.num_layers, problem.num_stages
    cost = problem.cost
    spb = cost.ms_per_byte
    cap = problem.cap_with_tolerance
    cut_bytes = chain.cut_bytes
    positions = np.arange(n + 1)
    prefix = chain.between(0, positions)
    load = cost.load_ms(prefix, "none")
    lows = []
    for j in range(k):
        if problem.graph.working_bytes.any():
            # A working term is a range maximum, not a prefix difference: the window's start by
            # bisection on l for every end at once (memory still falls as l rises).
            lows.append(_memory_window(problem, chain, j, positions, cap))
            continue
        combined = cost.stage_memory_bytes(prefix, 0.0, problem.in_flight[j], "none")
        # Memory falls as the start l rises, so the starts that fit form a window [low, r-1].
        lows.append(np.searchsorted(combined, combined - cap, side="left"))
    start_key = cut_bytes * spb - load

    def feasible(limit):
        reach = [np.zeros(n + 1, dtype=bool)]
        reach[0][0] = True
        for j in range(k):
            keyed = np.where(reach[-1], start_key, math.inf)
            query = _range_min(keyed)
            lo = np.maximum(lows[j], j)
            hi = positions - 1
            best = query(lo, hi)
            ok = np.isfinite(best) & (best + load + cut_bytes * spb <= limit)
            ok[0] = False
            reach.append(ok)
        if not reach[k][n]:
            return None
        cuts = [n]
        for j in range(k - 1, -1, -1):
            r = cuts[-1]
            cand = np.arange(max(lows[j][r], j), r)
            time = cost.stage_time_ms(chain.between(cand, r), cut_bytes[cand], cut_bytes[r], "none")
            good = cand[reach[j][cand] & (time <= limit * (1 + 1e-12) + 1e-12)]
            cuts.append(int(good[-1]) if j > 0 else 0)
        cuts.reverse()
        return [tuple(range(cuts[j], cuts[j + 1])) for j in range(k)]

    return feasible


def _bisect(problem: PartitionProblem, chain: _Chain):
    """Bisection on the bottleneck with the O(k n log n) feasibility test.

    Exact to floating-point precision: the answer is always the bottleneck of a split found
    feasible, and every value below the final lower bound is infeasible.
    """
    k = problem.num_stages
    n = problem.graph.num_layers
    feasible = _feasibility(problem, chain)
    split = feasible(math.inf)
    if split is None:
        return None
    hi_split = split
    hi = evaluate_split(problem, split).bottleneck_ms
    total = float(chain.between(0, n).compute_ms)
    lo = max(float(problem.graph.compute_ms.max()), total / k) * (1 - 1e-12)
    lo = min(lo, hi)
    while hi - lo > max(1e-9 * hi, 1e-12):
        mid = 0.5 * (lo + hi)
        split = feasible(mid)
        if split is None:
            lo = mid
        else:
            hi_split = split
            hi = evaluate_split(problem, split).bottleneck_ms
    return hi_split


def fits_along_order(problem: PartitionProblem) -> bool:
    """Whether some split along the layer order fits the memory cap.

    For a chain this is exact; for a DAG, True proves a split exists. Without recomputation
    it runs the O(k n log n) feasibility test, with it the bottleneck-only DP.
    """
    if problem.any_recompute or problem.tied_copies_bind:
        return math.isfinite(chain_bottleneck_ms(problem))
    return _feasibility(problem, _chain_of(problem))(math.inf) is not None


def partition_chain(problem: PartitionProblem, method: str = "auto") -> Partition:
    """Optimal split along the layer order (for a chain: the optimal split).

    Parameters
    ----------
    problem : PartitionProblem
        For a chain the result is optimal; for a DAG it is the best split into prefixes of the
        profile's topological order (an upper bound for the ILP), and ``optimal`` is False.
    method : {"auto", "direct", "bisect"}
        ``direct``: min-max DP with tie-break toward balance, O(k n^2).
        ``bisect``: bisection with a greedy-window feasibility test, O(k n log n log(1/eps)); no
        recompute, no tied weights' copies under a cap, no tie-break. ``auto`` picks direct
        when ``k n^2`` is small, a stage recomputes or a tied copy may count against the cap.

    Returns
    -------
    Partition
        ``method`` is ``dp-chain-direct`` or ``dp-chain-bisect``.

    Raises
    ------
    InfeasibleError
        If no split fits the memory cap.
    ValueError
        ``bisect`` with a recomputing stage or tied copies under a cap, or an unknown method.

    Examples
    --------
    >>> import networkx as nx, numpy as np
    >>> from pipeplan.plan.graph import LayerGraph
    >>> ones = np.ones(4)
    >>> g = LayerGraph(names=("a", "b", "c", "d"), forward_ms=np.array([1., 1., 1., 3.]),
    ...                backward_ms=np.array([2., 2., 2., 6.]), backward_input_ms=ones,
    ...                backward_weight_ms=ones, backward_split_measured=False, param_bytes=ones,
    ...                activation_bytes=ones, output_bytes=ones, graph=nx.path_graph(4, nx.DiGraph),
    ...                chain=True)
    >>> found = partition_chain(PartitionProblem(graph=g, num_stages=2, in_flight=(2, 1)))
    >>> found.stages, found.bottleneck_ms
    (((0, 1, 2), (3,)), 9.0)

    Notes
    -----
    Complexity as above; both methods are exact (tests check them against each other and
    against brute force).
    """
    n, k = problem.graph.num_layers, problem.num_stages
    chain = _chain_of(problem)
    if method == "auto":
        exact_window = not (problem.any_recompute or problem.tied_copies_bind)
        method = "direct" if (n * n * k <= DIRECT_DP_MAX_WORK or not exact_window) else "bisect"
    if method == "direct":
        split = _direct(problem, chain)
    elif method == "bisect":
        split = _bisect(problem, chain)
    else:
        raise ValueError(f"unknown chain method {method!r}")
    if split is None:
        raise InfeasibleError("no split into the requested stages fits the memory cap")
    return evaluate_split(problem, split, method=f"dp-chain-{method}", optimal=problem.graph.chain)
