"""The run report format (``pipeplan-run-report/1``): what a run of a plan measured.

Written by ``pipeplan run --report``; read by ``pipeplan calibrate``. The fields ``calibrate``
and ``show`` rely on are typed and range-checked here; the many descriptive fields a run adds
(per-rank ratios, the link, load averages; see :mod:`pipeplan.run.report`) are kept as they
are, but must be finite numbers, strings, lists or objects. See docs/formats.md.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeplan.formats.limits import Count, Name, OptionalRatio, PlanMs, PositiveCount, Text
from pipeplan.facts.schedules import SCHEDULES

__all__ = ["REPORT_SCHEMA", "RankReport", "MeasuredTimes", "RunReport"]

#: The value of a report's ``schema`` field.
REPORT_SCHEMA = "pipeplan-run-report/1"


def _finite_everywhere(value: Any, where: str) -> None:
    stack = [(value, where)]
    while stack:
        item, loc = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{loc}: {item!r} is not a finite number")
        if isinstance(item, dict):
            stack.extend((v, f"{loc}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{loc}[{i}]") for i, v in enumerate(item))


class _Open(BaseModel):
    """Typed fields checked; other fields kept (a run records more than calibrate reads)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _extras_finite(self) -> Any:
        for key, value in (self.model_extra or {}).items():
            _finite_everywhere(value, key)
        return self


class RankReport(_Open):
    """What one rank measured, medians over the timed steps (milliseconds per iteration)."""

    rank: Count = Field(description="The rank (global: data_rank + d x pipeline_rank).")
    pipeline_rank: Optional[Count] = Field(default=None, description="The plan's rank this process ran (the rank "
                                                                     "itself without data parallelism).")
    data_rank: Optional[Count] = Field(default=None, description="Which data-parallel replica it belongs to.")
    stages: list[Count] = Field(default_factory=list, description="The plan's stages it ran.")
    forward_ms: PlanMs = Field(description="Time in forward calls per iteration.")
    backward_ms: PlanMs = Field(description="Time in backward (input gradient) calls per iteration.")
    weight_ms: Optional[PlanMs] = Field(default=None, description="Time in weight-gradient calls per iteration.")
    loss_ms: Optional[PlanMs] = Field(default=None, description="Time in the loss per iteration.")
    busy_ms: Optional[PlanMs] = Field(default=None, description="All compute calls per iteration.")
    pipeline_ms: Optional[PlanMs] = Field(default=None, description="Wall time of schedule.step().")
    cpu_share: Optional[OptionalRatio] = Field(default=None, description="CPU time / wall time in compute (CPU).")


class MeasuredTimes(_Open):
    """The run's iteration, over the timed steps."""

    iteration_ms: Optional[PlanMs] = Field(default=None, description="Median iteration time.")
    action_overhead_ms: Optional[PlanMs] = Field(
        default=None, description="The schedule's own time per compute action, pooled over the ranks.")


class RunReport(_Open):
    """A run of one plan: the run's shape (must match the plan), per-rank times, predictions."""

    schema_: Literal["pipeplan-run-report/1"] = Field(
        default=REPORT_SCHEMA, alias="schema", description="Format name and version.")
    model: Optional[Name] = Field(default=None, description="The model that ran.")
    schedule: Literal[SCHEDULES]
    virtual_stages: Optional[PositiveCount] = None
    num_ranks: Optional[PositiveCount] = Field(default=None, description="Processes: d x p.")
    data_parallel: Optional[PositiveCount] = Field(
        default=None, description="Data-parallel replicas d of the pipeline (absent in older reports: 1).")
    pipeline_ranks: Optional[PositiveCount] = Field(default=None, description="Pipeline ranks p per replica.")
    microbatch_size: PositiveCount
    num_microbatches: PositiveCount = Field(description="Micro-batches per replica per iteration.")
    measured: MeasuredTimes = Field(default_factory=MeasuredTimes)
    ranks: list[RankReport] = Field(min_length=1)
    notes: list[Text] = Field(default_factory=list)
    profile_path: Optional[str] = Field(default=None, max_length=4096, description="The profile given to run.")
    profile_sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    plan_path: Optional[str] = Field(default=None, max_length=4096)

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @field_validator("ranks")
    @classmethod
    def _ranks_once(cls, ranks: list[RankReport]) -> list[RankReport]:
        seen = [r.rank for r in ranks]
        if len(set(seen)) != len(seen):
            raise ValueError(f"rank numbers repeat: {sorted(seen)}")
        return ranks
