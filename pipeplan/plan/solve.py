"""Solver dispatch: the exact solver that fits the graph, and the fast one the search uses.

- a chain: :func:`pipeplan.plan.chain.partition_chain` (``dp-chain-direct`` / ``-bisect``);
- a DAG with few ideals: :func:`pipeplan.plan.ideals.partition_ideals` (``dp-ideals``);
- otherwise the ILP (:mod:`pipeplan.plan.ilp`) seeded with the best split along a few
  topological orders (:mod:`pipeplan.plan.orders`), or that split itself (``dp-orders``) when
  the ILP is too large to prove in seconds.
"""

from __future__ import annotations

from pipeplan.errors import InfeasibleError
from pipeplan.plan.chain import partition_chain
from pipeplan.plan.ideals import IDEALS_DP_MAX_IDEALS, count_ideals, partition_ideals
from pipeplan.plan.orders import partition_along_orders
from pipeplan.plan.problem import Partition, PartitionProblem
from pipeplan.plan.ilp import ILP_AUTO_MAX_BINARIES, count_binaries, partition_ilp
from pipeplan.plan.memo import memoised

__all__ = ["solve_partition", "search_partition"]


def solve_partition(problem: PartitionProblem, solver: str = "auto") -> Partition:
    """The exact split of ``problem``.

    Parameters
    ----------
    problem : PartitionProblem
    solver : {"auto", "dp", "ilp"}
        ``dp`` forces the chain or ideal DP, ``ilp`` the ILP (on DAGs and chains).

    Returns
    -------
    Partition
        Marked optimal whenever its bottleneck meets a proven lower bound, whatever found it.

    Raises
    ------
    InfeasibleError
        If nothing fits the memory cap.
    """
    found = _solve(problem, solver)
    if not found.optimal and found.lower_bound_ms is not None and found.bottleneck_ms <= found.lower_bound_ms * (1 + 1e-9):
        # The split meets a proven lower bound, so it is optimal whatever found it.
        found = found.replace(optimal=True)
    return found


def _solve(problem: PartitionProblem, solver: str) -> Partition:
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


def search_partition(problem: PartitionProblem) -> Partition | None:
    """The split used while searching: the optimal split along the profile's layer order.

    Exact for chains; for DAGs a split into prefixes of the topological order (costed
    exactly), and the search's winner is solved again exactly (:func:`solve_partition`).
    None when nothing fits. Remembered inside :func:`pipeplan.plan.memo.planning_cache`.
    """
    def solve():
        try:
            return partition_chain(problem)
        except InfeasibleError:
            return None

    key = (id(problem.graph), problem.num_stages, problem.in_flight, problem.recompute, problem.cost,
           problem.memory_cap_bytes)
    return memoised("search_partition", key, (problem.graph,), solve)
