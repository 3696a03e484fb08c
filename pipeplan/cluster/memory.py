"""Memory per GPU of the training state under ZeRO, and the reserve pipeplan never plans.

ZeRO (Rajbhandari et al. 2020) shards the three parts of the training state
(:class:`pipeplan.cluster.optimizers.TrainingState`) over the ``d`` data-parallel ranks:

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

On top of what is planned, each GPU keeps a reserve: a fixed part (the CUDA context, NCCL's
buffers, cuBLAS workspace) and a share for the caching allocator's fragmentation
(:func:`reserve_bytes`). Both are settable in the cluster spec; docs/cluster-model.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeplan.cluster.optimizers import TrainingState

__all__ = ["ZERO_STAGES", "StateMemory", "state_memory", "state_bytes_per_param_byte",
           "zero3_gathered_bytes", "reserve_bytes", "plannable_bytes"]

#: The ZeRO stages pipeplan plans.
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class StateMemory:
    """One GPU's training state, by part, in bytes."""

    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


def state_memory(params: float, state: TrainingState, zero_stage: int, data_parallel: int) -> StateMemory:
    """The training state one GPU holds for ``params`` parameters under ZeRO ``zero_stage``.

    Parameters
    ----------
    params : float
        Parameters of the GPU's stages, its tensor shard (a profile at degree ``t`` gives them).
    state : TrainingState
        Bytes per parameter of each part.
    zero_stage : {0, 1, 2, 3}
    data_parallel : int
        ``d``; a sharded part is ``ceil(bytes / d)`` (the last rank's padding is not counted).

    Raises
    ------
    ValueError
        For a stage outside 0-3 or ``d < 1``.

    Examples
    --------
    >>> from pipeplan.cluster.optimizers import training_state
    >>> megatron = training_state("adam-fp32-grads", 2)
    >>> m = state_memory(1e9, megatron, zero_stage=1, data_parallel=4)   # 6 + 12 / 4 bytes
    >>> m.total_bytes / 1e9
    9.0
    >>> state_memory(1e9, megatron, 0, 4).total_bytes / 1e9
    18.0
    >>> state_memory(1e9, megatron, 3, 4).total_bytes / 1e9
    4.5
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage: {zero_stage} is not one of 0, 1, 2, 3")
    if data_parallel < 1:
        raise ValueError(f"data_parallel: {data_parallel} must be at least 1")

    def part(bytes_per_param: float, sharded: bool) -> int:
        whole = params * bytes_per_param
        return math.ceil(whole / data_parallel) if sharded else math.ceil(whole)

    return StateMemory(
        weight_bytes=part(state.weight_bytes, zero_stage >= 3),
        gradient_bytes=part(state.gradient_bytes, zero_stage >= 2),
        optimizer_bytes=part(state.optimizer_bytes, zero_stage >= 1),
    )


def state_bytes_per_param_byte(optimizer: str, dtype_bytes: int, zero_stage: int = 0,
                               data_parallel: int = 1) -> float:
    """Training state one GPU holds per byte of its parameters: the cost model's static factor.

    With ``zero_stage = 0`` it is the pipeline planner's long-standing factor (16 bytes per
    parameter over the dtype's bytes for ``adam``); ZeRO divides each sharded part by ``d``.

    Examples
    --------
    >>> state_bytes_per_param_byte("adam", 2)
    8.0
    >>> state_bytes_per_param_byte("adam-fp32-grads", 2, zero_stage=1, data_parallel=4)   # (6 + 3) / 2
    4.5
    >>> state_bytes_per_param_byte("none", 4)
    2.0
    """
    from pipeplan.cluster.optimizers import training_state

    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage: {zero_stage} is not one of 0, 1, 2, 3")
    state = training_state(optimizer, dtype_bytes)
    d = float(data_parallel)
    per_param = (state.weight_bytes / (d if zero_stage >= 3 else 1.0)
                 + state.gradient_bytes / (d if zero_stage >= 2 else 1.0)
                 + state.optimizer_bytes / (d if zero_stage >= 1 else 1.0))
    return per_param / float(dtype_bytes)


def zero3_gathered_bytes(largest_unit_params: float, state: TrainingState, data_parallel: int,
                         prefetch_units: int = 2) -> int:
    """Extra bytes of weights gathered whole at once under ZeRO 3.

    ``prefetch_units`` units (the running one and the prefetched next) are whole, less the
    shard of each that the GPU keeps anyway. Zero when ``d = 1``.

    Examples
    --------
    >>> from pipeplan.cluster.optimizers import training_state
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
