"""Memory over a schedule: micro-batches in flight per stage, and each rank's peak.

What one stage holds per micro-batch is the cost model's (:mod:`pipeplan.plan.costmodel`);
how many micro-batches it holds at once, and how a rank's stages add up, follows the order of
the schedule's actions (:mod:`pipeplan.plan.actions`), not their times. See
docs/cost-model.md.
"""

from __future__ import annotations

from functools import lru_cache
from pipeplan.plan.actions import cached_rank_actions
from pipeplan.facts.schedules import check_schedule, stage_ranks

__all__ = [
    "in_flight_microbatches",
    "stage_in_flight",
    "rank_peak_bytes",
]


def in_flight_microbatches(schedule: str, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Micro-batches whose activations each stage holds at its peak.

    GPipe runs every forward before any backward, so each stage holds all ``m``; 1F1B starts
    backwards as soon as the last stage can, so stage ``s`` of ``p`` holds ``min(m, p - s)``.

    Examples
    --------
    >>> in_flight_microbatches("1f1b", 4, 8)
    (4, 3, 2, 1)
    >>> in_flight_microbatches("gpipe", 4, 8)
    (8, 8, 8, 8)
    """
    if schedule == "gpipe":
        return (num_microbatches,) * num_stages
    return tuple(min(num_microbatches, num_stages - s) for s in range(num_stages))


@lru_cache(maxsize=512)
def stage_in_flight(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations it holds at once under ``schedule``.

    Read off the action order that torch runs (:func:`pipeplan.plan.actions.rank_actions`):
    a forward adds one micro-batch, the action that frees it (the whole backward, or the
    weight gradient where the backward is split) removes one. It depends on the order only,
    not on the stage times, so the simulator reports the same counts for any costs.

    Parameters
    ----------
    schedule : str
        One of :data:`pipeplan.facts.schedules.SCHEDULES`.
    num_ranks, num_microbatches, virtual_stages : int
        ``p``, ``m`` and ``v``; there are ``p * v`` stages.

    Returns
    -------
    tuple of int
        One count per stage, in pipeline order.

    Raises
    ------
    BadInputError
        If the schedule refuses ``(p, m, v)``.

    Examples
    --------
    >>> stage_in_flight("1f1b", 4, 8)
    (4, 3, 2, 1)
    >>> stage_in_flight("zb", 4, 8)  # ZB-H1: later ranks delay their weight gradients
    (4, 4, 4, 4)

    Notes
    -----
    O(p m v), cached per ``(schedule, p, m, v)``.
    """
    check_schedule(schedule, num_ranks, num_microbatches, virtual_stages)

    held = [0] * (num_ranks * virtual_stages)
    peak = [0] * (num_ranks * virtual_stages)
    for actions in cached_rank_actions(schedule, num_ranks, num_microbatches, virtual_stages):
        for action in actions:
            if action.kind == "F":
                held[action.stage] += 1
                peak[action.stage] = max(peak[action.stage], held[action.stage])
            elif action.kind in ("FULL_B", "W"):
                held[action.stage] -= 1
    return tuple(peak)


@lru_cache(maxsize=256)
def _live_count_rows(schedule: str, p: int, m: int, v: int):
    """Per rank: its stages and the Pareto-maximal vectors of live micro-batches per stage.

    A rank's memory only rises at a forward, so its peak is the largest weighted sum of the
    live counts right after one of its forwards; a vector that another one dominates never
    gives the largest sum (activation bytes are >= 0), so only the maximal ones are kept.
    """
    import numpy as np

    placement = stage_ranks(schedule, p, v)
    out = []
    for rank, actions in enumerate(cached_rank_actions(schedule, p, m, v)):
        stages = tuple(s for s in range(p * v) if placement[s] == rank)
        position = {s: i for i, s in enumerate(stages)}
        live = [0] * len(stages)
        rows = set()
        for action in actions:
            if action.kind == "F":
                live[position[action.stage]] += 1
                rows.add(tuple(live))
            elif action.kind in ("FULL_B", "W"):
                live[position[action.stage]] -= 1
        table = np.array(sorted(rows, reverse=True) or [[0] * len(stages)], dtype=np.int64)
        if len(stages) == 1:
            table = table[:1]
        else:
            # dominated[i]: some other row is >= row i everywhere and differs from it.
            above = (table[:, None, :] >= table[None, :, :]).all(axis=2)
            differs = (table[:, None, :] != table[None, :, :]).any(axis=2)
            table = table[~(above & differs).any(axis=0)]
        out.append((stages, table))
    return tuple(out)


def rank_peak_bytes(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int,
                    static_bytes, activation_bytes) -> tuple[int, ...]:
    """Each rank's peak memory under ``schedule``, without simulating the timing.

    Equal to :func:`pipeplan.plan.simulate.simulate`'s ``rank_peak_memory_bytes`` for the same
    per-stage bytes: memory follows the order of a rank's actions, not their times (a forward
    adds its stage's activations, the whole backward or the weight gradient frees them).

    Parameters
    ----------
    schedule : str
    num_ranks, num_microbatches, virtual_stages : int
        ``p``, ``m``, ``v``.
    static_bytes, activation_bytes : sequence of int
        Per stage (``p * v``), as in :class:`pipeplan.plan.simulate.StageCost`.

    Returns
    -------
    tuple of int
        One peak per rank.

    Examples
    --------
    >>> rank_peak_bytes("1f1b", 4, 8, 1, [10] * 4, [1] * 4)
    (14, 13, 12, 11)

    Notes
    -----
    The live-count vectors are cached per ``(schedule, p, m, v)``; each call is then
    ``O(p R v)`` for ``R`` maximal vectors per rank (``R = 1`` when ``v = 1``).
    """
    peaks = []
    for stages, rows in _live_count_rows(schedule, num_ranks, num_microbatches, virtual_stages):
        static = sum(int(static_bytes[s]) for s in stages)
        weights = [int(activation_bytes[s]) for s in stages]
        held = max(sum(int(c) * w for c, w in zip(row, weights)) for row in rows.tolist())
        peaks.append(static + held)
    return tuple(peaks)
