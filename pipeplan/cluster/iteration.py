"""A cluster iteration as named parts that add up, its throughput and MFU, and its lower bound.

The pipeline's simulation (docs/schedules.md) gives, for the bottleneck pipeline rank, its
compute, its idle time (the bubble) and its exposed transfers; the cluster adds after the last
backward of each pipeline rank its data-parallel sync (the exposed share) and its optimizer step.
Pipeline ranks finish their last backward at different times (the first rank last under 1F1B),
so the iteration ends at

    iteration_ms = max over pipeline ranks r of (end_r + exposed_sync_r + optimizer_r)

and the parts are read off the rank that attains the maximum (:func:`iteration_parts`): its
compute (tensor-parallel collectives apart), the collectives, its exposed transfers, its sync and
step, and the bubble as the rest of its time line up to its last action (idle time, and the
schedule's own work). The bubble is therefore a remainder here; that it equals the simulation's
idle intervals is the simulator's property (tested there), not this function's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["IterationParts", "iteration_parts", "tokens_per_s_per_gpu", "model_flops_utilization",
           "pipeline_lower_bound_ms"]


@dataclass(frozen=True)
class IterationParts:
    """One iteration of the whole cluster, in ms; the parts add up to :attr:`iteration_ms`."""

    compute_ms: float
    """Forward and backward work of the rank that ends last (recompute included), without
    its tensor-parallel collectives."""
    tensor_parallel_ms: float
    """Its tensor-parallel collectives (not overlapped)."""
    pipeline_transfer_ms: float
    """Its exposed pipeline transfers."""
    bubble_ms: float
    """Its idle time inside the pipeline's make-span (and the schedule's own work)."""
    data_parallel_ms: float
    """Its exposed data-parallel sync."""
    optimizer_ms: float
    """Its optimizer step."""
    rank: int
    """The pipeline rank that ends last."""

    @property
    def iteration_ms(self) -> float:
        return (self.compute_ms + self.tensor_parallel_ms + self.pipeline_transfer_ms + self.bubble_ms
                + self.data_parallel_ms + self.optimizer_ms)


def iteration_parts(rank_end_ms: Sequence[float], rank_busy_ms: Sequence[float],
                    rank_tensor_parallel_ms: Sequence[float], rank_transfer_ms: Sequence[float],
                    rank_sync_ms: Sequence[float], rank_optimizer_ms: Sequence[float]) -> IterationParts:
    """The iteration's parts, read off the pipeline rank that ends last.

    Parameters
    ----------
    rank_end_ms : sequence of float
        When each pipeline rank's last action ends (the largest is the make-span).
    rank_busy_ms : sequence of float
        Each rank's compute inside the make-span, tensor-parallel collectives included.
    rank_tensor_parallel_ms : sequence of float
        The share of ``rank_busy_ms`` that is tensor-parallel collectives.
    rank_transfer_ms : sequence of float
        Each rank's exposed pipeline transfers.
    rank_sync_ms, rank_optimizer_ms : sequence of float
        Each rank's exposed data-parallel sync and optimizer step, after its last action.

    Returns
    -------
    IterationParts

    Raises
    ------
    ValueError
        If the sequences differ in length, or a rank's busy and transfer time exceed the make-span.

    Examples
    --------
    >>> parts = iteration_parts([100.0, 90.0], [80.0, 80.0], [8.0, 8.0], [5.0, 5.0],
    ...                         [20.0, 20.0], [3.0, 3.0])
    >>> parts.rank, parts.iteration_ms, parts.bubble_ms
    (0, 123.0, 15.0)
    >>> parts = iteration_parts([100.0, 90.0], [80.0, 80.0], [8.0, 8.0], [5.0, 5.0],
    ...                         [20.0, 40.0], [3.0, 3.0])
    >>> parts.rank, parts.iteration_ms, parts.bubble_ms     # rank 1 ends at 90 + 40 + 3
    (1, 133.0, 5.0)
    """
    columns = (rank_end_ms, rank_busy_ms, rank_tensor_parallel_ms, rank_transfer_ms, rank_sync_ms,
               rank_optimizer_ms)
    ranks = len(rank_end_ms)
    if ranks == 0 or any(len(c) != ranks for c in columns):
        raise ValueError("every per-rank sequence needs one value per pipeline rank")
    ends = [rank_end_ms[r] + rank_sync_ms[r] + rank_optimizer_ms[r] for r in range(ranks)]
    last = max(range(ranks), key=lambda r: (ends[r], -r))  # the earliest rank among equals
    end = ends[last]
    tail = rank_sync_ms[last] + rank_optimizer_ms[last]
    busy = rank_busy_ms[last]
    tp = rank_tensor_parallel_ms[last]
    transfer = rank_transfer_ms[last]
    bubble = end - tail - busy - transfer
    if bubble < -1e-9 * max(1.0, end):
        raise ValueError(f"pipeline rank {last}: busy {busy} + transfers {transfer} exceed its time line {end - tail}")
    return IterationParts(
        compute_ms=busy - tp, tensor_parallel_ms=tp, pipeline_transfer_ms=transfer,
        bubble_ms=max(bubble, 0.0), data_parallel_ms=rank_sync_ms[last],
        optimizer_ms=rank_optimizer_ms[last], rank=last,
    )


def tokens_per_s_per_gpu(global_batch: int, sequence_length: int, iteration_ms: float, num_gpus: int) -> float:
    """Training throughput per GPU.

    Examples
    --------
    >>> tokens_per_s_per_gpu(64, 2048, 13750.0, 64)   # GPT-3 175B on 64 A100s, selective
    148.94545454545454
    """
    if iteration_ms <= 0 or num_gpus < 1:
        raise ValueError("iteration_ms must be > 0 and num_gpus >= 1")
    return global_batch * sequence_length / (iteration_ms / 1e3) / num_gpus


def model_flops_utilization(model_flops: float, iteration_ms: float, num_gpus: int,
                            peak_flops_per_s: float) -> float:
    """MFU: the model's FLOPs per iteration (no recomputation counted) over the GPUs' peak.

    ``model_flops`` is the useful work of one iteration: forward and backward of every token,
    as in Chowdhery et al. 2022 (PaLM, appendix B) and Korthikanti et al. 2022 (section 6).

    Examples
    --------
    >>> round(model_flops_utilization(1.1436e15, 1100.0, 8, 312e12), 3)   # 22B, t = 8, selective
    0.417
    """
    if iteration_ms <= 0 or num_gpus < 1 or peak_flops_per_s <= 0:
        raise ValueError("iteration_ms and peak_flops_per_s must be > 0, num_gpus >= 1")
    return model_flops / (iteration_ms / 1e3) / (num_gpus * peak_flops_per_s)


def pipeline_lower_bound_ms(work_ms_per_microbatch: float, num_microbatches: int, pipeline: int,
                            largest_unit_ms: float = 0.0, tail_ms: float = 0.0) -> float:
    """A lower bound on a candidate's iteration, without splitting it: for pruning the search.

    Some pipeline rank does at least ``1 / p`` of the work of every micro-batch, and at least
    the largest unit's work; and its sync and step (``tail_ms``, their least over the ranks)
    follow. Every split, schedule and placement is at least this slow.

    Parameters
    ----------
    work_ms_per_microbatch : float
        The whole model's forward + backward (+ tensor-parallel collectives) per micro-batch, at
        the candidate's degree and micro-batch size.
    num_microbatches, pipeline : int
        ``m`` and ``p``.
    largest_unit_ms : float
        The largest single unit's work per micro-batch (a stage holds it whole).
    tail_ms : float
        The least exposed sync + optimizer step over the ranks.

    Examples
    --------
    >>> pipeline_lower_bound_ms(80.0, 8, 4, largest_unit_ms=30.0, tail_ms=5.0)   # 8 x max(20, 30) + 5
    245.0
    """
    if pipeline < 1 or num_microbatches < 1:
        raise ValueError("pipeline and num_microbatches must be >= 1")
    return num_microbatches * max(work_ms_per_microbatch / pipeline, largest_unit_ms) + tail_ms
