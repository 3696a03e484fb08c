"""A cluster iteration as named parts that add up, its throughput and MFU, and its lower bound.

The pipeline's simulation (docs/schedules.md) gives the make-span ``M`` (first forward to last
backward) split, on its critical rank, into compute, the schedule's own work, bubble and exposed
transfers. After its last backward each pipeline rank runs its data-parallel sync; the optimizer
step then waits for every rank's sync, because the step clips gradients by their global norm (an
all-reduce over every model-parallel rank, Megatron's default ``--clip-grad 1.0``). So

    iteration_ms = max over pipeline ranks r of (end_r + exposed_sync_r) + max over r of optimizer_r

and the data-parallel part is what the sync adds beyond the make-span,
``max_r (end_r + sync_r) - M >= 0`` (a rank that ends early hides some of its sync in the
others' drain). The parts (:class:`IterationParts`) add up to the iteration exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["IterationParts", "iteration_parts", "tokens_per_s_per_gpu", "model_flops_utilization",
           "pipeline_lower_bound_ms", "round_trip_lower_bound_ms"]


@dataclass(frozen=True)
class IterationParts:
    """One iteration of the whole cluster, in ms; the parts add up to :attr:`iteration_ms`."""

    compute_ms: float
    """The critical pipeline rank's forward and backward work (recompute included), without its
    tensor-parallel collectives."""
    tensor_parallel_ms: float
    """Its tensor-parallel collectives (not overlapped)."""
    pipeline_transfer_ms: float
    """Exposed pipeline transfers (the simulation's)."""
    bubble_ms: float
    """The critical rank's idle time in the make-span, and the schedule's own work."""
    data_parallel_ms: float
    """What the data-parallel sync adds beyond the make-span."""
    optimizer_ms: float
    """The optimizer step (the slowest rank's)."""
    expert_dispatch_ms: float = 0.0
    """Mixture of experts: the critical rank's token dispatch all-to-alls (forward and backward)."""
    expert_compute_ms: float = 0.0
    """Its routed experts' GEMMs for the tokens it receives."""
    expert_combine_ms: float = 0.0
    """Its combine all-to-alls."""
    shared_expert_ms: float = 0.0
    """Its shared experts."""
    quantize_ms: float = 0.0
    """A quantized precision (``--precision``): its casts of the GEMMs' inputs and output gradients
    outside the experts' parts (the quantized GEMMs themselves are in ``compute_ms``)."""
    context_exchange_ms: float = 0.0
    """Context parallelism: the critical rank's KV ring sends not hidden behind attention."""
    cpu_offload_ms: float = 0.0
    """CPU activation offload: the host-link copies compute does not cover (pipeplan.plan.offload),
    after the make-span's micro-batches, before the sync."""
    host_wait_ms: float = 0.0
    """The critical rank's time waiting for the host to launch its kernels (the analytic profile's
    host-overhead term: units whose kernels are shorter than their launches)."""

    @property
    def expert_ms(self) -> float:
        """The mixture-of-experts parts together (0 for a dense model)."""
        return self.expert_dispatch_ms + self.expert_compute_ms + self.expert_combine_ms + self.shared_expert_ms

    @property
    def pipeline_ms(self) -> float:
        """The make-span: everything before the sync."""
        return (self.compute_ms + self.tensor_parallel_ms + self.expert_ms + self.quantize_ms
                + self.host_wait_ms + self.context_exchange_ms + self.pipeline_transfer_ms + self.bubble_ms)

    @property
    def iteration_ms(self) -> float:
        return self.pipeline_ms + self.cpu_offload_ms + self.data_parallel_ms + self.optimizer_ms


def iteration_parts(busy_ms: float, tensor_parallel_ms: float, transfer_ms: float, bubble_ms: float,
                    rank_end_ms: Sequence[float], rank_sync_ms: Sequence[float],
                    rank_optimizer_ms: Sequence[float], expert_ms: Optional[dict] = None,
                    context_ms: float = 0.0, offload_ms: float = 0.0) -> IterationParts:
    """The iteration's parts from the pipeline's simulation and each rank's sync and step.

    Parameters
    ----------
    busy_ms, tensor_parallel_ms, transfer_ms, bubble_ms : float
        The simulation's critical rank: its busy time (tensor-parallel collectives included), the
        collectives' share of it, the exposed transfers, and the rest of the make-span (idle and
        the schedule's own work). They add up to the make-span.
    rank_end_ms : sequence of float
        When each pipeline rank's last action ends; the largest is the make-span.
    rank_sync_ms, rank_optimizer_ms : sequence of float
        Each rank's exposed data-parallel sync and its optimizer step.
    expert_ms : dict, optional
        The critical rank's mixture-of-experts parts of its busy time (``dispatch``, ``experts``,
        ``combine``, ``shared_expert``: :data:`pipeplan.cluster.profile_view.EXPERT_PARTS`); they
        come out of ``compute_ms``, in that order, never below zero; then ``quantize`` (a quantized
        precision's casts) and ``host_wait`` (the GPU waiting for the host's launches), likewise.
    context_ms : float
        The critical rank's exposed context-parallel KV exchange (:mod:`pipeplan.cluster.context`),
        out of ``compute_ms`` too, never below zero.
    offload_ms : float
        CPU activation offload's exposed copies over the iteration (one pipeline rank: its
        micro-batches run one after another), added to the iteration as ``cpu_offload_ms``.

    Returns
    -------
    IterationParts

    Raises
    ------
    ValueError
        If the per-rank sequences differ in length, or the parts do not add up to the make-span.

    Examples
    --------
    >>> parts = iteration_parts(80.0, 8.0, 5.0, 15.0, [100.0, 90.0], [20.0, 20.0], [3.0, 3.0])
    >>> parts.data_parallel_ms, parts.iteration_ms       # rank 0 ends last: 100 + 20 + 3
    (20.0, 123.0)
    >>> parts = iteration_parts(80.0, 8.0, 5.0, 15.0, [100.0, 90.0], [20.0, 40.0], [3.0, 3.0])
    >>> parts.data_parallel_ms, parts.iteration_ms       # rank 1 syncs longer: 90 + 40 + 3
    (30.0, 133.0)
    """
    ranks = len(rank_end_ms)
    if ranks == 0 or len(rank_sync_ms) != ranks or len(rank_optimizer_ms) != ranks:
        raise ValueError("every per-rank sequence needs one value per pipeline rank")
    makespan = max(rank_end_ms)
    if abs(busy_ms + transfer_ms + bubble_ms - makespan) > 1e-6 * max(1.0, makespan):
        raise ValueError(f"busy {busy_ms} + transfers {transfer_ms} + bubble {bubble_ms} is not the "
                         f"make-span {makespan}")
    if not 0 <= tensor_parallel_ms <= busy_ms:
        raise ValueError(f"tensor_parallel_ms {tensor_parallel_ms} must be within busy_ms {busy_ms}")
    synced = max(end + sync for end, sync in zip(rank_end_ms, rank_sync_ms))
    left = busy_ms - tensor_parallel_ms
    moe = {}
    for part, name in (("dispatch", "expert_dispatch_ms"), ("combine", "expert_combine_ms"),
                       ("experts", "expert_compute_ms"), ("shared_expert", "shared_expert_ms"),
                       ("quantize", "quantize_ms"), ("host_wait", "host_wait_ms")):
        value = min(max(0.0, (expert_ms or {}).get(part, 0.0)), left)
        moe[name] = value
        left -= value
    exchange = min(max(0.0, context_ms), left)
    left -= exchange
    return IterationParts(
        compute_ms=left, tensor_parallel_ms=tensor_parallel_ms,
        pipeline_transfer_ms=transfer_ms, bubble_ms=bubble_ms,
        data_parallel_ms=synced - makespan, optimizer_ms=max(rank_optimizer_ms), **moe,
        context_exchange_ms=exchange, cpu_offload_ms=max(0.0, offload_ms),
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


def round_trip_lower_bound_ms(forward_ms: Sequence[float], input_backward_ms: Sequence[float],
                              work_ms: Sequence[float], num_microbatches: int) -> float:
    """A lower bound on the make-span from one micro-batch's round trip, without splitting.

    Every micro-batch runs every unit's forward in order, then the input gradient back through
    every stage but the first; the first stage's rank then still runs that stage's backward. So
    the make-span is at least ``sum(forward) + sum(input_backward over the units after the first
    stage)``. The first stage holds some prefix of ``L >= 1`` units, and its rank does all
    ``m`` micro-batches of them, so the make-span is also at least ``m x work(prefix)``; the bound
    is the least over ``L`` of the larger of the two. It holds for every split, schedule and
    placement (transfers, recomputation and the schedule's own time only add to both terms),
    and it is what prunes short pipelines of few, large micro-batches (``m`` below ``p``), where
    ``m / p`` of the work bounds nothing.

    Parameters
    ----------
    forward_ms, input_backward_ms, work_ms : sequence of float
        Per unit in pipeline order: forward, the input-gradient part of the backward (the whole
        backward where it is not split; the least of the two where it is), and forward +
        backward.
    num_microbatches : int
        ``m``.

    Examples
    --------
    >>> round_trip_lower_bound_ms([1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], 2)   # L = 1: max(6, 4 + 6)
    10.0
    >>> round_trip_lower_bound_ms([1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], 64)  # L = 1: max(192, 10)
    192.0

    Notes
    -----
    O(n) for ``n`` units.
    """
    if num_microbatches < 1:
        raise ValueError("num_microbatches must be >= 1")
    if not work_ms:
        return 0.0
    trip = float(sum(forward_ms)) + float(sum(input_backward_ms))
    best, prefix = float("inf"), 0.0
    for work, back in zip(work_ms, input_backward_ms):
        prefix += work
        trip -= back
        best = min(best, max(num_microbatches * prefix, trip))
        if num_microbatches * prefix >= trip:
            break  # the prefix term only grows from here
    return best
