"""Exact splits of a DAG: dynamic programming over its lattice of ideals.

An ideal is a down-closed layer set; a split into ``k`` stages is a chain of ``k + 1``
ideals from the empty set to all layers. The DP visits each pair of nested ideals once per
stage, so it suits graphs with few ideals (residual networks: a few hundred), not wide cells
(Inception, NASNet: 10^5 and more), where :mod:`pipeplan.plan.ilp` is used.
"""

from __future__ import annotations

import math

import networkx as nx
import numpy as np

from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.plan.costmodel import LARGEST_OF, TIED, LayerSums, tied_copy_bytes
from pipeplan.plan.problem import Partition, PartitionProblem, evaluate_split

__all__ = ["enumerate_ideals", "count_ideals", "partition_ideals", "IDEALS_DP_MAX_IDEALS"]

#: The ideal-lattice DP is quadratic in the number of ideals; beyond this use the ILP.
IDEALS_DP_MAX_IDEALS = 3000


def enumerate_ideals(graph: nx.DiGraph, limit: int | None = None) -> list[frozenset]:
    """Every down-closed node set of a DAG (ideals), smallest first.

    Raises
    ------
    BadInputError
        If there are more than ``limit``.

    Examples
    --------
    >>> [sorted(i) for i in enumerate_ideals(nx.DiGraph([(0, 1), (0, 2)]))]
    [[], [0], [0, 1], [0, 2], [0, 1, 2]]

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


def count_ideals(graph: nx.DiGraph, limit: int) -> int:
    """The number of ideals, counting at most ``limit + 1``."""
    count = 0
    for _ in nx.antichains(graph):
        count += 1
        if count > limit:
            break
    return count


def partition_ideals(problem: PartitionProblem) -> Partition:
    """Exact DP over the ideal lattice of a DAG (any graph, few ideals).

    Returns
    -------
    Partition
        ``method`` is ``dp-ideals``, ``optimal`` True.

    Raises
    ------
    InfeasibleError
        If no split fits the memory cap.
    BadInputError
        If the graph has more than :data:`IDEALS_DP_MAX_IDEALS` ideals.

    Notes
    -----
    O(k N^2) for N ideals. Stage ``(ideal i) - (ideal j)`` is costed by the cost model on the
    differences of the ideals' sums, for every ``j`` at once.
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
    totals: dict[str, np.ndarray] = {}

    def total(name):
        if name not in totals:
            totals[name] = member @ getattr(g, name)
        return totals[name]

    def tied(i):
        # The tied copies held by ideal i minus each ideal.
        held = member.astype(bool)
        return tied_copy_bytes(g, lambda v: held[i, v] & ~held[:, v])

    def largest(i, name):
        # The largest layer of ideal i minus each ideal (the maxima among the sums).
        inside = member[i].astype(bool)[None, :] & ~member.astype(bool)
        return np.where(inside, getattr(g, LARGEST_OF[name])[None, :], 0.0).max(axis=1)

    bnd = np.array([g.boundary_bytes(member[i].astype(bool)) for i in range(count)], dtype=float)
    full = count - 1
    cost = problem.cost
    cap = problem.cap_with_tolerance
    inf = math.inf
    best = np.full((k, count), inf)
    arg = np.zeros((k, count), dtype=int)
    for j in range(k):
        prev = np.full(count, inf)
        if j == 0:
            prev[0] = 0.0
        else:
            prev = best[j - 1]
        mode = problem.recompute[j]
        for i in range(count):
            sub = contains[i]
            # Every stage ending at ideal i: ideal i minus each ideal j (valid where sub[j]).
            sums = LayerSums(lambda name, i=i: largest(i, name) if name in LARGEST_OF else tied(i) if name == TIED
                             else total(name)[i] - total(name))
            time = cost.stage_time_ms(sums, bnd, bnd[i], mode)
            memory = cost.stage_memory_bytes(sums, bnd, problem.in_flight[j], mode)
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
