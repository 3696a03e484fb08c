"""An outer search's best time, for pruning one pipeline search against it (:class:`Incumbent`).

The cluster search (:mod:`pipeplan.cluster.search`) runs the pipeline planner once per layout
(d, t, p, ZeRO stage, recomputation family) and adds its own terms after the pipeline (each
rank's data-parallel sync, the optimizer step). Given the best iteration found so far and how
the caller times a pipeline plan, :func:`pipeplan.plan.search.make_plan` skips every
configuration whose lower bound, in the caller's time, is above that best, and raises
:class:`PrunedError` when it proves that the layout's own plan cannot beat it.

The pruning never changes what the caller would choose: make_plan picks its plan by pipeline
time, the caller by its own, so a pruned search returns a plan only when nothing was pruned;
when its best might beat the incumbent while a pruned configuration might have been faster in
pipeline time, it plans the layout again in full.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from pipeplan.errors import PipeplanError

__all__ = ["Incumbent", "PrunedError", "above"]

#: Relative slack before a bound counts as above the incumbent, so that rounding never prunes a tie.
BOUND_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Incumbent:
    """The best time an outer search has found, and how it times one pipeline plan.

    Parameters
    ----------
    iteration_ms : float
        The best iteration found so far, in the caller's time (ms). A configuration is pruned
        only if its bound is strictly above it (ties are kept: the caller breaks them).
    time_ms : callable
        ``time_ms(rank_end_ms, rank_param_bytes, num_microbatches)``: the caller's time of a
        pipeline plan whose rank ``r`` ends its last action at ``rank_end_ms[r]`` and holds
        ``rank_param_bytes[r]`` of parameters. It must not decrease when any ``rank_end_ms``
        grows, so that rank lower bounds give a lower bound.
    microbatch_bound_ms : mapping of int to float
        Per micro-batch size, a lower bound on the caller's time of any plan at that size,
        with no split known (sizes not given: no bound).
    """

    iteration_ms: float
    time_ms: Callable[[Sequence[float], Sequence[float], int], float]
    microbatch_bound_ms: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self):
        if not self.iteration_ms >= 0:
            raise ValueError(f"iteration_ms must be >= 0, got {self.iteration_ms}")


def above(bound_ms: float, incumbent: Incumbent) -> bool:
    """Whether ``bound_ms`` is above the incumbent by more than rounding.

    Examples
    --------
    >>> inc = Incumbent(100.0, lambda ends, params, m: max(ends))
    >>> above(100.0, inc), above(100.0 + 1e-12, inc), above(100.1, inc)
    (False, False, True)
    """
    return bound_ms > incumbent.iteration_ms + BOUND_TOLERANCE * max(1.0, abs(incumbent.iteration_ms))


class PrunedError(PipeplanError):
    """The pipeline search proved that its best plan is slower than the incumbent.

    ``lower_bound_ms`` is a lower bound on that plan's time in the caller's time (not a time:
    the plan was not worked out).
    """

    def __init__(self, lower_bound_ms: float, incumbent_ms: float):
        self.lower_bound_ms = float(lower_bound_ms)
        self.incumbent_ms = float(incumbent_ms)
        super().__init__(f"lower bound {self.lower_bound_ms:.1f} ms \u2265 best {self.incumbent_ms:.1f} ms")
