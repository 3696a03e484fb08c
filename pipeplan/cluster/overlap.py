"""Communication overlapped with compute, as each launcher runs it: how much of each collective is exposed.

Three overlaps, each named as the plan's ``settings.overlap`` names it (null: the launcher's
defaults, :func:`pipeplan.launchers.registry.launcher_overlaps`):

``grad-reduce``
    The data-parallel gradient reduce (all-reduce, or the distributed optimizer's reduce-scatter)
    launched bucket by bucket during the backward (Megatron's ``--overlap-grad-reduce``, FSDP's
    reduce-scatter stream, DeepSpeed's ``overlap_comm``). Megatron-core fills its buckets in
    reverse parameter order (``param_and_grad_buffer.py``: "Iterate through parameters in
    reverse order to roughly follow backprop order"), a bucket closing at ``bucket_size``
    parameters (default ``max(40e6, 1e6 x d)``, ``distributed_data_parallel.py``), and a
    bucket's collective starts when the *last* micro-batch's backward has made all its gradients
    (``register_grad_ready`` counts only while ``is_last_microbatch``). Pipeline ranks after the
    first and model chunks after the first hold one bucket each (``bucket_size = None`` when
    ``disable_bucketing or pp_rank > 0``). The collectives run one after another on one stream::

        finish_i = max(ready_i, finish_{i-1}) + comm_i
        exposed  = max(0, finish_last - end_of_rank)                    (:func:`stream_exposed_ms`)

    so the last bucket (the first layers', ready when the backward ends) is always exposed.
``param-gather``
    The all-gather of the updated weights (ZeRO 1/2: Megatron's ``--overlap-param-gather``)
    moved into the next forward, bucket by bucket, each bucket's all-gather dispatched when the
    forward reaches the bucket before it (``next_param_gather_bucket_group``); under ZeRO 3 the
    prefetch of the next unit's all-gather behind the current unit's compute (FSDP2, Megatron
    FSDP, DeepSpeed's ``stage3_prefetch_bucket_size``)::

        exposed = comm_1 + sum_i max(0, comm_{i+1} - compute_i)         (:func:`prefetch_exposed_ms`)
``tp-comm``
    Tensor-parallel collectives split into chunks overlapped with their GEMMs
    (:func:`tensor_parallel_exposed_shares`).
``moe-a2a``
    An MoE layer's dispatch and combine all-to-alls of one micro-batch behind the compute of the
    other micro-batch of a combined 1F1B step (:func:`expert_all_to_all_exposed_ms`).

Times are the cluster model's collectives (:mod:`pipeplan.cluster.collectives`); a bucket's
share of a rank's collective is its share of the rank's parameters (the per-call latency of
each bucket is not added). docs/cluster-model.md, "Overlap as each launcher runs it".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["OVERLAPS", "StageUnits", "buckets", "stream_exposed_ms", "prefetch_exposed_ms",
           "fsdp_microbatch_exposed_ms", "exposed_sync_ms", "tensor_parallel_exposed_shares",
           "expert_all_to_all_exposed_ms", "TE_PIPELINE_SPLITS"]

#: The overlaps a plan can name (settings.overlap).
OVERLAPS = ("grad-reduce", "param-gather", "tp-comm", "moe-a2a")

#: Transformer Engine's userbuffers default ``num_splits`` for its "pipeline" method (the chunked
#: GEMM + reduce-scatter of ``proj_fprop`` and ``fc2_fprop``): ``transformer_engine/pytorch/module/
#: base.py``, ``initialize_ub``: ``"num_splits": 4 if method == "pipeline" else tp_size``.
TE_PIPELINE_SPLITS = 4


@dataclass(frozen=True)
class StageUnits:
    """One stage of a pipeline rank: its units in forward order and its last backward's window."""

    params: tuple[float, ...]
    """Parameters of each unit (one GPU's shard before ZeRO)."""
    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    """Each unit's forward and backward per micro-batch."""
    last_backward: tuple[float, float] = (0.0, 0.0)
    """(start, end) ms of the stage's last micro-batch's backward (the weight-gradient pass where
    it is split), in the iteration's time."""
    bucket_params: Optional[float] = None
    """How its gradients are bucketed: None one bucket for the stage, 0 one per unit, else a
    bucket closes every ``bucket_params`` parameters (Megatron's ``bucket_size``)."""


def buckets(stage: StageUnits) -> list[tuple[float, float, float]]:
    """The stage's gradient buckets in launch (backward) order: ``(params, ready_ms, forward_ms)``.

    A bucket is ready when the last micro-batch's backward has run through the unit holding its
    last parameter in reverse order; the backward window is shared out over the units in
    proportion to their backward times. ``forward_ms`` is the forward of the bucket's parameters
    (a unit split over two buckets shares its forward by parameters).

    Examples
    --------
    >>> s = StageUnits((10.0, 10.0, 20.0), (1.0, 1.0, 2.0), (2.0, 2.0, 4.0), (100.0, 108.0), bucket_params=20.0)
    >>> buckets(s)   # units backward: the last (20 params) by 104 ms, then 10 + 10 by 108 ms
    [(20.0, 104.0, 2.0), (20.0, 108.0, 2.0)]
    >>> buckets(StageUnits((10.0, 10.0), (1.0, 1.0), (2.0, 2.0), (0.0, 4.0)))   # one bucket
    [(20.0, 4.0, 2.0)]
    """
    start, end = stage.last_backward
    total_backward = sum(stage.backward_ms)
    size = stage.bucket_params
    out: list[tuple[float, float, float]] = []
    held = held_forward = 0.0
    done = 0.0
    for params, forward, backward in zip(reversed(stage.params), reversed(stage.forward_ms),
                                         reversed(stage.backward_ms)):
        done += backward
        ready = start + (end - start) * (done / total_backward if total_backward > 0 else 1.0)
        left = params
        while size and held + left >= size:
            take = size - held
            out.append((size, ready, held_forward + forward * take / params if params else held_forward))
            left -= take
            held = held_forward = 0.0
        held += left
        held_forward += forward * left / params if params else 0.0
        if size == 0 and held > 0:  # one bucket per unit
            out.append((held, ready, held_forward))
            held = held_forward = 0.0
    if held > 0:
        out.append((held, end, held_forward))
    return out


def stream_exposed_ms(ready_and_comm_ms: Sequence[tuple[float, float]], end_ms: float) -> float:
    """What one communication stream leaves after ``end_ms``: collectives in order of readiness,
    each starting when it is ready and the one before has finished.

    Examples
    --------
    >>> stream_exposed_ms([(104.0, 3.0), (108.0, 3.0)], 108.0)   # the first hides, the last does not
    3.0
    >>> stream_exposed_ms([(104.0, 6.0), (108.0, 3.0)], 108.0)   # the first runs 2 ms past the end
    5.0
    """
    finish = -math.inf
    for ready, comm in sorted(ready_and_comm_ms):
        finish = max(ready, finish) + comm
    return max(0.0, finish - end_ms) if ready_and_comm_ms else 0.0


def prefetch_exposed_ms(comm_ms: Sequence[float], compute_ms: Sequence[float]) -> float:
    """A chain of prefetched collectives: the first is exposed, each next one hides behind the
    compute of the one before it (``compute_ms[i]`` hides ``comm_ms[i + 1]``).

    Examples
    --------
    >>> prefetch_exposed_ms([2.0, 3.0, 5.0], [4.0, 4.0, 4.0])   # 2 + max(0, 3 - 4) + max(0, 5 - 4)
    3.0
    """
    if not comm_ms:
        return 0.0
    return comm_ms[0] + sum(max(0.0, nxt - compute) for nxt, compute in zip(comm_ms[1:], compute_ms))


def fsdp_microbatch_exposed_ms(gather_ms: Sequence[float], reduce_ms: Sequence[float], forward_ms: Sequence[float],
                               backward_ms: Sequence[float], prefetch: bool, overlap_reduce: bool) -> float:
    """ZeRO 3 / FSDP, one micro-batch of one stage: each unit's weights all-gathered for its forward
    and again for its backward, its gradients reduce-scattered after its backward (units in
    forward order; ``gather_ms[u]`` one all-gather of unit ``u``).

    With ``prefetch`` the next unit's all-gather runs behind the current unit's compute (forward:
    ``u + 1`` behind ``u``; backward: ``u - 1`` behind ``u``); with ``overlap_reduce`` unit ``u``'s
    reduce-scatter runs behind the backward of unit ``u - 1``, sharing the link with that unit's
    prefetch. The first all-gather of each pass and the last reduce-scatter are exposed::

        forward  = g_1 + sum_u max(0, g_{u+1} - f_u)
        backward = g_U + sum_u max(0, g_{u-1} + r_{u+1} - b_u) + r_1

    (a term not overlapped is charged whole instead).

    Examples
    --------
    >>> fsdp_microbatch_exposed_ms([1, 1, 1], [2, 2, 2], [3, 3, 3], [6, 6, 6], True, True)   # 1 + 1 + 2
    4.0
    >>> fsdp_microbatch_exposed_ms([1, 1, 1], [2, 2, 2], [3, 3, 3], [6, 6, 6], False, False)   # 2 x 3 + 6
    12.0
    """
    units = len(gather_ms)
    if units == 0:
        return 0.0
    if prefetch:
        forward = prefetch_exposed_ms(list(gather_ms), list(forward_ms))
    else:
        forward = float(sum(gather_ms))
    backward = 0.0 if prefetch else float(sum(gather_ms))
    if prefetch:
        backward += gather_ms[-1]
    if not overlap_reduce:
        backward += float(sum(reduce_ms))
    for u in range(units - 1, -1, -1):  # the backward runs the units in reverse
        hidden = (gather_ms[u - 1] if prefetch and u > 0 else 0.0) + (
            reduce_ms[u + 1] if overlap_reduce and u + 1 < units else 0.0)
        backward += max(0.0, hidden - backward_ms[u])
    if overlap_reduce:
        backward += reduce_ms[0]
    return forward + backward


def exposed_sync_ms(gradient_ms: float, weight_gather_ms: float, zero_stage: int, overlaps, stages: Sequence[StageUnits],
                    rank_end_ms: float, num_microbatches: int) -> tuple[float, float]:
    """One pipeline rank's exposed gradient reduce and parameter all-gather, in ms.

    ``gradient_ms`` and ``weight_gather_ms`` are the rank's whole sync per iteration, not overlapped
    (:func:`pipeplan.cluster.dataparallel.data_parallel_sync`); each bucket or unit takes its share
    by parameters. Under ZeRO 3 the two are one per-unit chain (:func:`fsdp_microbatch_exposed_ms`):
    its exposed time is reported as the gradient's and the gather's in proportion to their totals.

    Examples
    --------
    >>> s = StageUnits((10.0, 10.0, 20.0), (1.0, 1.0, 2.0), (2.0, 2.0, 4.0), (100.0, 108.0), bucket_params=20.0)
    >>> exposed_sync_ms(6.0, 0.0, 1, {"grad-reduce"}, [s], 108.0, 4)   # buckets of 3 ms: the last exposed
    (3.0, 0.0)
    >>> exposed_sync_ms(6.0, 6.0, 1, {"param-gather"}, [s], 108.0, 4)  # forward order: 3 + max(0, 3 - 2)
    (6.0, 4.0)
    """
    total_params = sum(sum(s.params) for s in stages)
    if total_params <= 0 or (gradient_ms == 0 and weight_gather_ms == 0):
        return gradient_ms, weight_gather_ms
    grad_on, gather_on = "grad-reduce" in overlaps, "param-gather" in overlaps
    m = num_microbatches
    if zero_stage == 3:
        exposed = 0.0
        for s in stages:
            shares = [p / total_params for p in s.params]
            gathers = [weight_gather_ms / (2 * m) * share for share in shares]
            reduces = [gradient_ms / m * share for share in shares]
            exposed += m * fsdp_microbatch_exposed_ms(gathers, reduces, s.forward_ms, s.backward_ms, gather_on, grad_on)
        whole = gradient_ms + weight_gather_ms
        return exposed * gradient_ms / whole, exposed * weight_gather_ms / whole
    per_bucket = [b for s in stages for b in buckets(s)]
    # ZeRO 2 reduce-scatters every micro-batch: each micro-batch's as the last one's.
    reductions = m if zero_stage == 2 else 1
    if grad_on:
        gradient = reductions * stream_exposed_ms(
            [(ready, gradient_ms / reductions * params / total_params) for params, ready, _ in per_bucket], rank_end_ms)
    else:
        gradient = gradient_ms
    if gather_on and weight_gather_ms:
        # The next forward meets the buckets in forward order: the stages in order, each reversed.
        order = [b for s in stages for b in reversed(buckets(s))]
        gather = prefetch_exposed_ms([weight_gather_ms * params / total_params for params, _, _ in order],
                                     [forward for _, _, forward in order])
    else:
        gather = weight_gather_ms
    return gradient, gather


def tensor_parallel_exposed_shares(overlaps, launcher: Optional[str], kind: Optional[str], tensor: int) -> tuple[float, float]:
    """The exposed shares (forward, backward) of a unit's tensor-parallel collectives.

    Without ``tp-comm``, or without sequence parallelism (``kind`` ``all_reduce``: Megatron's
    ``--tp-comm-overlap`` needs it), all of it: ``(1, 1)``. With it, each pass's calls are half
    all-gathers (before the QKV and FC1 GEMMs) and half reduce-scatters (after the projection and
    FC2 GEMMs), of equal buffers:

    - Megatron (Transformer Engine userbuffers' default methods): the forward all-gathers run as
      ``ring_exchange`` (each chunk's transfer behind the GEMM of the chunk before: hidden), its
      reduce-scatters as ``pipeline`` in :data:`TE_PIPELINE_SPLITS` chunks (the last chunk's
      reduce-scatter exposed: 1/4 of them); the backward's dgrad all-gathers as ``ring_exchange`` and
      its reduce-scatters and input all-gathers as ``bulk`` behind the weight-gradient and dgrad
      GEMMs (hidden): ``(1/2 x 1/4, 0)``.
    - torchtitan's async TP (torch's ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``,
      ``torch/distributed/_symmetric_memory``): the local shard is consumed first while the others
      arrive (all-gathers hidden); the reduce-scatter's chunks are produced and pulled in turn, the
      last of its ``t - 1`` pulls exposed, in both passes: ``(1/2 x 1/(t - 1),) x 2``.

    Examples
    --------
    >>> tensor_parallel_exposed_shares({"tp-comm"}, "megatron", "reduce_scatter_all_gather", 8)
    (0.125, 0.0)
    >>> tensor_parallel_exposed_shares({"tp-comm"}, "torchtitan", "reduce_scatter_all_gather", 5)
    (0.125, 0.125)
    >>> tensor_parallel_exposed_shares(set(), "megatron", "reduce_scatter_all_gather", 8)
    (1.0, 1.0)
    """
    if "tp-comm" not in overlaps or kind != "reduce_scatter_all_gather" or tensor < 2:
        return 1.0, 1.0
    if launcher == "torchtitan":
        share = 0.5 / (tensor - 1)
        return share, share
    return 0.5 / TE_PIPELINE_SPLITS, 0.0


def expert_all_to_all_exposed_ms(dispatch_ms: tuple[float, float], combine_ms: tuple[float, float],
                                 attention_ms: tuple[float, float], experts_ms: tuple[float, float]
                                 ) -> tuple[tuple[float, float], tuple[float, float]]:
    """The exposed (forward, backward) ms of an MoE layer's dispatch and combine all-to-alls under
    Megatron-core's expert-parallel A2A overlap (``overlap_moe_expert_parallel_comm``, Megatron
    Bridge's ``moe_a2a_overlap``).

    The combined 1F1B schedule runs the forward of one micro-batch and the backward of another
    layer by layer, the all-to-alls on a communication stream beside the compute stream
    (``megatron/core/models/common/model_chunk_schedule_plan.py``,
    ``TransformerLayerSchedulePlan.run``, megatron-core 0.16.1)::

        comm stream: combine_bwd | dispatch_fwd | dispatch_bwd | combine_fwd
        comp stream: attn_fwd    | mlp_bwd (dw) | mlp_fwd      | attn_bwd

    each phase waiting for both streams' previous one (an all-to-all needs the compute before it,
    the compute after it its result), so a layer's pair takes ``sum max(comm_i, comp_i)`` and each
    all-to-all keeps only what its partner phase's compute does not cover::

        combine_bwd  exposed = max(0, combine_bwd  - attention_fwd)
        dispatch_fwd exposed = max(0, dispatch_fwd - experts_bwd)
        dispatch_bwd exposed = max(0, dispatch_bwd - experts_fwd)
        combine_fwd  exposed = max(0, combine_fwd  - attention_bwd)

    Parameters
    ----------
    dispatch_ms, combine_ms : tuple of float
        The all-to-alls' (forward, backward) ms per micro-batch.
    attention_ms : tuple of float
        The layer's compute outside the routed experts (attention, router, shared experts, its
        tensor-parallel collectives: Megatron's ``attn`` node), (forward, backward).
    experts_ms : tuple of float
        The routed experts' (forward, backward) ms (the ``mlp`` node; its backward with the
        weight gradients, ``backward_dw``).

    Returns
    -------
    tuple
        ``((dispatch forward, dispatch backward), (combine forward, combine backward))`` exposed.

    Examples
    --------
    >>> expert_all_to_all_exposed_ms((2.0, 2.0), (2.0, 2.0), (1.0, 1.5), (0.5, 3.0))
    ((0.0, 1.5), (0.5, 1.0))
    """
    (dispatch_f, dispatch_b), (combine_f, combine_b) = dispatch_ms, combine_ms
    (attention_f, attention_b), (experts_f, experts_b) = attention_ms, experts_ms
    return ((max(0.0, dispatch_f - experts_b), max(0.0, dispatch_b - experts_f)),
            (max(0.0, combine_f - attention_b), max(0.0, combine_b - attention_f)))
