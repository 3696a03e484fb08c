"""Memory per GPU of the training state under ZeRO, and the reserve pipeplan never plans.

ZeRO (Rajbhandari et al. 2020) shards the three parts of the training state
(:class:`pipeplan.facts.training_state.TrainingState`) over the ``d`` data-parallel ranks:

=====  =========================================  ==========================================
stage  sharded over d                             also known as
=====  =========================================  ==========================================
0      nothing                                    plain data parallelism (DDP)
1      optimizer state                            Megatron's ``--use-distributed-optimizer``
2      optimizer state, gradients                 DeepSpeed ZeRO-2
3      optimizer state, gradients, weights        DeepSpeed ZeRO-3, FSDP / FSDP2 (full shard)
=====  =========================================  ==========================================

Under ZeRO 3 a unit's weights are gathered whole for its forward and again for its backward;
with FSDP's prefetch two units are whole at once (:func:`zero3_gathered_bytes`).

On top of what is planned, each GPU keeps a reserve (:func:`job_memory`): a fixed part, the
CUDA context, the cuBLAS / cuBLASLt workspaces and the NCCL buffers of the communicators the
rank's layout holds (:func:`nccl_communicators`), and a share of the planned bytes for the
caching allocator's fragmentation (:func:`reserve_bytes`). Each figure is documented in
:mod:`pipeplan.facts.job_memory`; the cluster spec overrides any of them (``reserve`` the whole
fixed part, as before). docs/cluster-model.md, "Memory a real job sees".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from pipeplan.facts.gpus import GPUS
from pipeplan.facts.job_memory import (CUDA_CONTEXT_BYTES, NCCL_BUFFSIZE_BYTES, NCCL_COLL_CHANNELS,
                                       NCCL_P2P_CHANNELS_PER_PEER, cublas_workspace_bytes, fragmentation_share)
from pipeplan.facts.training_state import TrainingState

__all__ = ["zero3_gathered_bytes", "reserve_bytes", "plannable_bytes", "JobMemory", "nccl_communicators",
           "nccl_buffer_bytes", "job_fixed_bytes", "job_fragmentation", "job_memory", "plannable_for", "trial_layout"]

def zero3_gathered_bytes(largest_unit_params: float, state: TrainingState, data_parallel: int,
                         prefetch_units: int = 2) -> int:
    """Extra bytes of weights gathered whole at once under ZeRO 3.

    ``prefetch_units`` units (the running one and the prefetched next) are whole, less the
    shard of each that the GPU keeps anyway. Zero when ``d = 1``.

    Examples
    --------
    >>> from pipeplan.facts.training_state import training_state
    >>> zero3_gathered_bytes(1e8, training_state("adam", 2), data_parallel=4)  # 2 x 200 MB x 3/4
    300000000
    """
    if data_parallel <= 1:
        return 0
    whole = largest_unit_params * state.weight_bytes
    return math.ceil(prefetch_units * whole * (data_parallel - 1) / data_parallel)


def reserve_bytes(planned_bytes: float, fixed_bytes: int, fragmentation: float) -> int:
    """The per-GPU reserve on top of ``planned_bytes``: fixed part + fragmentation share.

    Examples
    --------
    >>> reserve_bytes(60 * 2**30, 2 * 2**30, 0.05) / 2**30
    5.0
    """
    if planned_bytes < 0 or fixed_bytes < 0 or not 0 <= fragmentation < 1:
        raise ValueError("planned_bytes and fixed_bytes must be >= 0, fragmentation in [0, 1)")
    return fixed_bytes + math.ceil(fragmentation * planned_bytes)


def plannable_bytes(cap_bytes: int, fixed_bytes: int, fragmentation: float) -> int:
    """The most a GPU can be planned to hold so that plan + reserve stays within the cap.

    The inverse of :func:`reserve_bytes`: the largest ``x`` with
    ``x + reserve_bytes(x) <= cap_bytes`` (0 when the fixed reserve alone is over the cap).

    Examples
    --------
    >>> x = plannable_bytes(80 * 10**9, 2 * 2**30, 0.05)
    >>> x + reserve_bytes(x, 2 * 2**30, 0.05) <= 80 * 10**9 < x + 1 + reserve_bytes(x + 1, 2 * 2**30, 0.05)
    True
    """
    room = cap_bytes - fixed_bytes
    if room <= 0:
        return 0
    # x + reserve_bytes(x) grows with x, so bisect: ~log2(cap) steps, where correcting the float
    # estimate one byte at a time took ~1e14 steps at a cap of 1e30 bytes.
    lo, hi = 0, room  # lo fits (the fixed reserve is within the cap); the answer is at most room
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid + reserve_bytes(mid, fixed_bytes, fragmentation) <= cap_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class JobMemory:
    """What a GPU of a real job holds beside the planned bytes, by part (docs/cluster-model.md)."""

    cuda_context_bytes: int
    cublas_workspace_bytes: int
    nccl_buffer_bytes: int
    fragmentation_bytes: int
    """The caching allocator's share of the planned bytes."""
    fixed_override_bytes: Optional[int] = None
    """The cluster spec's ``reserve``: it replaces the three fixed parts (which are then 0)."""

    @property
    def fixed_bytes(self) -> int:
        if self.fixed_override_bytes is not None:
            return self.fixed_override_bytes
        return self.cuda_context_bytes + self.cublas_workspace_bytes + self.nccl_buffer_bytes

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.fragmentation_bytes


def nccl_communicators(data: int, tensor: int, pipeline: int, context: int = 1, expert: int = 1,
                       expert_data: int = 1) -> list[tuple[str, str, int]]:
    """The NCCL communicators one rank of a d x t x p (x C, E) Megatron layout holds:
    ``(group, kind, ranks)`` with kind ``collective`` (ring / tree), ``p2p`` (sends to the
    neighbours) or ``all-to-all``.

    Megatron-core's ``parallel_state`` makes the groups; PyTorch creates a group's NCCL
    communicator on its first operation, so only the groups a training step uses count: the
    default (world) group, tensor (t > 1), data with context (the gradient reduce, d x C > 1),
    pipeline sends (p > 1) and the tied embedding's first-and-last-stage group (p > 1), the
    context ring (C > 1), the expert all-to-all (E > 1) and the experts' own data-parallel group
    (``expert_data``, EDP = t x d / (E x ETP) > 1: their gradient reduce).

    Examples
    --------
    >>> nccl_communicators(8, 8, 4)
    [('world', 'collective', 256), ('tensor', 'collective', 8), ('data', 'collective', 8), ('pipeline', 'p2p', 4), ('embedding', 'collective', 2)]
    """
    world = data * tensor * pipeline * context
    groups = [("world", "collective", world), ("tensor", "collective", tensor),
              ("data", "collective", data * context), ("pipeline", "p2p", pipeline),
              ("embedding", "collective", 2 if pipeline > 1 else 1), ("context", "p2p", context),
              ("expert", "all-to-all", expert), ("expert data", "collective", expert_data if expert > 1 else 1)]
    return [g for g in groups if g[2] > 1]


def nccl_buffer_bytes(communicators, channels: int = NCCL_COLL_CHANNELS, buffsize_bytes: int = NCCL_BUFFSIZE_BYTES,
                      p2p_channels_per_peer: int = NCCL_P2P_CHANNELS_PER_PEER) -> int:
    """NCCL's buffers for ``communicators`` (:func:`nccl_communicators`), one ``NCCL_BUFFSIZE``
    per channel per peer connection::

        collective of n ranks:  channels x min(2, n - 1) x buffsize   (the ring's two neighbours)
        p2p of n ranks:         min(2, n - 1) x p2p_channels_per_peer x buffsize
        all-to-all of n ranks:  (n - 1) x p2p_channels_per_peer x buffsize

    Examples
    --------
    >>> nccl_buffer_bytes([("tensor", "collective", 8), ("pipeline", "p2p", 4)]) // 2**20   # 8x2x4 + 2x2x4
    80
    """
    total = 0
    for _, kind, ranks in communicators:
        peers = ranks - 1 if kind == "all-to-all" else min(2, ranks - 1)
        total += peers * (channels if kind == "collective" else p2p_channels_per_peer) * buffsize_bytes
    return total


def job_fixed_bytes(cluster, launcher, layout: tuple[int, ...]) -> JobMemory:
    """The fixed parts (fragmentation 0) on one GPU of ``cluster`` for ``layout`` = (d, t, p[, C, E]).

    The spec's ``reserve`` replaces all three; its ``cuda_context`` and ``nccl_channels`` replace
    one figure each.
    """
    override = getattr(cluster, "reserve_bytes", None)
    if override is not None:
        return JobMemory(0, 0, 0, 0, fixed_override_bytes=override)
    gpu = GPUS.get(cluster.gpu)
    memory = gpu.memory_bytes if gpu is not None else (cluster.memory_cap_bytes or 0)
    context = getattr(cluster, "cuda_context_bytes", None)
    channels = getattr(cluster, "nccl_channels", None) or NCCL_COLL_CHANNELS
    return JobMemory(cuda_context_bytes=CUDA_CONTEXT_BYTES if context is None else context,
                     cublas_workspace_bytes=cublas_workspace_bytes(cluster.gpu, memory),
                     nccl_buffer_bytes=nccl_buffer_bytes(nccl_communicators(*layout), channels),
                     fragmentation_bytes=0)


def job_fragmentation(cluster, launcher) -> float:
    """The allocator's fragmentation share: the spec's ``fragmentation``, else the launcher's."""
    share = getattr(cluster, "fragmentation", None)
    return fragmentation_share(launcher) if share is None else share


def job_memory(planned_bytes: float, cluster, launcher, layout: tuple[int, ...]) -> JobMemory:
    """Every part beside ``planned_bytes``: :func:`job_fixed_bytes` and the fragmentation share
    of the planned bytes (:func:`reserve_bytes`'s rule, rounded up)."""
    fixed = job_fixed_bytes(cluster, launcher, layout)
    share = job_fragmentation(cluster, launcher)
    return JobMemory(fixed.cuda_context_bytes, fixed.cublas_workspace_bytes, fixed.nccl_buffer_bytes,
                     reserve_bytes(planned_bytes, 0, share), fixed.fixed_override_bytes)


def plannable_for(cap_bytes: int, cluster, launcher, layout: tuple[int, ...] = (1, 1, 1)) -> int:
    """:func:`plannable_bytes` of ``cap_bytes`` under the job's parts for ``layout`` (the default,
    one GPU with no communicator, is the least reserve: the most any layout can plan)."""
    return plannable_bytes(cap_bytes, job_fixed_bytes(cluster, launcher, layout).fixed_bytes,
                           job_fragmentation(cluster, launcher))


def trial_layout(trial) -> tuple[int, int, int, int, int, int]:
    """(d, t, p, C, E, EDP) of a cluster search's trial (E and EDP 1 on a dense model)."""
    return (trial.data, trial.tensor, trial.pipeline, trial.context, trial.expert if trial.moe else 1,
            trial.expert_data if trial.moe else 1)
