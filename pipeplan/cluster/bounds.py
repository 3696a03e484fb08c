"""What the cluster search knows of a layout before splitting it: per-unit sums, bounds, a guess.

The search (:mod:`pipeplan.cluster.search`) orders and prunes its candidates (d, t, p, ZeRO
stage, recomputation family) by lower bounds that need no split: some rank does ``1 / p`` of
every micro-batch's work (:func:`pipeplan.cluster.iteration.pipeline_lower_bound_ms`), and one
micro-batch's round trip bounds short pipelines of few micro-batches
(:func:`pipeplan.cluster.iteration.round_trip_lower_bound_ms`). The first candidate it plans
is chosen by a guess, not a bound (:func:`seed_estimate_ms`): the sooner a fast plan is found,
the more the bounds prune; the guess changes how much is pruned, never the winner.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.cluster.iteration import round_trip_lower_bound_ms
from pipeplan.cluster.profile_view import DegreeView

__all__ = ["UnitSums", "unit_sums", "seed_estimate_ms"]


def _work_ms(cost) -> float:
    """A unit's least forward + backward per micro-batch, however the schedule runs its backward."""
    backward = cost.backward_ms
    if cost.backward_input_ms is not None and cost.backward_weight_ms is not None:
        backward = min(backward, cost.backward_input_ms + cost.backward_weight_ms)
    return cost.forward_ms + backward


def _input_backward_ms(cost) -> float:
    """A unit's least backward on the way back to the first stage (the input gradient where split)."""
    if cost.backward_input_ms is None:
        return cost.backward_ms
    return min(cost.backward_ms, cost.backward_input_ms)


@dataclass(frozen=True)
class UnitSums:
    """What the bounds and the seed need of a layout's units at one micro-batch size."""

    work_ms: float
    """The whole model's least forward + backward per micro-batch."""
    largest_unit_ms: float
    """The largest single unit's (a stage holds it whole)."""
    activation_bytes: float
    """The whole model's activations of one micro-batch, kept for its backward."""
    recompute_factor: float
    """``1 + forward / work``: what recomputing every forward multiplies the work by."""
    forward_ms: tuple[float, ...]
    input_backward_ms: tuple[float, ...]
    unit_work_ms: tuple[float, ...]

    def round_trip_ms(self, num_microbatches: int) -> float:
        """:func:`~pipeplan.cluster.iteration.round_trip_lower_bound_ms` of ``m`` micro-batches."""
        return round_trip_lower_bound_ms(self.forward_ms, self.input_backward_ms, self.unit_work_ms,
                                         num_microbatches)


def unit_sums(view: DegreeView, sizes) -> dict[int, UnitSums]:
    """What the bounds need of a layout's units, per micro-batch size.

    Parameters
    ----------
    view : DegreeView
        The profile at the layout's tensor-parallel degree.
    sizes : iterable of int
        Micro-batch sizes.

    Returns
    -------
    dict of int to UnitSums

    Notes
    -----
    O(n) per size for ``n`` units; each ``round_trip_ms(m)`` is O(n) too.
    """
    out = {}
    for b in sizes:
        costs = [layer.cost_at(b) for layer in view.profile.layers]
        works = tuple(_work_ms(c) for c in costs)
        forwards = tuple(c.forward_ms for c in costs)
        work = sum(works)
        out[b] = UnitSums(work_ms=work, largest_unit_ms=max(works),
                          activation_bytes=float(sum(c.activation_bytes for c in costs)),
                          recompute_factor=1.0 + (sum(forwards) / work if work > 0 else 0.0),
                          forward_ms=forwards, input_backward_ms=tuple(_input_backward_ms(c) for c in costs),
                          unit_work_ms=works)
    return out


def seed_estimate_ms(bound_ms: float, m: int, p: int, sums: UnitSums, state_bytes: float,
                     usable_bytes: float) -> float:
    """Not a bound: a guess at a trial's iteration, to choose which to plan first (the seed).

    The bound with a one-forward-one-backward schedule's fill and drain, ``(m + p - 1) / m``; and
    where one micro-batch of the whole model's activations (what 1F1B's first rank holds: ``p``
    in flight of its ``1 / p``) does not fit beside the state, every forward run twice. Without
    the memory term the guess prefers short pipelines, which then need recomputation; found
    first, the fastest layout of 70B on 1,024 H100s prunes the rest about twice as fast.

    Parameters
    ----------
    bound_ms : float
        The trial's lower bound at this micro-batch size.
    m, p : int
        Micro-batches per replica and pipeline ranks.
    sums : UnitSums
        The layout's units at this size (its activation bytes and recompute factor).
    state_bytes, usable_bytes : float
        The training state per GPU (weights, gradients, optimizer, ZeRO-sharded; on average over
        the pipeline ranks) and the plannable memory.

    Examples
    --------
    >>> sums = UnitSums(3.0, 3.0, 10.0, 1.5, (1.0,), (1.0,), (3.0,))
    >>> seed_estimate_ms(100.0, 8, 4, sums, 50, 80)    # fits: 100 x 11 / 8
    137.5
    >>> seed_estimate_ms(100.0, 8, 4, sums, 75, 80)    # does not: and 1.5 x
    206.25
    """
    guess = bound_ms * (m + p - 1) / m
    return guess * sums.recompute_factor if state_bytes + sums.activation_bytes > usable_bytes else guess
