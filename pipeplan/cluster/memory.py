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

On top of what is planned, each GPU keeps a reserve: a fixed part (the CUDA context, NCCL's
buffers, cuBLAS workspace) and a share for the caching allocator's fragmentation
(:func:`reserve_bytes`). Both are settable in the cluster spec; docs/cluster-model.md.
"""

from __future__ import annotations

import math

from pipeplan.facts.training_state import TrainingState

__all__ = ["zero3_gathered_bytes", "reserve_bytes", "plannable_bytes"]

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
    x = int(room / (1 + fragmentation))
    while x > 0 and x + reserve_bytes(x, fixed_bytes, fragmentation) > cap_bytes:
        x -= 1
    while x + 1 + reserve_bytes(x + 1, fixed_bytes, fragmentation) <= cap_bytes:
        x += 1
    return x
