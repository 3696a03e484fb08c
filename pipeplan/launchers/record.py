"""The shape of a launcher's record: what one launcher runs, each rule with its source.

Each launcher's home holds one (:mod:`pipeplan.launchers.megatron.record`, ...);
:mod:`pipeplan.launchers.registry` gathers them for the planner's search, the exports and doctor.
A record sits at facts' level: it imports no reader, writer or planner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from pipeplan.facts.loss import DEFAULT_LOSS

__all__ = ["LauncherFacts", "LauncherSettings", "DEFAULT_OPTIMIZER"]

#: The optimizer state a plan keeps without a launcher (16-bit weights and gradients, fp32 Adam).
DEFAULT_OPTIMIZER = "adam"


@dataclass(frozen=True)
class LauncherSettings:
    """The launcher's own words for what doctor's findings name (the setting a user edits)."""

    split: str
    """Where the layers per stage are said (the gap and imbalance findings)."""
    layout: str
    """What decides which layers the launcher builds on each stage (lost, repeated, empty stages)."""
    layers: str
    """The model's layer count."""
    units: str
    """What the launcher splits into stages."""
    schedule: str
    """The pipeline schedule (and its virtual stages)."""
    batch: str
    """The settings that give the micro-batch count."""
    microbatch: str
    """The micro-batch size."""
    recompute: str
    """What the launcher recomputes."""
    tensor: str
    """The tensor-parallel size."""
    expert: str
    """The expert-parallel size, as written before its value."""
    zero: Callable[[int], str]
    """The setting that gives a ZeRO stage, as a user writes it."""


@dataclass(frozen=True)
class LauncherFacts:
    """One launcher's rules, each from its own code."""

    name: str
    schedules: tuple[str, ...]
    """pipeplan's names of the schedules it runs."""
    zero_with_pipeline: tuple[int, ...]
    """ZeRO stages it runs as planned with more than one pipeline rank (and d > 1)."""
    zero_without_pipeline: tuple[int, ...]
    """ZeRO stages it runs as planned with one pipeline rank (and d > 1)."""
    config_zero_stages: tuple[int, ...]
    """ZeRO stages a user's config of it can be at (what doctor costs a config at)."""
    search_zero_stages: tuple[int, ...]
    """ZeRO stages doctor's search over every layout tries for it."""
    optimizer: str
    """The optimizer state it keeps by default (a :mod:`pipeplan.facts.training_state` name)."""
    uniform_recompute: bool
    """Whether it applies one recomputation to every pipeline stage (the planner may not mix)."""
    zero_is_a_switch: bool
    """Whether a config's ZeRO stage is a switch of its own (``--fix`` may raise it at the same
    degrees), not tied to how the data-parallel ranks are laid out."""
    sequence_parallel_flag: Optional[str]
    """The flag that turns sequence parallelism on where it is optional (None: always on with
    tensor parallelism, or not run)."""
    empty_stage_severity: str
    """``error`` where a stage without layers fails the run, ``warning`` where it only idles."""
    refusal: Callable[[str, int, int, int, Optional[int]], Optional[str]]
    """Why it refuses ``(schedule, p, m, v, group size)`` at run time, or None where it runs."""
    settings: LauncherSettings
    batch: str
    """What its batch settings mean, as its docs and code say."""
    source: str
    loss: str = DEFAULT_LOSS
    """The cross-entropy it computes (a :data:`pipeplan.facts.loss.LOSS_FORMS` name): what the head's
    working memory is costed as (pipeplan.facts.loss)."""

    def zero_stages(self, data: int, pipeline: int) -> tuple[int, ...]:
        """The ZeRO stages to plan at ``d = data`` replicas of ``pipeline`` ranks (0 only at d = 1)."""
        if data == 1:
            return (0,)
        return self.zero_with_pipeline if pipeline > 1 else self.zero_without_pipeline
