"""The plan format (schema_version 2, reads 1): a split of a profile into pipeline stages.

Written by ``pipeplan plan``; read by ``show``, ``run``, ``export`` and ``check``.
See docs/formats.md.

Version 2 adds the cluster plan (docs/cluster-model.md): ``parallelism`` (data, tensor and
pipeline degrees, ZeRO stage, sequence parallelism), the cluster spec and the cluster options
in ``settings``, the iteration's cluster parts in ``predicted`` and each stage's memory by part,
and full recomputation's kept bytes per stage (``checkpoint_bytes``).
A plan is written as version 2 only where one of them is set, so a pipeline-only plan keeps
version 1 and its bytes; version 1 files read unchanged.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from pipeplan.formats.cluster import ClusterSpec
from pipeplan.formats.profile import RECOMPUTE_MODULES
from pipeplan.formats.limits import (Bandwidth, Count, FiniteFloat, Fraction, MicrobatchCount, Ms, Name,
                                     NonNegativeFloat, PlanBytes, PlanMs, PositiveBytes, PositiveCount, Rate, Text)
# Schedule names, one per torch.distributed.pipelining class; the records (torch class,
# stages per rank, placement) are pipeplan.facts.schedules.SCHEDULE_INFO.
from pipeplan.facts.schedules import SCHEDULES
from pipeplan.formats.profile import PRECISION_NAMES

__all__ = [
    "SCHEDULES",
    "PLAN_SCHEMA_VERSIONS",
    "Parallelism",
    "RecomputePart",
    "SOLVER_METHODS",
    "DEFAULT_BANDWIDTH_BYTES_PER_S",
    "DEFAULT_GLOBAL_BATCH_PER_MICROBATCH",
    "PlanProfileRef",
    "PlanSettings",
    "PlanStage",
    "Predicted",
    "RankSummary",
    "Alternative",
    "SolverInfo",
    "ReserveParts",
    "Plan",
]



#: ``solver.method``: how a plan's split was found, one value per solver path.
SOLVER_METHODS = {
    "dp-chain-direct": "chain DP over (start, end) pairs with ties broken toward balance; optimal for a "
                       "chain of layers (for a DAG: the best split along its layer order)",
    "dp-chain-bisect": "bisection on the bottleneck with a windowed feasibility test, for long chains; "
                       "optimal for a chain, no recomputation",
    "dp-ideals": "DP over the DAG's lattice of ideals (down-closed layer sets); optimal",
    "dp-orders": "best split along a few topological orders, refined by single-layer moves; optimal "
                 "only when it meets the lower bound (solver.lower_bound_ms)",
    "ilp-highs": "integer linear program solved by HiGHS; optimal when solver.optimal",
    "ilp-cbc": "integer linear program solved by CBC (PuLP's COIN_CMD); optimal when solver.optimal",
    "rank-balanced": "the search's min-max-stage split with its boundaries moved toward equal work per "
                     "rank (several stages per rank), chosen where it simulates faster; not optimal "
                     "for the slowest stage (pipeplan.plan.balance)",
    "balanced": "near-equal compute per stage (pipeplan.run.plans.balanced_plan); not optimised for the "
                "simulated iteration",
    "given": "a split the caller chose (pipeplan.api.plan_split, compare's baselines), costed and "
             "simulated like any plan",
    "dp-chain": "older pipeplan's name for dp-chain-direct",
}
SolverMethod = Literal["dp-chain-direct", "dp-chain-bisect", "dp-ideals", "dp-orders", "ilp-highs", "ilp-cbc",
                       "rank-balanced", "balanced", "given", "dp-chain"]
assert set(SolverMethod.__args__) == set(SOLVER_METHODS)

#: The CLI's ``--bandwidth`` default, and ``PlanSettings``'.
DEFAULT_BANDWIDTH_BYTES_PER_S = 25e9
#: With no global batch given, plans take this many x the largest profiled micro-batch size.
DEFAULT_GLOBAL_BATCH_PER_MICROBATCH = 8


#: Plan versions this pipeplan reads.
PLAN_SCHEMA_VERSIONS = (1, 2)


def effective_cap_bytes(memory_cap_bytes: Optional[int], cluster: Optional[ClusterSpec]) -> float:
    """A request's per-GPU cap: the given one, else the cluster's, else ``inf`` (no cap).

    Examples
    --------
    >>> effective_cap_bytes(None, None), effective_cap_bytes(4 * 2**30, None) / 2**30
    (inf, 4.0)
    """
    if memory_cap_bytes is not None:
        return memory_cap_bytes
    return math.inf if cluster is None else cluster.cap_bytes()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Parallelism(_Strict):
    """How the plan lays its GPUs out (ranks in Megatron's order: docs/cluster-model.md)."""

    num_gpus: PositiveCount = Field(description="data x tensor x pipeline (x context).")
    data: PositiveCount = Field(description="Data-parallel replicas d.")
    tensor: PositiveCount = Field(description="Tensor-parallel degree t (inside a node).")
    pipeline: PositiveCount = Field(description="Pipeline ranks p.")
    virtual_stages: PositiveCount = Field(default=1, description="Stages per pipeline rank.")
    zero_stage: int = Field(default=0, ge=0, le=3, description="ZeRO stage: 1 shards the optimizer state over d, "
                                                               "2 also the gradients, 3 also the weights.")
    sequence_parallel: bool = Field(default=False, description="Megatron's sequence parallelism (t > 1).")
    gpus_per_node: PositiveCount = Field(description="From the cluster spec, for the layout.")
    expert: Optional[PositiveCount] = Field(
        default=None, description="Expert-parallel degree E of a mixture-of-experts model (its groups carved "
                                  "out of each stage's data-parallel ranks); null: 1 (a dense model).")
    expert_tensor: Optional[PositiveCount] = Field(
        default=None, description="Expert-tensor-parallel degree ETP (the experts' own tensor sharding); null: 1.")
    context: Optional[PositiveCount] = Field(
        default=None, description="Context-parallel degree C (each sequence split over C GPUs, ranks ordered "
                                  "tensor, context, data, pipeline; gradients reduced over d x C); null: 1.")

    @property
    def expert_data(self) -> int:
        """The expert-data-parallel degree ``t x d / (E x ETP)``: the ranks holding the same experts."""
        return max(1, self.tensor * self.data // ((self.expert or 1) * (self.expert_tensor or 1)))

    @model_validator(mode="after")
    def _product(self) -> "Parallelism":
        c = self.context or 1
        if self.data * self.tensor * self.pipeline * c != self.num_gpus:
            context = f" x context {c}" if c > 1 else ""
            raise ValueError(f"data x tensor x pipeline = {self.data} x {self.tensor} x {self.pipeline}{context} is not "
                             f"num_gpus {self.num_gpus}")
        return self


class PlanProfileRef(_Strict):
    """Which profile the plan was made from."""

    model: Name
    sha256: Name = Field(description="sha256 of the profile file's bytes.")


class PlanSettings(_Strict):
    """Every input that shaped the plan, so that it can be re-planned (``pipeplan check``).

    The defaults are the CLI's, so ``pipeplan plan`` and :func:`pipeplan.api.plan_profile`
    make the same plan from the same inputs. A plan records its settings with the defaults
    that depend on the profile (``global_batch``, ``action_overhead_ms``) filled in.
    """

    stages: Optional[PositiveCount] = Field(
        default=None,
        description="Pipeline ranks p. Required, except in a cluster request (num_gpus set) where null "
                    "means search; a cluster plan records the chosen p (and search_stages).")
    global_batch: Optional[PositiveCount] = Field(
        default=None,
        description="Samples per iteration; null (before planning) means 8 x the largest profiled "
                    "micro-batch size. Plans record the value used.")
    microbatch_size: Optional[PositiveCount] = Field(default=None, description="Fixed micro-batch size, or null to search.")
    memory_cap_bytes: Optional[PositiveBytes] = Field(default=None, description="Per-GPU memory cap, or null for none.")
    optimizer: Literal["adam", "adam-fp32-grads", "sgd", "none"] = Field(
        default="adam", description="Training state per parameter: adam 16 bytes (ZeRO paper, DeepSpeed), "
                                    "adam-fp32-grads 18 (Megatron), sgd 12, none 2 x dtype; docs/cluster-model.md.")
    bandwidth_bytes_per_s: Optional[Bandwidth] = Field(
        default=DEFAULT_BANDWIDTH_BYTES_PER_S,
        description="Point-to-point bandwidth; null means infinite (transfers ignored). A plan file "
                    "always writes it (null included); one without it, from before 25 GB/s became "
                    "the default, means null."
    )
    schedule: Literal[("auto", *SCHEDULES)] = Field(default="auto", description="Requested schedule, or 'auto' to search.")
    virtual_stages: Optional[PositiveCount] = Field(default=None, description="Requested stages per rank, or null to search.")
    recompute: Literal["auto", "none", "selective", "all"] = Field(
        default="auto",
        description="Activation recomputation: auto (searched: none, selective where the profile "
                    "gives it, full, per stage), none, selective (every stage) or all (every stage, full).")
    solver: Literal["auto", "dp", "ilp"] = "auto"
    action_overhead_ms: Optional[Ms] = Field(
        default=None,
        description="The schedule's own time per compute action on a rank (posting transfers, "
                    "bookkeeping), outside compute; null means none. `pipeplan run` measures it.",
    )
    launcher: Optional[Literal["megatron", "torchtitan", "deepspeed"]] = Field(
        default=None,
        description="The launcher the plan is for, or null for torch: the planner only picks schedules "
                    "and micro-batch counts it runs (e.g. not the interleaved counts Megatron-LM refuses).",
    )
    # --- schema_version 2: the cluster plan (all null for a pipeline-only plan) ---
    num_gpus: Optional[PositiveCount] = Field(
        default=None, description="--gpus: plan d x t x p = num_gpus over the cluster; null: d = t = 1.")
    cluster: Optional[ClusterSpec] = Field(default=None, description="The cluster spec (preset or file), inlined.")
    data_parallel: Optional[PositiveCount] = Field(default=None, description="Fixed d, or null to search.")
    tensor_parallel: Optional[PositiveCount] = Field(default=None, description="Fixed t, or null to search.")
    zero_stage: Optional[int] = Field(default=None, ge=0, le=3, description="Fixed ZeRO stage, or null to search.")
    layers_per_stage: Optional[list[PositiveCount]] = Field(
        default=None, description="Fixed split: units per stage in profile order (virtual stages in order).")
    data_parallel_overlap: Optional[FiniteFloat] = Field(
        default=None, ge=0, le=1,
        description="A further share of what the modelled overlaps (overlap) leave exposed of the "
                    "data-parallel sync, assumed hidden; null: 0.")
    overlap: Optional[list[Literal["grad-reduce", "param-gather", "tp-comm", "moe-a2a"]]] = Field(
        default=None,
        description="--overlap: the communication overlapped with compute (grad-reduce: the data-parallel "
                    "gradient reduce behind the backward, bucketed; param-gather: the updated weights' "
                    "all-gather behind the next forward, or ZeRO 3's prefetch; tp-comm: tensor-parallel "
                    "collectives chunked behind their GEMMs; moe-a2a: the MoE all-to-alls of one micro-batch "
                    "behind the other's compute in Megatron's combined 1F1B, overlap_moe_expert_parallel_comm); [] none; null: the launcher's defaults "
                    "(pipeplan.launchers.registry.launcher_overlaps).")
    ddp_bucket_size: Optional[PositiveCount] = Field(
        default=None,
        description="--ddp-bucket-size: parameters per gradient bucket with grad-reduce (Megatron's "
                    "--ddp-bucket-size); null: the launcher's (Megatron-core: max(40M, 1M x d)).")
    search_stages: Optional[bool] = Field(
        default=None, description="True in a cluster plan whose pipeline degree was searched (stages is the choice).")
    expert_parallel: Optional[PositiveCount] = Field(
        default=None,
        description="--expert-parallel: fixed expert-parallel degree E (it must divide d and the number of "
                    "experts), or null to search it (mixture-of-experts profiles; 1 for dense ones).")
    expert_tensor_parallel: Optional[PositiveCount] = Field(
        default=None, description="--expert-tensor-parallel: the experts' tensor-parallel degree ETP (it must "
                                  "divide t); null: 1.")
    expert_imbalance: Optional[FiniteFloat] = Field(
        default=None, ge=1, le=64,
        description="--expert-imbalance: the busiest rank's routed tokens over the balanced share (>= 1); "
                    "null: 1 (balanced routing).")
    precision: Optional[Literal[PRECISION_NAMES]] = Field(
        default=None,
        description="The profile's precision (how its GEMMs ran: fp8, mxfp8, nvfp4), recorded from it: it sets "
                    "the quantized weight copies (pipeplan.facts.training_state); null: bf16 throughout.")
    fp8_param_gather: Optional[bool] = Field(
        default=None,
        description="--fp8-param-gather (a quantized precision): the weights are kept quantized (Megatron-LM's "
                    "--fp8-param-gather, torchtitan's enable_fsdp_float8_all_gather) and gathered so; null: no.")
    compare: Optional[list[Text]] = Field(
        default=None,
        description="--compare: layouts to plan beside the winner, each 'd=..,t=..,p=..' with optional "
                    "zero=.., mbs=.. and e=..; null: none.")
    expert_data_parallel: Optional[PositiveCount] = Field(
        default=None,
        description="Internal: the expert-data-parallel degree t x d / (E x ETP) of one replica's cost model "
                    "(set by the cluster search; null in a request and in a plan file's settings).")
    recompute_modules: Optional[list[Literal[RECOMPUTE_MODULES]]] = Field(
        default=None, min_length=1,
        description="--recompute-modules: what selective recomputation recomputes, in Megatron-core's module "
                    "names (core_attn, layernorm, mlp, moe_act, moe, shared_experts, mla_up_proj), costed from "
                    "the profile's selective_modules; null: the attention core as the profile's "
                    "selective fields give it (Megatron's default, core_attn).")
    recompute_method: Optional[Literal["uniform", "block"]] = Field(
        default=None,
        description="--recompute-method (with --launcher megatron): how full recomputation runs, as Megatron's "
                    "flag: uniform (with recompute_num_layers 1: every layer rebuilt from its input, the default) "
                    "or block (the first recompute_num_layers transformer blocks of each stage recompute in full, "
                    "the rest keep everything); null: uniform 1.")
    recompute_num_layers: Optional[PositiveCount] = Field(
        default=None, description="--recompute-num-layers: N of recompute_method (Megatron's flag); null: 1.")
    selective_ac_option: Optional[str] = Field(
        default=None, pattern=r"^(op|[1-9][0-9]{0,5})$",
        description="--selective-ac-option (with --launcher torchtitan): what selective recomputation is, as "
                    "torchtitan's [activation_checkpoint] selective_ac_option: op (per-op: every other matmul's and "
                    "the attention's outputs saved, the rest recomputed; the profile's selective_op_sac) or N "
                    "(every N-th transformer block checkpointed in full, the others keep everything); "
                    "null: op under --launcher torchtitan.")
    cpu_offload_layers: Optional[PositiveCount] = Field(
        default=None,
        description="--cpu-offload-layers (with --launcher megatron): the first N transformer layers' saved "
                    "activations go to host memory in the forward and come back in the backward, Megatron's "
                    "--cpu-offloading --cpu-offloading-num-layers N (one pipeline rank, no recomputation); null: none.")
    context_parallel: Optional[PositiveCount] = Field(
        default=None,
        description="--context-parallel: fixed context-parallel degree C (the sequence split over C GPUs; "
                    "2 C must divide it), or null: 1.")

    def cap_bytes(self) -> float:
        """The per-GPU cap the request means: ``memory_cap_bytes``, else the cluster's (its spec or
        its GPU model's memory), else none (``inf``). The one place this rule is written.

        Raises
        ------
        BadInputError
            A cluster whose GPU the table does not know and that gives no cap.
        """
        return effective_cap_bytes(self.memory_cap_bytes, self.cluster)

    @model_validator(mode="after")
    def _stages_given(self) -> "PlanSettings":
        if self.stages is None and self.num_gpus is None:
            raise ValueError("stages: give the pipeline stages (--stages), or --gpus to search them")
        return self

    @model_serializer(mode="wrap")
    def _keep_null_bandwidth(self, handler) -> dict[str, Any]:
        # Files drop nulls, but a null bandwidth (infinite) differs from the default: keep it.
        data = handler(self)
        if self.bandwidth_bytes_per_s is None and "bandwidth_bytes_per_s" not in data:
            ordered = {}
            for name in type(self).model_fields:
                if name in data:
                    ordered[name] = data[name]
                elif name == "bandwidth_bytes_per_s":
                    ordered[name] = None
            data = ordered
        return data


class RecomputePart(_Strict):
    """One selective-recomputation module's share of a stage, per micro-batch."""

    recompute_ms: PlanMs = Field(description="Its forward run again in backward, over the stage's layers "
                                             "(part of backward_ms and backward_input_ms).")
    saved_bytes: PlanBytes = Field(description="Activation bytes it frees, over the stage's layers (activation_bytes "
                                               "less their sum is selective_activation_bytes).")


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
    param_bytes: PlanBytes = Field(default=0, description="Bytes of the stage's parameters, with the copy of each "
                                   "tied weight whose later user it holds without its first.")
    activation_bytes: PlanBytes = Field(default=0, description="Bytes kept for backward per micro-batch in flight.")
    in_flight: Count = Field(default=1, description="Micro-batches whose activations it holds at its peak.")
    recompute: bool = Field(
        default=False,
        description="Recomputes in backward: its whole forward, one layer at a time from each layer's kept "
                    "input, or with recompute_granularity selective each layer's attention core.")
    recompute_granularity: Optional[Literal["full", "selective"]] = Field(
        default=None,
        description="With recompute: full (also when absent) or selective (Megatron's "
                    "--recompute-granularity).")
    selective_activation_bytes: Optional[PlanBytes] = Field(
        default=None, description="Selective stages: bytes kept for backward per micro-batch in flight.")
    peak_memory_bytes: PlanBytes = Field(description="Predicted peak memory of the stage.")
    # --- schema_version 2 (cluster plans): the stage's share of its GPU's memory, by part ---
    weight_bytes: Optional[PlanBytes] = Field(default=None, description="Weights held (ZeRO 3: the shard and the gathered units).")
    gradient_bytes: Optional[PlanBytes] = Field(default=None, description="Gradients held (ZeRO 2-3: the shard).")
    optimizer_bytes: Optional[PlanBytes] = Field(default=None, description="Optimizer state held (ZeRO 1-3: the shard).")
    quantized_weight_bytes: Optional[PlanBytes] = Field(
        default=None, description="A quantized precision's weight copies held (Transformer Engine's row-wise and "
                                  "column-wise fp8/mxfp8/nvfp4 copies; ZeRO 3: the shard); null: none.")
    peak_activation_bytes: Optional[PlanBytes] = Field(default=None, description="Activations at the stage's peak.")
    context_buffer_bytes: Optional[PlanBytes] = Field(
        default=None, description="Context-parallel plans: the received KV chunks of the ring exchange (two "
                                  "buffers of one chunk's K and V, and of its gradients in the backward), part "
                                  "of peak_activation_bytes.")
    expert_state_bytes: Optional[PlanBytes] = Field(
        default=None, description="Mixture-of-experts plans: the routed experts' weights, gradients and optimizer "
                                  "state the stage holds (1 / (E x ETP) of them, sharded over the "
                                  "expert-data-parallel group); weight_bytes, gradient_bytes and optimizer_bytes "
                                  "are then the dense part's.")
    working_bytes: Optional[PlanBytes] = Field(
        default=None, description="What the stage's largest layer allocates and frees within one pass above what it "
                                  "keeps (the loss's working memory at the head: pipeplan.facts.loss), once, part "
                                  "of peak_memory_bytes (and of peak_activation_bytes); null: none.")
    # --- schema_version 2: full recomputation's kept bytes ---
    checkpoint_bytes: Optional[PlanBytes] = Field(
        default=None, description="Full-recompute stages: bytes kept per micro-batch in flight, every layer's "
                                  "input (each layer is recomputed from it, one at a time). Null in plans from "
                                  "before it was recorded, which kept the stage's input alone.")
    recompute_modules: Optional[dict[Literal[RECOMPUTE_MODULES], RecomputePart]] = Field(
        default=None, description="Selective stages of a plan made with --recompute-modules: per module, its time "
                                  "and the bytes it frees (the parts of the stage's recomputation).")


class Predicted(_Strict):
    """Predicted performance; the named parts add up to ``iteration_ms``."""

    iteration_ms: PlanMs
    bubble_fraction: Fraction = Field(description="Idle share of all ranks' time.")
    samples_per_second: Rate
    bottleneck_stage: Count
    compute_ms: PlanMs = Field(default=0.0, description="Busy time of the bottleneck rank.")
    bubble_ms: PlanMs = Field(default=0.0, description="Idle time of the bottleneck rank.")
    transfer_ms: PlanMs = Field(default=0.0, description="Exposed transfer time of the bottleneck rank.")
    overhead_ms: Optional[PlanMs] = Field(
        default=None, description="The schedule's own time on the bottleneck rank (settings.action_overhead_ms "
                                  "per action); null when none was set.")
    # --- schema_version 2 (cluster plans): with compute_ms, bubble_ms, overhead_ms and transfer_ms they
    # add up to iteration_ms; compute_ms then leaves out the tensor-parallel collectives ---
    tensor_parallel_ms: Optional[PlanMs] = Field(default=None, description="Tensor-parallel collectives.")
    data_parallel_ms: Optional[PlanMs] = Field(default=None, description="What the data-parallel sync adds.")
    optimizer_ms: Optional[PlanMs] = Field(default=None, description="The optimizer step.")
    gradient_reduce_ms: Optional[PlanMs] = Field(
        default=None, description="With an overlap of the sync (settings.overlap): the gradient reduce's share of "
                                  "data_parallel_ms (exposed); null: no overlap modelled.")
    param_gather_ms: Optional[PlanMs] = Field(
        default=None, description="With an overlap of the sync: the parameter all-gathers' share of "
                                  "data_parallel_ms (exposed); gradient_reduce_ms + param_gather_ms = data_parallel_ms.")
    data_parallel_hidden_ms: Optional[PlanMs] = Field(
        default=None, description="With an overlap of the sync: what the overlaps hid of the sync of the rank that "
                                  "ends last (not part of the iteration).")
    tensor_parallel_hidden_ms: Optional[PlanMs] = Field(
        default=None, description="With tp-comm: the critical rank's tensor-parallel collectives hidden behind "
                                  "their GEMMs (not part of the iteration; tensor_parallel_ms is the exposed rest).")
    expert_all_to_all_hidden_ms: Optional[PlanMs] = Field(
        default=None, description="With moe-a2a: the critical rank's dispatch and combine all-to-alls hidden behind "
                                  "the other micro-batch's compute (not part of the iteration; expert_dispatch_ms "
                                  "and expert_combine_ms are the exposed rest).")
    expert_dispatch_ms: Optional[PlanMs] = Field(
        default=None, description="Mixture of experts: the token dispatch all-to-alls (forward and backward).")
    expert_compute_ms: Optional[PlanMs] = Field(
        default=None, description="Mixture of experts: the routed experts' GEMMs for the tokens the rank receives.")
    expert_combine_ms: Optional[PlanMs] = Field(
        default=None, description="Mixture of experts: the combine all-to-alls (forward and backward).")
    shared_expert_ms: Optional[PlanMs] = Field(
        default=None, description="Mixture of experts: the shared experts' MLP.")
    quantize_ms: Optional[PlanMs] = Field(
        default=None, description="A quantized precision (settings.precision): the casts of the GEMMs' inputs and "
                                  "output gradients outside the experts' parts; null: none.")
    context_exchange_ms: Optional[PlanMs] = Field(
        default=None, description="Context parallelism: the ring's KV sends not hidden behind the attention "
                                  "blocks they overlap (forward and backward), out of compute_ms.")
    cpu_offload_ms: Optional[PlanMs] = Field(
        default=None, description="CPU activation offload (settings.cpu_offload_layers): the host-link copies "
                                  "(D2H in the forward, H2D in the backward) that compute does not cover; null: none.")
    host_wait_ms: Optional[PlanMs] = Field(
        default=None, description="The time the GPU waits for the host to launch its kernels (an analytic "
                                  "profile's host_wait_*_ms: units whose kernels are shorter than their "
                                  "launches), out of compute_ms; null: every unit GPU-bound.")
    tokens_per_second_per_gpu: Optional[NonNegativeFloat] = Field(default=None, description="Training throughput per GPU.")
    model_flops_utilization: Optional[FiniteFloat] = Field(
        default=None, ge=0, description="Model FLOPs per iteration (no recompute) over the GPUs' peak (MFU).")


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
    iteration_ms: Optional[PlanMs] = Field(
        default=None, description="Its predicted iteration, where it was planned in full; null where it was not "
                                  "(pruned, over the cap, refused).")
    lower_bound_ms: Optional[PlanMs] = Field(
        default=None, description="Cluster runners-up only: for a layout whose search was pruned against the best "
                                  "iteration found so far, a proven lower bound on its iteration (a bound, not a "
                                  "predicted time; iteration_ms is then null). Null where it was planned.")
    peak_memory_bytes: Optional[PlanBytes] = None
    reason: Text
    # --- cluster runners-up and --compare layouts (null in pipeline-only plans) ---
    data: Optional[PositiveCount] = Field(default=None, description="Cluster plans: the layout's data-parallel degree d.")
    tensor: Optional[PositiveCount] = Field(default=None, description="Cluster plans: the layout's tensor-parallel degree t.")
    pipeline: Optional[PositiveCount] = Field(default=None, description="Cluster plans: the layout's pipeline ranks p.")
    expert: Optional[PositiveCount] = Field(default=None, description="Mixture-of-experts cluster plans: E.")
    zero_stage: Optional[int] = Field(default=None, ge=0, le=3, description="Cluster plans: the ZeRO stage of its plan.")
    model_flops_utilization: Optional[FiniteFloat] = Field(
        default=None, ge=0, description="Cluster plans: its MFU, where it was planned in full and the GPU's peak is known.")
    label: Optional[Text] = Field(
        default=None, description="Cluster plans: why this layout is listed (e.g. 'best at t=8', 'pure data "
                                  "parallel', 'next best layout', or the --compare text that named it).")


class SolverInfo(_Strict):
    """How the split was found."""

    method: SolverMethod = Field(description="How the split was found: " + "; ".join(
        f"{name}: {text}" for name, text in SOLVER_METHODS.items()) + ".")
    optimal: bool = Field(description="Whether the split is proven optimal.")
    lower_bound_ms: Optional[PlanMs] = Field(
        default=None, description="Proven lower bound on the slowest stage's time (equals it when optimal)."
    )
    seconds: NonNegativeFloat = Field(description="Solver time; 0 unless recorded with --record-time, so plans are reproducible.")
    failure: Optional[Text] = Field(
        default=None, description="Why an exact solver gave up and the split came from another (e.g. the "
                                  "ILP solve failed); also in the plan's notes. Null when none did.")


class ReserveParts(_Strict):
    """The reserve by part (cluster plans): what a real job holds per GPU beside the plan; the parts
    add up to ``Plan.reserve_bytes`` (docs/cluster-model.md, Memory a real job sees)."""

    cuda_context_bytes: PlanBytes = Field(description="The CUDA context (driver state, loaded kernels).")
    cublas_workspace_bytes: PlanBytes = Field(description="PyTorch's cuBLAS and cuBLASLt workspaces.")
    nccl_buffer_bytes: PlanBytes = Field(description="NCCL's buffers for the communicators the layout holds.")
    fragmentation_bytes: PlanBytes = Field(description="The caching allocator's share of the fullest GPU's plan.")
    spec_reserve_bytes: Optional[PlanBytes] = Field(
        default=None, description="The cluster spec's reserve, replacing the three fixed parts (then 0); null: none.")

    @property
    def total_bytes(self) -> int:
        return (self.cuda_context_bytes + self.cublas_workspace_bytes + self.nccl_buffer_bytes
                + self.fragmentation_bytes + (self.spec_reserve_bytes or 0))


class Plan(_Strict):
    """A pipeline plan."""

    schema_version: Literal[1, 2] = Field(description="2 where a version-2 field is set, else 1.")
    profile: PlanProfileRef
    settings: PlanSettings
    schedule: Literal[SCHEDULES]
    virtual_stages: PositiveCount = Field(default=1, description="Stages per rank.")
    microbatch_size: PositiveCount
    num_microbatches: MicrobatchCount
    stages: list[PlanStage] = Field(min_length=1)
    predicted: Predicted
    ranks: list[RankSummary] = Field(default_factory=list)
    alternatives: list[Alternative] = Field(default_factory=list)
    notes: list[Text] = Field(default_factory=list, description="Assumptions the planner made.")
    solver: SolverInfo
    parallelism: Optional[Parallelism] = Field(
        default=None, description="The cluster layout (schema_version 2); null: d = t = 1 on `stages` GPUs.")
    reserve_bytes: Optional[PlanBytes] = Field(
        default=None, description="Per GPU, the memory not planned (the CUDA context, workspaces, NCCL buffers and "
                                  "the allocator's fragmentation share; reserve_parts by part).")
    reserve_parts: Optional[ReserveParts] = Field(
        default=None, description="reserve_bytes by part (cluster plans); null in older plans.")
    comparisons: Optional[list[Alternative]] = Field(
        default=None, description="Cluster plans with --compare: each named layout planned in full under the same "
                                  "rules (or why it does not fit), beside the winner; null when none was named.")

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
        if ranks is None:
            raise ValueError("settings.stages: a plan records its pipeline ranks")
        if self.parallelism is not None and self.parallelism.pipeline != ranks:
            raise ValueError(f"parallelism.pipeline: {self.parallelism.pipeline} is not settings.stages {ranks}")
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
        if self.reserve_parts is not None and self.reserve_parts.total_bytes != self.reserve_bytes:
            raise ValueError(f"reserve_parts: they add up to {self.reserve_parts.total_bytes} bytes, not "
                             f"reserve_bytes {self.reserve_bytes}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _missing_bandwidth_is_infinite(cls, data: Any) -> Any:
        # Plan files from before the 25 GB/s default dropped a null (infinite) bandwidth.
        if isinstance(data, dict) and isinstance(data.get("settings"), dict) \
                and "bandwidth_bytes_per_s" not in data["settings"]:
            data = {**data, "settings": {**data["settings"], "bandwidth_bytes_per_s": None}}
        return data
