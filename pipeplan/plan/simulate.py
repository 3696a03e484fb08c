"""Event-level simulation of one training iteration under a pipeline schedule.

The single source of truth for a plan's predicted time and memory: every
compute action of :func:`pipeplan.plan.actions.rank_actions` gets a start
and an end, and every rank's memory is followed through the actual order of
work. Closed-form bubble formulas only hold for equal stages and free
transfers; this holds for any per-stage costs.

Model
-----
- Each rank runs its actions strictly in the listed order, one at a time (as
  torch's schedules do), starting each as soon as the rank is free and its
  input has arrived.
- ``F`` of stage ``s`` for micro-batch ``i`` needs ``F(s-1, i)`` to have ended,
  plus ``send_ms`` of stage ``s-1`` when that stage is on another rank.
- The input-gradient backward (``B`` or the whole ``FULL_B``) of stage ``s``
  needs the input-gradient backward of ``s+1`` for the same micro-batch, plus
  ``send_ms`` of stage ``s`` (the gradient of its output has its output's size)
  when ``s+1`` is on another rank; the last stage's backward follows its own
  forward. ``W`` follows the ``B`` of the same stage and micro-batch.
- ``FULL_B`` takes ``full_backward_ms``; a split backward takes ``B`` then ``W``,
  whose sum may be more. As in torch 2.13, stage 0's ``B`` takes no time and its
  ``W`` runs the whole backward (``stage_backward_weight`` needs the input pass's
  intermediate gradients, which stage 0, with no input to send a gradient to,
  does not make).
- Transfers are asynchronous: they never block the sender and never occupy a
  rank; a receiver only waits for the data.
- Before each action the rank spends its stage's ``action_overhead_ms``: the
  schedule's own work (posting the action's transfers, bookkeeping), which
  overlaps with waiting for the action's input but not with compute. It is
  counted apart from compute (``rank_overhead_ms``, ``overhead_ms``).
- Memory: a rank starts at the static bytes of its stages; a forward adds its
  stage's ``activation_bytes`` when it starts; the backward that consumes them
  frees them when it ends (``FULL_B``, or ``W`` where ``B`` and ``W`` are split).

See docs/schedules.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Optional, Sequence

from pipeplan.errors import BadInputError
from pipeplan.plan.actions import cached_rank_actions
from pipeplan.facts.schedules import check_schedule, stage_ranks

__all__ = ["StageCost", "Event", "Simulation", "simulate"]


@dataclass(frozen=True)
class StageCost:
    """Costs of one pipeline stage for one micro-batch."""

    forward_ms: float
    """Forward time of one micro-batch."""
    backward_input_ms: float
    """Input-gradient time (B) of one micro-batch. Schedules that do not split the
    backward run ``backward_input_ms + backward_weight_ms`` as one action."""
    backward_weight_ms: float
    """Weight-gradient time (W) of one micro-batch."""
    send_ms: float = 0.0
    """Time to send this stage's output for one micro-batch to the next stage; the
    gradient sent back has the same size and takes the same time. Unused for the
    last stage and between stages on the same rank."""
    static_memory_bytes: int = 0
    """Parameters, gradients and optimizer state: held for the whole iteration."""
    activation_bytes: int = 0
    """Bytes a forward keeps for its backward, per micro-batch in flight."""
    full_backward_ms: Optional[float] = None
    """The whole backward as one action (``FULL_B``, torch's ``stage_backward``); None means
    ``backward_input_ms + backward_weight_ms``. Splitting a backward costs extra work (the
    input pass keeps intermediate gradients, the weight pass walks the graph again), so a
    profile timed the way torch splits gives less here than the two passes' sum."""
    action_overhead_ms: float = 0.0
    """The schedule's own time before each action of this stage, outside compute: posting
    the action's transfers and the schedule's bookkeeping (0.5-1.9 ms per action measured on
    a 2-core CPU with gloo; unmeasured on a GPU)."""

    def __post_init__(self) -> None:
        for name in ("forward_ms", "backward_input_ms", "backward_weight_ms", "send_ms", "full_backward_ms",
                     "action_overhead_ms"):
            value = getattr(self, name)
            if value is None and name == "full_backward_ms":
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise BadInputError(f"StageCost.{name} = {value!r} must be a finite number >= 0")
        for name in ("static_memory_bytes", "activation_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadInputError(f"StageCost.{name} = {value!r} must be an integer >= 0")

    @property
    def backward_ms(self) -> float:
        """The whole backward as one action: ``full_backward_ms``, else the two passes' sum."""
        if self.full_backward_ms is not None:
            return self.full_backward_ms
        return self.backward_input_ms + self.backward_weight_ms


class Event(NamedTuple):
    """One compute action as simulated."""

    rank: int
    """The rank that ran it."""
    stage: int
    """Global stage index."""
    microbatch: int
    """Micro-batch index."""
    kind: str
    """``"F"``, ``"B"`` (input gradient), ``"W"`` (weight gradient) or ``"FULL_B"``."""
    start_ms: float
    """Start time from the beginning of the iteration."""
    end_ms: float
    """End time from the beginning of the iteration."""


@dataclass(frozen=True)
class Simulation:
    """The simulated iteration. Per-rank tuples are indexed by rank."""

    schedule: str
    """Schedule name."""
    num_ranks: int
    """Pipeline ranks ``p``."""
    num_microbatches: int
    """Micro-batches per iteration ``m``."""
    virtual_stages: int
    """Stages per rank ``v``."""
    stage_ranks: tuple[int, ...]
    """The rank of each stage."""
    events: tuple[Event, ...]
    """Every compute action, by rank and then in execution order."""
    iteration_ms: float
    """From the first action's start (0) to the last action's end."""
    bubble_fraction: float
    """Idle share of all ranks' time: ``sum(rank_idle_ms) / (p * iteration_ms)``."""
    rank_busy_ms: tuple[float, ...]
    """Compute time of each rank."""
    rank_idle_ms: tuple[float, ...]
    """``iteration_ms - rank_busy_ms - rank_overhead_ms``: waiting for inputs, fill, drain."""
    rank_peak_memory_bytes: tuple[int, ...]
    """Static bytes plus the largest sum of live activations, from the actual order."""
    rank_memory_timeline: tuple[tuple[tuple[float, int], ...], ...]
    """Per rank, ``(time_ms, bytes)`` steps: the memory from that time on."""
    stage_peak_in_flight: tuple[int, ...]
    """Per stage, the most micro-batches whose activations it held at once."""
    critical_rank: int
    """The bottleneck rank: the busiest, overhead included (lowest index on ties)."""
    compute_ms: float
    """Busy time of the critical rank."""
    bubble_ms: float
    """Idle time of the critical rank that free transfers would not remove: fill,
    drain and waiting on slower stages. The sum of its idle intervals
    (:meth:`rank_idle_intervals`) less ``transfer_ms``."""
    transfer_ms: float
    """Exposed transfer: how much longer the iteration is than with free transfers
    (transfers on the critical path that no compute hides); part of the critical
    rank's idle time. ``compute_ms + overhead_ms + bubble_ms + transfer_ms == iteration_ms``."""
    rank_overhead_ms: tuple[float, ...] = ()
    """The schedule's own time of each rank: its actions' ``action_overhead_ms``."""
    overhead_ms: float = 0.0
    """The schedule's own time on the critical rank."""
    stage_action_overhead_ms: tuple[float, ...] = ()
    """Per stage, the schedule's own time before each of its actions."""

    @property
    def peak_memory_bytes(self) -> int:
        """The largest per-rank peak."""
        return max(self.rank_peak_memory_bytes)

    def rank_idle_intervals(self, rank: int) -> list[tuple[float, float]]:
        """When ``rank`` waits: ``(start_ms, end_ms)`` from the events, in order.

        Before each action the rank first spends its stage's own time per action, then waits
        for the action's input; the wait is the interval. The time after its last action to
        the end of the iteration is one more.
        """
        overhead = self.stage_action_overhead_ms or (0.0,) * len(self.stage_ranks)
        intervals = []
        free = 0.0
        for event in self.events:
            if event.rank != rank:
                continue
            ready = free + overhead[event.stage]
            if event.start_ms > ready:
                intervals.append((ready, event.start_ms))
            free = event.end_ms
        if self.iteration_ms > free:
            intervals.append((free, self.iteration_ms))
        return intervals


def simulate(
    stage_costs: Sequence[StageCost],
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int = 1,
) -> Simulation:
    """Simulate one iteration of ``schedule`` with the given per-stage costs.

    Parameters
    ----------
    stage_costs : sequence of StageCost
        One per stage, ``num_ranks * virtual_stages`` of them, in pipeline order.
    schedule : str
        One of :data:`pipeplan.facts.schedules.SCHEDULES`.
    num_ranks : int
        Pipeline ranks ``p``.
    num_microbatches : int
        Micro-batches per iteration ``m``.
    virtual_stages : int, optional
        Stages per rank ``v`` (2 for ``zbv`` and ``dualpipev``).

    Returns
    -------
    Simulation

    Raises
    ------
    BadInputError
        If the schedule refuses ``(p, m, v)`` (see
        :func:`pipeplan.facts.schedules.check_schedule`) or the number of stage
        costs is not ``p * v``.

    Notes
    -----
    Every action is visited once and every dependency once: time
    ``O(p * m * v)``, memory the same for the events.

    Examples
    --------
    >>> cost = StageCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=1.0)
    >>> sim = simulate([cost] * 4, "1f1b", num_ranks=4, num_microbatches=8)
    >>> sim.iteration_ms, round(sim.bubble_fraction, 4)  # (m + p - 1) * (f + b); (p-1)/(m+p-1)
    (33.0, 0.2727)
    """
    check_schedule(schedule, num_ranks, num_microbatches, virtual_stages)
    p, m, v = num_ranks, num_microbatches, virtual_stages
    num_stages = p * v
    costs = list(stage_costs)
    if len(costs) != num_stages:
        raise BadInputError(
            f"{len(costs)} stage costs given for {p} ranks x {v} virtual stages; "
            f"give one StageCost per stage ({num_stages})"
        )
    for index, cost in enumerate(costs):
        if not isinstance(cost, StageCost):
            raise BadInputError(f"stage_costs[{index}] is a {type(cost).__name__}, not a StageCost")

    placement = stage_ranks(schedule, p, v)
    orders = _compiled(schedule, p, m, v)

    # Transfer time into stage s (forward) and back out of it (backward), 0 on the same rank.
    forward_in_ms = [0.0] * num_stages
    backward_in_ms = [0.0] * num_stages
    for s in range(1, num_stages):
        if placement[s - 1] != placement[s]:
            forward_in_ms[s] = costs[s - 1].send_ms
            backward_in_ms[s - 1] = costs[s - 1].send_ms

    # torch's split schedules skip the first stage's input pass (no stage wants that gradient)
    # and run its whole backward as the W action.
    duration_ms = [
        (c.forward_ms, 0.0, c.backward_ms, c.backward_ms) if s == 0 else
        (c.forward_ms, c.backward_input_ms, c.backward_weight_ms, c.backward_ms)
        for s, c in enumerate(costs)
    ]
    overhead_ms = [c.action_overhead_ms for c in costs]
    times = _run(orders, duration_ms, forward_in_ms, backward_in_ms, p, m, overhead_ms)
    rank_events = [
        [Event(r, a[1], a[2], _KINDS[a[0]], start, end) for a, (start, end) in zip(orders[r], times[r])]
        for r in range(p)
    ]
    iteration_ms = max((events[-1].end_ms for events in rank_events if events), default=0.0)
    busy = tuple(sum(e.end_ms - e.start_ms for e in rank_events[r]) for r in range(p))
    overhead = tuple(sum(overhead_ms[a[1]] for a in orders[r]) for r in range(p))
    idle = tuple(max(0.0, iteration_ms - busy[r] - overhead[r]) for r in range(p))
    bubble_fraction = sum(idle) / (p * iteration_ms) if iteration_ms > 0 else 0.0

    critical = max(range(p), key=lambda r: (busy[r] + overhead[r], -r))
    # Exposed transfer: how much sooner the iteration would end with free transfers.
    # Start times are max-plus sums of durations, so they never shrink as a transfer grows.
    transfer_ms = 0.0
    if any(forward_in_ms) or any(backward_in_ms):
        zeros = [0.0] * num_stages
        free_times = _run(orders, duration_ms, zeros, zeros, p, m, overhead_ms)
        free_iteration_ms = max((row[-1][1] for row in free_times if row), default=0.0)
        transfer_ms = min(max(0.0, iteration_ms - free_iteration_ms), idle[critical])

    peaks, timelines, in_flight_peak = _memory(rank_events, costs, placement, p, num_stages)
    critical_waits = 0.0
    free = 0.0
    for event in rank_events[critical]:
        critical_waits += max(0.0, event.start_ms - (free + overhead_ms[event.stage]))
        free = event.end_ms
    critical_waits += max(0.0, iteration_ms - free)

    return Simulation(
        schedule=schedule,
        num_ranks=p,
        num_microbatches=m,
        virtual_stages=v,
        stage_ranks=tuple(placement),
        events=tuple(e for events in rank_events for e in events),
        iteration_ms=iteration_ms,
        bubble_fraction=bubble_fraction,
        rank_busy_ms=busy,
        rank_idle_ms=idle,
        rank_peak_memory_bytes=peaks,
        rank_memory_timeline=timelines,
        stage_peak_in_flight=in_flight_peak,
        critical_rank=critical,
        compute_ms=busy[critical],
        bubble_ms=max(0.0, critical_waits - transfer_ms),
        transfer_ms=transfer_ms,
        rank_overhead_ms=overhead,
        overhead_ms=overhead[critical],
        stage_action_overhead_ms=tuple(overhead_ms),
    )


_KIND_CODE = {"F": 0, "B": 1, "W": 2, "FULL_B": 3}
_KINDS = ("F", "B", "W", "FULL_B")


@lru_cache(maxsize=256)
def _compiled(schedule: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, int, int, int, int, int], ...], ...]:
    """Per rank, each action as (kind code, stage, micro-batch, own slot, local input slot, cross input slot).

    Slots index one table of end times: ``2 * (stage * m + micro-batch)`` for the
    forward, ``+ 1`` for the input-gradient backward; -1 for none.
    """
    last = p * v - 1
    out = []
    for actions in cached_rank_actions(schedule, p, m, v):
        row = []
        for action in actions:
            s, i, code = action.stage, action.microbatch, _KIND_CODE[action.kind]
            slot = 2 * (s * m + i)
            if code == 0:
                row.append((0, s, i, slot, -1, slot - 2 * m if s > 0 else -1))
            elif code == 2:
                row.append((2, s, i, -1, slot + 1, -1))
            else:
                row.append((code, s, i, slot + 1, slot, slot + 2 * m + 1 if s < last else -1))
        out.append(tuple(row))
    return tuple(out)


def _run(
    orders: tuple[tuple[tuple[int, int, int, int, int, int], ...], ...],
    duration_ms: list[tuple[float, float, float, float]],
    forward_in_ms: list[float],
    backward_in_ms: list[float],
    p: int,
    m: int,
    overhead_ms: Sequence[float],
) -> list[list[tuple[float, float]]]:
    """(start, end) of every action: each rank in order, each action once its inputs are in
    and the rank has done the action's overhead."""
    num_stages = len(duration_ms)
    end_ms: list[float | None] = [None] * (2 * num_stages * m)
    waiting: dict[int, list[int]] = {}  # slot -> ranks blocked on it
    position = [0] * p
    free_ms = [0.0] * p
    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]

    pending = list(range(p))
    while pending:
        rank = pending.pop()
        order = orders[rank]
        length = len(order)
        at = position[rank]
        start_free = free_ms[rank]
        out = times[rank]
        while at < length:
            code, s, _, own, local, cross = order[at]
            start = start_free + overhead_ms[s]
            if local >= 0:
                done = end_ms[local]
                if done is None:
                    waiting.setdefault(local, []).append(rank)
                    break
                if done > start:
                    start = done
            if cross >= 0:
                done = end_ms[cross]
                if done is None:
                    waiting.setdefault(cross, []).append(rank)
                    break
                done += forward_in_ms[s] if code == 0 else backward_in_ms[s]
                if done > start:
                    start = done
            start_free = start + duration_ms[s][code]
            out.append((start, start_free))
            at += 1
            if own >= 0:
                end_ms[own] = start_free
                woken = waiting.pop(own, None)
                if woken:
                    pending.extend(woken)
        position[rank] = at
        free_ms[rank] = start_free

    stuck = [r for r in range(p) if position[r] < len(orders[r])]
    if stuck:
        # Only a wrong action order can get here; rank_actions is tested against torch.
        raise RuntimeError(
            f"the action order deadlocks: ranks {stuck} wait at "
            + ", ".join(
                "{}{}{}".format(orders[r][position[r]][1], _KINDS[orders[r][position[r]][0]], orders[r][position[r]][2])
                for r in stuck
            )
        )
    return times


def _memory(
    rank_events: list[list[Event]],
    costs: list[StageCost],
    placement: list[int],
    p: int,
    num_stages: int,
) -> tuple[tuple[int, ...], tuple[tuple[tuple[float, int], ...], ...], tuple[int, ...]]:
    """Per-rank peaks and timelines, and per-stage peak in-flight micro-batches."""
    static = [0] * p
    for s in range(num_stages):
        static[placement[s]] += costs[s].static_memory_bytes
    # Per action, not per stage: dualpipev runs FULL_B for some micro-batches of a
    # stage and B then W for others.
    in_flight = [0] * num_stages
    in_flight_peak = [0] * num_stages
    peaks = []
    timelines = []
    for rank in range(p):
        current = static[rank]
        peak = current
        timeline = [(0.0, current)]
        for event in rank_events[rank]:
            s = event.stage
            if event.kind == "F":
                current += costs[s].activation_bytes
                in_flight[s] += 1
                in_flight_peak[s] = max(in_flight_peak[s], in_flight[s])
                peak = max(peak, current)
                timeline.append((event.start_ms, current))
            elif event.kind in ("FULL_B", "W"):
                current -= costs[s].activation_bytes
                in_flight[s] -= 1
                timeline.append((event.end_ms, current))
        peaks.append(peak)
        timelines.append(tuple(timeline))
    return tuple(peaks), tuple(timelines), tuple(in_flight_peak)
