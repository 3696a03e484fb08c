"""The partition problem and a split's cost: what every solver takes in and gives back.

A split into ``k`` stages is a chain of ideals (down-closed layer sets)
``{} = I_0 < I_1 < ... < I_k = V``; stage ``j`` holds ``I_{j+1} - I_j`` and every edge goes to
the same or a later stage. The objective is the bottleneck, the largest stage time of
:meth:`pipeplan.plan.costmodel.CostModel.stage_time_ms`, subject to each stage's memory
(:meth:`~pipeplan.plan.costmodel.CostModel.stage_memory_bytes`) staying within the cap.

Functions here are pure: a :class:`PartitionProblem` in, a :class:`Partition` out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pipeplan.errors import BadInputError
from pipeplan.plan.costmodel import CostModel, StageBreakdown, layer_sums, recompute_mode
from pipeplan.plan.graph import LayerGraph
from pipeplan.plan.memo import memoised

__all__ = [
    "CAP_TOLERANCE",
    "PartitionProblem",
    "Partition",
    "build_problem",
    "evaluate_split",
    "split_fits",
    "stage_cost_at",
    "stage_fits",
    "stage_breakdowns",
    "stage_costs",
    "trivial_lower_bound_ms",
]

#: Relative slack on the memory cap, so that a split exactly at the cap fits despite rounding.
CAP_TOLERANCE = 1e-9


@dataclass(frozen=True)
class PartitionProblem:
    """What to split and under which rules."""

    graph: LayerGraph
    """The layer graph at one micro-batch size."""
    num_stages: int
    """Stages to split into, exactly; each gets at least one layer."""
    in_flight: tuple[int, ...]
    """Per stage, micro-batches whose activations it holds at its peak (schedule-dependent)."""
    recompute: tuple[str, ...] = ()
    """Per stage, its recompute mode (:data:`pipeplan.plan.costmodel.RECOMPUTE_MODES`; bools
    are read as ``"full"``/``"none"``). Empty: none."""
    cost: CostModel = CostModel()
    """Bandwidth, training state per parameter byte, the schedule's own time per action."""
    memory_cap_bytes: float = math.inf
    """Per-stage memory cap."""

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
        modes = tuple(recompute_mode(r) for r in self.recompute) or ("none",) * self.num_stages
        object.__setattr__(self, "recompute", modes)
        if len(self.recompute) != self.num_stages:
            raise ValueError("recompute needs one entry per stage")

    @property
    def any_recompute(self) -> bool:
        return any(mode != "none" for mode in self.recompute)

    @property
    def tied_copies_bind(self) -> bool:
        """Whether a stage's memory may hold a tied weight's copy under a finite cap: a stage with
        a later user of a tied weight but not its first keeps one, so its memory is not a
        difference of prefix sums (what the bisection's window test needs)."""
        return math.isfinite(self.memory_cap_bytes) and any(others for _, others, _ in self.graph.tied_weights)

    @property
    def cap_with_tolerance(self) -> float:
        """The cap the solvers test against."""
        return self.memory_cap_bytes * (1 + CAP_TOLERANCE)

    def replace(self, **changes) -> "PartitionProblem":
        """A copy with some fields changed."""
        return PartitionProblem(**{**self.__dict__, **changes})


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
    """How it was found: a value of :data:`pipeplan.formats.plan.SOLVER_METHODS`, or
    ``given`` / ``brute-force``."""
    optimal: bool
    """Whether the bottleneck is proven minimal."""
    boundary_bytes: tuple[int, ...] = field(default=())
    """Bytes crossing each of the ``k - 1`` boundaries per micro-batch."""
    lower_bound_ms: float | None = None
    """A proven lower bound on the optimal bottleneck (equal to it when optimal)."""
    notes: tuple[str, ...] = ()
    """What the solver wants the plan to say (e.g. an ILP solve that failed)."""

    def replace(self, **changes) -> "Partition":
        """A copy with some fields changed."""
        return Partition(**{**self.__dict__, **changes})


def build_problem(profile, graph: LayerGraph, settings, in_flight, recompute=(),
                  memory_cap_bytes: float | None = None) -> PartitionProblem:
    """The problem of splitting ``graph`` under ``settings`` (a PlanSettings) for one schedule's
    in-flight counts; ``memory_cap_bytes`` overrides the settings' cap."""
    if memory_cap_bytes is None:
        memory_cap_bytes = settings.cap_bytes()
    if "block" in recompute and not graph.chain:  # its sums are ranges of the layer order
        raise BadInputError("--recompute-method block: the profile's layers are not a chain; it is costed on chains only")
    return PartitionProblem(
        graph=graph,
        num_stages=len(in_flight),
        in_flight=tuple(in_flight),
        recompute=tuple(recompute),
        cost=CostModel.from_settings(settings, profile.dtype_bytes, graph),
        memory_cap_bytes=float(memory_cap_bytes),
    )


def trivial_lower_bound_ms(problem: PartitionProblem) -> float:
    """No split beats an even share of the compute, nor the costliest single layer."""
    compute = problem.graph.compute_ms
    return max(float(compute.sum()) / problem.num_stages, float(compute.max()))


def _boundary_bytes(problem: PartitionProblem, stages) -> list[int]:
    g = problem.graph
    k = problem.num_stages
    stage_of = np.full(g.num_layers, -1)
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
        return [int(g.output_bytes[max(stages[j])]) for j in range(k - 1)]
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
    delta = np.zeros(k + 1, dtype=np.int64)
    out = g.output_bytes.astype(np.int64)
    np.add.at(delta, stage_of[crossing], out[crossing])
    np.add.at(delta, last[crossing], -out[crossing])
    return [int(b) for b in np.cumsum(delta)[: k - 1]]


def _in_out(partition_boundaries, j: int, k: int):
    in_b = partition_boundaries[j - 1] if j > 0 else 0
    out_b = partition_boundaries[j] if j < k - 1 else 0
    return in_b, out_b


def evaluate_split(problem: PartitionProblem, stages, method: str = "given", optimal: bool = False,
                   lower_bound_ms: float | None = None) -> Partition:
    """Cost a given split with the cost model every solver uses.

    Raises
    ------
    ValueError
        If the split is not a valid chain of ideals into ``num_stages`` non-empty stages.
    """
    stages = tuple(tuple(int(v) for v in s) for s in stages)
    if len(stages) != problem.num_stages or any(not s for s in stages):
        raise ValueError("a split needs exactly num_stages non-empty stages")
    boundaries = _boundary_bytes(problem, stages)
    k = problem.num_stages
    cost = problem.cost
    times = []
    for j, layers in enumerate(stages):
        in_b, out_b = _in_out(boundaries, j, k)
        times.append(cost.stage_time_ms(layer_sums(problem.graph, layers), in_b, out_b, problem.recompute[j]))
    return Partition(
        stages=stages,
        stage_times_ms=tuple(times),
        bottleneck_ms=max(times),
        method=method,
        optimal=optimal,
        boundary_bytes=tuple(int(b) for b in boundaries),
        lower_bound_ms=max(times) if optimal else lower_bound_ms,
    )


def stage_breakdowns(problem: PartitionProblem, partition: Partition) -> list[StageBreakdown]:
    """Every stage of a split, costed in named parts (:class:`~pipeplan.plan.costmodel.StageBreakdown`)."""
    k = problem.num_stages
    out = []
    for j, layers in enumerate(partition.stages):
        in_b, out_b = _in_out(partition.boundary_bytes, j, k)
        out.append(problem.cost.breakdown(
            layer_sums(problem.graph, layers), index=j, layers=layers, in_bytes=in_b, out_bytes=out_b,
            in_flight=problem.in_flight[j], mode=problem.recompute[j], last=j == k - 1))
    return out


def stage_costs(problem: PartitionProblem, partition: Partition) -> list:
    """The simulator's :class:`~pipeplan.plan.simulate.StageCost` of each stage of a split
    (remembered inside :func:`pipeplan.plan.memo.planning_cache`)."""
    key = (id(problem.graph), problem.in_flight, problem.recompute, problem.cost, partition.stages,
           partition.boundary_bytes)
    costs = memoised("stage_costs", key, (problem.graph,), lambda: tuple(
        _stage_cost(problem, partition.boundary_bytes, j, layers) for j, layers in enumerate(partition.stages)))
    return list(costs)


def _stage_cost(problem: PartitionProblem, boundaries, j: int, layers):
    in_b, out_b = _in_out(boundaries, j, problem.num_stages)
    return stage_cost_at(problem, j, layers, in_b, out_b)


def stage_cost_at(problem: PartitionProblem, j: int, layers, in_bytes: float, out_bytes: float):
    """Stage ``j`` holding ``layers`` with ``in_bytes``/``out_bytes`` at its boundaries, as the
    simulator's :class:`~pipeplan.plan.simulate.StageCost` (the same stage, in-flight count and
    mode recur in many splits of one search, so it is remembered inside
    :func:`pipeplan.plan.memo.planning_cache`)."""
    k = problem.num_stages
    layers = tuple(layers)
    key = (id(problem.graph), problem.cost, layers, in_bytes, out_bytes, problem.in_flight[j],
           problem.recompute[j], j == k - 1)
    return memoised("stage_cost", key, (problem.graph,), lambda: problem.cost.breakdown(
        layer_sums(problem.graph, layers), index=j, layers=layers, in_bytes=in_bytes, out_bytes=out_bytes,
        in_flight=problem.in_flight[j], mode=problem.recompute[j], last=j == k - 1).stage_cost())


def stage_fits(problem: PartitionProblem, j: int, layers, in_bytes: float) -> bool:
    """Whether stage ``j`` holding ``layers`` (input ``in_bytes``) is within the per-stage cap:
    the rule :func:`split_fits` applies to every stage and the partitioners enforce."""
    memory = problem.cost.stage_memory_bytes(layer_sums(problem.graph, tuple(layers)), in_bytes,
                                             problem.in_flight[j], problem.recompute[j])
    return bool(memory <= problem.cap_with_tolerance)


def split_fits(problem: PartitionProblem, partition: Partition) -> bool:
    """Whether every stage of ``partition`` is within the memory cap."""
    k = problem.num_stages
    return all(stage_fits(problem, j, layers, _in_out(partition.boundary_bytes, j, k)[0])
               for j, layers in enumerate(partition.stages))
