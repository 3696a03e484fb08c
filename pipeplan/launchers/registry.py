"""What each launcher runs: one record per launcher (in its home, ``pipeplan.launchers.<name>.record``),
which the planner's search, the exports and doctor all read, so that a plan for a launcher is a
plan that launcher runs.

Each :class:`~pipeplan.launchers.record.LauncherFacts` says, with its source:

- the pipeline schedules it runs (``schedules``; torch's classes for torchtitan) and what it
  refuses at run time (``refusal``: Megatron's interleaved micro-batch rule, torch's classes');
- the ZeRO stages it runs as planned, by pipeline depth (:meth:`LauncherFacts.zero_stages`);
- the optimizer state it keeps by default (``optimizer``: the bytes per parameter of
  :mod:`pipeplan.facts.training_state`) and whether one recomputation covers every stage;
- what its batch settings mean (``batch``), and its own names for the settings doctor names.

Examples
--------
>>> LAUNCHERS["deepspeed"].zero_stages(data=8, pipeline=4)
(1,)
>>> launcher_zero_stages("torchtitan", data=8, pipeline=1), launcher_zero_stages("torchtitan", data=8, pipeline=4)
((0, 2, 3), (0, 1, 3))
>>> launcher_optimizer("megatron"), launcher_optimizer(None)
('adam-fp32-grads', 'adam')
>>> check_launcher("megatron", "interleaved", 4, 8, 2)
>>> check_launcher(None, "interleaved", 4, 6, 2)
"""

from __future__ import annotations

from typing import Optional

from pipeplan.errors import BadInputError
from pipeplan.launchers.deepspeed.record import DEEPSPEED
from pipeplan.launchers.megatron.record import MEGATRON
from pipeplan.launchers.record import DEFAULT_OPTIMIZER, LauncherFacts
from pipeplan.launchers.torchtitan.record import TORCHTITAN

__all__ = ["LauncherFacts", "LAUNCHERS", "LAUNCHER_SCHEDULES", "launcher_zero_stages", "launcher_optimizer", "check_launcher", "launcher_refusal", "DEFAULT_OPTIMIZER", "launcher_overlaps", "plan_overlaps", "gradient_bucket_params", "MEGATRON_MIN_BUCKET_PARAMS"]

LAUNCHERS = {record.name: record for record in (MEGATRON, TORCHTITAN, DEEPSPEED)}

#: The schedules each launcher runs (its record's ``schedules``).
LAUNCHER_SCHEDULES = {name: record.schedules for name, record in LAUNCHERS.items()}


def launcher_zero_stages(launcher: Optional[str], data: int, pipeline: int) -> tuple[int, ...]:
    """The ZeRO stages a plan for ``launcher`` is searched at (every stage without a launcher)."""
    if launcher is None:
        return (0,) if data == 1 else (1, 2, 3)
    return LAUNCHERS[launcher].zero_stages(data, pipeline)


def launcher_optimizer(launcher: Optional[str]) -> str:
    """The optimizer state a plan keeps by default for ``launcher`` (``--optimizer auto``)."""
    return DEFAULT_OPTIMIZER if launcher is None else LAUNCHERS[launcher].optimizer


def launcher_refusal(launcher: str, schedule: str, p: int, m: int, v: int,
                     group_size: int | None = None) -> str | None:
    """Why ``launcher`` refuses ``schedule`` with ``m`` micro-batches on ``p`` ranks x ``v``, or None."""
    return LAUNCHERS[launcher].refusal(schedule, p, m, v, group_size)


def check_launcher(launcher: str | None, schedule: str, num_ranks: int, num_microbatches: int,
                   virtual_stages: int) -> None:
    """Raise if ``launcher`` cannot run these numbers (beyond what torch's classes refuse).

    Raises
    ------
    BadInputError
        A schedule the launcher does not run, or one it refuses at these numbers (Megatron's
        interleaved micro-batch rule).
    """
    if launcher is None:
        return
    allowed = LAUNCHERS[launcher].schedules
    if schedule not in allowed:
        raise BadInputError(f"launcher {launcher}: runs {', '.join(allowed)}, not {schedule}")
    why = launcher_refusal(launcher, schedule, num_ranks, num_microbatches, virtual_stages)
    if why is not None:
        raise BadInputError(f"launcher {launcher}: its {schedule} schedule refuses {num_microbatches} "
                            f"micro-batches on {num_ranks} ranks: {why}")


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
