"""A profile as one GPU of a tensor-parallel group on a cluster sees it: the pipeline planner's input.

A profile of schema version 2 (issue 12's analytic profiles) holds, per unit, one cost entry per
(micro-batch size, tensor-parallel degree ``t``): one rank's share of the time, the activations,
the boundary bytes and the parameters, and the bytes and calls of the unit's tensor-parallel
collectives. :func:`degree_view` picks the entries at ``t`` and adds the collectives' time on the
cluster's intra-node link (:func:`pipeplan.cluster.collectives.tensor_parallel_ms`) to each pass:

    forward_ms'        = forward_ms  + TP(forward)
    backward_ms'       = backward_ms + TP(backward)
    backward_input_ms' = backward_input_ms + TP(backward)    (the collectives sit on the input-
                                                              gradient path: W needs none)

so that every solver, the simulator and full recomputation (which runs ``forward_ms'`` again,
collectives included, as Megatron does) see them without a term of their own. The view keeps,
per unit, the collectives' time apart (:attr:`DegreeView.tensor_parallel_ms`) so that a plan can
report them as a part.

``selective`` recomputation (Megatron's ``--recompute-granularity selective``: the attention core
is recomputed in the backward) is a view too: each unit keeps ``selective_activation_bytes`` and
its backward (and input-gradient pass) grows by ``selective_recompute_ms``.

Expert parallelism (a profile with ``experts``) is a view too: at expert-parallel degree ``E``
and expert-tensor-parallel degree ``ETP`` one GPU holds ``1 / (E x ETP)`` of each MoE unit's
routed experts (``expert_param_bytes``; the dense part as at ``t``), and each MoE unit's passes
grow by its token dispatch and combine, two all-to-alls over the expert-parallel group in the
forward and two in the backward (:func:`pipeplan.cluster.collectives.all_to_all_ms` of the
unit's ``expert_dispatch_bytes``, times the imbalance ``f``), and by ``(f - 1)`` of its routed
experts' time (the busiest rank receives ``f`` times the balanced share)::

    forward_ms'        += (f - 1) x expert_forward_ms  + 2 x A2A(f x dispatch bytes, E)
    backward_ms'       += (f - 1) x expert_backward_ms + 2 x A2A(f x dispatch bytes, E)

(the input-gradient pass takes the all-to-alls and its share of the experts' extra), and its
activations by ``(f - 1) x expert_activation_bytes`` (the dispatched tokens and the experts'
tensors of ``f`` times the balanced share of tokens). The view
keeps each MoE unit's parts (dispatch, combine, routed experts, shared experts) apart
(:attr:`DegreeView.expert_ms`) for the iteration's named parts. docs/cluster-model.md.

A measured or version-1 profile has degree 1 only; its view at ``t = 1`` is the profile itself.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Optional

from pipeplan.cluster.collectives import all_to_all_ms, tensor_parallel_ms
from pipeplan.cluster.overlap import expert_all_to_all_exposed_ms, tensor_parallel_exposed_shares
from pipeplan.errors import BadInputError
from pipeplan.formats.cluster import ClusterSpec
from pipeplan.formats.profile import Layer, LayerCost

__all__ = ["DegreeView", "degree_view", "tensor_degrees", "head_counts", "EXPERT_PARTS", "ExpertGroup",
           "stage_pass_ms"]

#: The named parts of an MoE unit's time that the iteration reports (DegreeView.expert_ms).
EXPERT_PARTS = ("dispatch", "experts", "combine", "shared_expert")


def stage_pass_ms(table: dict, layer_names, microbatch_size: int, recompute) -> float:
    """A stage's share per micro-batch of a per-unit part ``table`` (``{(unit name, micro-batch
    size): (forward ms, backward ms)}``): each unit's forward, twice where it recomputes
    (``recompute`` True for every layer, or the names of the layers recomputed in full), and its
    backward."""
    total = 0.0
    for name in layer_names:
        twice = recompute if isinstance(recompute, bool) else name in recompute
        forward, backward = table.get((name, microbatch_size), (0.0, 0.0))
        total += forward * (2 if twice else 1) + backward
    return total


@dataclass(frozen=True)
class ExpertGroup:
    """Expert parallelism of a view: the degrees, the imbalance and the group's shape."""

    expert: int = 1
    """``E``: the expert-parallel degree."""
    expert_tensor: int = 1
    """``ETP``: the expert-tensor-parallel degree."""
    imbalance: float = 1.0
    """``f >= 1``: the busiest rank's routed tokens over the balanced share."""
    ranks_per_node: int = 1
    """The group's ranks in one NVLink domain, a node unless the cluster's domain spans nodes
    (``E`` when it fits in one)."""

    @property
    def trivial(self) -> bool:
        return self.expert == 1 and self.expert_tensor == 1 and self.imbalance == 1.0


#: LayerCost fields a degree-1 entry of the view keeps (the rest are schema version 2's).
_V1_FIELDS = ("microbatch_size", "forward_ms", "backward_ms", "activation_bytes", "output_bytes",
              "backward_input_ms", "backward_weight_ms", "forward_spread", "backward_spread")


def _degree(cost) -> int:
    return getattr(cost, "tensor_parallel", None) or 1


def tensor_degrees(profile) -> list[int]:
    """The tensor-parallel degrees every unit of ``profile`` has entries for, ascending.

    Examples
    --------
    >>> from pipeplan.formats.profile import Profile
    >>> p = Profile.model_validate({"schema_version": 1, "model": "m", "source": "analytic",
    ...     "device": {"name": "x"}, "dtype": "bf16", "layers": [{"name": "a", "param_bytes": 1,
    ...     "costs": [{"microbatch_size": 1, "forward_ms": 1, "backward_ms": 2,
    ...                "activation_bytes": 1, "output_bytes": 1}]}]})
    >>> tensor_degrees(p)
    [1]
    """
    common = None
    for layer in profile.layers:
        degrees = {_degree(c) for c in layer.costs}
        common = degrees if common is None else common & degrees
    return sorted(common or {1})


def head_counts(profile) -> list[int]:
    """Head counts a tensor-parallel degree must divide, where the profile records its config."""
    shape = (profile.measurement or {}).get("config_shape") or {}
    return sorted({int(shape[k]) for k in ("num_heads", "num_kv_heads") if shape.get(k)})


@dataclass(frozen=True)
class DegreeView:
    """The profile at one tensor-parallel degree on one cluster (module docstring)."""

    profile: object
    """A :class:`pipeplan.formats.profile.Profile` of degree-1 entries: the planner's input."""
    tensor_parallel: int
    selective: bool
    tensor_parallel_ms: dict = field(default_factory=dict)
    """``{(unit name, micro-batch size): (forward ms, backward ms)}`` of its collectives."""
    expert_ms: dict = field(default_factory=dict)
    """``{(MoE unit name, micro-batch size): {part: (forward ms, backward ms)}}`` for the parts of
    :data:`EXPERT_PARTS` (empty for a dense profile)."""
    experts: ExpertGroup = field(default_factory=ExpertGroup)
    expert_bytes: dict = field(default_factory=dict)
    """``{MoE unit name: routed-expert parameter bytes one GPU holds}`` (empty for a dense profile)."""
    context_ms: dict = field(default_factory=dict)
    """``{(unit name, micro-batch size): (forward ms, backward ms)}`` of the context-parallel KV
    exchange's exposed time (:mod:`pipeplan.cluster.context`; empty at C = 1)."""
    offload_ms: dict = field(default_factory=dict)
    """``{micro-batch size: exposed ms per micro-batch}`` of CPU activation offload's copies
    (:func:`pipeplan.plan.offload.offload_view`; empty without it)."""

    def stage_expert_bytes(self, layer_names) -> float:
        """The routed experts' parameter bytes one GPU holds of these units."""
        if not self.expert_bytes:
            return 0.0
        return float(sum(self.expert_bytes.get(name, 0) for name in layer_names))

    def stage_expert_ms(self, layer_names, microbatch_size: int, recompute) -> dict:
        """The MoE parts' time of a stage per micro-batch (the forward's twice where it recomputes:
        ``recompute`` True for every layer, or the names of the layers recomputed in full)."""
        total = dict.fromkeys(EXPERT_PARTS, 0.0)
        if not self.expert_ms:
            return total
        for name in layer_names:
            twice = recompute if isinstance(recompute, bool) else name in recompute
            for part, (forward, backward) in self.expert_ms.get((name, microbatch_size), {}).items():
                total[part] = total.get(part, 0.0) + forward * (2 if twice else 1) + backward  # and a2a_hidden under moe-a2a
        return total

    tensor_parallel_hidden_ms: dict = field(default_factory=dict)
    """With ``tp-comm``: ``{(unit name, micro-batch size): (forward ms, backward ms)}`` of the
    collectives hidden behind their GEMMs (:attr:`tensor_parallel_ms` holds the exposed rest)."""

    def stage_tensor_parallel_hidden_ms(self, layer_names, microbatch_size: int, recompute) -> float:
        """The hidden collectives of a stage per micro-batch (:func:`stage_pass_ms`)."""
        return stage_pass_ms(self.tensor_parallel_hidden_ms, layer_names, microbatch_size, recompute)

    quantize_ms: dict = field(default_factory=dict)
    """``{(unit name, micro-batch size): (forward ms, backward ms)}`` of a quantized precision's
    casts (the profile's ``quantize_*_ms``; empty without one)."""

    host_wait_ms: dict = field(default_factory=dict)
    """``{(unit name, micro-batch size): (forward ms, backward ms)}`` the GPU waits for the host's
    launches (the profile's ``host_wait_*_ms``; empty where every unit is GPU-bound)."""

    def stage_tensor_parallel_ms(self, layer_names, microbatch_size: int, recompute) -> float:
        """The collectives' time of a stage per micro-batch (:func:`stage_pass_ms`)."""
        return stage_pass_ms(self.tensor_parallel_ms, layer_names, microbatch_size, recompute)


def degree_view(profile, tensor_parallel: int, cluster: ClusterSpec, selective: bool = False,
                experts: ExpertGroup = ExpertGroup(), tp_comm: Optional[str] = None,
                moe_a2a: bool = False) -> DegreeView:
    """The profile one GPU of a ``tensor_parallel`` group sees, collectives timed on ``cluster``
    (and, for an MoE profile, one GPU of an ``experts`` group: the module docstring).

    ``tp_comm`` (a launcher's name, or ``"megatron"`` without one; None: off) overlaps the
    collectives with their GEMMs: each pass keeps the exposed share of
    :func:`pipeplan.cluster.overlap.tensor_parallel_exposed_shares`, and never less than what the
    pass's own compute cannot cover (``collectives - compute``). ``moe_a2a`` overlaps each MoE
    unit's all-to-alls with the other micro-batch's compute (:func:`_expert_parts`).

    Raises
    ------
    BadInputError
        If a unit has no entry at the degree, or ``selective`` is asked of a profile without
        the selective fields.
    """
    t = tensor_parallel
    link = cluster.intra_node
    layers, tp_ms, ep_ms, cast_ms, tp_hidden, host_ms = [], {}, {}, {}, {}, {}
    moe = getattr(profile, "experts", None) is not None
    for layer in profile.layers:
        entries = [c for c in layer.costs if _degree(c) == t]
        if not entries:
            raise BadInputError(
                f"profile: {layer.name} has no cost entry at tensor_parallel {t}; it has "
                f"{sorted({_degree(c) for c in layer.costs})} (build it with --tensor-parallel)")
        costs = []
        for c in entries:
            values = {k: getattr(c, k) for k in _V1_FIELDS}
            # The loss's working memory at this degree (pipeplan.facts.loss), as the entry gives it.
            values["working_bytes"] = getattr(c, "working_bytes", None)
            forward_tp = backward_tp = 0.0
            kind = getattr(c, "tensor_parallel_collective", None)
            if t > 1 and kind is not None:
                forward_tp = tensor_parallel_ms(kind, c.tensor_parallel_forward_bytes or 0,
                                                c.tensor_parallel_forward_count or 0, t, link)
                backward_tp = tensor_parallel_ms(kind, c.tensor_parallel_backward_bytes or 0,
                                                 c.tensor_parallel_backward_count or 0, t, link)
                if tp_comm is not None:
                    whole = (forward_tp, backward_tp)
                    shares = tensor_parallel_exposed_shares({"tp-comm"}, tp_comm, kind, t)
                    forward_tp, backward_tp = (min(ms, max(share * ms, ms - compute)) for ms, share, compute in
                                               zip(whole, shares, (c.forward_ms, c.backward_ms)))
                    tp_hidden[(layer.name, c.microbatch_size)] = (whole[0] - forward_tp, whole[1] - backward_tp)
            extra_backward = backward_tp
            if selective:
                if getattr(c, "selective_activation_bytes", None) is None:
                    raise BadInputError(
                        f"profile: {layer.name} has no selective_activation_bytes; selective "
                        f"recomputation needs an analytic profile (pipeplan profile --analytic)")
                values["activation_bytes"] = c.selective_activation_bytes
                extra_backward += c.selective_recompute_ms
            extra_forward, extra_input = forward_tp, extra_backward
            if moe and layer.expert_param_bytes:
                parts = _expert_parts(c, experts, cluster, moe_a2a, (forward_tp, backward_tp))
                ep_ms[(layer.name, c.microbatch_size)] = parts
                more_forward, more_backward, more_input = _expert_extra(c, parts, experts)
                extra_forward += more_forward
                extra_backward += more_backward
                extra_input += more_input
                waits = _local_expert_host_waits(c, profile.experts.num_experts // experts.expert)
                if waits is not None:
                    # The GPU's added wait for the host's per-expert GEMM launches, named as the
                    # profile's own host wait (the input-gradient pass takes its share of it).
                    extra_forward += waits[0] - (c.host_wait_forward_ms or 0.0)
                    added_backward = waits[1] - (c.host_wait_backward_ms or 0.0)
                    extra_backward += added_backward
                    extra_input += _input_share(c) * added_backward
                    if waits[0] > 0 or waits[1] > 0:
                        host_ms[(layer.name, c.microbatch_size)] = waits
                # The busiest rank also keeps f times the balanced share of the routed tensors.
                values["activation_bytes"] += int(math.ceil((experts.imbalance - 1.0)
                                                            * (getattr(c, "expert_activation_bytes", None) or 0)))
            values["forward_ms"] += extra_forward
            values["backward_ms"] += extra_backward
            if values["backward_input_ms"] is not None:
                values["backward_input_ms"] += extra_input
            costs.append(LayerCost(**{k: v for k, v in values.items() if v is not None}))
            tp_ms[(layer.name, c.microbatch_size)] = (forward_tp, backward_tp)
            if getattr(c, "quantize_forward_ms", None) is not None:
                cast_ms[(layer.name, c.microbatch_size)] = (c.quantize_forward_ms, c.quantize_backward_ms or 0.0)
            if getattr(c, "host_wait_forward_ms", None) is not None and (layer.name, c.microbatch_size) not in host_ms:
                host_ms[(layer.name, c.microbatch_size)] = (c.host_wait_forward_ms, c.host_wait_backward_ms or 0.0)
        param_bytes = layer.param_bytes if t == 1 else layer.param_bytes_at(t)
        expert_bytes = None
        if moe and layer.expert_param_bytes:
            # The dense part as at t; the routed experts: 1 / (E x ETP) of the layer's.
            at_t = layer.expert_param_bytes if t == 1 else (entries[0].expert_param_bytes or 0)
            expert_bytes = int(math.ceil(layer.expert_param_bytes / (experts.expert * experts.expert_tensor)))
            param_bytes = param_bytes - at_t + expert_bytes
        layers.append(Layer(name=layer.name, param_bytes=param_bytes, costs=costs, kind=layer.kind,
                            description=layer.description, expert_param_bytes=expert_bytes))
    update = {"layers": layers, "schema_version": 1}
    if profile.tied_weights and t > 1:
        # A tied weight is sharded as its first user is (a vocabulary-parallel embedding: 1/t).
        share = {layer.name: (view_layer.param_bytes / layer.param_bytes if layer.param_bytes else 1.0)
                 for layer, view_layer in zip(profile.layers, layers)}
        update["tied_weights"] = [tie.model_copy(update={"param_bytes": int(math.ceil(tie.param_bytes
                                                                                       * share[tie.layers[0]]))})
                                  for tie in profile.tied_weights]
    view = profile.model_copy(update=update)
    return DegreeView(profile=view, tensor_parallel=t, selective=selective, tensor_parallel_ms=tp_ms,
                      expert_ms=ep_ms, experts=experts, quantize_ms=cast_ms, tensor_parallel_hidden_ms=tp_hidden,
                      host_wait_ms=host_ms,
                      expert_bytes={layer.name: layer.expert_param_bytes for layer in layers
                                    if layer.expert_param_bytes})


def _expert_parts(cost, experts: ExpertGroup, cluster: ClusterSpec, moe_a2a: bool = False,
                  tensor_parallel_ms: tuple[float, float] = (0.0, 0.0)) -> dict:
    """One MoE unit's parts per micro-batch at one entry: ``{part: (forward ms, backward ms)}``.

    Dispatch and combine are one all-to-all each per pass (the backward runs each one's
    transpose); the busiest rank receives ``f`` times the balanced share of tokens. With
    ``moe_a2a`` each keeps its exposed rest behind the other micro-batch's compute
    (:func:`pipeplan.cluster.overlap.expert_all_to_all_exposed_ms`; the unit's compute outside the
    routed experts, its exposed tensor-parallel collectives included, is the attention node's) and
    ``a2a_hidden`` holds what was hidden (no part of the iteration)."""
    f = experts.imbalance
    a2a = all_to_all_ms(f * (cost.expert_dispatch_bytes or 0), experts.expert, experts.ranks_per_node,
                        cluster.intra_node, cluster.inter_node)
    routed = (f * (cost.expert_forward_ms or 0.0), f * (cost.expert_backward_ms or 0.0))
    dispatch = combine = (a2a, a2a)
    if moe_a2a:
        attention = tuple(max(0.0, whole + tp - (expert or 0.0)) for whole, tp, expert in
                          zip((cost.forward_ms, cost.backward_ms), tensor_parallel_ms,
                              (cost.expert_forward_ms, cost.expert_backward_ms)))
        dispatch, combine = expert_all_to_all_exposed_ms(dispatch, combine, attention, routed)
    parts = {
        "dispatch": dispatch,
        "experts": routed,
        "combine": combine,
        "shared_expert": (cost.shared_expert_forward_ms or 0.0, cost.shared_expert_backward_ms or 0.0),
    }
    if moe_a2a:
        parts["a2a_hidden"] = (2 * a2a - dispatch[0] - combine[0], 2 * a2a - dispatch[1] - combine[1])
    return parts


def _expert_extra(cost, parts: dict, experts: ExpertGroup) -> tuple[float, float, float]:
    """What expert parallelism adds to a unit's forward, backward and input-gradient pass: the
    all-to-alls and the imbalance's share of the routed experts (the input-gradient pass takes
    the all-to-alls and the experts' extra in its own share of the backward)."""
    a2a_forward = parts["dispatch"][0] + parts["combine"][0]
    a2a_backward = parts["dispatch"][1] + parts["combine"][1]
    more_forward = (experts.imbalance - 1.0) * (cost.expert_forward_ms or 0.0)
    more_backward = (experts.imbalance - 1.0) * (cost.expert_backward_ms or 0.0)
    share = _input_share(cost)
    return a2a_forward + more_forward, a2a_backward + more_backward, a2a_backward + share * more_backward


def _input_share(cost) -> float:
    """The input-gradient pass's share of a unit's backward (0.5 where the profile has no split)."""
    return (cost.backward_input_ms / cost.backward_ms) if cost.backward_input_ms is not None and cost.backward_ms \
        else 0.5


def _local_expert_host_waits(cost, local_experts: int) -> Optional[tuple[float, float]]:
    """The GPU's wait for the host in an MoE unit's forward and backward when each of its
    ``local_experts`` (``num_experts / E``) costs the host its routed GEMMs' launches
    (docs/analytic.md, "Host overhead"):

        host' = host_ms + (local_experts - 1) x expert_host_ms,   gpu = pass_ms - host_wait_ms
        wait' = max(host_wait_ms, host' - gpu)

    (the profile's pass is ``max(gpu, host)``, so ``gpu = pass - wait`` either way; the backward's
    wait was taken per gradient pass and is kept where larger). None where the profile does not
    record the host's time (a measured profile, or one written before these fields)."""
    if getattr(cost, "host_forward_ms", None) is None or getattr(cost, "expert_host_forward_ms", None) is None:
        return None
    more = max(0, local_experts - 1)
    waits = []
    for pass_ms, wait, host, per_expert in (
            (cost.forward_ms, cost.host_wait_forward_ms, cost.host_forward_ms, cost.expert_host_forward_ms),
            (cost.backward_ms, cost.host_wait_backward_ms, cost.host_backward_ms, cost.expert_host_backward_ms or 0.0)):
        wait = wait or 0.0
        waits.append(max(wait, host + more * per_expert - (pass_ms - wait)))
    return waits[0], waits[1]
