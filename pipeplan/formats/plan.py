"""The plan format (schema_version 2, reads 1): a split of a profile into pipeline stages.

Written by ``pipeplan plan``; read by ``show``, ``run``, ``export`` and ``check``.
See docs/formats.md.

Version 2 adds the cluster plan (docs/cluster-model.md): ``parallelism`` (data, tensor and
pipeline degrees, ZeRO stage, sequence parallelism), the cluster spec and the cluster options
in ``settings``, the iteration's cluster parts in ``predicted`` and each stage's memory by part.
A plan is written as version 2 only where one of them is set, so a pipeline-only plan keeps
version 1 and its bytes; version 1 files read unchanged.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeplan.formats.cluster import ClusterSpec

__all__ = [
    "SCHEDULES",
    "PLAN_SCHEMA_VERSIONS",
    "Parallelism",
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


#: Plan versions this pipeplan reads.
PLAN_SCHEMA_VERSIONS = (1, 2)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Parallelism(_Strict):
    """How the plan lays its GPUs out (ranks in Megatron's order: docs/cluster-model.md)."""

    num_gpus: int = Field(gt=0, description="data x tensor x pipeline.")
    data: int = Field(gt=0, description="Data-parallel replicas d.")
    tensor: int = Field(gt=0, description="Tensor-parallel degree t (inside a node).")
    pipeline: int = Field(gt=0, description="Pipeline ranks p.")
    virtual_stages: int = Field(default=1, ge=1, description="Stages per pipeline rank.")
    zero_stage: int = Field(default=0, ge=0, le=3, description="ZeRO stage: 1 shards the optimizer state over d, "
                                                               "2 also the gradients, 3 also the weights.")
    sequence_parallel: bool = Field(default=False, description="Megatron's sequence parallelism (t > 1).")
    gpus_per_node: int = Field(gt=0, description="From the cluster spec, for the layout.")


class PlanProfileRef(_Strict):
    """Which profile the plan was made from."""

    model: str
    sha256: str = Field(description="sha256 of the profile file's bytes.")


class PlanSettings(_Strict):
    """Every input that shaped the plan, so that it can be re-planned (``pipeplan check``)."""

    stages: Optional[int] = Field(
        default=None, gt=0,
        description="Pipeline ranks p. Required, except in a cluster request (num_gpus set) where null "
                    "means search; a cluster plan records the chosen p (and search_stages).")
    global_batch: int = Field(gt=0, description="Samples per iteration.")
    microbatch_size: Optional[int] = Field(default=None, description="Fixed micro-batch size, or null to search.")
    memory_cap_bytes: Optional[int] = Field(default=None, description="Per-GPU memory cap, or null for none.")
    optimizer: Literal["adam", "adam-fp32-grads", "sgd", "none"] = Field(
        default="adam", description="Training state per parameter: adam 16 bytes (ZeRO paper, DeepSpeed), "
                                    "adam-fp32-grads 18 (Megatron), sgd 12, none 2 x dtype; docs/cluster-model.md.")
    bandwidth_bytes_per_s: Optional[float] = Field(
        default=None, description="Point-to-point bandwidth; null means infinite (transfers ignored)."
    )
    schedule: str = Field(default="1f1b", description="Requested schedule, or 'auto'.")
    virtual_stages: Optional[int] = Field(default=None, description="Requested stages per rank, or null to search.")
    recompute: Literal["auto", "none", "all", "selective"] = Field(
        default="none", description="auto searches; all recomputes whole stages; selective (cluster plans of "
                                    "analytic profiles) recomputes the attention core, as Megatron does.")
    solver: Literal["auto", "dp", "ilp"] = "auto"
    action_overhead_ms: Optional[float] = Field(
        default=None, ge=0,
        description="The schedule's own time per compute action on a rank (posting transfers, "
                    "bookkeeping), outside compute; null means none. `pipeplan run` measures it.",
    )
    # --- schema_version 2: the cluster plan (all null for a pipeline-only plan) ---
    num_gpus: Optional[int] = Field(
        default=None, gt=0, description="--gpus: plan d x t x p = num_gpus over the cluster; null: d = t = 1.")
    cluster: Optional[ClusterSpec] = Field(default=None, description="The cluster spec (preset or file), inlined.")
    data_parallel: Optional[int] = Field(default=None, gt=0, description="Fixed d, or null to search.")
    tensor_parallel: Optional[int] = Field(default=None, gt=0, description="Fixed t, or null to search.")
    zero_stage: Optional[int] = Field(default=None, ge=0, le=3, description="Fixed ZeRO stage, or null to search.")
    layers_per_stage: Optional[list[int]] = Field(
        default=None, description="Fixed split: units per stage in profile order (virtual stages in order).")
    data_parallel_overlap: Optional[float] = Field(
        default=None, ge=0, le=1,
        description="Share of the data-parallel sync hidden behind compute; null: 0 (all exposed).")
    search_stages: Optional[bool] = Field(
        default=None, description="True in a cluster plan whose pipeline degree was searched (stages is the choice).")

    @model_validator(mode="after")
    def _stages_given(self) -> "PlanSettings":
        if self.stages is None and self.num_gpus is None:
            raise ValueError("stages: give the pipeline stages (--stages), or --gpus to search them")
        return self


class PlanStage(_Strict):
    """One pipeline stage: a run of layers placed on one rank."""

    index: int = Field(ge=0, description="Stage number in pipeline order.")
    rank: int = Field(ge=0, description="The rank (GPU) that runs it.")
    layers: list[str] = Field(min_length=1, description="Layer names, in order.")
    forward_ms: float = Field(description="Forward time of one micro-batch.")
    backward_ms: float = Field(description="Backward time of one micro-batch (recompute included).")
    backward_input_ms: Optional[float] = Field(
        default=None,
        description="Input-gradient pass (B) of a split backward, recompute included. Null: half of "
                    "the backward is assumed.",
    )
    backward_weight_ms: Optional[float] = Field(
        default=None,
        description="Weight-gradient pass (W) of a split backward; B + W may exceed backward_ms, since "
                    "splitting costs extra work. Null: backward_ms minus backward_input_ms.",
    )
    transfer_ms: float = Field(default=0.0, description="Receive time per micro-batch at the bandwidth.")
    send_bytes: int = Field(description="Bytes sent to later stages per micro-batch.")
    param_bytes: int = Field(default=0, description="Bytes of the stage's parameters.")
    activation_bytes: int = Field(default=0, description="Bytes kept for backward per micro-batch in flight.")
    in_flight: int = Field(default=1, description="Micro-batches whose activations it holds at its peak.")
    recompute: bool = Field(default=False, description="Keeps only its input and recomputes the forward.")
    peak_memory_bytes: int = Field(description="Predicted peak memory of the stage.")
    # --- schema_version 2 (cluster plans): the stage's share of its GPU's memory, by part ---
    weight_bytes: Optional[int] = Field(default=None, description="Weights held (ZeRO 3: the shard and the gathered units).")
    gradient_bytes: Optional[int] = Field(default=None, description="Gradients held (ZeRO 2-3: the shard).")
    optimizer_bytes: Optional[int] = Field(default=None, description="Optimizer state held (ZeRO 1-3: the shard).")
    peak_activation_bytes: Optional[int] = Field(default=None, description="Activations at the stage's peak.")


class Predicted(_Strict):
    """Predicted performance; the named parts add up to ``iteration_ms``."""

    iteration_ms: float
    bubble_fraction: float = Field(description="Idle share of all ranks' time.")
    samples_per_second: float
    bottleneck_stage: int
    compute_ms: float = Field(default=0.0, description="Busy time of the bottleneck rank.")
    bubble_ms: float = Field(default=0.0, description="Idle time of the bottleneck rank.")
    transfer_ms: float = Field(default=0.0, description="Exposed transfer time of the bottleneck rank.")
    overhead_ms: Optional[float] = Field(
        default=None, description="The schedule's own time on the bottleneck rank (settings.action_overhead_ms "
                                  "per action); null when none was set.")
    # --- schema_version 2 (cluster plans): with compute_ms, bubble_ms and transfer_ms they add up
    # to iteration_ms; compute_ms then leaves out the tensor-parallel collectives ---
    tensor_parallel_ms: Optional[float] = Field(default=None, description="Tensor-parallel collectives.")
    data_parallel_ms: Optional[float] = Field(default=None, description="Exposed data-parallel sync.")
    optimizer_ms: Optional[float] = Field(default=None, description="The optimizer step.")
    tokens_per_second_per_gpu: Optional[float] = Field(default=None, description="Training throughput per GPU.")
    model_flops_utilization: Optional[float] = Field(
        default=None, description="Model FLOPs per iteration (no recompute) over the GPUs' peak (MFU).")


class RankSummary(_Strict):
    """What one rank does in an iteration."""

    rank: int
    stages: list[int]
    busy_ms: float
    idle_ms: float
    peak_memory_bytes: int
    overhead_ms: Optional[float] = Field(
        default=None, description="The schedule's own time (not in busy or idle); null when none was set.")


class Alternative(_Strict):
    """A runner-up configuration and why it lost."""

    schedule: str
    virtual_stages: int
    microbatch_size: int
    recompute: str
    iteration_ms: Optional[float] = None
    peak_memory_bytes: Optional[int] = None
    reason: str


class SolverInfo(_Strict):
    """How the split was found."""

    method: str = Field(description="dp-chain, dp-ideals, ilp-highs, ilp-cbc.")
    optimal: bool = Field(description="Whether the split is proven optimal.")
    lower_bound_ms: Optional[float] = Field(
        default=None, description="Proven lower bound on the slowest stage's time (equals it when optimal)."
    )
    seconds: float = Field(description="Solver time; 0 unless recorded with --record-time, so plans are reproducible.")


class Plan(_Strict):
    """A pipeline plan."""

    schema_version: Literal[1, 2] = Field(description="2 where a version-2 field is set, else 1.")
    profile: PlanProfileRef
    settings: PlanSettings
    schedule: str
    virtual_stages: int = Field(default=1, ge=1, description="Stages per rank.")
    microbatch_size: int = Field(gt=0)
    num_microbatches: int = Field(gt=0)
    stages: list[PlanStage] = Field(min_length=1)
    predicted: Predicted
    ranks: list[RankSummary] = Field(default_factory=list)
    alternatives: list[Alternative] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list, description="Assumptions the planner made.")
    solver: SolverInfo
    parallelism: Optional[Parallelism] = Field(
        default=None, description="The cluster layout (schema_version 2); null: d = t = 1 on `stages` GPUs.")
    reserve_bytes: Optional[int] = Field(
        default=None, description="Per GPU, the memory not planned (the cluster's reserve and fragmentation share).")
