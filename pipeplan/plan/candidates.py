"""One configuration of the search (schedule, v, micro-batch size, recompute set) and its fate."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeplan.plan.problem import Partition, PartitionProblem
from pipeplan.plan.simulate import Simulation

__all__ = ["Candidate", "recompute_text", "tie_key", "RECOMPUTE_SEARCH_MAX_LAYERS"]

#: Beyond this many layers the recompute candidates are not searched: the chain DP that
#: models recomputation is quadratic in the layers (the bisection solver does not model it).
RECOMPUTE_SEARCH_MAX_LAYERS = 2000


@dataclass
class Candidate:
    """One configuration: schedule, v, micro-batch size and recompute set, with its split."""

    schedule: str
    virtual_stages: int
    microbatch_size: int
    num_microbatches: int
    recompute: tuple[str, ...]
    """Per stage, its recompute mode."""
    problem: PartitionProblem | None = None
    partition: Partition | None = None
    lower_bound_ms: float = math.inf
    simulation: Simulation | None = None
    status: str = "new"
    """new, fits, over (simulated over the cap), nosplit (no split fits), pruned, refused."""
    over_bytes: int = 0
    peak_bytes: int | None = None
    reason: str = ""
    seconds: float = 0.0
    order: int = 0
    balanced: Partition | None = None
    """With several stages per rank, the split moved toward equal work per rank
    (:func:`pipeplan.plan.balance.balance_ranks`), where one improves on ``partition``."""
    unbalanced: Partition | None = None
    """Where the balanced split won the simulation: the min-max-stage split it replaced."""
    unbalanced_ms: float | None = None
    """Where the balanced split won the simulation: the min-max-stage split's time (None if it did not fit)."""

    @property
    def recompute_count(self) -> int:
        return sum(mode != "none" for mode in self.recompute)

    @property
    def iteration_ms(self) -> float:
        return self.simulation.iteration_ms if self.simulation is not None else math.inf

    def label(self) -> str:
        return (f"{self.schedule} v={self.virtual_stages} micro-batch {self.microbatch_size} "
                f"recompute {recompute_text(self.recompute)}")


def recompute_text(recompute) -> str:
    """``none``, ``all`` or the recomputing stages, e.g. ``stages 0-2,5``; selective
    recomputation says so.

    Examples
    --------
    >>> recompute_text(("full", "full", "none", "full"))
    'stages 0-1,3'
    >>> recompute_text(("selective", "none"))
    'selective on stages 0'
    """
    chosen = [j for j, mode in enumerate(recompute) if mode != "none"]
    if not chosen:
        return "none"
    if any(mode == "selective" for mode in recompute):
        kinds = {mode for mode in recompute if mode != "none"}
        plain = recompute_text(tuple("none" if mode == "none" else "full" for mode in recompute))
        return ("selective on " if kinds == {"selective"} else "selective and full on ") + plain
    if len(chosen) == len(recompute):
        return "all"
    runs, start = [], chosen[0]
    for a, b in zip(chosen, chosen[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return "stages " + ",".join(runs)


def tie_key(cand: Candidate, space):
    """Between equally fast configurations: fewer recomputing stages, larger micro-batches,
    lower peak memory, then the schedule order."""
    peak = cand.simulation.peak_memory_bytes if cand.simulation is not None else 0
    return (cand.recompute_count, -cand.microbatch_size, peak, space.index((cand.schedule, cand.virtual_stages)))
