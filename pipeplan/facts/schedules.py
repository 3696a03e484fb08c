"""Pipeline schedules: one record per schedule, and the rules torch's classes enforce.

Every fact about a schedule (its torch class and ``get_schedule_class`` name, the stages per
rank it takes, whether it splits the backward, its placement) lives in :data:`SCHEDULE_INFO`;
every other module (the planner, the simulator, the exporters, the runner) reads it there.
The per-rank action orders are in :mod:`pipeplan.plan.actions`.

Vocabulary
----------
- *rank*: one GPU (process) of the pipeline; ``p`` ranks.
- *stage*: a run of layers; there are ``p * v`` stages, ``v`` per rank
  (*virtual stages*). Stage ``s`` feeds stage ``s + 1``.
- *micro-batch*: one of the ``m`` slices of the batch.

See docs/schedules.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.errors import BadInputError

__all__ = [
    "ScheduleInfo",
    "SCHEDULE_INFO",
    "SCHEDULES",
    "PLANNER_SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "TORCH_SCHEDULE_CLASS",
    "schedule_info",
    "check_schedule",
    "valid_virtual_stages",
    "allows_virtual_stages",
    "virtual_stages_rule",
    "searched_virtual_stages",
    "SEARCHED_VIRTUAL_STAGES_ALWAYS",
    "SEARCHED_VIRTUAL_STAGES_MAX",
    "stage_ranks",
    "num_rounds",
]


@dataclass(frozen=True)
class ScheduleInfo:
    """What pipeplan knows about one schedule."""

    name: str
    """pipeplan's name (``--schedule``, ``plan.schedule``)."""
    torch_class: str
    """The ``torch.distributed.pipelining.schedules`` class that runs it."""
    torch_name: str
    """The name ``get_schedule_class`` (and torchtitan's ``pipeline_parallel_schedule``) accepts."""
    min_virtual_stages: int
    """The fewest stages per rank it takes (``interleaved``: 2, pipeplan's rule: torch's class
    takes 1 too, but that is ``1f1b`` with more bookkeeping)."""
    max_virtual_stages: int | None
    """The most stages per rank its torch class takes; None: any number (the interleaved classes
    build their order for any ``len(stages)``; the V classes raise unless it is exactly 2)."""
    split_backward: bool
    """Runs input and weight gradients as separate actions, so its prediction depends on the
    profile's B/W split."""
    v_placement: bool
    """V placement (rank ``r`` holds stages ``r`` and ``2p - 1 - r``) rather than the loop
    placement (stage ``s`` on rank ``s % p``)."""
    description: str
    """One line for documentation."""


#: One record per schedule, in the order ``--schedule auto`` prefers on ties (1F1B before
#: GPipe: same time, less memory).
SCHEDULE_INFO: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo("1f1b", "Schedule1F1B", "1F1B", 1, 1, False, False,
                     "one forward, one backward after a warm-up of p - s forwards"),
        ScheduleInfo("gpipe", "ScheduleGPipe", "GPipe", 1, 1, False, False,
                     "every forward, then every backward"),
        ScheduleInfo("interleaved", "ScheduleInterleaved1F1B", "Interleaved1F1B", 2, None, False, False,
                     "1F1B over v stages per rank (Megatron's interleaving)"),
        ScheduleInfo("zb", "ScheduleInterleavedZeroBubble", "InterleavedZeroBubble", 1, None, True, False,
                     "zero-bubble (ZB-H1 when v = 1): weight gradients delayed into the bubble"),
        ScheduleInfo("zbv", "ScheduleZBVZeroBubble", "ZBVZeroBubble", 2, 2, True, True,
                     "zero-bubble on the V placement"),
        ScheduleInfo("dualpipev", "ScheduleDualPipeV", "DualPipeV", 2, 2, True, True,
                     "DeepSeek's DualPipe on the V placement"),
    )
}

#: Schedule names, one per torch.distributed.pipelining class, in the plan format's order.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
assert set(SCHEDULES) == set(SCHEDULE_INFO)

#: The order ``--schedule auto`` searches and prefers on ties.
PLANNER_SCHEDULES = tuple(SCHEDULE_INFO)

#: Schedules that run the input and weight gradients as separate actions.
SPLIT_BACKWARD_SCHEDULES = tuple(name for name, info in SCHEDULE_INFO.items() if info.split_backward)

#: The torch.distributed.pipelining class that runs each schedule.
TORCH_SCHEDULE_CLASS = {name: SCHEDULE_INFO[name].torch_class for name in SCHEDULES}


def schedule_info(schedule: str) -> ScheduleInfo:
    """The record of ``schedule``.

    Raises
    ------
    BadInputError
        If the name is unknown.

    Examples
    --------
    >>> schedule_info("zbv").torch_class
    'ScheduleZBVZeroBubble'
    """
    try:
        return SCHEDULE_INFO[schedule]
    except (KeyError, TypeError):
        raise BadInputError(
            f"schedule {schedule!r} is unknown; use one of {', '.join(SCHEDULES)}"
        ) from None


def num_rounds(num_ranks: int, num_microbatches: int) -> int:
    """Rounds of the interleaved and zero-bubble classes: ``max(1, m // p)``."""
    return max(1, num_microbatches // num_ranks)


#: Stages per rank every search tries where the class takes them and each stage gets a layer.
SEARCHED_VIRTUAL_STAGES_ALWAYS = 4

#: The most stages per rank a search tries unasked (``--virtual-stages`` reaches any number the
#: class takes). Beyond 4 only ``interleaved``, at values that give every rank's stages the same
#: whole number of layers, is searched (the recipes' VP 5 and 8, Megatron's ``--num-layers-per-virtual-pipeline-
#: stage``): the transfers grow with ``v`` while the bubble left is already small, and each value
#: costs the search a simulation per layout.
SEARCHED_VIRTUAL_STAGES_MAX = 8


def allows_virtual_stages(schedule: str, virtual_stages: int) -> bool:
    """Whether the schedule's class takes ``virtual_stages`` stages per rank.

    Examples
    --------
    >>> allows_virtual_stages("interleaved", 24), allows_virtual_stages("zbv", 3)
    (True, False)
    """
    info = schedule_info(schedule)
    top = info.max_virtual_stages
    return info.min_virtual_stages <= virtual_stages and (top is None or virtual_stages <= top)


def virtual_stages_rule(schedule: str) -> str:
    """The stages-per-rank rule in words: ``exactly 2``, ``2 or more``.

    Examples
    --------
    >>> virtual_stages_rule("interleaved"), virtual_stages_rule("zbv"), virtual_stages_rule("gpipe")
    ('2 or more', 'exactly 2', 'exactly 1')
    """
    info = schedule_info(schedule)
    if info.max_virtual_stages is None:
        return f"{info.min_virtual_stages} or more"
    if info.max_virtual_stages == info.min_virtual_stages:
        return f"exactly {info.min_virtual_stages}"
    return f"{info.min_virtual_stages} to {info.max_virtual_stages}"


def valid_virtual_stages(schedule: str) -> tuple[int, ...]:
    """The small stages-per-rank values the schedule takes, the default first: those from its
    least up to :data:`SEARCHED_VIRTUAL_STAGES_ALWAYS` (the class may take more:
    :func:`allows_virtual_stages`).

    Examples
    --------
    >>> valid_virtual_stages("interleaved")
    (2, 3, 4)
    >>> valid_virtual_stages("zbv")
    (2,)
    """
    info = schedule_info(schedule)
    top = info.max_virtual_stages
    last = SEARCHED_VIRTUAL_STAGES_ALWAYS if top is None else min(top, SEARCHED_VIRTUAL_STAGES_ALWAYS)
    return tuple(range(info.min_virtual_stages, last + 1))


def searched_virtual_stages(schedule: str, num_ranks: int, num_layers: int) -> tuple[int, ...]:
    """The stages-per-rank values a search tries for ``schedule`` with ``p`` ranks and ``n`` layers.

    Those of :func:`valid_virtual_stages` with ``p * v <= n`` (a layer per stage), then, for the
    schedules that run the whole backward (``interleaved``), the larger ones up to
    :data:`SEARCHED_VIRTUAL_STAGES_MAX` that divide the layers per rank rounded down, ``n // p``
    (the same whole number of layers on each stage but for the few units left over: embedding,
    final norm, head). The split itself is per stage and need not be even. The split-backward
    schedules (``zb``) fill the bubble with weight gradients already, so a larger ``v`` buys them
    little; left out, they keep the added cost of a cluster search to about a tenth more chain
    DPs (Llama 3 70B on 1,024 GPUs: 2,468 against 2,243; 2,687 with ``zb`` too).

    Examples
    --------
    >>> searched_virtual_stages("interleaved", 4, 83)     # Llama 3 70B's units: 20 per rank
    (2, 3, 4, 5)
    >>> searched_virtual_stages("interleaved", 8, 129)    # Llama 3.1 405B's: 16 per rank
    (2, 3, 4, 8)
    >>> searched_virtual_stages("zb", 8, 129)
    (1, 2, 3, 4)
    >>> searched_virtual_stages("interleaved", 4, 65)     # DeepSeek-V3's: 16 per rank
    (2, 3, 4, 8)
    >>> searched_virtual_stages("zbv", 8, 12)
    ()
    """
    p, n = num_ranks, num_layers
    small = tuple(v for v in valid_virtual_stages(schedule) if p * v <= n)
    large = tuple(v for v in range(SEARCHED_VIRTUAL_STAGES_ALWAYS + 1, SEARCHED_VIRTUAL_STAGES_MAX + 1)
                  if allows_virtual_stages(schedule, v) and not schedule_info(schedule).split_backward
                  and (n // p) % v == 0)
    return small + large


def check_schedule(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    """Raise if torch's class for ``schedule`` would refuse these numbers.

    The rules mirror the checks of the torch 2.13 classes (constructor errors),
    plus the stages-per-rank each schedule is meant for.

    Parameters
    ----------
    schedule : str
        One of :data:`SCHEDULES`.
    num_ranks : int
        Pipeline ranks ``p`` (>= 1).
    num_microbatches : int
        Micro-batches per iteration ``m`` (>= 1).
    virtual_stages : int
        Stages per rank ``v``.

    Raises
    ------
    BadInputError
        Naming the value, the rule and a fix.

    Examples
    --------
    >>> check_schedule("1f1b", 4, 8, 1)
    >>> check_schedule("1f1b", 4, 2, 1)
    Traceback (most recent call last):
    ...
    pipeplan.errors.BadInputError: schedule 1f1b: 2 micro-batches < 4 ranks; Schedule1F1B needs micro-batches >= ranks: use at least 4 micro-batches or the gpipe schedule
    """
    info = schedule_info(schedule)
    p, m, v = num_ranks, num_microbatches, virtual_stages
    for name, value in (("ranks", p), ("micro-batches", m), ("virtual stages", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadInputError(f"schedule {schedule}: {name} = {value!r} must be an integer >= 1")
    if not allows_virtual_stages(schedule, v):
        least = info.min_virtual_stages
        raise BadInputError(
            f"schedule {schedule}: virtual stages = {v} is not allowed; "
            f"{info.torch_class} takes {virtual_stages_rule(schedule)} stages per rank: "
            f"use --virtual-stages {least if v < least else info.max_virtual_stages}"
        )
    if schedule == "1f1b" and m < p:
        raise BadInputError(
            f"schedule 1f1b: {m} micro-batches < {p} ranks; Schedule1F1B needs micro-batches >= ranks: "
            f"use at least {p} micro-batches or the gpipe schedule"
        )
    if schedule in ("interleaved", "zb"):
        rounds = num_rounds(p, m)
        if m % rounds:
            lower = (m // rounds) * rounds
            raise BadInputError(
                f"schedule {schedule}: {m} micro-batches is not a multiple of the {rounds} rounds "
                f"(max(1, micro-batches // ranks) with {p} ranks); {info.torch_class} "
                f"needs it: use {lower} or a multiple of {p} micro-batches"
            )
    if schedule == "dualpipev" and m < 2 * p:
        raise BadInputError(
            f"schedule dualpipev: {m} micro-batches < {2 * p} stages; ScheduleDualPipeV needs "
            f"micro-batches >= stages (2 x ranks): use at least {2 * p} micro-batches"
        )


def stage_ranks(schedule: str, num_ranks: int, virtual_stages: int) -> list[int]:
    """The rank of each stage.

    Loop placement (stage ``s`` on rank ``s % p``) for all schedules except
    ``zbv`` and ``dualpipev``, which use the V placement: rank ``r`` holds
    stages ``r`` and ``2p - 1 - r``.

    Examples
    --------
    >>> stage_ranks("interleaved", 2, 2)
    [0, 1, 0, 1]
    >>> stage_ranks("zbv", 2, 2)
    [0, 1, 1, 0]
    """
    info = schedule_info(schedule)
    p, v = num_ranks, virtual_stages
    if p < 1 or v < 1:
        raise BadInputError(f"ranks = {p} and virtual stages = {v} must both be >= 1")
    if info.v_placement:
        if v != 2:
            raise BadInputError(
                f"schedule {schedule}: virtual stages = {v}; the V placement needs exactly 2: use 2"
            )
        return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return [s % p for s in range(p * v)]
