"""Splits of a DAG along a few topological orders, then refined by single-layer moves.

The upper bound the ILP starts from, and the split kept where the ILP is too large to prove
(NASNet cells). Both steps cost stages with :class:`pipeplan.plan.costmodel.CostModel`.
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from pipeplan.errors import InfeasibleError
from pipeplan.plan.chain import partition_chain
from pipeplan.plan.costmodel import layer_sums
from pipeplan.plan.graph import reorder
from pipeplan.plan.problem import Partition, PartitionProblem, evaluate_split, split_fits, trivial_lower_bound_ms

__all__ = ["topological_orders", "partition_along_orders", "refine_split"]


def topological_orders(graph: nx.DiGraph):
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

    Returns
    -------
    Partition
        ``method`` is ``dp-orders``; on a DAG refined by :func:`refine_split`, with the
        trivial lower bound.

    Raises
    ------
    InfeasibleError
        If no order admits a split within the memory cap.
    """
    best = None
    seen = set()
    for order in topological_orders(problem.graph.graph):
        if len(order) != problem.graph.num_layers:
            continue
        key = tuple(order)
        if key in seen:
            continue
        seen.add(key)
        reordered = problem.replace(graph=reorder(problem.graph, order))
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
    bytes and two stages' loads (the cost model's split-independent time, linear in the
    layers) incrementally.
    """
    if problem.num_stages < 2:
        return partition
    descent = _Descent(problem, partition)
    for _ in range(max_moves):
        if not descent.step():
            break
    stages = [tuple(sorted(m)) for m in descent.members]
    refined = evaluate_split(problem, stages, method=partition.method, optimal=partition.optimal,
                             lower_bound_ms=partition.lower_bound_ms)
    if refined.bottleneck_ms <= partition.bottleneck_ms and split_fits(problem, refined):
        return refined
    return partition


class _Descent:
    """The state of :func:`refine_split`'s descent: each layer's stage, the stages' members and
    split-independent loads, the boundaries' bytes; :meth:`step` takes the best single move."""

    def __init__(self, problem: PartitionProblem, partition: Partition):
        g = self.g = problem.graph
        self.problem, self.k, self.cost = problem, problem.num_stages, problem.cost
        self.cap = problem.cap_with_tolerance
        n = g.num_layers
        self.stage_of = np.empty(n, dtype=int)
        for j, layers in enumerate(partition.stages):
            self.stage_of[list(layers)] = j
        self.succ = [list(g.graph.successors(v)) for v in range(n)]
        self.pred = [list(g.graph.predecessors(v)) for v in range(n)]
        self.members = [set(layers) for layers in partition.stages]
        self.bnd = list(partition.boundary_bytes)
        self.loads = [self.load(j, self.members[j]) for j in range(self.k)]

    def crosses(self, u, j, where):
        """Whether u's output crosses boundary j (after stage j) under the assignment ``where``."""
        return where(u) <= j and any(where(w) > j for w in self.succ[u])

    def load(self, j, layers):
        return self.cost.load_ms(layer_sums(self.g, layers), self.problem.recompute[j])

    def memory(self, j, layers, in_bytes):
        return self.cost.stage_memory_bytes(layer_sums(self.g, list(layers)), in_bytes, self.problem.in_flight[j],
                                            self.problem.recompute[j])

    def time(self, load_j, b_in, b_out):
        return load_j + self.cost.transfer_ms(b_in, b_out)

    def times(self):
        k, bnd = self.k, self.bnd
        return [self.time(self.loads[j], bnd[j - 1] if j else 0, bnd[j] if j < k - 1 else 0) for j in range(k)]

    def step(self) -> bool:
        """Take the best move off the slowest stage; False when no move lowers the bottleneck."""
        current = self.times()
        b = max(range(self.k), key=lambda j: (current[j], -j))
        best_move = None
        for v in sorted(self.members[b]):
            if len(self.members[b]) == 1:
                break
            for target in (b - 1, b + 1):
                move = self.move(v, b, target, current)
                if move is not None and (best_move is None or move[0] < best_move[0]):
                    best_move = move
        if best_move is None:
            return False
        _, v, target, edge, new_bnd, new_loads = best_move
        self.members[self.stage_of[v]].discard(v)
        self.members[target].add(v)
        for j, value in new_loads.items():
            self.loads[j] = value
        self.stage_of[v] = target
        self.bnd[edge] = new_bnd
        return True

    def move(self, v, b, target, current):
        """Layer v from stage b to target: (key, v, target, boundary, its bytes, the two loads),
        or None if the move breaks the order, does not lower the larger time, or goes over the cap."""
        if not 0 <= target < self.k:
            return None
        if target < b and any(self.stage_of[u] >= b for u in self.pred[v]):
            return None
        if target > b and any(self.stage_of[w] <= b for w in self.succ[v]):
            return None
        edge = min(b, target)  # the boundary between the two stages
        where = lambda x: target if x == v else self.stage_of[x]
        delta = 0.0
        for u in [v, *self.pred[v]]:
            before = self.stage_of[u] <= edge and any(self.stage_of[w] > edge for w in self.succ[u])
            after = self.crosses(u, edge, where)
            delta += (int(after) - int(before)) * self.g.output_bytes[u]
        new_bnd = self.bnd[edge] + delta
        c_v = self.load(b, [v])
        c_t = self.load(target, [v])
        lo, hi = (b, target) if b < target else (target, b)
        new_loads = {b: self.loads[b] - c_v, target: self.loads[target] + c_t}
        t_lo = self.time(new_loads[lo], self.bnd[lo - 1] if lo else 0, new_bnd)
        t_hi = self.time(new_loads[hi], new_bnd, self.bnd[hi] if hi < self.k - 1 else 0)
        worst = max(t_lo, t_hi)
        if worst >= current[b] - 1e-12:
            return None
        if self.cap < float("inf"):
            m_b = self.members[b] - {v}
            m_t = self.members[target] | {v}
            sets = {b: m_b, target: m_t}
            ok = True
            for j in (lo, hi):
                in_b = new_bnd if j == hi else (self.bnd[j - 1] if j else 0)
                if self.memory(j, sets[j], in_b) > self.cap:
                    ok = False
            if not ok:
                return None
        return (worst, v, target), v, target, edge, new_bnd, new_loads


