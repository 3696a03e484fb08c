"""torchtitan: the ``[parallelism]`` settings of a plan, as TOML, and its schedule as a CSV.

torchtitan (0.1 and 0.2 read a TOML job config, ``--job.config_file``) builds one pipeline stage per
inner list of ``parallelism.module_fqns_per_model_part``, places them the way the named schedule
class does (stage ``s`` on rank ``s % p``; ``ZBVZeroBubble`` and ``DualPipeV`` in a V), and cuts
``training.local_batch_size`` into micro-batches of ``parallelism.pipeline_parallel_microbatch_size``.
With ``pipeline_parallel_schedule_csv`` it runs ``_PipelineScheduleRuntime`` on the actions listed
in the file (one row per rank, ``0F0``, ``1B0``, ``2I1``, ``2W1``; torch adds the sends and
receives). See docs/launchers.md.
"""

from __future__ import annotations

import json

from pipeplan.errors import BadInputError
from pipeplan.export.common import TORCH_SCHEDULE_NAME, header_lines, pipeline_shape
from pipeplan.formats.plan import Plan

__all__ = ["export_torchtitan", "schedule_csv"]


def _toml_string(text: str) -> str:
    # A JSON string (ASCII, \" \\ \n \uXXXX escapes) is a valid TOML basic string.
    return json.dumps(text, ensure_ascii=True)


def schedule_csv(plan: Plan) -> str:
    """The plan's per-rank compute actions in the CSV format torch's schedule runtime loads.

    Parameters
    ----------
    plan : Plan

    Returns
    -------
    str
        One line per rank, comma-separated actions in execution order (``0F0``, ``0B0`` whole
        backward, ``0I0`` input gradient, ``0W0`` weight gradient).

    Raises
    ------
    BadInputError
        If the schedule is not one pipeplan simulates, or torch's class refuses its numbers.

    Notes
    -----
    The order is :func:`pipeplan.plan.actions.rank_actions`, the one the simulator predicted;
    ``_PipelineScheduleRuntime._load_csv(path, format="compute_only")`` reads it. O(p m v).
    """
    from pipeplan.plan.actions import rank_actions
    from pipeplan.plan.schedules import SCHEDULES

    if plan.schedule not in SCHEDULES:
        raise BadInputError(
            f"plan: schedule {plan.schedule!r} has no action list in pipeplan; "
            f"re-plan with one of {', '.join(SCHEDULES)}"
        )
    shape = pipeline_shape(plan)
    rows = rank_actions(plan.schedule, shape.num_ranks, plan.num_microbatches, shape.virtual_stages)
    return "".join(",".join(str(action) for action in row) + "\n" for row in rows)


def export_torchtitan(plan: Plan, *, schedule_csv_path: str | None = None) -> str:
    """The plan as torchtitan TOML (``[parallelism]`` and ``[training]`` keys).

    Parameters
    ----------
    plan : Plan
    schedule_csv_path : str, optional
        When given, the TOML points ``pipeline_parallel_schedule_csv`` at this path (write
        :func:`schedule_csv` there). Needed for schedules torchtitan has no name for.

    Returns
    -------
    str
        TOML text to merge into a torchtitan job config.

    Raises
    ------
    BadInputError
        If the plan's stages are inconsistent, or its schedule has no torchtitan name and no
        CSV path was given.

    Notes
    -----
    ``training.local_batch_size`` is micro-batch size x micro-batches: torchtitan derives the
    micro-batch count from it (per data-parallel replica). O(L) for L layers.
    """
    shape = pipeline_shape(plan)
    name = TORCH_SCHEDULE_NAME.get(plan.schedule)
    if name is None and schedule_csv_path is None:
        raise BadInputError(
            f"plan: torchtitan has no schedule named for {plan.schedule!r}; export with a "
            f"schedule CSV (`--schedule-csv`)"
        )
    lines = ["# " + line for line in header_lines(plan, "torchtitan")]
    lines.append("# Merge into your torchtitan job config (TOML, --job.config_file); see docs/launchers.md.")
    recompute = [s.index for s in shape.stages if s.recompute]
    if recompute:
        lines.append(
            f"# The plan recomputes activations on stages {recompute}"
            + (" (selective: the attention core)" if any(s.recompute_granularity == "selective" for s in shape.stages) else "")
            + "; torchtitan's [activation_checkpoint] mode applies to every stage."
        )
    lines += ["", "[parallelism]", f"pipeline_parallel_degree = {shape.num_ranks}"]
    # With a CSV, torchtitan still reads the schedule name to place stages (loop or V).
    placement_name = name or ("ZBVZeroBubble" if shape.v_placement else "Interleaved1F1B")
    lines.append(f"pipeline_parallel_schedule = {_toml_string(placement_name)}")
    if schedule_csv_path is not None:
        lines.append(f"pipeline_parallel_schedule_csv = {_toml_string(schedule_csv_path)}")
    lines.append(f"pipeline_parallel_microbatch_size = {plan.microbatch_size}")
    lines.append("module_fqns_per_model_part = [")
    for stage in shape.stages:
        names = ", ".join(_toml_string(n) for n in stage.layers)
        lines.append(f"    [{names}],  # stage {stage.index}, rank {stage.rank}")
    lines.append("]")
    lines += [
        "",
        "[training]",
        "# micro-batch size x micro-batches, per data-parallel replica",
        f"local_batch_size = {plan.microbatch_size * plan.num_microbatches}",
    ]
    return "\n".join(lines) + "\n"
