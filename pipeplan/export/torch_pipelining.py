"""torch.distributed.pipelining: split points for ``pipeline()``, the schedule class, placement.

``pipeline(module, mb_args, split_spec={fqn: SplitPoint.BEGINNING, ...})`` cuts the traced
model before each named module; ``pipe.build_stage(s, device, group)`` builds stage ``s`` on the
rank ``stage_to_rank[s]``; ``get_schedule_class(schedule)(stages, n_microbatches=...)`` runs it.
See docs/launchers.md.
"""

from __future__ import annotations

from pipeplan.export.common import compact_json, TORCH_SCHEDULE_NAME, header_lines, pipeline_shape
from pipeplan.formats.plan import Plan

__all__ = ["export_torch"]


def export_torch(plan: Plan) -> str:
    """The plan as JSON for ``torch.distributed.pipelining``.

    Parameters
    ----------
    plan : Plan

    Returns
    -------
    str
        JSON with ``split_spec`` ({first layer of each stage after the first: "BEGINNING"}),
        ``schedule`` (the name ``get_schedule_class`` takes), ``schedule_class``,
        ``n_microbatches``, ``microbatch_size``, ``num_stages``, ``num_ranks``,
        ``stages_per_rank``, ``stage_to_rank`` and ``stage_modules``.

    Notes
    -----
    Layer names are used as module FQNs: true for profiles made by ``pipeplan profile`` from a
    torch model. O(L).
    """
    from pipeplan.plan.schedules import TORCH_SCHEDULE_CLASS

    shape = pipeline_shape(plan)
    data = {
        "pipeplan": {"launcher": "torch", "model": plan.profile.model,
                     "profile_sha256": plan.profile.sha256, "notes": header_lines(plan, "torch")},
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
    }
    return compact_json(data) + "\n"
