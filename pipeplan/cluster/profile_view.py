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

A measured or version-1 profile has degree 1 only; its view at ``t = 1`` is the profile itself.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from pipeplan.cluster.collectives import tensor_parallel_ms
from pipeplan.errors import BadInputError
from pipeplan.formats.cluster import ClusterSpec
from pipeplan.formats.profile import Layer, LayerCost

__all__ = ["DegreeView", "degree_view", "tensor_degrees", "head_counts"]

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

    def stage_tensor_parallel_ms(self, layer_names, microbatch_size: int, recompute: bool) -> float:
        """The collectives' time of a stage per micro-batch (the forward's twice if it recomputes)."""
        total = 0.0
        for name in layer_names:
            forward, backward = self.tensor_parallel_ms.get((name, microbatch_size), (0.0, 0.0))
            total += forward * (2 if recompute else 1) + backward
        return total


def degree_view(profile, tensor_parallel: int, cluster: ClusterSpec, selective: bool = False) -> DegreeView:
    """The profile one GPU of a ``tensor_parallel`` group sees, collectives timed on ``cluster``.

    Raises
    ------
    BadInputError
        If a unit has no entry at the degree, or ``selective`` is asked of a profile without
        the selective fields.
    """
    t = tensor_parallel
    link = cluster.intra_node
    layers, tp_ms = [], {}
    for layer in profile.layers:
        entries = [c for c in layer.costs if _degree(c) == t]
        if not entries:
            raise BadInputError(
                f"profile: {layer.name} has no cost entry at tensor_parallel {t}; it has "
                f"{sorted({_degree(c) for c in layer.costs})} (build it with --tensor-parallel)")
        costs = []
        for c in entries:
            values = {k: getattr(c, k) for k in _V1_FIELDS}
            forward_tp = backward_tp = 0.0
            kind = getattr(c, "tensor_parallel_collective", None)
            if t > 1 and kind is not None:
                forward_tp = tensor_parallel_ms(kind, c.tensor_parallel_forward_bytes or 0,
                                                c.tensor_parallel_forward_count or 0, t, link)
                backward_tp = tensor_parallel_ms(kind, c.tensor_parallel_backward_bytes or 0,
                                                 c.tensor_parallel_backward_count or 0, t, link)
            extra_backward = backward_tp
            if selective:
                if getattr(c, "selective_activation_bytes", None) is None:
                    raise BadInputError(
                        f"profile: {layer.name} has no selective_activation_bytes; selective "
                        f"recomputation needs an analytic profile (pipeplan profile --analytic)")
                values["activation_bytes"] = c.selective_activation_bytes
                extra_backward += c.selective_recompute_ms
            values["forward_ms"] += forward_tp
            values["backward_ms"] += extra_backward
            if values["backward_input_ms"] is not None:
                values["backward_input_ms"] += extra_backward
            costs.append(LayerCost(**{k: v for k, v in values.items() if v is not None}))
            tp_ms[(layer.name, c.microbatch_size)] = (forward_tp, backward_tp)
        param_bytes = layer.param_bytes if t == 1 else layer.param_bytes_at(t)
        layers.append(Layer(name=layer.name, param_bytes=param_bytes, costs=costs, kind=layer.kind,
                            description=layer.description))
    update = {"layers": layers, "schema_version": 1}
    if profile.tied_weights and t > 1:
        # A tied weight is sharded as its first user is (a vocabulary-parallel embedding: 1/t).
        share = {layer.name: (view_layer.param_bytes / layer.param_bytes if layer.param_bytes else 1.0)
                 for layer, view_layer in zip(profile.layers, layers)}
        update["tied_weights"] = [tie.model_copy(update={"param_bytes": int(math.ceil(tie.param_bytes
                                                                                       * share[tie.layers[0]]))})
                                  for tie in profile.tied_weights]
    view = profile.model_copy(update=update)
    return DegreeView(profile=view, tensor_parallel=t, selective=selective, tensor_parallel_ms=tp_ms)
