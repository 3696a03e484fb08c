"""The profile format (schema_version 1): per-layer time and memory of one model.

A profile is what the planner reads. It is produced by ``pipeplan profile`` (measured),
``pipeplan import`` (imported) or written by hand (analytic). See docs/formats.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Device", "LayerCost", "Layer", "Profile", "TiedWeight", "NonNegativeMs", "LAYER_KINDS"]

NonNegativeMs = Annotated[float, Field(ge=0, allow_inf_nan=False)]
NonNegativeBytes = Annotated[int, Field(ge=0)]

#: Roles a layer can declare; exporters (Megatron's layout) use them.
LAYER_KINDS = ("embedding", "block", "norm", "head", "other")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Device(_Strict):
    """Where the profile was measured."""

    name: str = Field(min_length=1, description="Device name, e.g. 'NVIDIA H200' or 'cpu'.")
    memory_bytes: Optional[NonNegativeBytes] = Field(
        default=None, description="Device memory, if known."
    )


class LayerCost(_Strict):
    """One layer's cost at one micro-batch size."""

    microbatch_size: int = Field(gt=0, description="Samples per micro-batch.")
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
    forward_spread: Optional[NonNegativeMs] = Field(
        default=None, description="Coefficient of variation of the forward repeats (0.05 = 5%)."
    )
    backward_spread: Optional[NonNegativeMs] = Field(
        default=None, description="Coefficient of variation of the backward repeats."
    )

    @model_validator(mode="after")
    def _backward_split_whole(self) -> "LayerCost":
        if (self.backward_input_ms is None) != (self.backward_weight_ms is None):
            raise ValueError(
                "give both backward_input_ms and backward_weight_ms, or neither"
            )
        return self


class Layer(_Strict):
    """One partitionable unit: a module of the model, or a node of an imported graph."""

    name: str = Field(min_length=1, description="Unique; the module's dotted name for torch models.")
    param_bytes: NonNegativeBytes = Field(description="Bytes of the layer's parameters.")
    costs: list[LayerCost] = Field(min_length=1, description="One entry per profiled micro-batch size.")
    kind: Optional[Literal["embedding", "block", "norm", "head", "other"]] = Field(
        default=None, description="The layer's role, for launchers that name layers by role."
    )
    description: Optional[str] = Field(default=None, description="Free text, e.g. the module's repr.")

    @model_validator(mode="after")
    def _one_cost_per_size(self) -> "Layer":
        sizes = [c.microbatch_size for c in self.costs]
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"costs: micro-batch sizes repeat: {sorted(sizes)}")
        return self

    def cost_at(self, microbatch_size: int) -> LayerCost:
        for cost in self.costs:
            if cost.microbatch_size == microbatch_size:
                return cost
        raise KeyError(microbatch_size)


class TiedWeight(_Strict):
    """One parameter shared by several layers (tied weights, e.g. the embedding and the LM head)."""

    name: str = Field(min_length=1, description="The parameter's name in the model (its first name).")
    layers: list[str] = Field(min_length=2, description="The layers that use it; the first counts its bytes.")
    param_bytes: NonNegativeBytes = Field(
        description="Its bytes, counted once in the first layer's param_bytes; a stage that holds "
        "another of these layers but not the first keeps a copy of this size."
    )


class Profile(_Strict):
    """A whole model's profile; layers in a topological order."""

    schema_version: Literal[1] = Field(description="Format version; always 1.")
    model: str = Field(min_length=1, description="Model name.")
    source: Literal["measured", "analytic", "imported"] = Field(description="How the numbers were obtained.")
    device: Device
    dtype: str = Field(min_length=1, description="Training dtype: fp32, bf16, fp16.")
    sequence_length: Optional[int] = Field(default=None, gt=0, description="Tokens per sample, for LMs.")
    layers: list[Layer] = Field(min_length=1)
    edges: Optional[list[tuple[str, str]]] = Field(
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
        sizes = sorted(c.microbatch_size for c in self.layers[0].costs)
        for index, layer in enumerate(self.layers):
            other = sorted(c.microbatch_size for c in layer.costs)
            if other != sizes:
                raise ValueError(
                    f"layers[{index}].costs: micro-batch sizes {other} differ from "
                    f"layers[0]'s {sizes}; every layer needs the same sizes"
                )
        for index, (src, dst) in enumerate(self.edges or ()):
            for end in (src, dst):
                if end not in seen:
                    raise ValueError(f"edges[{index}]: unknown layer {end!r}")
            if seen[src] >= seen[dst]:
                kind = "a self-loop" if src == dst else "a cycle or an order that is not topological"
                raise ValueError(
                    f"edges[{index}]: [{src!r}, {dst!r}] goes backwards in the layer list "
                    f"({kind}); list layers in a topological order"
                )
        for index, tie in enumerate(self.tied_weights or ()):
            for layer in tie.layers:
                if layer not in seen:
                    raise ValueError(f"tied_weights[{index}].layers: unknown layer {layer!r}")
        return self

    @property
    def microbatch_sizes(self) -> list[int]:
        """The profiled micro-batch sizes, ascending."""
        return sorted(c.microbatch_size for c in self.layers[0].costs)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the training dtype (for counting parameters)."""
        return {"fp32": 4, "float32": 4, "tf32": 4, "fp64": 8}.get(self.dtype, 2)

    def edge_list(self) -> list[tuple[str, str]]:
        """The edges, with the implicit chain made explicit."""
        if self.edges is not None:
            return [tuple(e) for e in self.edges]
        names = [layer.name for layer in self.layers]
        return list(zip(names, names[1:]))
