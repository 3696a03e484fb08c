"""The partition problem as an integer linear program (PuLP; HiGHS, CBC as fallback).

Variables ``y[v, s] = 1`` when layer ``v`` is in stage ``s`` or earlier; monotone in ``s`` and
along edges (``y[v, s] <= y[u, s]`` for an edge ``u -> v``), so each stage is the difference of
two ideals. ``z[u, s] = 1`` when ``u``'s output crosses boundary ``s``. The bottleneck ``T``
bounds every stage's time; memory is linear per stage. Both are the cost model's terms
(:class:`pipeplan.plan.costmodel.CostModel`) evaluated on linear expressions: each stage's
layer sums are sums of its layers' shares ``y[v, s] - y[v, s - 1]``, its boundary bytes sums
of ``z``.

A solve that fails (the backend raises, or stops without a solution) keeps the upper bound
split when one was given and says so in the result's ``notes`` (and so in the plan's notes
and ``solver.failure``); without one it raises :class:`SolverError`.

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

from pipeplan.errors import InfeasibleError, PipeplanError
from pipeplan.plan.costmodel import LARGEST_OF, TIED, LayerSums
from pipeplan.plan.problem import Partition, PartitionProblem, evaluate_split, trivial_lower_bound_ms


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

__all__ = ["partition_ilp", "count_binaries", "SolverError", "ILP_TIME_LIMIT_SECONDS", "ILP_RELATIVE_GAP",
           "ILP_AUTO_MAX_BINARIES", "ILP_AUTO_MAX_LAYERS"]


class SolverError(PipeplanError):
    """The ILP solver could not run or ended without a split, and there was no split to fall back on."""

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
        if the solver finds nothing better in time, or fails (with a note saying so).
    time_limit_seconds : float
    solver : {"auto", "highs", "cbc"}
        ``cbc`` needs PuLP's ``COIN_CMD`` (``pip install pulp[cbc]``).

    Returns
    -------
    Partition
        ``method`` is ``ilp-highs`` or ``ilp-cbc``; ``optimal`` is True only when the solver
        proved optimality (within ``ILP_RELATIVE_GAP``). A kept upper bound carries a note.

    Raises
    ------
    InfeasibleError
        If the solver proves no split fits the memory cap.
    SolverError
        If no backend runs, or the solve fails, and there is no upper bound to keep.
    """
    import pulp

    lo, hi = _stage_windows(problem, upper_bound.bottleneck_ms if upper_bound else None)
    if (lo > hi).any():
        # The bound is tighter than any split allows: it is optimal as it stands.
        return upper_bound
    model = _Model(problem, lo, hi, upper_bound)
    crossing = model.boundary_bytes()
    for s in range(problem.num_stages):
        model.stage_rows(s, crossing)
    model.prob += model.bottleneck

    failures = []
    for name, make in _backends(solver, time_limit_seconds):
        backend = make()
        if not backend.available():
            failures.append(f"{name}: not installed")
            continue
        try:
            with _quiet_stdout():
                model.prob.solve(backend)
        except (pulp.PulpSolverError, KeyError) as exc:
            # The backend failed to run, or ended with a status pulp cannot map (KeyError).
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            break
        status = pulp.LpStatus[model.prob.status]
        if status == "Infeasible":
            raise InfeasibleError("no split into the requested stages fits the memory cap")
        if status != "Optimal" or model.bottleneck.varValue is None:
            failures.append(f"{name}: stopped with status {status!r} and no split "
                            f"(time limit {time_limit_seconds:g} s)")
            break
        return model.solution(name, upper_bound)
    reason = "; ".join(failures) or f"no ILP backend for solver {solver!r}"
    if upper_bound is None:
        raise SolverError(f"the ILP solve failed ({reason}); install highspy, or use --solver dp")
    note = (f"the ILP solve failed ({reason}); kept the best split along the layer orders "
            f"({upper_bound.method}), not proven optimal")
    return upper_bound.replace(optimal=False, notes=upper_bound.notes + (note,))


class _Model:
    """The ILP of one partition problem: ``Y(v, s)`` is 1 when layer ``v`` is in stage ``s`` or
    earlier (a constant outside the layer's stage window), the order and edge rows, the boundary
    bytes, and per stage the cost model's time and memory rows over the layer shares."""

    def __init__(self, problem: PartitionProblem, lo, hi, upper_bound: Partition | None):
        import pulp

        self.problem, self.lo, self.hi = problem, lo, hi
        self.prob = pulp.LpProblem("pipeline_partition", pulp.LpMinimize)
        ub = upper_bound.bottleneck_ms * (1 + 1e-9) if upper_bound else None
        self.bottleneck = self.prob.add_variable("bottleneck_ms", lowBound=0, upBound=ub)
        self.y: dict = {}
        g = problem.graph
        for v in range(g.num_layers):
            for s in range(lo[v], hi[v] - 1):
                self.add(self.Y(v, s) <= self.Y(v, s + 1))
        for u, v in g.graph.edges():
            for s in range(min(lo[v], lo[u]), max(hi[u], hi[v])):
                a, b = self.Y(v, s), self.Y(u, s)
                if isinstance(a, int) and isinstance(b, int):
                    continue
                self.add(a <= b)

    def Y(self, v: int, s: int):
        """1 when layer v is in stage s or earlier."""
        if s < 0 or s < self.lo[v]:
            return 0
        if s >= self.hi[v]:
            return 1
        key = (v, s)
        if key not in self.y:
            self.y[key] = self.prob.add_variable(f"y_{v}_{s}", cat="Binary")
        return self.y[key]

    def add(self, constraint) -> None:
        if not isinstance(constraint, bool):
            self.prob.addConstraint(constraint)

    def boundary_bytes(self) -> list:
        """Per boundary, the bytes crossing it: z[u, s] >= y[u, s] - y[v, s] for each consumer v of u."""
        import pulp

        problem, g = self.problem, self.problem.graph
        crossing = []
        for s in range(problem.num_stages - 1):
            terms = []
            if problem.cost.needs_boundary_bytes(problem.recompute):
                for u in range(g.num_layers):
                    succ = list(g.graph.successors(u))
                    if not succ or g.output_bytes[u] == 0:
                        continue
                    exprs = [self.Y(u, s) - self.Y(v, s) for v in succ]
                    if all(isinstance(e, int) and e <= 0 for e in exprs):
                        continue
                    z = self.prob.add_variable(f"z_{u}_{s}", lowBound=0, upBound=1)
                    for e in exprs:
                        if not (isinstance(e, int) and e <= 0):
                            self.add(z >= e)
                    terms.append(float(g.output_bytes[u]) * z)
            crossing.append(pulp.lpSum(terms))
        return crossing

    def stage_rows(self, s: int, crossing: list) -> None:
        """Stage ``s``'s time row (under the bottleneck), its at-least-one-layer row and its
        memory row, the cost model's own terms over the stage's layer shares."""
        import pulp

        problem, g, prob = self.problem, self.problem.graph, self.prob
        cost, k = problem.cost, problem.num_stages
        members = [v for v in range(g.num_layers) if self.lo[v] <= s <= self.hi[v]]
        share = {v: self.Y(v, s) - self.Y(v, s - 1) for v in members}

        def stage_sum(name):
            if name in LARGEST_OF:
                # The stage's largest layer: a variable at least each member's, which the memory
                # row (its only use, with a positive coefficient) keeps at the maximum.
                values = getattr(g, LARGEST_OF[name])
                largest = prob.add_variable(f"{name}_{s}", lowBound=0)
                for v in members:
                    if values[v] > 0:
                        self.add(largest >= float(values[v]) * share[v])
                return largest
            if name == TIED:
                # Per tied weight, a share at least each later user's minus the first's (0 or 1 at
                # the binary shares), which the memory row keeps at its least.
                copies = []
                for index, (first, others, size) in enumerate(g.tied_weights):
                    users = [v for v in others if v in share]
                    if not users or size <= 0:
                        continue
                    copy = prob.add_variable(f"tied_{index}_{s}", lowBound=0, upBound=1)
                    for v in users:
                        self.add(copy >= share[v] - share.get(first, 0))
                    copies.append(float(size) * copy)
                return pulp.lpSum(copies)
            return pulp.lpSum(float(getattr(g, name)[v]) * share[v] for v in members)

        sums = LayerSums(stage_sum)
        in_bytes = crossing[s - 1] if s > 0 else 0
        out_bytes = crossing[s] if s < k - 1 else 0
        mode = problem.recompute[s]
        if cost.ms_per_byte > 0:
            time = cost.stage_time_ms(sums, in_bytes, out_bytes, mode)
        else:  # no zero-coefficient boundary terms in the rows
            time = cost.load_ms(sums, mode)
        self.add(time <= self.bottleneck)
        self.add(pulp.lpSum(share.values()) >= 1)
        if math.isfinite(problem.memory_cap_bytes):
            self.add(cost.stage_memory_bytes(sums, in_bytes, problem.in_flight[s], mode) <= problem.memory_cap_bytes)

    def solution(self, name: str, upper_bound: Partition | None) -> Partition:
        """The solved split, evaluated by the cost model (the upper bound where it is no worse)."""
        import pulp

        problem, prob = self.problem, self.prob
        n, k = problem.graph.num_layers, problem.num_stages
        optimal = prob.sol_status == pulp.LpSolutionOptimal
        bound = _dual_bound(prob)
        stage_of = np.zeros(n, dtype=int)
        for v in range(n):
            for s in range(k):
                value = self.Y(v, s)
                value = value if isinstance(value, int) else round(value.varValue or 0.0)
                if value >= 1:
                    stage_of[v] = s
                    break
        stages = [tuple(int(v) for v in np.flatnonzero(stage_of == s)) for s in range(k)]
        lower = max(trivial_lower_bound_ms(problem), bound or 0.0)
        found = evaluate_split(problem, stages, method=name, optimal=optimal, lower_bound_ms=lower)
        if upper_bound is not None and upper_bound.bottleneck_ms < found.bottleneck_ms:
            return upper_bound.replace(method=name, optimal=optimal,
                                       lower_bound_ms=upper_bound.bottleneck_ms if optimal else lower)
        return found


def _backends(solver: str, time_limit_seconds: float):
    import pulp

    if solver in ("auto", "highs"):
        yield "ilp-highs", lambda: pulp.HiGHS(msg=False, timeLimit=time_limit_seconds, gapRel=ILP_RELATIVE_GAP,
                                              threads=1, random_seed=0)
    if solver in ("auto", "cbc"):
        yield "ilp-cbc", lambda: pulp.COIN_CMD(msg=False, timeLimit=time_limit_seconds, gapRel=ILP_RELATIVE_GAP,
                                               threads=1)


def _dual_bound(prob) -> float | None:
    """HiGHS' proven bound on the objective; None for backends that report none (CBC)."""
    model = getattr(prob, "solverModel", None)
    if model is None or not hasattr(model, "getInfo"):
        return None
    return float(model.getInfo().mip_dual_bound)
