"""Exact partitioners: split a layer graph into consecutive stages, minimising the slowest.

A split into ``k`` stages is a chain of ideals (down-closed layer sets)
``{} = I_0 < I_1 < ... < I_k = V``; stage ``j`` holds ``I_{j+1} - I_j`` and every edge goes to
the same or a later stage. The objective is the bottleneck: the largest stage time, where

    stage_time_ms = compute (forward + backward [+ forward again if it recomputes])
                    + (bytes received at its input boundary + bytes of gradients received
                       at its output boundary) / bandwidth,

subject to each stage's memory (``memory.stage_memory_bytes``) staying within the cap.
Ties are broken toward balancing the other stages (smallest sum of squared stage times) by
the chain DP; the ILP returns one optimal split.

Functions here are pure: a :class:`PartitionProblem` in, a :class:`Partition` out.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.plan.graph import LayerGraph

__all__ = [
    "PartitionProblem",
    "Partition",
    "stage_time_ms",
    "stage_memory_bytes",
    "evaluate_split",
    "partition_chain",
    "partition_ideals",
    "partition_brute_force",
    "enumerate_ideals",
    "fits_along_order",
    "partition_along_orders",
    "refine_split",
    "count_ideals",
    "trivial_lower_bound_ms",
    "chain_bottleneck_ms",
    "split_fits",
    "DIRECT_DP_MAX_WORK",
    "IDEALS_DP_MAX_IDEALS",
]

#: Above this many (layer pairs x stages) the chain solver bisects on the bottleneck instead
#: of running the direct DP (which also breaks ties toward balance).
DIRECT_DP_MAX_WORK = 4_000_000
#: The ideal-lattice DP is quadratic in the number of ideals; beyond this use the ILP.
IDEALS_DP_MAX_IDEALS = 3000

_TOLERANCE = 1e-9


@dataclass(frozen=True)
class PartitionProblem:
    """What to split and under which rules."""

    graph: LayerGraph
    """The layer graph at one micro-batch size."""
    num_stages: int
    """Stages to split into, exactly; each gets at least one layer."""
    in_flight: tuple[int, ...]
    """Per stage, micro-batches whose activations it holds at its peak (schedule-dependent)."""
    recompute: tuple[bool, ...] = ()
    """Per stage, whether it recomputes its forward in backward (keeps only its input). Empty: none."""
    bandwidth_bytes_per_s: float = math.inf
    """Point-to-point bandwidth; ``inf`` ignores transfers."""
    static_bytes_per_param_byte: float = 0.0
    """Weights, gradients and optimizer state per byte of parameters (see memory.py)."""
    memory_cap_bytes: float = math.inf
    """Per-stage memory cap."""
    action_overhead_ms: float = 0.0
    """The schedule's own time per action (the simulator's, see ``StageCost``). The same for
    every stage, so it moves no split: the solvers ignore it."""

    def __post_init__(self):
        n = self.graph.num_layers
        if self.num_stages < 1:
            raise BadInputError(f"--stages: {self.num_stages} must be at least 1")
        if self.num_stages > n:
            raise BadInputError(
                f"--stages: {self.num_stages} stages but the profile has only {n} layers; "
                f"each stage needs at least one layer, so use at most {n}"
            )
        if len(self.in_flight) != self.num_stages:
            raise ValueError("in_flight needs one entry per stage")
        if not self.recompute:
            object.__setattr__(self, "recompute", (False,) * self.num_stages)
        if len(self.recompute) != self.num_stages:
            raise ValueError("recompute needs one entry per stage")

    @property
    def seconds_per_byte_ms(self) -> float:
        """Milliseconds per byte moved."""
        return 0.0 if math.isinf(self.bandwidth_bytes_per_s) else 1000.0 / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Partition:
    """A split and how it was found."""

    stages: tuple[tuple[int, ...], ...]
    """Layer positions of each stage, in order."""
    stage_times_ms: tuple[float, ...]
    """Each stage's time per micro-batch (compute plus transfers)."""
    bottleneck_ms: float
    """The largest stage time."""
    method: str
    """dp-chain, dp-chain-bisect, dp-ideals, ilp-highs, ilp-cbc, brute-force."""
    optimal: bool
    """Whether the bottleneck is proven minimal."""
    boundary_bytes: tuple[int, ...] = field(default=())
    """Bytes crossing each of the ``k - 1`` boundaries per micro-batch."""
    lower_bound_ms: float | None = None
    """A proven lower bound on the optimal bottleneck (equal to it when optimal)."""


def stage_time_ms(problem: PartitionProblem, index: int, layers, in_bytes: float, out_bytes: float) -> float:
    """Time of stage ``index`` per micro-batch: compute plus received bytes at the bandwidth."""
    g = problem.graph
    layers = list(layers)
    compute = float(g.compute_ms[layers].sum())
    if problem.recompute[index]:
        compute += float(g.forward_ms[layers].sum())
    return compute + (in_bytes + out_bytes) * problem.seconds_per_byte_ms


def stage_memory_bytes(problem: PartitionProblem, index: int, layers, in_bytes: float) -> float:
    """Peak memory of stage ``index``: static state plus in-flight activations.

    A recomputing stage keeps only its input per micro-batch in flight, plus one micro-batch's
    full activations while it recomputes.
    """
    g = problem.graph
    layers = list(layers)
    static = problem.static_bytes_per_param_byte * float(g.param_bytes[layers].sum())
    activations = float(g.activation_bytes[layers].sum())
    if problem.recompute[index]:
        return static + problem.in_flight[index] * in_bytes + activations
    return static + problem.in_flight[index] * activations


def trivial_lower_bound_ms(problem: PartitionProblem) -> float:
    """No split beats an even share of the compute, nor the costliest single layer."""
    compute = problem.graph.compute_ms
    return max(float(compute.sum()) / problem.num_stages, float(compute.max()))


def evaluate_split(problem: PartitionProblem, stages, method: str = "given", optimal: bool = False,
                   lower_bound_ms: float | None = None) -> Partition:
    """Cost a given split with the same model every solver uses.

    Raises
    ------
    ValueError
        If the split is not a valid chain of ideals into ``num_stages`` non-empty stages.
    """
    g = problem.graph
    stage_of = np.full(g.num_layers, -1)
    stages = tuple(tuple(int(v) for v in s) for s in stages)
    if len(stages) != problem.num_stages or any(not s for s in stages):
        raise ValueError("a split needs exactly num_stages non-empty stages")
    for j, layers in enumerate(stages):
        stage_of[list(layers)] = j
    if (stage_of < 0).any():
        raise ValueError("every layer needs a stage")
    if g.chain:
        # Only the edge out of a stage's last layer crosses its boundary; the planner costs
        # thousands of splits, so skip the general edge walk.
        if (np.diff(stage_of) < 0).any():
            bad = int(np.flatnonzero(np.diff(stage_of) < 0)[0])
            raise ValueError(f"edge {g.names[bad]} -> {g.names[bad + 1]} goes to an earlier stage")
        boundaries = [int(g.output_bytes[max(stages[j])]) for j in range(problem.num_stages - 1)]
    else:
        edges = np.array(list(g.graph.edges()), dtype=np.int64).reshape(-1, 2)
        src, dst = edges[:, 0], edges[:, 1]
        backwards = stage_of[src] > stage_of[dst]
        if backwards.any():
            u, v = (int(x) for x in edges[np.flatnonzero(backwards)[0]])
            raise ValueError(f"edge {g.names[u]} -> {g.names[v]} goes to an earlier stage")
        # A layer's output crosses every boundary from its own stage to its last consumer's
        # (once, however many consumers): a difference array over the boundaries.
        last = np.full(g.num_layers, -1)
        np.maximum.at(last, src, stage_of[dst])
        crossing = last > stage_of
        delta = np.zeros(problem.num_stages + 1, dtype=np.int64)
        out = g.output_bytes.astype(np.int64)
        np.add.at(delta, stage_of[crossing], out[crossing])
        np.add.at(delta, last[crossing], -out[crossing])
        boundaries = [int(b) for b in np.cumsum(delta)[: problem.num_stages - 1]]
    times = []
    for j, layers in enumerate(stages):
        in_b = boundaries[j - 1] if j > 0 else 0
        out_b = boundaries[j] if j < problem.num_stages - 1 else 0
        times.append(stage_time_ms(problem, j, layers, in_b, out_b))
    return Partition(
        stages=stages,
        stage_times_ms=tuple(times),
        bottleneck_ms=max(times),
        method=method,
        optimal=optimal,
        boundary_bytes=tuple(int(b) for b in boundaries),
        lower_bound_ms=max(times) if optimal else lower_bound_ms,
    )


def split_fits(problem: PartitionProblem, partition: Partition) -> bool:
    """Whether every stage of ``partition`` is within the memory cap."""
    for j, layers in enumerate(partition.stages):
        in_b = partition.boundary_bytes[j - 1] if j > 0 else 0
        if stage_memory_bytes(problem, j, layers, in_b) > problem.memory_cap_bytes * (1 + _TOLERANCE):
            return False
    return True


# ----------------------------------------------------------------------------------------
# Chains


def _chain_arrays(problem: PartitionProblem):
    """Prefix sums along the layer order: entry ``i`` covers the first ``i`` layers.

    ``cut_bytes[i]`` is every tensor crossing the cut after ``i`` layers: a layer's output
    crosses each cut between it and its last consumer, so a split of a DAG along its
    topological order is costed exactly too.
    """
    g = problem.graph
    n = g.num_layers
    zero = np.zeros(1)
    compute = np.concatenate([zero, np.cumsum(g.compute_ms)])
    forward = np.concatenate([zero, np.cumsum(g.forward_ms)])
    params = np.concatenate([zero, np.cumsum(g.param_bytes)])
    acts = np.concatenate([zero, np.cumsum(g.activation_bytes)])
    delta = np.zeros(n + 2)
    for u in range(n):
        succ = list(g.graph.successors(u))
        if succ:
            last = max(succ)
            delta[u + 1] += g.output_bytes[u]
            delta[last + 1] -= g.output_bytes[u]
    cut_bytes = np.cumsum(delta)[: n + 1]
    return compute, forward, params, acts, cut_bytes


def _chain_stage_matrix(problem, j, compute, forward, params, acts, cut_bytes, r):
    """Vectors over every start ``l < r`` of stage ``j`` ending at cut ``r``: time and fit."""
    l = np.arange(r)
    time = compute[r] - compute[l]
    if problem.recompute[j]:
        time = time + forward[r] - forward[l]
    time = time + (cut_bytes[l] + cut_bytes[r]) * problem.seconds_per_byte_ms
    static = problem.static_bytes_per_param_byte * (params[r] - params[l])
    if problem.recompute[j]:
        memory = static + problem.in_flight[j] * cut_bytes[l] + (acts[r] - acts[l])
    else:
        memory = static + problem.in_flight[j] * (acts[r] - acts[l])
    fits = memory <= problem.memory_cap_bytes * (1 + _TOLERANCE)
    return time, fits


#: The matrix form of the direct DP holds a few (n + 1) x (n + 1) arrays; above this many
#: entries it falls back to a loop over stage ends (same result, slower).
_DIRECT_MATRIX_MAX_ENTRIES = 4_000_000


def _two_pass(run, n: int, k: int, bottleneck_only: bool = False):
    """Run a chain DP twice: min-max for the bottleneck, then most balanced at it; backtrack.

    ``run(None)`` gives the min-max table, ``run(limit)`` the sum-of-squares table over splits
    whose stages stay within ``limit``; both return ``(best, arg)`` indexed ``[stage, end]``.
    """
    best, _ = run(None)
    bottleneck = best[k - 1, n]
    if bottleneck_only:
        return float(bottleneck)
    if not math.isfinite(bottleneck):
        return None
    best, arg = run(bottleneck * (1 + _TOLERANCE) + 1e-12)
    cuts = [n]
    for j in range(k - 1, 0, -1):
        cuts.append(int(arg[j, cuts[-1]]))
    cuts.append(0)
    cuts.reverse()
    return [tuple(range(cuts[j], cuts[j + 1])) for j in range(k)]


def _chain_direct(problem: PartitionProblem, arrays, bottleneck_only: bool = False):
    """Min-max DP, then a second DP for the most balanced split at that bottleneck.

    O(k n^2) time. Up to :data:`_DIRECT_MATRIX_MAX_ENTRIES` it works on whole (start, end)
    matrices, one numpy step per stage (the planner runs it for many schedules and
    recompute sets); beyond, one step per (stage, end) pair.
    """
    n = problem.graph.num_layers
    if (n + 1) * (n + 1) > _DIRECT_MATRIX_MAX_ENTRIES:
        return _chain_direct_loop(problem, arrays)
    compute, forward, params, acts, cut_bytes = arrays
    k = problem.num_stages
    inf = math.inf
    spb = problem.seconds_per_byte_ms
    cap = problem.memory_cap_bytes * (1 + _TOLERANCE)
    # Entry [l, r] is the stage holding layers l .. r - 1; the element-wise operations are
    # the same, in the same order, as in _chain_stage_matrix, so both forms agree bit for bit.
    upper = np.arange(n + 1)[:, None] < np.arange(n + 1)[None, :]
    plain = compute[None, :] - compute[:, None]
    recomputed = plain + forward[None, :] - forward[:, None]
    transfer = (cut_bytes[:, None] + cut_bytes[None, :]) * spb
    times = {False: plain + transfer, True: recomputed + transfer}
    static = problem.static_bytes_per_param_byte * (params[None, :] - params[:, None])
    held = acts[None, :] - acts[:, None]
    fits_cache = {}

    def fits(j):
        key = (problem.in_flight[j], problem.recompute[j])
        if key not in fits_cache:
            if problem.recompute[j]:
                memory = static + problem.in_flight[j] * cut_bytes[:, None] + held
            else:
                memory = static + problem.in_flight[j] * held
            fits_cache[key] = (memory <= cap) & upper
        return fits_cache[key]

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
            time = times[problem.recompute[j]][rows, cols]
            if j == 0:
                prev = np.zeros(1)
            else:
                prev = best[j - 1, rows]
            ok = fits(j)[rows, cols] & np.isfinite(prev)[:, None]
            if limit is None:
                value = np.where(ok, np.maximum(prev[:, None], time), inf)
            else:
                ok &= time <= limit
                value = np.where(ok, prev[:, None] + time * time, inf)
            pick = np.argmin(value, axis=0)
            best[j, cols] = value[pick, np.arange(hi + 1 - lo)]
            arg[j, cols] = pick + first
        return best, arg

    return _two_pass(run, n, k, bottleneck_only)


def chain_bottleneck_ms(problem: PartitionProblem) -> float:
    """The optimal bottleneck along the layer order, without the split (``inf``: nothing fits).

    Half the work of :func:`partition_chain` (no tie-break pass, no split to cost): the
    planner uses it to test which recompute sets fit.

    Notes
    -----
    O(k n^2); for a chain the value is exact, for a DAG an upper bound.
    """
    arrays = _chain_arrays(problem)
    n = problem.graph.num_layers
    if (n + 1) * (n + 1) > _DIRECT_MATRIX_MAX_ENTRIES:
        split = _chain_direct_loop(problem, arrays)
        return math.inf if split is None else evaluate_split(problem, split).bottleneck_ms
    return _chain_direct(problem, arrays, bottleneck_only=True)


def _chain_direct_loop(problem: PartitionProblem, arrays):
    """:func:`_chain_direct` one stage end at a time, for chains too long for the matrix form.

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
                time, fits = _chain_stage_matrix(problem, j, *arrays, r)
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


def _chain_feasibility(problem: PartitionProblem, arrays):
    """A test ``feasible(limit) -> split or None``: is there a split with bottleneck <= limit?

    O(k n log n) per call: the starts that fit in memory form a window, and a range-minimum
    query over reachable starts answers each end at once.
    """
    compute, _forward, params, acts, cut_bytes = arrays
    n, k = problem.graph.num_layers, problem.num_stages
    spb = problem.seconds_per_byte_ms
    cap = problem.memory_cap_bytes * (1 + _TOLERANCE)
    positions = np.arange(n + 1)
    lows = []
    for j in range(k):
        combined = problem.static_bytes_per_param_byte * params + problem.in_flight[j] * acts
        # Memory falls as the start l rises, so the starts that fit form a window [low, r-1].
        lows.append(np.searchsorted(combined, combined - cap, side="left"))
    start_key = cut_bytes * spb - compute  # stage time = compute[r] + cut[r]*spb + start_key[l]

    def feasible(limit):
        reach = [np.zeros(n + 1, dtype=bool)]
        reach[0][0] = True
        for j in range(k):
            keyed = np.where(reach[-1], start_key, math.inf)
            query = _range_min(keyed)
            lo = np.maximum(lows[j], j)
            hi = positions - 1
            best = query(lo, hi)
            ok = np.isfinite(best) & (best + compute + cut_bytes * spb <= limit)
            ok[0] = False
            reach.append(ok)
        if not reach[k][n]:
            return None
        cuts = [n]
        for j in range(k - 1, -1, -1):
            r = cuts[-1]
            cand = np.arange(max(lows[j][r], j), r)
            time = compute[r] - compute[cand] + (cut_bytes[cand] + cut_bytes[r]) * spb
            good = cand[reach[j][cand] & (time <= limit * (1 + 1e-12) + 1e-12)]
            cuts.append(int(good[-1]) if j > 0 else 0)
        cuts.reverse()
        return [tuple(range(cuts[j], cuts[j + 1])) for j in range(k)]

    return feasible


def _chain_bisect(problem: PartitionProblem, arrays):
    """Bisection on the bottleneck with the O(k n log n) feasibility test.

    Exact to floating-point precision: the answer is always the bottleneck of a split found
    feasible, and every value below the final lower bound is infeasible.
    """
    compute = arrays[0]
    k = problem.num_stages
    n = problem.graph.num_layers
    feasible = _chain_feasibility(problem, arrays)
    split = feasible(math.inf)
    if split is None:
        return None
    hi_split = split
    hi = evaluate_split(problem, split).bottleneck_ms
    lo = max(float(problem.graph.compute_ms.max()), float(compute[n]) / k) * (1 - 1e-12)
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
    """Whether some split along the layer order fits the memory cap (no recompute).

    For a chain this is exact; for a DAG, True proves a split exists.
    """
    return _chain_feasibility(problem, _chain_arrays(problem))(math.inf) is not None


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
        recompute, no tie-break. ``auto`` picks direct when ``k n^2`` is small.

    Returns
    -------
    Partition

    Raises
    ------
    InfeasibleError
        If no split fits the memory cap.

    Examples
    --------
    >>> from pipeplan.plan.graph import LayerGraph  # doctest: +SKIP

    Notes
    -----
    Complexity as above; both methods are exact (tests check them against each other and
    against brute force).
    """
    n, k = problem.graph.num_layers, problem.num_stages
    arrays = _chain_arrays(problem)
    if method == "auto":
        method = "direct" if (n * n * k <= DIRECT_DP_MAX_WORK or any(problem.recompute)) else "bisect"
    if method == "direct":
        split = _chain_direct(problem, arrays)
    elif method == "bisect":
        if any(problem.recompute):
            raise ValueError("the bisection solver does not model recomputation")
        split = _chain_bisect(problem, arrays)
    else:
        raise ValueError(f"unknown chain method {method!r}")
    if split is None:
        raise InfeasibleError("no split into the requested stages fits the memory cap")
    return evaluate_split(problem, split, method=f"dp-chain-{method}", optimal=problem.graph.chain)


# ----------------------------------------------------------------------------------------
# DAGs: the ideal lattice


def enumerate_ideals(graph: nx.DiGraph, limit: int | None = None) -> list[frozenset]:
    """Every down-closed node set of a DAG (ideals), smallest first.

    Raises
    ------
    BadInputError
        If there are more than ``limit``.

    Notes
    -----
    One ideal per antichain (its down-closure), so the count is the number of antichains,
    which grows exponentially with the graph's width.
    """
    ideals = []
    for antichain in nx.antichains(graph):
        closure = set(antichain)
        for v in antichain:
            closure |= nx.ancestors(graph, v)
        ideals.append(frozenset(closure))
        if limit is not None and len(ideals) > limit:
            raise BadInputError(
                f"--solver dp: the layer graph has more than {limit} ideals (possible stage "
                f"boundaries); use --solver ilp or auto"
            )
    ideals.sort(key=lambda s: (len(s), sorted(s)))
    return ideals


def partition_ideals(problem: PartitionProblem) -> Partition:
    """Exact DP over the ideal lattice of a DAG (any graph, few ideals).

    Notes
    -----
    O(k N^2) for N ideals: practical for residual networks (a few hundred ideals), not for
    Inception or NASNet cells (10^5 and more), where the ILP is used.
    """
    g = problem.graph
    k = problem.num_stages
    ideals = enumerate_ideals(g.graph, IDEALS_DP_MAX_IDEALS)
    count = len(ideals)
    member = np.zeros((count, g.num_layers), dtype=np.float64)
    for i, ideal in enumerate(ideals):
        member[i, list(ideal)] = 1.0
    sizes = member.sum(axis=1)
    # contains[i, j]: ideal j is a strict subset of ideal i.
    outside = 1.0 - member
    contains = (member @ outside.T).T == 0
    contains &= sizes[:, None] > sizes[None, :]
    compute = member @ g.compute_ms
    forward = member @ g.forward_ms
    params = member @ g.param_bytes
    acts = member @ g.activation_bytes
    bnd = np.array([g.boundary_bytes(member[i].astype(bool)) for i in range(count)], dtype=float)
    full = count - 1
    spb = problem.seconds_per_byte_ms
    cap = problem.memory_cap_bytes * (1 + _TOLERANCE)
    inf = math.inf
    best = np.full((k, count), inf)
    arg = np.zeros((k, count), dtype=int)
    for j in range(k):
        prev = np.full(count, inf)
        if j == 0:
            prev[0] = 0.0
        else:
            prev = best[j - 1]
        for i in range(count):
            sub = contains[i]
            time = compute[i] - compute + (bnd + bnd[i]) * spb
            static = problem.static_bytes_per_param_byte * (params[i] - params)
            if problem.recompute[j]:
                time = time + forward[i] - forward
                memory = static + problem.in_flight[j] * bnd + (acts[i] - acts)
            else:
                memory = static + problem.in_flight[j] * (acts[i] - acts)
            ok = sub & (memory <= cap) & np.isfinite(prev)
            if not ok.any():
                continue
            value = np.where(ok, np.maximum(prev, time), inf)
            pick = int(np.argmin(value))
            best[j, i], arg[j, i] = value[pick], pick
    if not math.isfinite(best[k - 1, full]):
        raise InfeasibleError("no split into the requested stages fits the memory cap")
    chain = [full]
    for j in range(k - 1, 0, -1):
        chain.append(int(arg[j, chain[-1]]))
    chain.append(0)
    chain.reverse()
    stages = []
    for j in range(k):
        layers = sorted(ideals[chain[j + 1]] - ideals[chain[j]])
        stages.append(tuple(layers))
    return evaluate_split(problem, stages, method="dp-ideals", optimal=True)


def count_ideals(graph: nx.DiGraph, limit: int) -> int:
    """The number of ideals, counting at most ``limit + 1``."""
    count = 0
    for _ in nx.antichains(graph):
        count += 1
        if count > limit:
            break
    return count


def _topological_orders(graph: nx.DiGraph):
    """A few deterministic topological orders that cut a DAG in different places."""
    n = graph.number_of_nodes()
    yield list(range(n))
    yield list(nx.lexicographical_topological_sort(graph, key=lambda v: -v))
    # Depth-first: finish each branch before starting the next.
    yield list(reversed(list(nx.dfs_postorder_nodes(graph))))
    depth = {}
    for v in nx.topological_sort(graph):
        depth[v] = max((depth[u] + 1 for u in graph.predecessors(v)), default=0)
    yield list(nx.lexicographical_topological_sort(graph, key=lambda v: (depth[v], v)))


def partition_along_orders(problem: PartitionProblem) -> Partition:
    """The best split along any of a few topological orders (an upper bound for DAGs).

    Raises
    ------
    InfeasibleError
        If no order admits a split within the memory cap.
    """
    from pipeplan.plan.graph import reorder

    best = None
    seen = set()
    for order in _topological_orders(problem.graph.graph):
        if len(order) != problem.graph.num_layers:
            continue
        key = tuple(order)
        if key in seen:
            continue
        seen.add(key)
        reordered = PartitionProblem(**{**problem.__dict__, "graph": reorder(problem.graph, order)})
        try:
            found = partition_chain(reordered)
        except InfeasibleError:
            continue
        stages = [tuple(sorted(order[v] for v in s)) for s in found.stages]
        candidate = evaluate_split(problem, stages, method="dp-orders", optimal=problem.graph.chain,
                                   lower_bound_ms=trivial_lower_bound_ms(problem))
        if best is None or candidate.bottleneck_ms < best.bottleneck_ms - 1e-12:
            best = candidate
    if best is None:
        raise InfeasibleError("no split into the requested stages fits the memory cap")
    if not problem.graph.chain:
        best = refine_split(problem, best)
    return best


def refine_split(problem: PartitionProblem, partition: Partition, max_moves: int = 10_000) -> Partition:
    """Steepest descent on the bottleneck: move single layers across a boundary of the slowest stage.

    A layer may leave stage ``b`` for ``b - 1`` when all its producers are in earlier stages, or
    for ``b + 1`` when all its consumers are in later stages, so every step keeps a chain of
    ideals. A move is taken only if it lowers the larger of the two stage times below the
    current bottleneck and both stages still fit the cap; the result is never worse than the
    input, and is deterministic.

    Notes
    -----
    Moves that cross no profile order's prefix are what this adds to ``partition_along_orders``
    on wide DAGs (NASNet cells). O(moves x width x degree); each move updates one boundary's
    bytes incrementally.
    """
    g = problem.graph
    k = problem.num_stages
    if k < 2:
        return partition
    n = g.num_layers
    spb = problem.seconds_per_byte_ms
    cap = problem.memory_cap_bytes * (1 + _TOLERANCE)
    stage_of = np.empty(n, dtype=int)
    for j, layers in enumerate(partition.stages):
        stage_of[list(layers)] = j
    succ = [list(g.graph.successors(v)) for v in range(n)]
    pred = [list(g.graph.predecessors(v)) for v in range(n)]
    compute = g.compute_ms
    forward = g.forward_ms
    members = [set(layers) for layers in partition.stages]
    bnd = list(partition.boundary_bytes)

    def crosses(u, j, where):
        """Whether u's output crosses boundary j (after stage j) under the assignment ``where``."""
        return where(u) <= j and any(where(w) > j for w in succ[u])

    def load(j, layers):
        idx = list(layers)
        total = float(compute[idx].sum())
        if problem.recompute[j]:
            total += float(forward[idx].sum())
        return total

    def memory(j, layers, in_bytes):
        return stage_memory_bytes(problem, j, list(layers), in_bytes)

    loads = [load(j, members[j]) for j in range(k)]

    def time(j, load_j, b_in, b_out):
        return load_j + (b_in + b_out) * spb

    def times():
        return [time(j, loads[j], bnd[j - 1] if j else 0, bnd[j] if j < k - 1 else 0) for j in range(k)]

    for _ in range(max_moves):
        current = times()
        b = max(range(k), key=lambda j: (current[j], -j))
        best_move = None
        for v in sorted(members[b]):
            if len(members[b]) == 1:
                break
            for target in (b - 1, b + 1):
                if not 0 <= target < k:
                    continue
                if target < b and any(stage_of[u] >= b for u in pred[v]):
                    continue
                if target > b and any(stage_of[w] <= b for w in succ[v]):
                    continue
                edge = min(b, target)  # the boundary between the two stages
                where = lambda x: target if x == v else stage_of[x]
                delta = 0.0
                for u in [v, *pred[v]]:
                    before = stage_of[u] <= edge and any(stage_of[w] > edge for w in succ[u])
                    after = crosses(u, edge, where)
                    delta += (int(after) - int(before)) * g.output_bytes[u]
                new_bnd = bnd[edge] + delta
                c_v = compute[v] + (forward[v] if problem.recompute[b] else 0.0)
                c_t = compute[v] + (forward[v] if problem.recompute[target] else 0.0)
                lo, hi = (b, target) if b < target else (target, b)
                new_loads = {b: loads[b] - c_v, target: loads[target] + c_t}
                t_lo = time(lo, new_loads[lo], bnd[lo - 1] if lo else 0, new_bnd)
                t_hi = time(hi, new_loads[hi], new_bnd, bnd[hi] if hi < k - 1 else 0)
                worst = max(t_lo, t_hi)
                if worst >= current[b] - 1e-12:
                    continue
                if math.isfinite(cap):
                    m_b = members[b] - {v}
                    m_t = members[target] | {v}
                    sets = {b: m_b, target: m_t}
                    ok = True
                    for j in (lo, hi):
                        in_b = new_bnd if j == hi else (bnd[j - 1] if j else 0)
                        if memory(j, sets[j], in_b) > cap:
                            ok = False
                    if not ok:
                        continue
                key = (worst, v, target)
                if best_move is None or key < best_move[0]:
                    best_move = (key, v, target, edge, new_bnd, new_loads)
        if best_move is None:
            break
        _, v, target, edge, new_bnd, new_loads = best_move
        members[stage_of[v]].discard(v)
        members[target].add(v)
        for j, value in new_loads.items():
            loads[j] = value
        stage_of[v] = target
        bnd[edge] = new_bnd
    stages = [tuple(sorted(m)) for m in members]
    refined = evaluate_split(problem, stages, method=partition.method, optimal=partition.optimal,
                             lower_bound_ms=partition.lower_bound_ms)
    if refined.bottleneck_ms <= partition.bottleneck_ms and split_fits(problem, refined):
        return refined
    return partition


def partition_brute_force(problem: PartitionProblem) -> Partition:
    """Try every monotone stage assignment (tests only: exponential)."""
    g = problem.graph
    n, k = g.num_layers, problem.num_stages
    best = None
    for assignment in itertools.product(range(k), repeat=n):
        if len(set(assignment)) != k:
            continue
        if any(assignment[u] > assignment[v] for u, v in g.graph.edges()):
            continue
        stages = [tuple(v for v in range(n) if assignment[v] == j) for j in range(k)]
        candidate = evaluate_split(problem, stages, method="brute-force", optimal=True)
        if not split_fits(problem, candidate):
            continue
        if best is None or candidate.bottleneck_ms < best.bottleneck_ms - 1e-12:
            best = candidate
    if best is None:
        raise InfeasibleError("no split into the requested stages fits the memory cap")
    return best
