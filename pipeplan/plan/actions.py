"""Per-rank action orders: the compute actions each torch schedule class runs, in order.

:func:`rank_actions` gives, per rank, the ordered compute actions that the class of
:data:`pipeplan.facts.schedules.SCHEDULE_INFO` *executes* in torch 2.13, computed here in pure
Python so that planning needs no torch. ``tests/test_schedules_torch.py`` checks the orders
against the classes' own action lists for many ``(ranks, micro-batches, virtual stages)``.

Action kinds: ``"F"`` forward, ``"B"`` input gradient, ``"W"`` weight gradient, ``"FULL_B"``
the whole backward (input and weight gradients at once). torch spells them ``F``, ``I``,
``W`` and ``B``; ``str(action)`` uses torch's spelling, so ``Action(1, 0, "FULL_B")`` prints
as ``1B0`` and ``Action(1, 0, "B")`` as ``1I0``.

See docs/schedules.md.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache
from typing import Literal, NamedTuple

from pipeplan.errors import BadInputError
from pipeplan.facts.schedules import check_schedule, num_rounds

__all__ = ["ACTION_KINDS", "Action", "rank_actions", "cached_rank_actions"]

#: Action kinds: forward, input gradient, weight gradient, whole backward.
ACTION_KINDS = ("F", "B", "W", "FULL_B")

# torch's one-letter spelling of each kind (torch.distributed.pipelining.schedules._ComputationType).
_TORCH_LETTER = {"F": "F", "B": "I", "W": "W", "FULL_B": "B"}
_KIND_OF_TORCH_LETTER = {letter: kind for kind, letter in _TORCH_LETTER.items()}

Kind = Literal["F", "B", "W", "FULL_B"]


class Action(NamedTuple):
    """One compute action of a schedule: a kind of work on one stage for one micro-batch.

    A named tuple rather than a dataclass: the planner builds a few hundred thousand of them per
    cluster search (every rank's order for every ``(schedule, p, m, v)`` it tries), and a tuple
    is built several times faster. Orders are built here, correct by construction; text from
    outside goes through :meth:`from_str`, which checks it.
    """

    stage: int
    """Global stage index, ``0 <= stage < ranks * virtual_stages``."""
    microbatch: int
    """Micro-batch index, ``0 <= microbatch < num_microbatches``."""
    kind: Kind
    """``"F"`` forward, ``"B"`` input gradient, ``"W"`` weight gradient, ``"FULL_B"`` whole backward."""

    def __str__(self) -> str:
        return f"{self.stage}{_TORCH_LETTER[self.kind]}{self.microbatch}"

    @classmethod
    def from_str(cls, text: str) -> "Action":
        """Parse torch's compact form, e.g. ``"0F0"``, ``"1B0"`` (whole backward), ``"2I1"``, ``"2W1"``.

        Examples
        --------
        >>> Action.from_str("1B0")
        Action(stage=1, microbatch=0, kind='FULL_B')
        >>> str(Action(2, 1, "B"))
        '2I1'
        """
        text = text.strip()
        for index, char in enumerate(text):
            if not char.isdigit():
                letter, stage, microbatch = char, text[:index], text[index + 1 :]
                if letter in _KIND_OF_TORCH_LETTER and stage.isdigit() and microbatch.isdigit():
                    return cls(int(stage), int(microbatch), _KIND_OF_TORCH_LETTER[letter])
                break
        raise BadInputError(
            f"action {text!r} is not of the form <stage><F|I|W|B><micro-batch>, e.g. '0F0' or '1B0'"
        )


def rank_actions(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> list[list[Action]]:
    """Per rank, the ordered compute actions that torch's class runs.

    Parameters
    ----------
    schedule : str
        One of :data:`pipeplan.facts.schedules.SCHEDULES`.
    num_ranks, num_microbatches, virtual_stages : int
        ``p``, ``m`` and ``v``; checked with :func:`check_schedule`.

    Returns
    -------
    list of list of Action
        ``result[r]`` is rank ``r``'s actions in execution order. Every
        ``(stage, micro-batch)`` appears once as ``F`` and either once as
        ``FULL_B`` or once as ``B`` and once as ``W``.

    Raises
    ------
    BadInputError
        If :func:`check_schedule` refuses the numbers.

    Notes
    -----
    The orders follow torch 2.13's ``torch/distributed/pipelining/schedules.py``:
    the ``_step_microbatches`` loops of ``ScheduleGPipe`` and ``Schedule1F1B``
    (whose own ``pipeline_order`` listing is off by one on the last rank), and
    the ``pipeline_order`` of the runtime classes with idle steps dropped and
    ``OVERLAP_F_B`` pairs expanded in their execution order (forward first).
    Time and memory are ``O(p * m * v)``.

    Examples
    --------
    >>> [" ".join(map(str, actions)) for actions in rank_actions("1f1b", 2, 3, 1)]
    ['0F0 0F1 0B0 0F2 0B1 0B2', '1F0 1B0 1F1 1B1 1F2 1B2']
    """
    check_schedule(schedule, num_ranks, num_microbatches, virtual_stages)
    return [list(actions) for actions in cached_rank_actions(schedule, num_ranks, num_microbatches, virtual_stages)]


@lru_cache(maxsize=256)
def cached_rank_actions(schedule: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """:func:`rank_actions` as tuples, cached, without the check (callers have checked).

    The planner simulates the same ``(schedule, p, m, v)`` for many splits; Actions are immutable.
    """
    builder = {
        "gpipe": _gpipe,
        "1f1b": _one_f_one_b,
        "interleaved": lambda r: _interleaved(r, p, m, v, zero_bubble=False),
        "zb": lambda r: _interleaved(r, p, m, v, zero_bubble=True),
        "zbv": lambda r: _zbv(r, p, m),
        "dualpipev": lambda r: _dualpipev(r, p, m),
    }[schedule]
    if schedule in ("gpipe", "1f1b"):
        return tuple(tuple(builder(r, p, m)) for r in range(p))
    return tuple(tuple(builder(r)) for r in range(p))


def _gpipe(rank: int, p: int, m: int) -> list[Action]:
    return [Action(rank, i, "F") for i in range(m)] + [Action(rank, i, "FULL_B") for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    # Schedule1F1B._step_microbatches: min(m, p - s) warm-up forwards, then
    # backward-forward pairs, then the remaining backwards.
    warmup = min(m, p - rank)
    actions = [Action(rank, i, "F") for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < m:
        actions.append(Action(rank, backward, "FULL_B"))
        backward += 1
        if forward < m:
            actions.append(Action(rank, forward, "F"))
            forward += 1
    return actions


def _interleaved(rank: int, p: int, m: int, v: int, zero_bubble: bool) -> list[Action]:
    # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble via _get_warmup_ops
    # and _get_1f1b_rank_ops (torch 2.13), without the idle (None) steps.
    per_round = m // num_rounds(p, m)
    factor = 1 if zero_bubble else 2
    warmup_ops = min((v - 1) * per_round + factor * (p - 1 - rank), m * v)
    microbatch_ops = v * m
    fwd_bwd_ops = microbatch_ops - warmup_ops
    cooldown_ops = microbatch_ops - fwd_bwd_ops
    total_ops = warmup_ops + fwd_bwd_ops + cooldown_ops
    # ZB-H1 delays each rank's weight gradients by its rank index.
    num_1f1b = rank

    def forward_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def backward_stage(step: int) -> int:
        return (v - 1 - ((step - warmup_ops) // per_round) % v) * p + rank

    next_f: dict[int, int] = defaultdict(int)
    next_b: dict[int, int] = defaultdict(int)
    next_w: dict[int, int] = defaultdict(int)
    backward_ops: list[int] = []
    weights_done = 0
    backward_kind: Kind = "B" if zero_bubble else "FULL_B"
    actions: list[Action] = []

    def take(counter: dict[int, int], stage: int) -> int:
        index = counter[stage]
        counter[stage] = index + 1
        return index

    def add_weight() -> None:
        nonlocal weights_done
        stage = backward_stage(backward_ops[weights_done])
        actions.append(Action(stage, take(next_w, stage), "W"))
        weights_done += 1

    for op in range(total_ops):
        if op < warmup_ops + fwd_bwd_ops:
            stage = forward_stage(op)
            actions.append(Action(stage, take(next_f, stage), "F"))
        if op >= warmup_ops:
            stage = backward_stage(op)
            actions.append(Action(stage, take(next_b, stage), backward_kind))
            backward_ops.append(op)
            if zero_bubble and op - warmup_ops >= num_1f1b:
                add_weight()
    while zero_bubble and weights_done < len(backward_ops):
        add_weight()
    return actions


def _zbv(rank: int, p: int, m: int) -> list[Action]:
    # ScheduleZBVZeroBubble._calculate_single_rank_operations (torch 2.13): built
    # for max(2p - 1, m) micro-batches, then the surplus ones are dropped.
    n_micro = max(2 * p - 1, m)
    chunk0, chunk1 = rank, 2 * p - 1 - rank
    f0 = f1 = b0 = b1 = 0
    out: list[Action] = []
    for _ in range(2 * (p - rank) - 1):
        out.append(Action(chunk0, f0, "F"))
        f0 += 1
    for _ in range(rank):
        out.append(Action(chunk1, f1, "F"))
        f1 += 1
        out.append(Action(chunk0, f0, "F"))
        f0 += 1
    for _ in range(p - rank):
        out.append(Action(chunk1, f1, "F"))
        f1 += 1
        out.append(Action(chunk1, b1, "B"))
        out.append(Action(chunk1, b1, "W"))
        b1 += 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            out.append(Action(chunk0, f0, "F"))
            f0 += 1
        out.append(Action(chunk0, b0, "B"))
        out.append(Action(chunk0, b0, "W"))
        b0 += 1
        out.append(Action(chunk1, f1, "F"))
        f1 += 1
        out.append(Action(chunk1, b1, "B"))
        out.append(Action(chunk1, b1, "W"))
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out.append(Action(chunk0, b0, "B"))
        b0 += 1
        out.append(Action(chunk1, b1, "B"))
        b1 += 1
    for _ in range(p - rank):
        out.append(Action(chunk0, b0, "B"))
        b0 += 1
        out.append(Action(chunk0, w0, "W"))
        w0 += 1
    while w1 < b1:
        out.append(Action(chunk1, w1, "W"))
        w1 += 1
    while w0 < b0:
        out.append(Action(chunk0, w0, "W"))
        w0 += 1
    return [action for action in out if action.microbatch < m]


def _dualpipev(rank: int, p: int, m: int) -> list[Action]:
    # ScheduleDualPipeV._calculate_single_rank_operations (torch 2.13), with each
    # OVERLAP_F_B pair run as its forward then its whole backward, as the runtime does.
    stage0, stage1 = rank, 2 * p - 1 - rank
    next_f: dict[int, int] = defaultdict(int)
    next_b: dict[int, int] = defaultdict(int)  # shared by B (input) and FULL_B, as in torch
    pending_weights: list[tuple[int, int]] = []
    out: list[Action] = []

    def forward(stage: int) -> None:
        out.append(Action(stage, next_f[stage], "F"))
        next_f[stage] += 1

    def full_backward(stage: int) -> None:
        out.append(Action(stage, next_b[stage], "FULL_B"))
        next_b[stage] += 1

    def input_backward(stage: int) -> None:
        out.append(Action(stage, next_b[stage], "B"))
        pending_weights.append((stage, next_b[stage]))
        next_b[stage] += 1

    def weight_if_pending() -> None:
        if pending_weights:
            stage, microbatch = pending_weights.pop(0)
            out.append(Action(stage, microbatch, "W"))

    def overlap(forward_stage: int, backward_stage: int) -> None:
        forward(forward_stage)
        full_backward(backward_stage)

    for _ in range((p - rank - 1) * 2):
        forward(stage0)
    for _ in range(rank + 1):
        forward(stage0)
        forward(stage1)
    for _ in range(p - rank - 1):
        input_backward(stage1)
        weight_if_pending()
        forward(stage1)
    for i in range(m - 2 * p + rank + 1):
        # torch keeps the last rank's first pair apart to shorten the bubble.
        overlap(stage0, stage1)
        overlap(stage1, stage0)
    for _ in range(p - rank - 1):
        full_backward(stage1)
        overlap(stage1, stage0)
    step_6 = rank + 1
    zero_bubble = False
    for i in range(step_6):
        if i == step_6 // 2 and rank % 2 == 1:
            zero_bubble = True
        (input_backward if zero_bubble else full_backward)(stage1)
        if i == step_6 // 2 and rank % 2 == 0:
            zero_bubble = True
        (input_backward if zero_bubble else full_backward)(stage0)
    for _ in range(p - rank - 1):
        weight_if_pending()
        (input_backward if zero_bubble else full_backward)(stage0)
    for _ in range(rank + 1):
        weight_if_pending()
    return out
