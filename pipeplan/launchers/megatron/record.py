"""What Megatron-LM (megatron-core 0.16) runs: its record, and its interleaved schedule's rule.

Examples
--------
>>> MEGATRON.zero_stages(data=8, pipeline=4), MEGATRON.refusal("1f1b", 4, 3, 1, None)
((1,), None)
>>> interleaved_refusal(4, 8) is None
True
"""

from __future__ import annotations

from typing import Optional

from pipeplan.launchers.record import LauncherFacts, LauncherSettings

__all__ = ["MEGATRON", "interleaved_refusal"]


def interleaved_refusal(num_ranks: int, num_microbatches: int, group_size: int | None = None) -> str | None:
    """Why Megatron's interleaved schedule refuses ``num_microbatches``, or None if it runs.

    megatron-core's ``forward_backward_pipelining_with_interleaving`` raises unless the group of
    contiguous micro-batches per virtual stage ``N`` (``--microbatch-group-size-per-virtual-
    pipeline-stage``, default ``p``) lies in ``[p, M]`` and ``M % N`` is 0 or at least ``p``.

    Examples
    --------
    >>> interleaved_refusal(4, 8) is None
    True
    >>> interleaved_refusal(4, 6)[:30]
    'The remainder of M (the total '
    """
    p, m = num_ranks, num_microbatches
    n = p if group_size is None else group_size
    if n > m or n < p:
        return (f"The number of contiguous micro-batches in a virtual pipeline stage should range in "
                f"[PP={p}, M={m}] (N = {n})")
    remainder = m % n
    if 0 < remainder < p:
        return (f"The remainder of M (the total micro-batches, {m}) divided by N (contiguous micro-batches "
                f"in a virtual pipeline stage, {n}) should be 0, or larger than or equal to the "
                f"pipeline-parallel size ({p}), but it is {remainder}")
    return None


def _refusal(schedule: str, p: int, m: int, v: int, group: Optional[int]) -> Optional[str]:
    if schedule == "interleaved":
        return interleaved_refusal(p, m, group)
    return None  # Megatron's own 1F1B warms up min(p - rank - 1, m): any m runs


def _zero_setting(zero_stage: int) -> str:
    return "--use-distributed-optimizer" if zero_stage else "--use-distributed-optimizer (not set)"


MEGATRON = LauncherFacts(
    name="megatron",
    # 1F1B, and interleaved when the layout has virtual stages (schedules.py of megatron-core).
    schedules=("1f1b", "interleaved"),
    # The distributed optimizer shards the optimizer state and reduce-scatters the gradients
    # but keeps the whole gradient buffer (ZeRO 1 memory); no ZeRO 3 outside Megatron FSDP.
    zero_with_pipeline=(1,), zero_without_pipeline=(1,),
    # A config runs with or without --use-distributed-optimizer; doctor's layout search tries only
    # ZeRO 1 (the distributed optimizer moves the same bytes as plain data parallelism, a
    # reduce-scatter and an all-gather for the all-reduce, and holds less).
    config_zero_stages=(0, 1), search_zero_stages=(1,),
    # 16-bit training keeps fp32 main gradients (--accumulate-allreduce-grads-in-fp32 is set
    # for bf16: megatron/training/arguments.py).
    optimizer="adam-fp32-grads",
    # One --recompute-granularity for the whole model (TransformerConfig), on every rank.
    uniform_recompute=True,
    zero_is_a_switch=True,  # --use-distributed-optimizer
    sequence_parallel_flag="--sequence-parallel",  # off unless given (training/arguments.py)
    empty_stage_severity="warning",  # an empty virtual stage only forwards activations
    refusal=_refusal,
    settings=LauncherSettings(
        split="--pipeline-model-parallel-layout (or the even split)",
        layout="--num-layers / --pipeline-model-parallel-size / virtual stages",
        layers="--num-layers", units="transformer layers",
        # Megatron interleaves where the layout has more stages than ranks.
        schedule="--pipeline-model-parallel-layout (or the even split)",
        batch="--global-batch-size / --micro-batch-size", microbatch="--micro-batch-size",
        recompute="--recompute-granularity / --recompute-method", tensor="--tensor-model-parallel-size",
        expert="--expert-model-parallel-size", zero=_zero_setting),
    batch="--global-batch-size = --micro-batch-size x micro-batches x d; no pipeline at "
          "--pipeline-model-parallel-size 1 (the micro-batches are gradient accumulation)",
    source="megatron-core 0.16 (distributed optimizer docs; parallel_state; training/arguments.py; "
           "pipeline_parallel/schedules.py)")
