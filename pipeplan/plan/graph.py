"""The layer graph: a networkx DiGraph built from a profile, with per-layer costs.

Stages are numbered so that every edge goes to the same or a later stage, so a split is a
chain of *ideals* (down-closed node sets) and a boundary carries every tensor that crosses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import networkx as nx
import numpy as np

from pipeplan.errors import BadInputError

__all__ = ["LAYER_ARRAYS", "LayerGraph", "build_layer_graph", "is_chain", "reorder"]

#: The per-layer arrays of a :class:`LayerGraph`, each indexed by layer position. A stage's
#: sums (:class:`pipeplan.plan.costmodel.LayerSums`) add these up, and :func:`reorder` permutes
#: them, so a new per-layer quantity is one field here and one line in :func:`build_layer_graph`.
LAYER_ARRAYS = ("forward_ms", "backward_ms", "backward_input_ms", "backward_weight_ms", "param_bytes",
                "activation_bytes", "output_bytes", "selective_activation_bytes", "selective_recompute_ms",
                "input_bytes", "expert_param_bytes", "working_bytes")


@dataclass(frozen=True)
class LayerGraph:
    """Per-layer costs at one micro-batch size, in the profile's topological order.

    All arrays are indexed by layer position ``0..n-1``.
    """

    names: tuple[str, ...]
    """Layer names in topological order."""
    forward_ms: np.ndarray
    """Forward time per micro-batch."""
    backward_ms: np.ndarray
    """Whole backward time per micro-batch."""
    backward_input_ms: np.ndarray
    """Input-gradient part of the backward (estimated where the profile lacks it)."""
    backward_weight_ms: np.ndarray
    """Weight-gradient part of the backward."""
    backward_split_measured: bool
    """Whether the B/W split came from the profile rather than an estimate."""
    param_bytes: np.ndarray
    """Parameter bytes."""
    activation_bytes: np.ndarray
    """Bytes kept for backward per micro-batch in flight."""
    output_bytes: np.ndarray
    """Bytes of the layer's output per micro-batch."""
    graph: nx.DiGraph
    """Edges between layer positions (ints)."""
    chain: bool
    """True when the graph is the path 0 -> 1 -> ... -> n-1."""
    selective_activation_bytes: np.ndarray | None = None
    """Bytes kept per micro-batch in flight under selective recomputation (the attention core
    recomputed in backward). Default: ``activation_bytes`` (nothing to recompute)."""
    selective_recompute_ms: np.ndarray | None = None
    """Extra forward time of the selective recomputation per micro-batch. Default: 0."""
    selective_known: bool = False
    """Whether every layer's profile entry gave the selective fields (else ``selective`` is not
    searched: it would save nothing)."""
    input_bytes: np.ndarray | None = None
    """Bytes of the layer's inputs per micro-batch: its predecessors' outputs (0 for a layer that
    reads only the data batch). What full recomputation keeps of the layer: each layer is
    recomputed from its own input. Default: from the edges and ``output_bytes``."""
    expert_param_bytes: np.ndarray | None = None
    """Of ``param_bytes``, the routed experts' (one rank's: the profile's ``expert_param_bytes``,
    which a cluster view divides by the expert-parallel degree). Their training state is sharded
    over the expert-data-parallel group, not the data-parallel one
    (:attr:`pipeplan.plan.costmodel.CostModel.expert_static_bytes_per_param_byte`). Default: 0."""
    tied_weights: tuple[tuple[int, tuple[int, ...], float], ...] = ()
    """The profile's tied weights (``Profile.tied_weights``) as ``(first, others, param_bytes)``
    in layer positions: the first layer's ``param_bytes`` counts the weight; a stage that holds
    one of the others but not the first keeps a copy (see :func:`tied_copy_mask`)."""
    block_mask: np.ndarray | None = None
    """Which layers are transformer blocks (profile ``kind: block``; every layer where the
    profile names no kinds): what Megatron's ``--recompute-method block`` counts and recomputes
    (its embedding, final norm and head sit outside the transformer block). Default: all."""
    working_bytes: np.ndarray | None = None
    """Bytes a layer allocates and frees within one pass above its kept ones (the profile's
    ``working_bytes``: the loss's fp32 copies at the head). A stage's peak adds its largest
    (:attr:`pipeplan.plan.costmodel.CostModel.working_bytes`). Default: 0."""
    recompute_block_layers: int = 0
    """Megatron's ``--recompute-method block --recompute-num-layers N``: the ``block`` recompute
    mode recomputes the first N blocks of each stage in full (0: no such mode)."""

    def __post_init__(self):
        if self.input_bytes is None:
            inputs = np.zeros(len(self.names), dtype=float)
            for u, v in self.graph.edges():
                inputs[v] += self.output_bytes[u]
            object.__setattr__(self, "input_bytes", inputs)
        if self.selective_activation_bytes is None:
            object.__setattr__(self, "selective_activation_bytes", self.activation_bytes.copy())
        if self.selective_recompute_ms is None:
            object.__setattr__(self, "selective_recompute_ms", np.zeros_like(self.forward_ms))
        if self.expert_param_bytes is None:
            object.__setattr__(self, "expert_param_bytes", np.zeros_like(self.param_bytes))
        if self.block_mask is None:
            object.__setattr__(self, "block_mask", np.ones(len(self.names), dtype=bool))
        if self.working_bytes is None:
            object.__setattr__(self, "working_bytes", np.zeros_like(self.activation_bytes))

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @cached_property
    def compute_ms(self) -> np.ndarray:
        """Forward plus backward time of each layer."""
        return self.forward_ms + self.backward_ms

    def boundary_bytes(self, ideal_mask: np.ndarray) -> int:
        """Bytes crossing the cut after the down-closed set ``ideal_mask``.

        Each tensor counts once however many later layers consume it.
        """
        total = 0
        for u in np.flatnonzero(ideal_mask):
            if any(not ideal_mask[v] for v in self.graph.successors(int(u))):
                total += int(self.output_bytes[u])
        return total


def is_chain(graph: nx.DiGraph, n: int) -> bool:
    return graph.number_of_edges() == n - 1 and all(graph.has_edge(i, i + 1) for i in range(n - 1))


# Where the profile does not split the backward, assume the input-gradient half equals the
# weight-gradient half: for matmul layers both are one GEMM of the forward's size.
_ESTIMATED_INPUT_GRAD_SHARE = 0.5


def build_layer_graph(profile, microbatch_size: int, recompute_block_layers: int = 0) -> LayerGraph:
    """Build the layer graph of ``profile`` at ``microbatch_size``.

    Parameters
    ----------
    profile : Profile
        A validated profile.
    microbatch_size : int
        One of ``profile.microbatch_sizes``.
    recompute_block_layers : int
        N of Megatron's ``--recompute-method block`` (:attr:`LayerGraph.recompute_block_layers`).

    Returns
    -------
    LayerGraph

    Raises
    ------
    BadInputError
        If the micro-batch size was not profiled.
    """
    if microbatch_size not in profile.microbatch_sizes:
        raise BadInputError(
            f"--microbatch-size: {microbatch_size} was not profiled; "
            f"the profile has {profile.microbatch_sizes}"
        )
    index = {layer.name: i for i, layer in enumerate(profile.layers)}
    costs = [layer.cost_at(microbatch_size) for layer in profile.layers]
    backward = np.array([c.backward_ms for c in costs], dtype=float)
    measured = all(c.backward_input_ms is not None for c in costs)
    if measured:
        b_input = np.array([c.backward_input_ms for c in costs], dtype=float)
        b_weight = np.array([c.backward_weight_ms for c in costs], dtype=float)
    else:
        b_input = backward * _ESTIMATED_INPUT_GRAD_SHARE
        b_weight = backward - b_input
    selective = all(c.selective_activation_bytes is not None for c in costs)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(profile.layers)))
    graph.add_edges_from((index[a], index[b]) for a, b in profile.edge_list())
    n = len(profile.layers)
    return LayerGraph(
        names=tuple(layer.name for layer in profile.layers),
        forward_ms=np.array([c.forward_ms for c in costs], dtype=float),
        backward_ms=backward,
        backward_input_ms=b_input,
        backward_weight_ms=b_weight,
        backward_split_measured=measured,
        param_bytes=np.array([layer.param_bytes for layer in profile.layers], dtype=float),
        activation_bytes=np.array([c.activation_bytes for c in costs], dtype=float),
        output_bytes=np.array([c.output_bytes for c in costs], dtype=float),
        graph=graph,
        chain=is_chain(graph, n),
        selective_activation_bytes=np.array([c.selective_activation_bytes for c in costs], dtype=float)
        if selective else None,
        selective_recompute_ms=np.array([c.selective_recompute_ms for c in costs], dtype=float) if selective else None,
        selective_known=selective,
        expert_param_bytes=np.array([layer.expert_param_bytes or 0 for layer in profile.layers], dtype=float)
        if any(layer.expert_param_bytes for layer in profile.layers) else None,
        tied_weights=tuple((index[tie.layers[0]], tuple(sorted({index[name] for name in tie.layers[1:]} - {index[tie.layers[0]]})),
                            float(tie.param_bytes)) for tie in (profile.tied_weights or ())),
        block_mask=np.array([layer.kind == "block" for layer in profile.layers], dtype=bool)
        if any(layer.kind for layer in profile.layers) else None,
        recompute_block_layers=int(recompute_block_layers),
        working_bytes=np.array([getattr(c, "working_bytes", None) or 0 for c in costs], dtype=float)
        if any(getattr(c, "working_bytes", None) for c in costs) else None,
    )


def reorder(graph: LayerGraph, order) -> LayerGraph:
    """The same graph with layers renumbered so that ``order[i]`` becomes position ``i``.

    ``order`` must be a topological order; splits found on the result map back through it.
    """
    order = list(order)
    position = {old: new for new, old in enumerate(order)}
    edges = nx.DiGraph()
    edges.add_nodes_from(range(len(order)))
    edges.add_edges_from((position[u], position[v]) for u, v in graph.graph.edges())
    pick = np.array(order)
    return LayerGraph(
        names=tuple(graph.names[i] for i in order),
        backward_split_measured=graph.backward_split_measured,
        graph=edges,
        chain=is_chain(edges, len(order)),
        selective_known=graph.selective_known,
        block_mask=graph.block_mask[pick],
        recompute_block_layers=graph.recompute_block_layers,
        tied_weights=tuple((position[first], tuple(sorted(position[o] for o in others)), size)
                           for first, others, size in graph.tied_weights),
        **{name: getattr(graph, name)[pick] for name in LAYER_ARRAYS},
    )
