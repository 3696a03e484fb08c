"""DeepSpeed: a plan's stage boundaries as ``PipelineModule.parts``, and the ds_config batch keys.

DeepSpeed's ``PipelineModule`` runs one stage per rank over a flat list of layers, layers
``parts[s]`` to ``parts[s + 1] - 1`` on stage ``s``. Its ``partition_method`` ('uniform',
'parameters', 'type:regex') cannot take given boundaries, so docs/launchers.md shows a small
subclass that sets ``self.parts`` from this export. The layer list must follow ``layers`` here
(stage after stage), which is the profile's order for chains.
"""

from __future__ import annotations

from pipeplan.errors import BadInputError
from pipeplan.export.common import compact_json, header_lines, pipeline_shape
from pipeplan.formats.plan import Plan

__all__ = ["export_deepspeed"]


def export_deepspeed(plan: Plan) -> str:
    """The plan as JSON: ``layers``, ``parts`` and a ``ds_config`` fragment.

    Parameters
    ----------
    plan : Plan

    Returns
    -------
    str
        JSON with ``parts`` (S + 1 layer indices for S stages), ``layers`` (names in that
        indexing), ``num_stages`` and ``ds_config`` (``train_micro_batch_size_per_gpu``,
        ``gradient_accumulation_steps`` = micro-batches, ``train_batch_size``).

    Raises
    ------
    BadInputError
        If the plan puts more than one stage on a rank (DeepSpeed's pipeline engine runs one).

    Notes
    -----
    DeepSpeed checks ``train_batch_size == train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x data-parallel size``; the values here are for one
    data-parallel replica (multiply ``train_batch_size`` by the data-parallel size). O(L).
    """
    shape = pipeline_shape(plan)
    if shape.virtual_stages != 1:
        raise BadInputError(
            f"plan: {shape.virtual_stages} stages per rank; DeepSpeed's PipelineModule runs one "
            f"stage per rank: re-plan with --schedule 1f1b for DeepSpeed"
        )
    parts = [0]
    for stage in shape.stages:
        parts.append(parts[-1] + len(stage.layers))
    notes = list(header_lines(plan, "DeepSpeed"))
    if plan.schedule not in ("1f1b", "gpipe"):
        notes.append(f"DeepSpeed runs its own 1F1B-like TrainSchedule; the plan's numbers are for {plan.schedule}")
    recompute = [s.index for s in shape.stages if s.recompute]
    if recompute:
        notes.append(
            f"the plan recomputes activations on stages {recompute}; PipelineModule's "
            f"activation_checkpoint_interval applies to every stage"
        )
    data = {
        "pipeplan": {"launcher": "deepspeed", "model": plan.profile.model,
                     "profile_sha256": plan.profile.sha256, "notes": notes},
        "num_stages": shape.num_ranks,
        "parts": parts,
        "layers": shape.layer_order,
        "ds_config": {
            "train_micro_batch_size_per_gpu": plan.microbatch_size,
            "gradient_accumulation_steps": plan.num_microbatches,
            "train_batch_size": plan.microbatch_size * plan.num_microbatches,
        },
    }
    return compact_json(data) + "\n"
