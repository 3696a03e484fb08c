"""The profile format (schema_version 2, reads 1): per-layer time and memory of one model.

A profile is what the planner reads. It is produced by ``pipeplan profile`` (measured),
``pipeplan import`` (imported), ``pipeplan profile --analytic`` or written by hand (analytic).
See docs/formats.md.

Version 2 adds, per cost entry, the tensor-parallel degree it was costed at (absent: 1), the
bytes of that degree's tensor-parallel collectives, the rank's parameter bytes at that degree and
what selective recomputation keeps and costs. A layer then has one entry per (micro-batch size,
tensor-parallel degree); the planner reads the degree-1 entries (:meth:`Layer.cost_at`).
Version 1 files read unchanged: none of the new fields is set, so every entry is degree 1.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeplan.facts.loss import LOSS_FORMS
from pipeplan.facts.precision import PRECISIONS
from pipeplan.formats.limits import Bytes, Ms, Name, OptionalRatio, PositiveCount, Text
from pipeplan.formats.measurement import check_measurement

__all__ = ["Device", "LayerCost", "Layer", "Profile", "TiedWeight", "Experts", "ParameterCounts", "NonNegativeMs",
           "LAYER_KINDS", "DTYPES", "PRECISION_NAMES", "SCHEMA_VERSIONS", "V2_COST_FIELDS", "TP_COLLECTIVES",
           "SelectiveModule", "RECOMPUTE_MODULES"]


# Finite ranges (pipeplan.formats.limits): 0..1e9 ms, 0..2**53 bytes, no booleans or strings.
NonNegativeMs = Ms
NonNegativeBytes = Bytes
#: A model's parameter count: hundreds of billions, beyond the formats' Count (10^9); the range
#: of bytes (0..2^53) fits any model whose bytes do.
ParameterCount = Bytes

#: Training dtypes a profile may name (bytes per element: 8, 4, 2 or 1).
#: The quantized ``--precision`` recipes a profile may name (pipeplan.facts.precision; bf16 is absent).
PRECISION_NAMES = tuple(name for name, recipe in PRECISIONS.items() if recipe.quantized)

DTYPES = ("fp64", "float64", "fp32", "float32", "tf32", "bf16", "bfloat16", "fp16", "float16")

#: Profile versions this pipeplan reads; it writes 2 only where a version-2 field is set.
SCHEMA_VERSIONS = (1, 2)

#: How a cost entry's tensor-parallel bytes move: all-reduces (Megatron's tensor parallelism), or
#: reduce-scatters and all-gathers (with sequence parallelism).
TP_COLLECTIVES = ("all_reduce", "reduce_scatter_all_gather")

#: Roles a layer can declare; exporters (Megatron's layout) use them.
LAYER_KINDS = ("embedding", "block", "norm", "head", "other")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Device(_Strict):
    """Where the profile was measured."""

    name: Name = Field(description="Device name, e.g. 'NVIDIA H200' or 'cpu'.")
    memory_bytes: Optional[NonNegativeBytes] = Field(
        default=None, description="Device memory, if known."
    )


#: Megatron-core's selective-recomputation modules (``TransformerConfig.recompute_modules``, its
#: ``--recompute-modules``): ``core_attn`` the attention core, ``layernorm`` the input and pre-MLP
#: norms' outputs, ``mlp`` a dense MLP, ``moe_act`` the routed experts' activation, ``moe`` the whole
#: MoE layer, ``shared_experts`` its shared experts, ``mla_up_proj`` multi-latent attention's up
#: projections and rotary (docs/cost-model.md, "Selective modules").
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


class SelectiveModule(_Strict):
    """What recomputing one of Megatron's selective modules in backward frees and costs."""

    saved_bytes: NonNegativeBytes = Field(
        description="Activation bytes per micro-batch in flight that the layer no longer keeps "
        "(of activation_bytes) when this module is recomputed.")
    recompute_ms: NonNegativeMs = Field(
        description="Extra time per micro-batch of running the module's forward again in backward.")


class LayerCost(_Strict):
    """One layer's cost at one micro-batch size."""

    microbatch_size: PositiveCount = Field(description="Samples per micro-batch.")
    forward_ms: NonNegativeMs = Field(description="Forward time of one micro-batch.")
    backward_ms: NonNegativeMs = Field(description="Whole backward time of one micro-batch.")
    activation_bytes: NonNegativeBytes = Field(
        description="Bytes this layer keeps for backward, per micro-batch in flight."
    )
    output_bytes: NonNegativeBytes = Field(
        description="Bytes of the layer's output, sent to consumers in another stage."
    )
    backward_input_ms: Optional[NonNegativeMs] = Field(
        default=None,
        description="Input-gradient pass (B) of a split backward, if measured apart. With "
        "backward_weight_ms it may add up to more than backward_ms: splitting costs extra work.",
    )
    backward_weight_ms: Optional[NonNegativeMs] = Field(
        default=None, description="Weight-gradient pass (W) that follows B in a split backward."
    )
    forward_spread: Optional[OptionalRatio] = Field(
        default=None, description="Coefficient of variation of the forward repeats (0.05 = 5%)."
    )
    backward_spread: Optional[OptionalRatio] = Field(
        default=None, description="Coefficient of variation of the backward repeats."
    )
    # --- schema_version 2 ---
    tensor_parallel: Optional[int] = Field(
        default=None, gt=0,
        description="Tensor-parallel degree t this entry is costed at (times, bytes: one rank's "
        "share). Absent: 1.",
    )
    param_bytes: Optional[NonNegativeBytes] = Field(
        default=None,
        description="One rank's parameter bytes at this degree (sharded weights plus replicated "
        "ones). Absent: the layer's param_bytes (degree 1).",
    )
    tensor_parallel_collective: Optional[Literal["all_reduce", "reduce_scatter_all_gather"]] = Field(
        default=None,
        description="How the tensor-parallel bytes move: all_reduce (ring cost 2(t-1)/t of the "
        "payload per rank), or reduce_scatter_all_gather with sequence parallelism (each "
        "(t-1)/t; an all-reduce counts as one of each).",
    )
    tensor_parallel_forward_bytes: Optional[NonNegativeBytes] = Field(
        default=None,
        description="Payload of the forward's tensor-parallel collectives per micro-batch: the sum "
        "of each collective's full (unsharded) buffer.",
    )
    tensor_parallel_backward_bytes: Optional[NonNegativeBytes] = Field(
        default=None, description="The same for the backward (B and W together)."
    )
    tensor_parallel_forward_count: Optional[int] = Field(
        default=None, ge=0, description="Collective calls in the forward (for latency terms)."
    )
    tensor_parallel_backward_count: Optional[int] = Field(
        default=None, ge=0, description="Collective calls in the backward."
    )
    sequence_parallel: Optional[bool] = Field(
        default=None,
        description="Whether the entry assumes Megatron's sequence parallelism (norms, dropouts "
        "and residuals sharded along the sequence). Absent: false.",
    )
    selective_activation_bytes: Optional[NonNegativeBytes] = Field(
        default=None,
        description="Bytes kept for backward under selective recomputation (the attention core "
        "recomputed in backward, as Megatron's --recompute-granularity selective).",
    )
    selective_recompute_ms: Optional[NonNegativeMs] = Field(
        default=None,
        description="Extra forward time per micro-batch of recomputing the attention core "
        "under selective recomputation.",
    )
    expert_param_bytes: Optional[NonNegativeBytes] = Field(
        default=None,
        description="Of param_bytes at this degree, one rank's bytes of the routed experts (a "
        "mixture-of-experts layer). Absent at degree 1 (the layer's expert_param_bytes).",
    )
    expert_forward_ms: Optional[NonNegativeMs] = Field(
        default=None,
        description="Of forward_ms, the routed experts' GEMMs and activation for the tokens one rank "
        "routes (top-k x its tokens, balanced): what expert parallelism moves to other ranks and "
        "--expert-imbalance scales. Absent: no routed experts.",
    )
    expert_backward_ms: Optional[NonNegativeMs] = Field(
        default=None, description="Of backward_ms, the routed experts' part (input and weight gradients).")
    shared_expert_forward_ms: Optional[NonNegativeMs] = Field(
        default=None, description="Of forward_ms, the shared experts' MLP every token passes through.")
    shared_expert_backward_ms: Optional[NonNegativeMs] = Field(
        default=None, description="Of backward_ms, the shared experts' part.")
    quantize_forward_ms: Optional[NonNegativeMs] = Field(
        default=None,
        description="Of forward_ms, a quantized precision's casts (the GEMMs' inputs to fp8/mxfp8/nvfp4) outside "
        "the routed and shared experts' parts. Absent: no quantized GEMMs (the profile's precision).")
    quantize_backward_ms: Optional[NonNegativeMs] = Field(
        default=None, description="Of backward_ms, the casts of the output gradients (as quantize_forward_ms).")
    host_wait_forward_ms: Optional[NonNegativeMs] = Field(
        default=None,
        description="Of forward_ms, the time the GPU waits for the host to launch the unit's kernels (the "
        "analytic model's host-overhead term: launches x host time per kernel beyond the GPU's own time). "
        "Absent: the unit is GPU-bound.")
    host_wait_backward_ms: Optional[NonNegativeMs] = Field(
        default=None, description="Of backward_ms, the time the GPU waits for the host (as host_wait_forward_ms).")
    host_forward_ms: Optional[NonNegativeMs] = Field(
        default=None,
        description="The host's time to launch the forward's kernels (an MoE unit's, analytic: launches x host "
        "time per kernel), whether or not the GPU waits for it. Absent: not recorded.")
    host_backward_ms: Optional[NonNegativeMs] = Field(
        default=None, description="The host's time to launch the backward's kernels (as host_forward_ms).")
    expert_host_forward_ms: Optional[NonNegativeMs] = Field(
        default=None,
        description="What each local expert beyond the first adds to host_forward_ms: Transformer Engine's grouped "
        "GEMM launches one GEMM per local expert (num_experts / E of them at expert-parallel degree E).")
    expert_host_backward_ms: Optional[NonNegativeMs] = Field(
        default=None, description="Of the backward, as expert_host_forward_ms.")
    expert_dispatch_bytes: Optional[NonNegativeBytes] = Field(
        default=None,
        description="Bytes one rank sends to the experts per micro-batch and pass in one dispatch "
        "(and gets back in one combine): its tokens x top-k x hidden x dtype bytes (its tokens: "
        "the micro-batch's, 1/t of them under sequence parallelism).",
    )
    expert_activation_bytes: Optional[NonNegativeBytes] = Field(
        default=None,
        description="Of activation_bytes (and of selective_activation_bytes), the routed experts' "
        "share for balanced routing: the dispatched top-k copies of the tokens and the experts' own "
        "tensors. --expert-imbalance f makes the busiest rank keep f times it. Absent: 0.",
    )
    selective_modules: Optional[dict[Literal[RECOMPUTE_MODULES], SelectiveModule]] = Field(
        default=None,
        description="Per Megatron selective-recomputation module (RECOMPUTE_MODULES; its "
        "--recompute-modules names) that this layer has, the bytes its recompute frees and its "
        "time. A module absent is not offered for this layer (it frees nothing here).",
    )
    selective_op_sac: Optional[SelectiveModule] = Field(
        default=None,
        description="torchtitan's per-op selective activation checkpointing of this block "
        "([activation_checkpoint] mode = \"selective\", selective_ac_option = \"op\"): the bytes it frees "
        "(of activation_bytes: what the policy neither saves nor is the block's input) and the forward it "
        "runs again (every op but the saved matmuls and attention). Absent: a unit torchtitan does not "
        "checkpoint (embedding, norm, head) or one pipeplan does not cost it for (docs/cost-model.md).",
    )

    working_bytes: Optional[NonNegativeBytes] = Field(
        default=None,
        description="Bytes this layer allocates and frees within one pass (forward or backward), above "
        "activation_bytes, at their largest: transient working memory such as the loss's fp32 copies "
        "of the logits (docs/cost-model.md, \"The loss's working memory\"). A stage's peak adds its "
        "largest layer's once. Absent: 0.",
    )
    loss_working_bytes: Optional[dict[Literal[LOSS_FORMS], NonNegativeBytes]] = Field(
        default=None,
        description="A head's working_bytes per cross-entropy implementation (pipeplan.facts.loss: "
        "vocab-parallel, Megatron-core's; torch-eager, torchtitan's F.cross_entropy(pred.float())): the "
        "planner takes working_bytes from the launcher's (--launcher), the default form without one.",
    )

    @model_validator(mode="after")
    def _backward_split_whole(self) -> "LayerCost":
        if self.expert_param_bytes is not None and self.param_bytes is not None \
                and self.expert_param_bytes > self.param_bytes:
            raise ValueError(
                f"expert_param_bytes: {self.expert_param_bytes} exceeds param_bytes {self.param_bytes} "
                f"(the experts' bytes are part of the rank's parameter bytes)"
            )
        if (self.backward_input_ms is None) != (self.backward_weight_ms is None):
            raise ValueError(
                "give both backward_input_ms and backward_weight_ms, or neither"
            )
        op_sac = {"selective_op_sac": self.selective_op_sac} if self.selective_op_sac is not None else {}
        for module, given in {**(self.selective_modules or {}), **op_sac}.items():
            if given.saved_bytes > self.activation_bytes:
                where = module if module == "selective_op_sac" else f"selective_modules.{module}"
                raise ValueError(f"{where}.saved_bytes: {given.saved_bytes} exceeds "
                                 f"activation_bytes {self.activation_bytes} (it frees part of them)")
        if (self.selective_activation_bytes is None) != (self.selective_recompute_ms is None):
            raise ValueError(
                "give both selective_activation_bytes and selective_recompute_ms, or neither"
            )
        return self

    @property
    def degree(self) -> int:
        """The tensor-parallel degree (1 where the field is absent)."""
        return self.tensor_parallel or 1

    def uses_version_2(self) -> bool:
        """Whether any field of schema_version 2 is set."""
        return any(getattr(self, name) is not None for name in V2_COST_FIELDS)


#: Cost fields an entry above degree 1 must give.
_NEEDED_ABOVE_DEGREE_1 = ("param_bytes", "tensor_parallel_collective", "tensor_parallel_forward_bytes",
                          "tensor_parallel_backward_bytes")

#: Cost fields that need schema_version 2.
V2_COST_FIELDS = tuple(
    name for name in LayerCost.model_fields
    if name.startswith(("tensor_parallel", "selective_")) or name in ("param_bytes", "sequence_parallel",
                                                                       "expert_param_bytes",
                                                                       "working_bytes", "loss_working_bytes")
    or name.startswith(("expert_", "shared_expert_", "quantize_"))
)


class Layer(_Strict):
    """One partitionable unit: a module of the model, or a node of an imported graph."""

    name: Name = Field(description="Unique; the module's dotted name for torch models; plain text.")
    param_bytes: NonNegativeBytes = Field(description="Bytes of the layer's parameters (unsharded: degree 1).")
    costs: list[LayerCost] = Field(
        min_length=1,
        description="One entry per (micro-batch size, tensor-parallel degree); degree 1 always present.",
    )
    kind: Optional[Literal["embedding", "block", "norm", "head", "other"]] = Field(
        default=None, description="The layer's role, for launchers that name layers by role."
    )
    description: Optional[Text] = Field(default=None, description="Free text, e.g. the module's repr.")
    expert_param_bytes: Optional[NonNegativeBytes] = Field(
        default=None,
        description="Of param_bytes, the routed experts' bytes (all of the profile's "
        "experts.num_experts experts of this layer; one expert: this / num_experts). The rest, "
        "param_bytes - expert_param_bytes, is the layer's dense part (attention, norms, router, "
        "shared experts). Absent: no routed experts.",
    )

    @model_validator(mode="after")
    def _one_cost_per_size(self) -> "Layer":
        if self.expert_param_bytes is not None and self.expert_param_bytes > self.param_bytes:
            raise ValueError(
                f"expert_param_bytes: {self.expert_param_bytes} exceeds param_bytes {self.param_bytes} "
                f"(the experts' bytes are part of the layer's parameter bytes)"
            )
        keys = [(c.microbatch_size, c.degree) for c in self.costs]
        if len(set(keys)) != len(keys):
            if all(c.tensor_parallel is None for c in self.costs):
                raise ValueError(f"costs: micro-batch sizes repeat: {sorted(c.microbatch_size for c in self.costs)}")
            repeated = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(
                f"costs: (micro-batch size, tensor_parallel) pairs repeat: {repeated}; give one entry per pair"
            )
        for index, cost in enumerate(self.costs):
            if cost.degree == 1 and cost.expert_param_bytes is not None:
                raise ValueError(
                    f"costs[{index}].expert_param_bytes: give it at tensor_parallel 1 as the layer's "
                    f"expert_param_bytes, not in the entry"
                )
            if cost.degree == 1 and cost.param_bytes is not None and cost.param_bytes != self.param_bytes:
                raise ValueError(
                    f"costs[{index}].param_bytes: {cost.param_bytes} at tensor_parallel 1 differs from the "
                    f"layer's param_bytes {self.param_bytes}; leave it out at degree 1"
                )
            if cost.degree > 1:
                # A planner that reads degree t needs one rank's share and its traffic; absent
                # would silently mean "unsharded" or "free", so they are required there.
                for needed in _NEEDED_ABOVE_DEGREE_1:
                    if getattr(cost, needed) is None:
                        raise ValueError(
                            f"costs[{index}].{needed}: needed at tensor_parallel {cost.degree} "
                            f"(one rank's share, see docs/formats.md)"
                        )
        return self

    def cost_at(self, microbatch_size: int, tensor_parallel: int = 1) -> LayerCost:
        """The entry at ``microbatch_size`` and ``tensor_parallel`` (default: degree 1, what the
        pipeline planner reads)."""
        for cost in self.costs:
            if cost.microbatch_size == microbatch_size and cost.degree == tensor_parallel:
                return cost
        raise KeyError((microbatch_size, tensor_parallel) if tensor_parallel != 1 else microbatch_size)

    def param_bytes_at(self, tensor_parallel: int = 1) -> int:
        """One rank's parameter bytes at ``tensor_parallel`` (the layer's own at degree 1)."""
        if tensor_parallel == 1:
            return self.param_bytes
        for cost in self.costs:
            if cost.degree == tensor_parallel:
                if cost.param_bytes is None:
                    raise KeyError(tensor_parallel)
                return cost.param_bytes
        raise KeyError(tensor_parallel)


class TiedWeight(_Strict):
    """One parameter shared by several layers (tied weights, e.g. the embedding and the LM head)."""

    name: Name = Field(description="The parameter's name in the model (its first name).")
    layers: list[Name] = Field(min_length=2, description="The layers that use it; the first counts its bytes.")
    param_bytes: NonNegativeBytes = Field(
        description="Its bytes, counted once in the first layer's param_bytes; a stage that holds "
        "another of these layers but not the first keeps a copy of this size."
    )


class Experts(_Strict):
    """The mixture of experts a model's routed layers share (those with expert_param_bytes)."""

    num_experts: PositiveCount = Field(
        description="Routed experts per MoE layer: what expert parallelism divides (it must divide this).")
    experts_per_token: PositiveCount = Field(description="Top-k: routed experts each token is sent to.")
    expert_intermediate_size: PositiveCount = Field(description="Inner (hidden) width of one routed expert.")
    shared_expert_intermediate_size: Optional[PositiveCount] = Field(
        default=None,
        description="Inner width of the shared-expert MLP every token also passes through "
        "(DeepSeek-V3: n_shared_experts x expert width); absent: none.")

    @model_validator(mode="after")
    def _top_k(self) -> "Experts":
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token: {self.experts_per_token} exceeds num_experts {self.num_experts}")
        return self


class ParameterCounts(_Strict):
    """The model's parameters, in elements (not bytes)."""

    total: ParameterCount = Field(description="Every parameter of the layers, each tied weight once.")
    active: ParameterCount = Field(
        description="Parameters one token passes through: total less the routed experts it is not "
        "sent to (equal to total for a dense model).")

    @model_validator(mode="after")
    def _active_le_total(self) -> "ParameterCounts":
        if self.active > self.total:
            raise ValueError(f"active: {self.active} exceeds total {self.total}")
        return self


class Profile(_Strict):
    """A whole model's profile; layers in a topological order."""

    schema_version: Literal[1, 2] = Field(
        description="Format version: 2 where a cost entry sets a version-2 field (tensor_parallel, "
        "param_bytes, the tensor-parallel bytes, sequence_parallel, the selective fields), else 1."
    )
    model: Name = Field(description="Model name.")
    source: Literal["measured", "analytic", "imported"] = Field(description="How the numbers were obtained.")
    device: Device
    dtype: Literal[DTYPES] = Field(description="Training dtype: fp32, bf16, fp16, ...")
    precision: Optional[Literal[PRECISION_NAMES]] = Field(
        default=None,
        description="How the transformer blocks' GEMMs ran (--precision: fp8, mxfp8, nvfp4; "
                    "pipeplan.facts.precision); absent: in the training dtype (bf16).")
    sequence_length: Optional[PositiveCount] = Field(default=None, description="Tokens per sample, for LMs.")
    layers: list[Layer] = Field(min_length=1)
    edges: Optional[list[tuple[Name, Name]]] = Field(
        default=None,
        description="[src, dst] pairs; absent means a chain in list order.",
    )
    measurement: Optional[dict[str, Any]] = Field(
        default=None,
        description="How it was measured: torch version, repeats, whole-model check, load.",
    )
    tied_weights: Optional[list[TiedWeight]] = Field(
        default=None,
        description="Parameters shared by several layers; absent means none.",
    )
    parameters: Optional[ParameterCounts] = Field(
        default=None, description="Total and active parameter counts (analytic profiles write them).")
    experts: Optional[Experts] = Field(
        default=None,
        description="The mixture of experts of the layers that give expert_param_bytes; absent: a dense model.")

    @field_validator("measurement")
    @classmethod
    def _measurement_read_by_the_planner(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        check_measurement(value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "Profile":
        seen: dict[str, int] = {}
        for index, layer in enumerate(self.layers):
            if layer.name in seen:
                raise ValueError(
                    f"layers[{index}].name: duplicate layer name {layer.name!r} "
                    f"(also layers[{seen[layer.name]}])"
                )
            seen[layer.name] = index
        if self.schema_version == 1:
            for index, layer in enumerate(self.layers):
                for k, cost in enumerate(layer.costs):
                    if cost.uses_version_2():
                        field = next(n for n in V2_COST_FIELDS if getattr(cost, n) is not None)
                        raise ValueError(
                            f"layers[{index}].costs[{k}].{field}: needs schema_version 2 (this file says 1)"
                        )
        keys = sorted((c.microbatch_size, c.degree) for c in self.layers[0].costs)
        for index, layer in enumerate(self.layers):
            other = sorted((c.microbatch_size, c.degree) for c in layer.costs)
            if other != keys:
                if all(d == 1 for _, d in keys + other):
                    raise ValueError(
                        f"layers[{index}].costs: micro-batch sizes {[b for b, _ in other]} differ from "
                        f"layers[0]'s {[b for b, _ in keys]}; every layer needs the same sizes"
                    )
                raise ValueError(
                    f"layers[{index}].costs: (micro-batch size, tensor_parallel) pairs {other} differ from "
                    f"layers[0]'s {keys}; every layer needs the same pairs"
                )
        sizes = sorted(b for b, d in keys if d == 1)
        for degree in sorted({d for _, d in keys}):
            at = sorted(b for b, d in keys if d == degree)
            if at != sizes:
                what = "none" if not sizes else f"{sizes}"
                raise ValueError(
                    f"layers[0].costs: tensor_parallel {degree} has micro-batch sizes {at}, degree 1 has "
                    f"{what}; every degree needs the same sizes, and degree 1 (what the pipeline planner "
                    f"reads) must be present"
                )
        first_edge: dict[tuple[str, str], int] = {}
        for index, (src, dst) in enumerate(self.edges or ()):
            if (src, dst) in first_edge:
                raise ValueError(
                    f"edges[{index}]: [{src!r}, {dst!r}] repeats edges[{first_edge[src, dst]}]; list each edge once"
                )
            first_edge[src, dst] = index
            for end in (src, dst):
                if end not in seen:
                    raise ValueError(f"edges[{index}]: unknown layer {end!r}")
            if seen[src] >= seen[dst]:
                kind = "a self-loop" if src == dst else "a cycle or an order that is not topological"
                raise ValueError(
                    f"edges[{index}]: [{src!r}, {dst!r}] goes backwards in the layer list "
                    f"({kind}); list layers in a topological order"
                )
        self._check_experts()
        for index, tie in enumerate(self.tied_weights or ()):
            for layer in tie.layers:
                if layer not in seen:
                    raise ValueError(f"tied_weights[{index}].layers: unknown layer {layer!r}")
        for size in sizes:
            costs = [layer.cost_at(size) for layer in self.layers]
            if not any(c.forward_ms > 0 or c.backward_ms > 0 for c in costs):
                raise ValueError(
                    f"layers: every forward_ms and backward_ms at micro-batch size {size} is 0; a profile "
                    f"needs some time to plan (a layer with no cost can share a stage with one that has)"
                )
        return self

    def _check_experts(self) -> None:
        """Expert bytes need the experts' shape, and split evenly over the experts (as expert
        parallelism divides them)."""
        for index, layer in enumerate(self.layers):
            if not layer.expert_param_bytes:
                continue
            if self.experts is None:
                raise ValueError(
                    f"layers[{index}].expert_param_bytes: needs the profile's experts (num_experts, "
                    f"experts_per_token, expert_intermediate_size)"
                )
            if layer.expert_param_bytes % self.experts.num_experts:
                raise ValueError(
                    f"layers[{index}].expert_param_bytes: {layer.expert_param_bytes} is not a multiple "
                    f"of experts.num_experts {self.experts.num_experts} (each expert holds the same bytes)"
                )

    @property
    def microbatch_sizes(self) -> list[int]:
        """The profiled micro-batch sizes, ascending."""
        return sorted(c.microbatch_size for c in self.layers[0].costs if c.degree == 1)

    @property
    def tensor_parallel_degrees(self) -> list[int]:
        """The tensor-parallel degrees the costs cover, ascending (``[1]`` for version-1 files)."""
        return sorted({c.degree for c in self.layers[0].costs})

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the training dtype (for counting parameters)."""
        return {"fp32": 4, "float32": 4, "tf32": 4, "fp64": 8, "float64": 8}.get(self.dtype, 2)

    def edge_list(self) -> list[tuple[str, str]]:
        """The edges, with the implicit chain made explicit."""
        if self.edges is not None:
            return [tuple(e) for e in self.edges]
        names = [layer.name for layer in self.layers]
        return list(zip(names, names[1:]))
