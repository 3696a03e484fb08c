"""torch.distributed.pipelining: split points for ``pipeline()``, the schedule class, placement.

``pipeline(module, mb_args, split_spec={fqn: SplitPoint.BEGINNING, ...})`` cuts the traced
model before each named module; ``pipe.build_stage(s, device, group)`` builds stage ``s`` on the
rank ``stage_to_rank[s]``; ``get_schedule_class(schedule)(stages, n_microbatches=...)`` runs it.
See docs/launchers.md.
"""

from __future__ import annotations

from pipeplan.launchers.common import (compact_json, TORCH_SCHEDULE_NAME, header_lines, pipeline_shape, precision_notes,
                                    tied_weight_notes)
from pipeplan.launchers.degrees import degree_line, degrees_of
from pipeplan.formats.plan import Plan
from pipeplan.facts.schedules import TORCH_SCHEDULE_CLASS

__all__ = ["export_torch"]


def export_torch(plan: Plan, profile=None) -> str:
    """The plan as JSON for ``torch.distributed.pipelining``.

    Parameters
    ----------
    plan : Plan
    profile : Profile, optional
        The plan's profile: its tied weights get a note (whose gradients to all-reduce).

    Returns
    -------
    str
        JSON with ``split_spec`` ({first layer of each stage after the first: "BEGINNING"}),
        ``schedule`` (the name ``get_schedule_class`` takes), ``schedule_class``,
        ``n_microbatches``, ``microbatch_size``, ``num_stages``, ``num_ranks``,
        ``stages_per_rank``, ``stage_to_rank``, ``stage_modules`` and ``parallelism`` (``data``,
        ``tensor``, ``zero_stage``, ``sequence_parallel``, ``global_batch``: what to wrap the stages
        in, which torch's pipelining leaves to the caller).

    Notes
    -----
    Layer names are used as module FQNs: true for profiles made by ``pipeplan profile`` from a
    torch model. O(L).
    """
    shape = pipeline_shape(plan)
    degrees = degrees_of(plan)
    notes = header_lines(plan, "torch") + [degree_line(degrees)]
    if degrees.data > 1 or degrees.tensor > 1:
        notes.append("torch.distributed.pipelining builds one pipeline: apply tensor parallelism to each stage's "
                     "module (parallelize_module) and wrap it for the data-parallel replicas (fully_shard for ZeRO "
                     "1-3, replicate/DDP for ZeRO 0) yourself; n_microbatches is per replica")
    notes += tied_weight_notes(plan, profile, "torch") + precision_notes(plan, "torch")
    data = {
        "pipeplan": {"launcher": "torch", "model": plan.profile.model,
                     "profile_sha256": plan.profile.sha256, "notes": notes},
        "split_spec": {stage.layers[0]: "BEGINNING" for stage in shape.stages[1:]},
        "schedule": TORCH_SCHEDULE_NAME.get(plan.schedule, plan.schedule),
        "schedule_class": TORCH_SCHEDULE_CLASS.get(plan.schedule, plan.schedule),
        "n_microbatches": plan.num_microbatches,
        "microbatch_size": plan.microbatch_size,
        "num_stages": len(shape.stages),
        "num_ranks": shape.num_ranks,
        "stages_per_rank": shape.virtual_stages,
        "stage_to_rank": list(shape.stage_to_rank),
        "stage_modules": [list(stage.layers) for stage in shape.stages],
        "parallelism": {"data": degrees.data, "tensor": degrees.tensor, "zero_stage": degrees.zero_stage,
                        "sequence_parallel": degrees.sequence_parallel, "global_batch": degrees.global_batch},
    }
    return compact_json(data) + "\n"
