"""What a caller asks the planner for: one validated request model per kind of plan.

- :class:`PipelineRequest`: one pipeline on ``stages`` ranks (``pipeplan plan --stages``,
  ``compare``, a given split with ``layers_per_stage``).
- :class:`ClusterRequest`: data x tensor x pipeline over ``num_gpus`` GPUs of a cluster
  (``pipeplan plan --gpus N --cluster C``); any degree may be fixed.

Each request owns its cross-field rules (a cluster option without ``num_gpus`` is not a request
at all) and its effective memory cap (:meth:`PipelineRequest.cap_bytes`: none means infinite
for a pipeline, the cluster's GPU memory for a cluster). Every field takes its type, default and
description from the plan file's record of the request, :class:`pipeplan.formats.plan.PlanSettings`,
so there is one source for every default; the CLI's options read theirs from here
(``tests/test_layers.py`` checks that they agree). A request becomes that record with
:meth:`PipelineRequest.settings`; a record read back from a plan file becomes a request with
:func:`request_of`, which applies the same rules (``pipeplan check`` re-plans through it).

Examples
--------
>>> PipelineRequest(stages=4, global_batch=32).settings().schedule
'auto'
>>> request_of(PlanSettings(stages=2, zero_stage=3, data_parallel=8))
Traceback (most recent call last):
...
pipeplan.errors.BadInputError: data_parallel, zero_stage: cluster options need num_gpus (--gpus) and a cluster; a pipeline request has no data-parallel, tensor-parallel or ZeRO degree
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeplan.errors import BadInputError, format_validation_error
from pipeplan.launchers.registry import DEFAULT_OPTIMIZER, launcher_optimizer
from pipeplan.formats.cluster import ClusterSpec
from pipeplan.formats.limits import PositiveCount
from pipeplan.formats.plan import PlanSettings, effective_cap_bytes

__all__ = ["PipelineRequest", "ClusterRequest", "Request", "request_of", "CLUSTER_ONLY_FIELDS", "parse_compare",
           "COMPARE_KEYS"]

_FIELDS = PlanSettings.model_fields


def _required(name: str, description: str):
    """A field the record may leave null but a request of this kind must give."""
    assert name in _FIELDS
    return Field(description=description)


#: Fields only a cluster request has.
CLUSTER_ONLY_FIELDS = ("cluster", "data_parallel", "tensor_parallel", "zero_stage", "data_parallel_overlap",
                       "overlap", "ddp_bucket_size",
                       "search_stages", "expert_parallel", "expert_tensor_parallel", "expert_imbalance",
                       "expert_data_parallel", "compare", "context_parallel")

#: The keys of a ``--compare`` layout: d, t and p are required, the rest fix one more choice.
COMPARE_KEYS = {"d": "data-parallel degree", "t": "tensor-parallel degree", "p": "pipeline ranks",
                "zero": "ZeRO stage (0-3)", "mbs": "micro-batch size", "e": "expert-parallel degree"}


def parse_compare(text: str) -> dict[str, int]:
    """One ``--compare`` layout, e.g. ``d=8,t=8,p=8`` or ``d=64,t=4,p=4,zero=1,mbs=2``.

    Raises
    ------
    BadInputError
        A key that is not one of :data:`COMPARE_KEYS`, a repeated or missing d/t/p, a value that is
        not a whole number in range; the message names ``--compare`` and the text.

    Examples
    --------
    >>> parse_compare("d=8, t=8, p=8")
    {'d': 8, 't': 8, 'p': 8}
    >>> parse_compare("d=8,t=8")
    Traceback (most recent call last):
    ...
    pipeplan.errors.BadInputError: --compare 'd=8,t=8': give p=.. too (a layout is d=..,t=..,p=..)
    """
    out: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or key not in COMPARE_KEYS:
            raise BadInputError(f"--compare {text!r}: {part.strip()!r} is not KEY=VALUE with KEY one of "
                                f"{', '.join(COMPARE_KEYS)}")
        if key in out:
            raise BadInputError(f"--compare {text!r}: {key} is given twice")
        try:
            number = int(value)
        except ValueError:
            raise BadInputError(f"--compare {text!r}: {key}={value!r} is not a whole number") from None
        low, high = (0, 3) if key == "zero" else (1, 1 << 20)
        if not low <= number <= high:
            raise BadInputError(f"--compare {text!r}: {key}={number} must be {low}..{high}")
        out[key] = number
    missing = [key for key in ("d", "t", "p") if key not in out]
    if missing:
        raise BadInputError(f"--compare {text!r}: give {', '.join(k + '=..' for k in missing)} too "
                            f"(a layout is d=..,t=..,p=..)")
    return out


class _Request(BaseModel):
    """The fields every request shares (see :class:`pipeplan.formats.plan.PlanSettings`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Unbounded here: the planner refuses a batch over its micro-batch count limit with the limit
    # and the profile's sizes (api), before the plan file's own bound could say less.
    global_batch: Optional[int] = Field(default=_FIELDS["global_batch"].default, gt=0,
                                        description=_FIELDS["global_batch"].description)
    microbatch_size: _FIELDS["microbatch_size"].annotation = _FIELDS["microbatch_size"]
    memory_cap_bytes: _FIELDS["memory_cap_bytes"].annotation = _FIELDS["memory_cap_bytes"]
    optimizer: Literal["auto", "adam", "adam-fp32-grads", "sgd", "none"] = Field(
        default="auto", description="The optimizer's training state; auto: the launcher's own (Megatron-LM keeps "
        "fp32 main gradients in 16-bit training: adam-fp32-grads), else adam. " + _FIELDS["optimizer"].description)
    schedule: _FIELDS["schedule"].annotation = _FIELDS["schedule"]
    virtual_stages: _FIELDS["virtual_stages"].annotation = _FIELDS["virtual_stages"]
    recompute: _FIELDS["recompute"].annotation = _FIELDS["recompute"]
    solver: _FIELDS["solver"].annotation = _FIELDS["solver"]
    action_overhead_ms: _FIELDS["action_overhead_ms"].annotation = _FIELDS["action_overhead_ms"]
    launcher: _FIELDS["launcher"].annotation = _FIELDS["launcher"]
    layers_per_stage: _FIELDS["layers_per_stage"].annotation = _FIELDS["layers_per_stage"]
    fp8_param_gather: _FIELDS["fp8_param_gather"].annotation = _FIELDS["fp8_param_gather"]
    recompute_modules: _FIELDS["recompute_modules"].annotation = _FIELDS["recompute_modules"]
    recompute_method: _FIELDS["recompute_method"].annotation = _FIELDS["recompute_method"]
    recompute_num_layers: _FIELDS["recompute_num_layers"].annotation = _FIELDS["recompute_num_layers"]
    selective_ac_option: _FIELDS["selective_ac_option"].annotation = _FIELDS["selective_ac_option"]
    cpu_offload_layers: _FIELDS["cpu_offload_layers"].annotation = _FIELDS["cpu_offload_layers"]

    @classmethod
    def make(cls, where: str = "request", **fields: Any):
        """The request, or a one-line :class:`BadInputError` naming ``where`` and the field."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise BadInputError(format_validation_error(where, exc)) from None

    def settings(self) -> PlanSettings:
        """The plan file's record of this request (``Plan.settings``).

        Raises
        ------
        BadInputError
            A value the record's finite ranges refuse (docs/formats.md).
        """
        fields = self.model_dump(exclude_unset=True)
        if self.optimizer == "auto":
            # Resolved here, so the plan file records what the launcher keeps.
            fields.pop("optimizer", None)
            if launcher_optimizer(self.launcher) != DEFAULT_OPTIMIZER:
                fields["optimizer"] = launcher_optimizer(self.launcher)
        try:
            return PlanSettings(**fields)
        except ValidationError as exc:
            raise BadInputError(format_validation_error("request", exc)) from None


class PipelineRequest(_Request):
    """One pipeline of ``stages`` ranks: the split, schedule, stages per rank, micro-batch size and
    recomputation are searched unless fixed."""

    stages: PositiveCount = _required("stages", "Pipeline ranks p.")
    bandwidth_bytes_per_s: _FIELDS["bandwidth_bytes_per_s"].annotation = _FIELDS["bandwidth_bytes_per_s"]

    def cap_bytes(self) -> float:
        """The per-GPU cap the planner tests against: none means infinite."""
        return effective_cap_bytes(self.memory_cap_bytes, None)


class ClusterRequest(_Request):
    """d x t x p = ``num_gpus`` over ``cluster``: every degree, the ZeRO stage and the pipeline's
    own choices searched unless fixed. The cluster's links replace a point-to-point bandwidth."""

    num_gpus: PositiveCount = _required("num_gpus", "--gpus: plan d x t x p = num_gpus over the cluster.")
    cluster: ClusterSpec = _required("cluster", _FIELDS["cluster"].description)
    stages: _FIELDS["stages"].annotation = _FIELDS["stages"]
    data_parallel: _FIELDS["data_parallel"].annotation = _FIELDS["data_parallel"]
    tensor_parallel: _FIELDS["tensor_parallel"].annotation = _FIELDS["tensor_parallel"]
    zero_stage: _FIELDS["zero_stage"].annotation = _FIELDS["zero_stage"]
    data_parallel_overlap: _FIELDS["data_parallel_overlap"].annotation = _FIELDS["data_parallel_overlap"]
    overlap: _FIELDS["overlap"].annotation = _FIELDS["overlap"]
    ddp_bucket_size: _FIELDS["ddp_bucket_size"].annotation = _FIELDS["ddp_bucket_size"]
    search_stages: _FIELDS["search_stages"].annotation = _FIELDS["search_stages"]
    expert_parallel: _FIELDS["expert_parallel"].annotation = _FIELDS["expert_parallel"]
    expert_tensor_parallel: _FIELDS["expert_tensor_parallel"].annotation = _FIELDS["expert_tensor_parallel"]
    expert_imbalance: _FIELDS["expert_imbalance"].annotation = _FIELDS["expert_imbalance"]
    context_parallel: _FIELDS["context_parallel"].annotation = _FIELDS["context_parallel"]
    compare: _FIELDS["compare"].annotation = _FIELDS["compare"]

    @model_validator(mode="after")
    def _compare_rules(self) -> "ClusterRequest":
        # The rules a layout breaks without the profile or the cluster; the rest (tensor degree
        # within a node, heads, stages, the batch) are the search's (pipeplan.cluster.search).
        for text in self.compare or ():
            layout = parse_compare(text)
            c = self.context_parallel or 1  # with context parallelism, d x t x p x C is the GPUs
            if layout["d"] * layout["t"] * layout["p"] * c != self.num_gpus:
                raise BadInputError(f"--compare {text!r}: d x t x p = {layout['d']} x {layout['t']} x {layout['p']} "
                                    + (f"x C {c} " if c > 1 else "")
                                    + f"= {layout['d'] * layout['t'] * layout['p'] * c} is not --gpus {self.num_gpus}")
        return self

    @model_validator(mode="after")
    def _expert_rules(self) -> "ClusterRequest":
        # (BadInputError, not ValueError: pydantic passes it through, naming the CLI's options.)
        # Megatron-core lays the expert layers' ranks out afresh over each stage's t x d GPUs
        # (parallel_state: ETP x E x EDP x PP = world; MoE parallel folding), so E x ETP divides t x d.
        e = self.expert_parallel
        etp_fixed = self.expert_tensor_parallel or 1
        if e is not None and self.data_parallel is not None and self.tensor_parallel is not None \
                and (self.tensor_parallel * self.data_parallel) % (e * etp_fixed):
            raise BadInputError(f"--expert-parallel: {e} x --expert-tensor-parallel {etp_fixed} does not divide "
                                f"--tensor-parallel {self.tensor_parallel} x --data-parallel {self.data_parallel} "
                                f"(the expert layers' ranks are laid out over each stage's t x d GPUs: "
                                f"ETP x E x EDP = t x d)")
        if e is not None and self.num_gpus % e:
            raise BadInputError(f"--expert-parallel: {e} does not divide --gpus {self.num_gpus}")
        c = self.context_parallel
        if c is not None and self.num_gpus % c:
            raise BadInputError(f"--context-parallel: {c} does not divide --gpus {self.num_gpus} "
                                f"(d x t x p x C = the GPUs)")
        etp = self.expert_tensor_parallel
        if etp is not None and self.tensor_parallel is not None and self.tensor_parallel % etp:
            raise BadInputError(f"--expert-tensor-parallel: {etp} does not divide --tensor-parallel "
                                f"{self.tensor_parallel} (the experts' tensor groups sit inside the dense layers')")
        return self

    def cap_bytes(self) -> float:
        """The per-GPU cap: the request's, else the cluster's (its spec or its GPU's memory)."""
        return effective_cap_bytes(self.memory_cap_bytes, self.cluster)


Request = Union[PipelineRequest, ClusterRequest]


def request_of(settings: Union[PlanSettings, PipelineRequest, ClusterRequest]) -> Request:
    """The request a plan file's settings record (a request is returned as it is).

    Raises
    ------
    BadInputError
        Cluster options (``data_parallel``, ``tensor_parallel``, ``zero_stage``, the cluster,
        ``data_parallel_overlap``) without ``num_gpus``, or ``num_gpus`` without a cluster: the
        API never plans what the CLI refuses.
    """
    if isinstance(settings, (PipelineRequest, ClusterRequest)):
        return settings
    given = settings.model_dump(exclude_defaults=True)
    if settings.bandwidth_bytes_per_s is None:
        given["bandwidth_bytes_per_s"] = None  # null (infinite) differs from the default
    if settings.num_gpus is None:
        stray = sorted(name for name in CLUSTER_ONLY_FIELDS if getattr(settings, name) is not None)
        if stray:
            raise BadInputError(f"{', '.join(stray)}: cluster options need num_gpus (--gpus) and a cluster; a "
                                f"pipeline request has no data-parallel, tensor-parallel or ZeRO degree")
        return PipelineRequest.make("settings", **given)
    if settings.cluster is None:
        raise BadInputError("num_gpus: a cluster request needs the cluster (--cluster NAME or FILE)")
    given.pop("bandwidth_bytes_per_s", None)  # the cluster's links replace it
    given["cluster"] = settings.cluster
    return ClusterRequest.make("settings", **given)
