"""The partition problem as an integer linear program (PuLP; HiGHS, CBC as fallback).

Variables ``y[v, s] = 1`` when layer ``v`` is in stage ``s`` or earlier; monotone in ``s`` and
along edges (``y[v, s] <= y[u, s]`` for an edge ``u -> v``), so each stage is the difference of
two ideals. ``z[u, s] = 1`` when ``u``'s output crosses boundary ``s``. The bottleneck ``T``
bounds every stage's compute plus transfers; memory is linear per stage.

Before solving, each layer's possible stages are narrowed with an upper bound ``U`` (any
feasible split, e.g. the best split along the profile's topological order): a layer whose
ancestors' compute exceeds ``(s + 1) U`` cannot sit in stage ``s`` or earlier, and likewise for
descendants. On the PipeDream graphs this fixes most variables and turns minutes into seconds.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import networkx as nx
import numpy as np

from pipeplan.errors import InfeasibleError
from pipeplan.plan.partition import Partition, PartitionProblem, evaluate_split, trivial_lower_bound_ms


@contextlib.contextmanager
def _quiet_stdout():
    """Silence the solver's banner, which highspy prints to file descriptor 1 at start-up."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)

__all__ = ["partition_ilp", "count_binaries", "ILP_TIME_LIMIT_SECONDS", "ILP_RELATIVE_GAP", "ILP_AUTO_MAX_BINARIES"]

#: Wall-clock limit per solve; past it the best split found is returned with optimal=False.
ILP_TIME_LIMIT_SECONDS = 120.0
#: Relative optimality gap asked of the solver (HiGHS' default is 1e-4).
ILP_RELATIVE_GAP = 1e-7


#: ``--solver auto`` runs the ILP only below this many free binaries (after narrowing): above
#: it HiGHS' root alone can take minutes (NASNet), and the split along several orders is kept.
ILP_AUTO_MAX_BINARIES = 1000
#: ... and only on graphs of at most this many layers (NASNet's 900+ stall even when narrowed).
ILP_AUTO_MAX_LAYERS = 500


def count_binaries(problem: PartitionProblem, upper_bound: Partition) -> int:
    """Free ``y`` variables once stage windows are narrowed by ``upper_bound``."""
    if problem.graph.num_layers > ILP_AUTO_MAX_LAYERS:
        return 10**9
    lo, hi = _stage_windows(problem, upper_bound.bottleneck_ms)
    return int(np.maximum(hi - lo, 0).sum())


def _stage_windows(problem: PartitionProblem, upper_bound_ms: float | None):
    g = problem.graph
    n, k = g.num_layers, problem.num_stages
    lo = np.zeros(n, dtype=int)
    hi = np.full(n, k - 1, dtype=int)
    if upper_bound_ms is None or not math.isfinite(upper_bound_ms) or upper_bound_ms <= 0:
        return lo, hi
    compute = g.compute_ms
    bound = upper_bound_ms * (1 + 1e-9)
    for v in range(n):
        before = compute[v] + compute[list(nx.ancestors(g.graph, v))].sum()
        after = compute[v] + compute[list(nx.descendants(g.graph, v))].sum()
        lo[v] = max(0, math.ceil(before / bound - 1e-12) - 1)
        hi[v] = min(k - 1, k - math.ceil(after / bound - 1e-12))
    return lo, hi


def partition_ilp(
    problem: PartitionProblem,
    upper_bound: Partition | None = None,
    time_limit_seconds: float = ILP_TIME_LIMIT_SECONDS,
    solver: str = "auto",
) -> Partition:
    """Solve the partition problem exactly with an ILP solver.

    Parameters
    ----------
    problem : PartitionProblem
    upper_bound : Partition, optional
        A feasible split; its bottleneck narrows each layer's stage window and is returned
        if the solver finds nothing better in time.
    time_limit_seconds : float
    solver : {"auto", "highs", "cbc"}

    Returns
    -------
    Partition
        ``optimal`` is True only when the solver proved optimality (within ``ILP_RELATIVE_GAP``).

    Raises
    ------
    InfeasibleError
        If the solver proves no split fits the memory cap.
    """
    import pulp

    g = problem.graph
    n, k = g.num_layers, problem.num_stages
    spb = problem.seconds_per_byte_ms
    lo, hi = _stage_windows(problem, upper_bound.bottleneck_ms if upper_bound else None)
    if (lo > hi).any():
        # The bound is tighter than any split allows: it is optimal as it stands.
        return upper_bound

    prob = pulp.LpProblem("pipeline_partition", pulp.LpMinimize)
    ub = upper_bound.bottleneck_ms * (1 + 1e-9) if upper_bound else None
    bottleneck = pulp.LpVariable("bottleneck_ms", lowBound=0, upBound=ub)
    y: dict[tuple[int, int], pulp.LpVariable] = {}

    def Y(v: int, s: int):
        """1 when layer v is in stage s or earlier."""
        if s < 0 or s < lo[v]:
            return 0
        if s >= hi[v]:
            return 1
        key = (v, s)
        if key not in y:
            y[key] = pulp.LpVariable(f"y_{v}_{s}", cat="Binary")
        return y[key]

    def add(constraint):
        if not isinstance(constraint, bool):
            prob.addConstraint(constraint)

    for v in range(n):
        for s in range(lo[v], hi[v] - 1):
            add(Y(v, s) <= Y(v, s + 1))
    for u, v in g.graph.edges():
        for s in range(min(lo[v], lo[u]), max(hi[u], hi[v])):
            a, b = Y(v, s), Y(u, s)
            if isinstance(a, int) and isinstance(b, int):
                continue
            add(a <= b)

    # Boundary bytes: z[u, s] >= y[u, s] - y[v, s] for each consumer v of u.
    crossing = []
    for s in range(k - 1):
        terms = []
        if spb > 0 or any(problem.recompute):
            for u in range(n):
                succ = list(g.graph.successors(u))
                if not succ or g.output_bytes[u] == 0:
                    continue
                exprs = [Y(u, s) - Y(v, s) for v in succ]
                if all(isinstance(e, int) and e <= 0 for e in exprs):
                    continue
                z = pulp.LpVariable(f"z_{u}_{s}", lowBound=0, upBound=1)
                for e in exprs:
                    if not (isinstance(e, int) and e <= 0):
                        add(z >= e)
                terms.append(float(g.output_bytes[u]) * z)
        crossing.append(pulp.lpSum(terms))

    cap = problem.memory_cap_bytes
    for s in range(k):
        members = [v for v in range(n) if lo[v] <= s <= hi[v]]
        share = {v: Y(v, s) - Y(v, s - 1) for v in members}
        compute = pulp.lpSum(float(g.compute_ms[v]) * share[v] for v in members)
        if problem.recompute[s]:
            compute += pulp.lpSum(float(g.forward_ms[v]) * share[v] for v in members)
        transfer = 0
        if spb > 0:
            if s > 0:
                transfer += spb * crossing[s - 1]
            if s < k - 1:
                transfer += spb * crossing[s]
        add(compute + transfer <= bottleneck)
        add(pulp.lpSum(share.values()) >= 1)
        if math.isfinite(cap):
            static = pulp.lpSum(
                problem.static_bytes_per_param_byte * float(g.param_bytes[v]) * share[v] for v in members
            )
            acts = pulp.lpSum(float(g.activation_bytes[v]) * share[v] for v in members)
            if problem.recompute[s]:
                held = acts + (problem.in_flight[s] * crossing[s - 1] if s > 0 else 0)
            else:
                held = problem.in_flight[s] * acts
            add(static + held <= cap)
    prob += bottleneck

    backends = []
    if solver in ("auto", "highs"):
        backends.append(("ilp-highs", lambda: pulp.HiGHS(
            msg=False, timeLimit=time_limit_seconds, gapRel=ILP_RELATIVE_GAP, threads=1,
            random_seed=0)))
    if solver in ("auto", "cbc"):
        backends.append(("ilp-cbc", lambda: pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_seconds, gapRel=ILP_RELATIVE_GAP, threads=1)))
    last_error = None
    for name, make in backends:
        try:
            backend = make()
            if not backend.available():
                continue
            with _quiet_stdout():
                prob.solve(backend)
        except Exception as exc:
            # A solver that ran but ended oddly (pulp cannot map every HiGHS status) keeps
            # the seed; only a backend that cannot run at all falls through to the next.
            last_error = exc
            if upper_bound is not None and name == "ilp-highs" and getattr(prob, "solverModel", None) is not None:
                return Partition(**{**upper_bound.__dict__, "optimal": False})
            continue
        status = pulp.LpStatus[prob.status]
        if status == "Infeasible":
            raise InfeasibleError("no split into the requested stages fits the memory cap")
        if status not in ("Optimal",) or bottleneck.varValue is None:
            if upper_bound is not None:
                return upper_bound
            raise InfeasibleError("the ILP solver found no split within its time limit")
        optimal = prob.sol_status == pulp.LpSolutionOptimal
        bound = None
        try:
            bound = float(prob.solverModel.getInfo().mip_dual_bound)
        except Exception:  # CBC, or an older highspy: fall back to the trivial bound
            pass
        stage_of = np.zeros(n, dtype=int)
        for v in range(n):
            for s in range(k):
                value = Y(v, s)
                value = value if isinstance(value, int) else round(value.varValue or 0.0)
                if value >= 1:
                    stage_of[v] = s
                    break
        stages = [tuple(int(v) for v in np.flatnonzero(stage_of == s)) for s in range(k)]
        lower = max(trivial_lower_bound_ms(problem), bound or 0.0)
        found = evaluate_split(problem, stages, method=name, optimal=optimal, lower_bound_ms=lower)
        if upper_bound is not None and upper_bound.bottleneck_ms < found.bottleneck_ms:
            return Partition(**{**upper_bound.__dict__, "method": name, "optimal": optimal,
                                "lower_bound_ms": upper_bound.bottleneck_ms if optimal else lower})
        return found
    raise RuntimeError(f"no ILP backend available ({last_error})")
