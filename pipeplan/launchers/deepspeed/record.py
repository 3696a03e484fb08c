"""What DeepSpeed (0.19) runs: its record.

Examples
--------
>>> DEEPSPEED.zero_stages(data=8, pipeline=4), DEEPSPEED.schedules
((1,), ('1f1b',))
"""

from __future__ import annotations

from typing import Optional

from pipeplan.launchers.record import DEFAULT_OPTIMIZER, LauncherFacts, LauncherSettings

__all__ = ["DEEPSPEED"]


def _refusal(schedule: str, p: int, m: int, v: int, group: Optional[int]) -> Optional[str]:
    return None  # TrainSchedule runs any gradient_accumulation_steps on any number of stages


def _zero_setting(zero_stage: int) -> str:
    return f"zero_optimization.stage = {zero_stage}"


DEEPSPEED = LauncherFacts(
    name="deepspeed",
    # Its 1F1B-like TrainSchedule, one stage per rank (runtime/pipe/schedule.py).
    schedules=("1f1b",),
    # PipelineEngine asserts zero_optimization.stage < 2 under pipeline parallelism.
    zero_with_pipeline=(1,), zero_without_pipeline=(1, 2, 3),
    config_zero_stages=(0, 1), search_zero_stages=(1,),
    optimizer=DEFAULT_OPTIMIZER,
    uniform_recompute=False,  # activation_checkpoint_interval is per PipelineModule layer
    zero_is_a_switch=True,  # zero_optimization.stage
    sequence_parallel_flag=None,  # its PipelineModule has none
    # A rank without layers is an error, as DeepSpeed issue 5078 reported it (docs/doctor-deepspeed.md).
    empty_stage_severity="error",
    refusal=_refusal,
    settings=LauncherSettings(
        split="PipelineModule parts / partition_method",
        layout="PipelineModule partition (parts / partition_method)",
        layers="PipelineModule layers", units="PipelineModule layers",
        schedule="its TrainSchedule (the only one)",
        batch="gradient_accumulation_steps", microbatch="train_micro_batch_size_per_gpu",
        recompute="PipelineModule activation_checkpoint_interval", tensor="the tensor-parallel size",
        expert="MoE(ep_size=...) =", zero=_zero_setting),
    batch="train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp; "
          "the pipeline runs gradient_accumulation_steps micro-batches per step",
    source="DeepSpeed 0.19 (runtime/pipe/engine.py, runtime/config.py)")
