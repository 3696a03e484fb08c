"""Predicted iteration time of a split, as a sum of named parts (Calculon-style).

For GPipe and 1F1B with per-micro-batch stage times ``t_s`` (compute plus exposed transfers),
``p`` stages and ``m`` micro-batches, the pipeline fills, runs at the pace of the slowest stage
and drains:

    iteration_ms = sum_s t_s + (m - 1) * max_s t_s

The bottleneck stage ``b`` is busy ``m * t_b`` of that; the rest is bubble (fill and drain).
With uniform stages this gives the known bubble fraction (p - 1) / (m + p - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IterationEstimate", "estimate_iteration"]


@dataclass(frozen=True)
class IterationEstimate:
    """An iteration's predicted time; the three parts add up to ``iteration_ms``."""

    iteration_ms: float
    """Wall time of one iteration (all micro-batches, forward and backward)."""
    compute_ms: float
    """Compute of the bottleneck stage over the iteration."""
    transfer_ms: float
    """Exposed receive time of the bottleneck stage over the iteration."""
    bubble_ms: float
    """Idle time of the bottleneck stage (fill and drain)."""
    bubble_fraction: float
    """Idle share of all stages' time."""
    bottleneck_stage: int
    """The slowest stage."""


def estimate_iteration(stage_compute_ms, stage_transfer_ms, num_microbatches: int) -> IterationEstimate:
    """Closed-form fill/steady/drain estimate for GPipe and 1F1B.

    Examples
    --------
    >>> e = estimate_iteration([1.0] * 4, [0.0] * 4, 8)
    >>> e.iteration_ms, round(e.bubble_fraction, 4) == round(3 / 11, 4)
    (11.0, True)
    """
    times = [c + t for c, t in zip(stage_compute_ms, stage_transfer_ms)]
    p, m = len(times), num_microbatches
    bottleneck = max(range(p), key=lambda s: (times[s], -s))
    iteration = sum(times) + (m - 1) * times[bottleneck]
    busy = m * sum(times)
    compute = m * stage_compute_ms[bottleneck]
    transfer = m * stage_transfer_ms[bottleneck]
    return IterationEstimate(
        iteration_ms=iteration,
        compute_ms=compute,
        transfer_ms=transfer,
        bubble_ms=iteration - compute - transfer,
        bubble_fraction=1.0 - busy / (p * iteration) if iteration > 0 else 0.0,
        bottleneck_stage=bottleneck,
    )
