"""Time of data parallelism: the gradient sync and ZeRO 3's parameter gathers, per iteration.

Each pipeline rank's data-parallel group (``d`` GPUs holding the same stages and tensor shard,
:meth:`pipeplan.cluster.placement.Layout.data_span`) synchronises its own gradients, in
parallel with the other pipeline ranks' groups. Per iteration of ``m`` micro-batches:

=====  ===================================================  ==========================
stage  collectives                                          when
=====  ===================================================  ==========================
0      all-reduce of the gradients                          once, after the last backward
1      reduce-scatter of the gradients, all-gather of the   once (Megatron's distributed
       updated weights                                      optimizer)
2      reduce-scatter of the gradients                      every micro-batch (they are
                                                            kept sharded)
       all-gather of the updated weights                    once, after the step
3      all-gather of the weights for the forward and        every micro-batch
       again for the backward; reduce-scatter of the
       gradients
=====  ===================================================  ==========================

Gradients move in their dtype (``TrainingState.gradient_bytes``: fp32 for
``adam-fp32-grads``), weights in the training dtype. ``overlap`` is the share of the sync that
hides behind compute (Megatron's ``--overlap-grad-reduce``, FSDP's prefetch); the rest is exposed
and adds to the iteration. It is an assumption, settable, not a prediction; docs/cluster-model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.cluster.collectives import collective_ms
from pipeplan.facts.training_state import ZERO_STAGES
from pipeplan.facts.training_state import TrainingState
from pipeplan.cluster.placement import GroupSpan
from pipeplan.formats.cluster import ClusterSpec

__all__ = ["DEFAULT_OVERLAP", "DataParallelSync", "data_parallel_sync", "moe_data_parallel_sync"]

#: Share of the data-parallel sync hidden behind compute unless the user says otherwise:
#: none, so the prediction is an upper bound on the sync's cost.
DEFAULT_OVERLAP = 0.0


@dataclass(frozen=True)
class DataParallelSync:
    """One iteration's data-parallel communication for one GPU, by part, in ms."""

    gradient_ms: float
    """Gradient all-reduce or reduce-scatters."""
    weight_gather_ms: float
    """All-gathers of weights (after the step for ZeRO 1/2, per micro-batch for ZeRO 3)."""
    exposed_ms: float
    """What adds to the iteration: ``(1 - overlap) x (gradient_ms + weight_gather_ms)``."""

    @property
    def total_ms(self) -> float:
        return self.gradient_ms + self.weight_gather_ms


def data_parallel_sync(params: float, state: TrainingState, zero_stage: int, span: GroupSpan,
                       cluster: ClusterSpec, num_microbatches: int,
                       overlap: float = DEFAULT_OVERLAP) -> DataParallelSync:
    """The data-parallel sync of a GPU holding ``params`` parameters (its stages' tensor shard).

    Parameters
    ----------
    params : float
        Parameters of the GPU's stages (one tensor shard, before ZeRO sharding).
    state : TrainingState
        Gives the bytes per parameter of the gradients and the weights.
    zero_stage : {0, 1, 2, 3}
    span : GroupSpan
        The data-parallel group's shape on the nodes.
    cluster : ClusterSpec
        Its links.
    num_microbatches : int
        ``m`` per replica (ZeRO 2 and 3 communicate every micro-batch).
    overlap : float
        Share hidden behind compute, in [0, 1].

    Returns
    -------
    DataParallelSync

    Examples
    --------
    >>> from pipeplan.facts.training_state import training_state
    >>> from pipeplan.cluster.presets import PRESETS
    >>> adam = training_state("adam", 2)
    >>> one_gpu = GroupSpan(ranks_per_node=1, nodes=1)
    >>> data_parallel_sync(1e9, adam, 0, one_gpu, PRESETS["dgx-h100"], 8).exposed_ms
    0.0
    >>> two_nodes = GroupSpan(ranks_per_node=1, nodes=2)   # d = 2 over the network
    >>> sync = data_parallel_sync(1e9, adam, 0, two_nodes, PRESETS["dgx-h100"], 8)
    >>> round(sync.gradient_ms, 4)   # 2 x 1/2 x 2 GB at 0.8 x 50 GB/s, 2 hops of 14 us, one call of 8.4 us
    50.0364
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage: {zero_stage} is not one of 0, 1, 2, 3")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches: {num_microbatches} must be at least 1")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap: {overlap} must be in [0, 1]")
    if span.size == 1:
        return DataParallelSync(0.0, 0.0, 0.0)

    def run(kind: str, size_bytes: float) -> float:
        return collective_ms(kind, size_bytes, span.ranks_per_node, span.nodes,
                             cluster.intra_node, cluster.inter_node)

    gradient_bytes = params * state.gradient_bytes
    weight_bytes = params * state.weight_bytes
    if zero_stage == 0:
        gradient_ms, gather_ms = run("all-reduce", gradient_bytes), 0.0
    elif zero_stage == 1:
        gradient_ms, gather_ms = run("reduce-scatter", gradient_bytes), run("all-gather", weight_bytes)
    elif zero_stage == 2:
        gradient_ms = num_microbatches * run("reduce-scatter", gradient_bytes)
        gather_ms = run("all-gather", weight_bytes)
    else:
        gradient_ms = num_microbatches * run("reduce-scatter", gradient_bytes)
        gather_ms = 2 * num_microbatches * run("all-gather", weight_bytes)
    return DataParallelSync(gradient_ms, gather_ms, (1 - overlap) * (gradient_ms + gather_ms))


def moe_data_parallel_sync(dense_params: float, expert_params: float, state: TrainingState, zero_stage: int,
                           span: GroupSpan, expert_span: GroupSpan, cluster: ClusterSpec, num_microbatches: int,
                           overlap: float = DEFAULT_OVERLAP) -> DataParallelSync:
    """The sync of a GPU of a mixture-of-experts layout: its dense parameters over the
    data-parallel group (``span``), its routed experts' over the expert-data-parallel group
    (``expert_span``: the ``t x d / (E x ETP)`` GPUs that hold the same experts; Megatron-core
    reduces the expert gradients over ``expert_data_parallel_group``). The two run one after
    the other (separate buckets), so their times add.

    Examples
    --------
    >>> from pipeplan.facts.training_state import training_state
    >>> from pipeplan.cluster.presets import PRESETS
    >>> adam, dgx = training_state("adam", 2), PRESETS["dgx-h100"]
    >>> two_nodes, one = GroupSpan(1, 2), GroupSpan(1, 1)
    >>> moe_data_parallel_sync(1e9, 5e8, adam, 0, two_nodes, one, dgx, 8) == data_parallel_sync(1e9, adam, 0, two_nodes, dgx, 8)
    True
    """
    dense = data_parallel_sync(dense_params, state, zero_stage, span, cluster, num_microbatches, overlap)
    if not expert_params:
        return dense
    expert = data_parallel_sync(expert_params, state, zero_stage, expert_span, cluster, num_microbatches, overlap)
    return DataParallelSync(dense.gradient_ms + expert.gradient_ms, dense.weight_gather_ms + expert.weight_gather_ms,
                            dense.exposed_ms + expert.exposed_ms)
