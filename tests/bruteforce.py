"""Brute-force oracles for the exact solvers (exponential: tiny problems only)."""

from __future__ import annotations

import itertools

from pipeplan.errors import InfeasibleError
from pipeplan.plan import Partition, PartitionProblem, evaluate_split, split_fits


def partition_brute_force(problem: PartitionProblem) -> Partition:
    """Try every monotone stage assignment and keep the smallest bottleneck that fits."""
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
