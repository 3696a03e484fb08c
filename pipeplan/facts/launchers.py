"""What each launcher runs: one record per launcher, which the planner's search, the exports and
doctor all read, so that a plan for a launcher is a plan that launcher runs.

Each :class:`LauncherFacts` says, with its source:

- the pipeline schedules it runs (``schedules``; torch's classes for torchtitan);
- the ZeRO stages it runs as planned, by pipeline depth (:meth:`LauncherFacts.zero_stages`);
- the optimizer state it keeps by default (``optimizer``: the bytes per parameter of
  :mod:`pipeplan.facts.training_state`);
- what its batch settings mean (``batch``).

Examples
--------
>>> LAUNCHERS["deepspeed"].zero_stages(data=8, pipeline=4)
(1,)
>>> launcher_zero_stages("torchtitan", data=8, pipeline=1), launcher_zero_stages("torchtitan", data=8, pipeline=4)
((0, 2, 3), (0, 1, 3))
>>> launcher_optimizer("megatron"), launcher_optimizer(None)
('adam-fp32-grads', 'adam')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipeplan.facts.loss import DEFAULT_LOSS
from pipeplan.facts.schedules import LAUNCHER_SCHEDULES

__all__ = ["LauncherFacts", "LAUNCHERS", "launcher_zero_stages", "launcher_optimizer", "DEFAULT_OPTIMIZER",
           "launcher_overlaps", "plan_overlaps", "gradient_bucket_params", "MEGATRON_MIN_BUCKET_PARAMS"]

#: The optimizer state a plan keeps without a launcher (16-bit weights and gradients, fp32 Adam).
DEFAULT_OPTIMIZER = "adam"


@dataclass(frozen=True)
class LauncherFacts:
    """One launcher's rules, each from its own code."""

    name: str
    schedules: tuple[str, ...]
    """pipeplan's names of the schedules it runs."""
    zero_with_pipeline: tuple[int, ...]
    """ZeRO stages it runs as planned with more than one pipeline rank (and d > 1)."""
    zero_without_pipeline: tuple[int, ...]
    """ZeRO stages it runs as planned with one pipeline rank (and d > 1)."""
    optimizer: str
    """The optimizer state it keeps by default (a :mod:`pipeplan.facts.training_state` name)."""
    batch: str
    """What its batch settings mean, as its docs and code say."""
    source: str
    loss: str = DEFAULT_LOSS
    """The cross-entropy it computes (a :data:`pipeplan.facts.loss.LOSS_FORMS` name): what the head's
    working memory is costed as (pipeplan.facts.loss)."""

    def zero_stages(self, data: int, pipeline: int) -> tuple[int, ...]:
        """The ZeRO stages to plan at ``d = data`` replicas of ``pipeline`` ranks (0 only at d = 1)."""
        if data == 1:
            return (0,)
        return self.zero_with_pipeline if pipeline > 1 else self.zero_without_pipeline


LAUNCHERS = {
    "megatron": LauncherFacts(
        name="megatron", schedules=LAUNCHER_SCHEDULES["megatron"],
        # The distributed optimizer shards the optimizer state and reduce-scatters the gradients
        # but keeps the whole gradient buffer (ZeRO 1 memory); no ZeRO 3 outside Megatron FSDP.
        zero_with_pipeline=(1,), zero_without_pipeline=(1,),
        # 16-bit training keeps fp32 main gradients (--accumulate-allreduce-grads-in-fp32 is set
        # for bf16: megatron/training/arguments.py).
        optimizer="adam-fp32-grads",
        batch="--global-batch-size = --micro-batch-size x micro-batches x d; no pipeline at "
              "--pipeline-model-parallel-size 1 (the micro-batches are gradient accumulation)",
        source="megatron-core 0.16 (distributed optimizer docs; parallel_state; training/arguments.py)"),
    "torchtitan": LauncherFacts(
        name="torchtitan", schedules=LAUNCHER_SCHEDULES["torchtitan"],
        # FSDP2 (data_parallel_shard_degree) with fsdp_reshard_after_forward: "always" keeps ZeRO 3's
        # memory; "never" keeps the weights whole, and the gradients whole until the step under a
        # pipeline (torch's stage defers FSDP's reduce-scatter: ZeRO 1's memory) or reduce-scattered
        # per micro-batch without one (ZeRO 2's); ZeRO 0 is DDP or FSDP "never" (pipeplan.export.
        # torchtitan). No optimizer-only sharding without a pipeline, no ZeRO 2 memory with one.
        zero_with_pipeline=(0, 1, 3), zero_without_pipeline=(0, 2, 3),
        optimizer=DEFAULT_OPTIMIZER,
        batch="training.local_batch_size per data-parallel rank and step; with a pipeline, "
              "split into local_batch_size / pipeline_parallel_microbatch_size micro-batches; "
              "training.global_batch_size / (local_batch_size x dp) gradient-accumulation steps",
        source="torchtitan 0.2.2 (config/job_config.py, train.py, distributed/pipeline_parallel.py)",
        # components/loss.py: F.cross_entropy(pred.flatten(0, 1).float(), ...), eager.
        loss="torch-eager"),
    "deepspeed": LauncherFacts(
        name="deepspeed", schedules=LAUNCHER_SCHEDULES["deepspeed"],
        # PipelineEngine asserts zero_optimization.stage < 2 under pipeline parallelism.
        zero_with_pipeline=(1,), zero_without_pipeline=(1, 2, 3),
        optimizer=DEFAULT_OPTIMIZER,
        batch="train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp; "
              "the pipeline runs gradient_accumulation_steps micro-batches per step",
        source="DeepSpeed 0.19 (runtime/pipe/engine.py, runtime/config.py)"),
}


def launcher_zero_stages(launcher: Optional[str], data: int, pipeline: int) -> tuple[int, ...]:
    """The ZeRO stages a plan for ``launcher`` is searched at (every stage without a launcher)."""
    if launcher is None:
        return (0,) if data == 1 else (1, 2, 3)
    return LAUNCHERS[launcher].zero_stages(data, pipeline)


def launcher_optimizer(launcher: Optional[str]) -> str:
    """The optimizer state a plan keeps by default for ``launcher`` (``--optimizer auto``)."""
    return DEFAULT_OPTIMIZER if launcher is None else LAUNCHERS[launcher].optimizer


#: Megatron-core's default gradient bucket, ``max(40000000, 1000000 x dp_size)`` parameters
#: (``megatron/core/distributed/distributed_data_parallel.py``; DistributedDataParallelConfig.bucket_size).
MEGATRON_MIN_BUCKET_PARAMS = 40_000_000


def launcher_overlaps(launcher: Optional[str], zero_stage: int) -> frozenset:
    """The communication a launcher overlaps with compute by default (names of
    :data:`pipeplan.cluster.overlap.OVERLAPS`), at a ZeRO stage.

    - Megatron-LM: none (``--overlap-grad-reduce``, ``--overlap-param-gather`` and
      ``--tp-comm-overlap`` are off unless given: DistributedDataParallelConfig's
      ``overlap_grad_reduce = False``, ``overlap_param_gather = False``).
    - torchtitan: FSDP2 reduce-scatters each unit's gradients on its own stream during the backward
      and prefetches the next unit's all-gather (implicit forward prefetch, one unit ahead in the
      backward), whatever the ZeRO stage it runs as; DDP (ZeRO 0) reduces its buckets during the
      backward: ``grad-reduce`` (and ``param-gather`` with FSDP). Async TP is off
      (``parallelism.enable_async_tensor_parallel = false``).
    - DeepSpeed: ``zero_optimization.overlap_comm`` defaults to true at stage 3 only
      (``deepspeed/runtime/zero/config.py``, ``overlap_comm_valid``), which overlaps the reduce and
      the prefetch (``stage3_prefetch_bucket_size``); stages 0-2 overlap nothing by default.
    - No launcher: none, so a plan is an upper bound on the sync (what plans said before).

    Examples
    --------
    >>> sorted(launcher_overlaps("deepspeed", 3)), sorted(launcher_overlaps("deepspeed", 1))
    (['grad-reduce', 'param-gather'], [])
    >>> sorted(launcher_overlaps("torchtitan", 0)), sorted(launcher_overlaps(None, 3))
    (['grad-reduce'], [])
    """
    if launcher == "torchtitan":
        return frozenset({"grad-reduce"} if zero_stage == 0 else {"grad-reduce", "param-gather"})
    if launcher == "deepspeed" and zero_stage == 3:
        return frozenset({"grad-reduce", "param-gather"})
    return frozenset()


def plan_overlaps(overlap, launcher: Optional[str], zero_stage: int) -> frozenset:
    """What a plan overlaps: its ``settings.overlap`` where given, else ``launcher``'s defaults.

    Examples
    --------
    >>> sorted(plan_overlaps(None, "torchtitan", 3)), sorted(plan_overlaps([], "torchtitan", 3))
    (['grad-reduce', 'param-gather'], [])
    """
    return frozenset(overlap) if overlap is not None else launcher_overlaps(launcher, zero_stage)


def gradient_bucket_params(launcher: Optional[str], data: int, given: Optional[int] = None) -> Optional[float]:
    """How the first stage's gradients are bucketed: a bucket of this many parameters
    (Megatron-core: ``given``, else ``max(40e6, 1e6 x d)``), or 0 for one bucket per unit (FSDP's
    units, DDP's and DeepSpeed's buckets taken as the units). Megatron's later stages and model
    chunks are one bucket each (:mod:`pipeplan.cluster.overlap`).

    Examples
    --------
    >>> gradient_bucket_params("megatron", 64), gradient_bucket_params("megatron", 64, 128 * 2**20)
    (64000000, 134217728)
    >>> gradient_bucket_params("torchtitan", 64)
    0
    """
    if launcher == "megatron":
        return given if given is not None else max(MEGATRON_MIN_BUCKET_PARAMS, 1_000_000 * data)
    return given if given is not None else 0
