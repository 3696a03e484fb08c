"""What torchtitan (0.2.2) runs: its record.

Examples
--------
>>> TORCHTITAN.zero_stages(data=8, pipeline=1), TORCHTITAN.zero_stages(data=8, pipeline=4)
((0, 2, 3), (0, 1, 3))
"""

from __future__ import annotations

from typing import Optional

from pipeplan.errors import BadInputError
from pipeplan.facts.schedules import check_schedule
from pipeplan.launchers.record import DEFAULT_OPTIMIZER, LauncherFacts, LauncherSettings

__all__ = ["TORCHTITAN"]


def _refusal(schedule: str, p: int, m: int, v: int, group: Optional[int]) -> Optional[str]:
    """torchtitan builds torch's schedule classes: what their constructors refuse."""
    try:
        check_schedule(schedule, p, m, v)
    except BadInputError as exc:
        return str(exc)
    return None


def _zero_setting(zero_stage: int) -> str:
    return ("parallelism.data_parallel_shard_degree (FSDP)" if zero_stage == 3
            else "parallelism.data_parallel_replicate_degree (DDP)")


TORCHTITAN = LauncherFacts(
    name="torchtitan",
    # torch.distributed.pipelining's classes (distributed/pipeline_parallel.py).
    schedules=("1f1b", "gpipe", "interleaved", "zb", "zbv", "dualpipev"),
    # FSDP2 (data_parallel_shard_degree) with fsdp_reshard_after_forward: "always" keeps ZeRO 3's
    # memory; "never" keeps the weights whole, and the gradients whole until the step under a
    # pipeline (torch's stage defers FSDP's reduce-scatter: ZeRO 1's memory) or reduce-scattered
    # per micro-batch without one (ZeRO 2's); ZeRO 0 is DDP or FSDP "never" (the writer,
    # pipeplan.launchers.torchtitan.writer). No optimizer-only sharding without a pipeline, no
    # ZeRO 2 memory with one.
    zero_with_pipeline=(0, 1, 3), zero_without_pipeline=(0, 2, 3),
    # A config replicates (DDP, 0) or shards fully (FSDP, 3); doctor's search tries both.
    config_zero_stages=(0, 3), search_zero_stages=(0, 3),
    optimizer=DEFAULT_OPTIMIZER,
    uniform_recompute=True,  # one [activation_checkpoint] for every block of every model part
    zero_is_a_switch=False,  # FSDP or DDP is how the data-parallel degrees are laid out
    # Tensor parallelism shards the norms' activations over the sequence (parallelize.py's
    # SequenceParallel plans): no switch.
    sequence_parallel_flag=None,
    empty_stage_severity="warning",
    refusal=_refusal,
    settings=LauncherSettings(
        split="parallelism.module_fqns_per_model_part", layout="parallelism.module_fqns_per_model_part",
        layers="model (its n_layers)", units="transformer layers",
        schedule="parallelism.pipeline_parallel_schedule",
        batch="training.local_batch_size / parallelism.pipeline_parallel_microbatch_size",
        microbatch="parallelism.pipeline_parallel_microbatch_size (training.local_batch_size without a pipeline)",
        recompute="activation_checkpoint.mode", tensor="parallelism.tensor_parallel_degree",
        expert="parallelism.expert_parallel_degree =", zero=_zero_setting),
    batch="training.local_batch_size per data-parallel rank and step; with a pipeline, "
          "split into local_batch_size / pipeline_parallel_microbatch_size micro-batches; "
          "training.global_batch_size / (local_batch_size x dp) gradient-accumulation steps",
    source="torchtitan 0.2.2 (config/job_config.py, train.py, distributed/pipeline_parallel.py)",
    # components/loss.py: F.cross_entropy(pred.flatten(0, 1).float(), ...), eager.
    loss="torch-eager")
