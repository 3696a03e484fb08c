"""The splits users make by hand today, costed by the same model as the optimal plan.

- ``uniform``: equal layer counts per stage (Megatron-LM's default).
- ``params``: equal parameter bytes per stage (DeepSpeed's ``partition_method="parameters"``).
- ``greedy``: fill each stage up to an even share of the compute time (torchgpipe's balance-by-time).

All split along the profile's layer order.
"""

from __future__ import annotations

import numpy as np

from pipeplan.plan.problem import Partition, PartitionProblem, evaluate_split
from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.plan.assemble import plan_given_split
from pipeplan.plan.graph import build_layer_graph
from pipeplan.plan.search import candidate_microbatch_sizes, make_plan, with_profile_defaults

__all__ = ["BASELINES", "split_uniform", "split_by_weight", "split_greedy", "baseline_partition", "compare_baselines"]


def _cuts_to_stages(cuts, n):
    bounds = [0, *cuts, n]
    return [tuple(range(bounds[j], bounds[j + 1])) for j in range(len(bounds) - 1)]


def split_uniform(num_layers: int, num_stages: int):
    """Equal layer counts; the first ``n mod k`` stages get one more.

    Examples
    --------
    >>> [len(s) for s in split_uniform(10, 4)]
    [3, 3, 2, 2]
    """
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if j < extra else 0) for j in range(num_stages)]
    return _cuts_to_stages(np.cumsum(sizes)[:-1].tolist(), num_layers)


def split_by_weight(weights, num_stages: int):
    """Cut where the running weight crosses each multiple of total / k (DeepSpeed's rule).

    Every stage keeps at least one layer.

    Examples
    --------
    >>> [len(s) for s in split_by_weight([1, 1, 1, 1, 4], 2)]
    [4, 1]
    """
    weights = np.asarray(weights, dtype=float)
    n = len(weights)
    prefix = np.cumsum(weights)
    total = prefix[-1]
    cuts = []
    for j in range(1, num_stages):
        target = total * j / num_stages
        cut = int(np.searchsorted(prefix, target, side="left")) + 1
        lo = (cuts[-1] if cuts else 0) + 1
        hi = n - (num_stages - j)
        cuts.append(min(max(cut, lo), hi))
    return _cuts_to_stages(cuts, n)


def split_greedy(weights, num_stages: int):
    """Fill each stage until adding the next layer would pass the even share of what remains."""
    weights = np.asarray(weights, dtype=float)
    n = len(weights)
    stages, start = [], 0
    for j in range(num_stages):
        left = num_stages - j
        if left == 1:
            stages.append(tuple(range(start, n)))
            break
        share = weights[start:].sum() / left
        end, load = start + 1, weights[start]
        while end < n - (left - 1) and load + weights[end] <= share:
            load += weights[end]
            end += 1
        stages.append(tuple(range(start, end)))
        start = end
    return stages


BASELINES = {
    "uniform": "equal layer counts (Megatron-LM default)",
    "params": "equal parameter bytes (DeepSpeed default)",
    "greedy": "greedy time balance (torchgpipe-like)",
}


def baseline_partition(problem: PartitionProblem, name: str) -> Partition:
    """Cost the split named ``name`` (a key of :data:`BASELINES`) under ``problem``'s model."""
    g = problem.graph
    k = problem.num_stages
    if name == "uniform":
        stages = split_uniform(g.num_layers, k)
    elif name == "params":
        stages = split_by_weight(g.param_bytes, k)
    elif name == "greedy":
        stages = split_greedy(g.compute_ms, k)
    else:
        raise ValueError(f"unknown baseline {name!r}")
    return evaluate_split(problem, stages, method=name, optimal=False)


def compare_baselines(profile, settings, profile_sha256: str):
    """The optimal plan and each baseline's, all at the same micro-batch size and schedule.

    The optimal plan is made with ``settings`` less recomputation and with one stage per rank
    (the baselines' terms); the baselines take its micro-batch size or, when nothing fits the
    cap, the largest profiled size that divides the global batch. ``settings.schedule`` is
    ``gpipe`` or ``1f1b`` (``auto`` means ``1f1b``).

    Returns
    -------
    (Plan or None, list of (name, description, Plan))
        The optimal plan (None when nothing fits), then one plan per :data:`BASELINES` entry
        (``solver.method`` ``given``), each costed and simulated like any plan.

    Raises
    ------
    BadInputError
        Another schedule.
    """
    schedule = "1f1b" if settings.schedule == "auto" else settings.schedule
    if schedule not in ("1f1b", "gpipe"):
        raise BadInputError(f"--schedule: compare takes gpipe or 1f1b (the schedules the baselines use), not {schedule!r}")
    fixed = with_profile_defaults(profile, settings).model_copy(
        update={"recompute": "none", "virtual_stages": 1, "schedule": schedule})
    try:
        optimal = make_plan(profile, fixed, profile_sha256=profile_sha256)
        b = optimal.microbatch_size
    except InfeasibleError:
        optimal = None
        b = max(candidate_microbatch_sizes(profile, fixed))
    m = fixed.global_batch // b
    graph = build_layer_graph(profile, b)
    k = fixed.stages
    splits = {"uniform": lambda: split_uniform(graph.num_layers, k),
              "params": lambda: split_by_weight(graph.param_bytes, k),
              "greedy": lambda: split_greedy(graph.compute_ms, k)}
    rows = []
    for name, description in BASELINES.items():
        plan = plan_given_split(profile, fixed, graph, splits[name](), schedule=schedule, virtual_stages=1,
                                microbatch_size=b, num_microbatches=m, profile_sha256=profile_sha256)
        rows.append((name, description, plan))
    return optimal, rows
