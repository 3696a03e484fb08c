"""What each launcher runs: one record per launcher (in its home, ``pipeplan.launchers.<name>.record``),
which the planner's search, the exports and doctor all read, so that a plan for a launcher is a
plan that launcher runs.

Each :class:`~pipeplan.launchers.record.LauncherFacts` says, with its source:

- the pipeline schedules it runs (``schedules``; torch's classes for torchtitan) and what it
  refuses at run time (``refusal``: Megatron's interleaved micro-batch rule, torch's classes');
- the ZeRO stages it runs as planned, by pipeline depth (:meth:`LauncherFacts.zero_stages`);
- the optimizer state it keeps by default (``optimizer``: the bytes per parameter of
  :mod:`pipeplan.facts.training_state`) and whether one recomputation covers every stage;
- what its batch settings mean (``batch``), and its own names for the settings doctor names.

Examples
--------
>>> LAUNCHERS["deepspeed"].zero_stages(data=8, pipeline=4)
(1,)
>>> launcher_zero_stages("torchtitan", data=8, pipeline=1), launcher_zero_stages("torchtitan", data=8, pipeline=4)
((0, 2, 3), (0, 1, 3))
>>> launcher_optimizer("megatron"), launcher_optimizer(None)
('adam-fp32-grads', 'adam')
>>> check_launcher("megatron", "interleaved", 4, 8, 2)
>>> check_launcher(None, "interleaved", 4, 6, 2)
"""

from __future__ import annotations

from typing import Optional

from pipeplan.errors import BadInputError
from pipeplan.launchers.deepspeed.record import DEEPSPEED
from pipeplan.launchers.megatron.record import MEGATRON
from pipeplan.launchers.record import DEFAULT_OPTIMIZER, LauncherFacts
from pipeplan.launchers.torchtitan.record import TORCHTITAN

__all__ = ["LauncherFacts", "LAUNCHERS", "LAUNCHER_SCHEDULES", "launcher_zero_stages", "launcher_optimizer",
           "check_launcher", "launcher_refusal", "DEFAULT_OPTIMIZER"]

LAUNCHERS = {record.name: record for record in (MEGATRON, TORCHTITAN, DEEPSPEED)}

#: The schedules each launcher runs (its record's ``schedules``).
LAUNCHER_SCHEDULES = {name: record.schedules for name, record in LAUNCHERS.items()}


def launcher_zero_stages(launcher: Optional[str], data: int, pipeline: int) -> tuple[int, ...]:
    """The ZeRO stages a plan for ``launcher`` is searched at (every stage without a launcher)."""
    if launcher is None:
        return (0,) if data == 1 else (1, 2, 3)
    return LAUNCHERS[launcher].zero_stages(data, pipeline)


def launcher_optimizer(launcher: Optional[str]) -> str:
    """The optimizer state a plan keeps by default for ``launcher`` (``--optimizer auto``)."""
    return DEFAULT_OPTIMIZER if launcher is None else LAUNCHERS[launcher].optimizer


def launcher_refusal(launcher: str, schedule: str, p: int, m: int, v: int,
                     group_size: int | None = None) -> str | None:
    """Why ``launcher`` refuses ``schedule`` with ``m`` micro-batches on ``p`` ranks x ``v``, or None."""
    return LAUNCHERS[launcher].refusal(schedule, p, m, v, group_size)


def check_launcher(launcher: str | None, schedule: str, num_ranks: int, num_microbatches: int,
                   virtual_stages: int) -> None:
    """Raise if ``launcher`` cannot run these numbers (beyond what torch's classes refuse).

    Raises
    ------
    BadInputError
        A schedule the launcher does not run, or one it refuses at these numbers (Megatron's
        interleaved micro-batch rule).
    """
    if launcher is None:
        return
    allowed = LAUNCHERS[launcher].schedules
    if schedule not in allowed:
        raise BadInputError(f"launcher {launcher}: runs {', '.join(allowed)}, not {schedule}")
    why = launcher_refusal(launcher, schedule, num_ranks, num_microbatches, virtual_stages)
    if why is not None:
        raise BadInputError(f"launcher {launcher}: its {schedule} schedule refuses {num_microbatches} "
                            f"micro-batches on {num_ranks} ranks: {why}")
