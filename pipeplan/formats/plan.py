"""The plan format (schema_version 1): a split of a profile into pipeline stages.

Written by ``pipeplan plan``; read by ``show``, ``run``, ``export`` and ``check``.
See docs/formats.md.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeplan.formats.limits import (MAX_MICROBATCHES, Bandwidth, Count, FiniteFloat, Ms, Name, PlanBytes, PlanMs,
                                     PositiveBytes, PositiveCount, Rate, Text)

__all__ = [
    "SCHEDULES",
    "PlanProfileRef",
    "PlanSettings",
    "PlanStage",
    "Predicted",
    "RankSummary",
    "Alternative",
    "SolverInfo",
    "Plan",
]

#: Schedule names, one per torch.distributed.pipelining class.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlanProfileRef(_Strict):
    """Which profile the plan was made from."""

    model: Name
    sha256: Name = Field(description="sha256 of the profile file's bytes.")


class PlanSettings(_Strict):
    """Every input that shaped the plan, so that it can be re-planned (``pipeplan check``)."""

    stages: PositiveCount = Field(description="Pipeline ranks (GPUs).")
    global_batch: PositiveCount = Field(description="Samples per iteration.")
    microbatch_size: Optional[PositiveCount] = Field(default=None, description="Fixed micro-batch size, or null to search.")
    memory_cap_bytes: Optional[PositiveBytes] = Field(default=None, description="Per-GPU memory cap, or null for none.")
    optimizer: Literal["adam", "sgd", "none"] = "adam"
    bandwidth_bytes_per_s: Optional[Bandwidth] = Field(
        default=None, description="Point-to-point bandwidth; null means infinite (transfers ignored)."
    )
    schedule: Literal["auto", "gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"] = Field(
        default="1f1b", description="Requested schedule, or 'auto'.")
    virtual_stages: Optional[PositiveCount] = Field(default=None, description="Requested stages per rank, or null to search.")
    recompute: Literal["auto", "none", "all"] = "none"
    solver: Literal["auto", "dp", "ilp"] = "auto"
    action_overhead_ms: Optional[Ms] = Field(
        default=None,
        description="The schedule's own time per compute action on a rank (posting transfers, "
                    "bookkeeping), outside compute; null means none. `pipeplan run` measures it.",
    )


class PlanStage(_Strict):
    """One pipeline stage: a run of layers placed on one rank."""

    index: Count = Field(description="Stage number in pipeline order.")
    rank: Count = Field(description="The rank (GPU) that runs it.")
    layers: list[Name] = Field(min_length=1, description="Layer names, in order.")
    forward_ms: PlanMs = Field(description="Forward time of one micro-batch.")
    backward_ms: PlanMs = Field(description="Backward time of one micro-batch (recompute included).")
    backward_input_ms: Optional[PlanMs] = Field(
        default=None,
        description="Input-gradient pass (B) of a split backward, recompute included. Null: half of "
                    "the backward is assumed.",
    )
    backward_weight_ms: Optional[PlanMs] = Field(
        default=None,
        description="Weight-gradient pass (W) of a split backward; B + W may exceed backward_ms, since "
                    "splitting costs extra work. Null: backward_ms minus backward_input_ms.",
    )
    transfer_ms: PlanMs = Field(default=0.0, description="Receive time per micro-batch at the bandwidth.")
    send_bytes: PlanBytes = Field(description="Bytes sent to later stages per micro-batch.")
    param_bytes: PlanBytes = Field(default=0, description="Bytes of the stage's parameters.")
    activation_bytes: PlanBytes = Field(default=0, description="Bytes kept for backward per micro-batch in flight.")
    in_flight: Count = Field(default=1, description="Micro-batches whose activations it holds at its peak.")
    recompute: bool = Field(default=False, description="Keeps only its input and recomputes the forward.")
    peak_memory_bytes: PlanBytes = Field(description="Predicted peak memory of the stage.")


class Predicted(_Strict):
    """Predicted performance; the named parts add up to ``iteration_ms``."""

    iteration_ms: PlanMs
    bubble_fraction: FiniteFloat = Field(ge=0, le=1, description="Idle share of all ranks' time.")
    samples_per_second: Rate
    bottleneck_stage: Count
    compute_ms: PlanMs = Field(default=0.0, description="Busy time of the bottleneck rank.")
    bubble_ms: PlanMs = Field(default=0.0, description="Idle time of the bottleneck rank.")
    transfer_ms: PlanMs = Field(default=0.0, description="Exposed transfer time of the bottleneck rank.")
    overhead_ms: Optional[PlanMs] = Field(
        default=None, description="The schedule's own time on the bottleneck rank (settings.action_overhead_ms "
                                  "per action); null when none was set.")


class RankSummary(_Strict):
    """What one rank does in an iteration."""

    rank: Count
    stages: list[Count]
    busy_ms: PlanMs
    idle_ms: PlanMs
    peak_memory_bytes: PlanBytes
    overhead_ms: Optional[PlanMs] = Field(
        default=None, description="The schedule's own time (not in busy or idle); null when none was set.")


class Alternative(_Strict):
    """A runner-up configuration and why it lost."""

    schedule: Name
    virtual_stages: PositiveCount
    microbatch_size: PositiveCount
    recompute: Name
    iteration_ms: Optional[PlanMs] = None
    peak_memory_bytes: Optional[PlanBytes] = None
    reason: Text


class SolverInfo(_Strict):
    """How the split was found."""

    method: Name = Field(description="dp-chain, dp-ideals, ilp-highs, ilp-cbc.")
    optimal: bool = Field(description="Whether the split is proven optimal.")
    lower_bound_ms: Optional[PlanMs] = Field(
        default=None, description="Proven lower bound on the slowest stage's time (equals it when optimal)."
    )
    seconds: FiniteFloat = Field(ge=0, description="Solver time; 0 unless recorded with --record-time, so plans are reproducible.")


class Plan(_Strict):
    """A pipeline plan."""

    schema_version: Literal[1]
    profile: PlanProfileRef
    settings: PlanSettings
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"]
    virtual_stages: PositiveCount = Field(default=1, description="Stages per rank.")
    microbatch_size: PositiveCount
    num_microbatches: PositiveCount = Field(le=MAX_MICROBATCHES)
    stages: list[PlanStage] = Field(min_length=1)
    predicted: Predicted
    ranks: list[RankSummary] = Field(default_factory=list)
    alternatives: list[Alternative] = Field(default_factory=list)
    notes: list[Text] = Field(default_factory=list, description="Assumptions the planner made.")
    solver: SolverInfo

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        # One check for every command that reads a plan (validate, show, export, run, calibrate,
        # check, diff): a plan that passes can be run as written.
        indexes = sorted(s.index for s in self.stages)
        if indexes != list(range(len(self.stages))):
            raise ValueError(f"stages: indexes {indexes[:8]}{'...' if len(indexes) > 8 else ''} must be "
                             f"0..{len(self.stages) - 1}, each once")
        owner: dict[str, int] = {}
        for stage in self.stages:
            for name in stage.layers:
                if name in owner:
                    raise ValueError(f"stages: layer {name!r} is in stage {owner[name]} and stage {stage.index}; "
                                     f"each layer belongs to one stage")
                owner[name] = stage.index
        ranks = self.settings.stages
        if len(self.stages) != ranks * self.virtual_stages:
            raise ValueError(f"stages: {len(self.stages)} stages for settings.stages {ranks} ranks x "
                             f"virtual_stages {self.virtual_stages}; give {ranks * self.virtual_stages}")
        for stage in self.stages:
            if stage.rank >= ranks:
                raise ValueError(f"stages[{self.stages.index(stage)}].rank: {stage.rank} is out of range; the plan "
                                 f"has ranks 0..{ranks - 1} (settings.stages {ranks})")
        used = {s.rank for s in self.stages}
        if used != set(range(ranks)):
            missing = min(set(range(ranks)) - used)
            raise ValueError(f"stages: rank {missing} has no stage; every rank 0..{ranks - 1} needs one")
        if self.predicted.bottleneck_stage >= len(self.stages):
            raise ValueError(f"predicted.bottleneck_stage: {self.predicted.bottleneck_stage} is not a stage "
                             f"(0..{len(self.stages) - 1})")
        for index, summary in enumerate(self.ranks):
            if summary.rank >= ranks or any(i >= len(self.stages) for i in summary.stages):
                raise ValueError(f"ranks[{index}]: rank {summary.rank} or its stages {summary.stages} are out of range")
        return self
