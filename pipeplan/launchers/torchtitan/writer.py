"""torchtitan: the ``[parallelism]`` settings of a plan, as TOML, and its schedule as a CSV.

torchtitan (0.1 and 0.2 read a TOML job config, ``--job.config_file``) builds one pipeline stage per
inner list of ``parallelism.module_fqns_per_model_part``, places them the way the named schedule
class does (stage ``s`` on rank ``s % p``; ``ZBVZeroBubble`` and ``DualPipeV`` in a V), and cuts
``training.local_batch_size`` into micro-batches of ``parallelism.pipeline_parallel_microbatch_size``.
With ``pipeline_parallel_schedule_csv`` it runs ``_PipelineScheduleRuntime`` on the actions listed
in the file (one row per rank, ``0F0``, ``1B0``, ``2I1``, ``2W1``; torch adds the sends and
receives). See docs/launchers.md.

Degrees: ``tensor_parallel_degree``, and ``d`` as ``data_parallel_replicate_degree`` (DDP, which
torchtitan runs only alone: ZeRO 0 at t = p = 1) or ``data_parallel_shard_degree`` (FSDP:
``fsdp_reshard_after_forward`` ``always`` for ZeRO 3, ``never`` for ZeRO 0-2, whose weights stay
whole through the step). ``global_batch_size`` is ``b x m x d``. ``[activation_checkpoint] mode``
is always written: torchtitan's default (selective) would recompute what the plan does not.
"""

from __future__ import annotations

import json
import re

from pipeplan.errors import BadInputError
from pipeplan.launchers.common import TORCH_SCHEDULE_NAME, header_lines, pipeline_shape, tied_weight_notes
from pipeplan.launchers.degrees import check_fits, degree_line, degrees_of, recompute_of, unsharded_extra_bytes
from pipeplan.launchers.registry import launcher_overlaps, plan_overlaps
from pipeplan.launchers.common import TORCH_SCHEDULE_NAME, header_lines, pipeline_shape, tied_weight_notes
from pipeplan.launchers.degrees import check_fits, degree_line, degrees_of, recompute_of, unsharded_extra_bytes
from pipeplan.formats.plan import Plan
from pipeplan.plan.actions import rank_actions
from pipeplan.facts.schedules import SCHEDULES

__all__ = ["export_torchtitan", "schedule_csv", "torchtitan_module_names", "TORCHTITAN_NAME"]

#: torchtitan's decoder models (llama3, llama4, qwen3, deepseek_v3) name their modules this way.
TORCHTITAN_NAME = re.compile(r"tok_embeddings|layers\.\d+|norm|output")
_ROLE_NAMES = {"embedding": "tok_embeddings", "norm": "norm", "head": "output"}


def torchtitan_module_names(profile) -> dict[str, str]:
    """Each profile layer's torchtitan module name (``""`` for a layer torchtitan has no module for).

    Profiles made from torchtitan's own model already use its names. Others map by role: the
    embedding is ``tok_embeddings``, block ``i`` is ``layers.<i>``, the final norm ``norm``, the
    head ``output``; layers of kind ``other`` (a rotary table) have no module and are dropped.

    Raises
    ------
    BadInputError
        If the profile's roles do not read embedding, blocks, [norm], head (torchtitan's decoder
        models), so no honest mapping exists.

    Examples
    --------
    >>> from types import SimpleNamespace as L
    >>> prof = L(model="m", layers=[L(name="embed", kind="embedding"), L(name="blocks.0", kind="block"),
    ...                             L(name="head", kind="head")])
    >>> torchtitan_module_names(prof)
    {'embed': 'tok_embeddings', 'blocks.0': 'layers.0', 'head': 'output'}
    """
    names = [layer.name for layer in profile.layers]
    if all(TORCHTITAN_NAME.fullmatch(n) for n in names):
        return {n: n for n in names}
    kinds = [layer.kind for layer in profile.layers]
    pattern = "".join({"embedding": "E", "block": "t", "norm": "n", "head": "h", "other": "o"}.get(k, "?")
                      for k in kinds)
    if not re.fullmatch(r"o*Eo*(t|o)*n?o*h", pattern):
        raise BadInputError(
            f"profile {profile.model!r}: layer roles read {pattern!r} (E embedding, t block, n norm, h head, "
            f"o other, ? none); torchtitan's decoder models have tok_embeddings, layers.N, norm, output, so "
            f"pipeplan cannot name these layers for torchtitan"
        )
    out, block = {}, 0
    for layer in profile.layers:
        if layer.kind == "block":
            out[layer.name] = f"layers.{block}"
            block += 1
        else:
            out[layer.name] = _ROLE_NAMES.get(layer.kind, "")
    return out


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
    if plan.schedule not in SCHEDULES:
        raise BadInputError(
            f"plan: schedule {plan.schedule!r} has no action list in pipeplan; "
            f"re-plan with one of {', '.join(SCHEDULES)}"
        )
    shape = pipeline_shape(plan)
    rows = rank_actions(plan.schedule, shape.num_ranks, plan.num_microbatches, shape.virtual_stages)
    return "".join(",".join(str(action) for action in row) + "\n" for row in rows)


def _data_parallel(plan: Plan, degrees, notes: list[str]) -> tuple[int, int, str]:
    """(replicate degree, shard degree, fsdp_reshard_after_forward) for the plan's d and ZeRO stage."""
    d, zero, p = degrees.data, degrees.zero_stage, degrees.pipeline
    if d == 1:
        return 1, 1, "default"
    if zero == 0:
        if degrees.tensor == 1 and p == 1:
            return d, 1, "default"  # DDP: torchtitan's replicate degree
        notes.append(
            f"ZeRO 0 with d={d}: torchtitan runs DDP (data_parallel_replicate_degree) only as the sole "
            f"parallelism ('DDP has not supported > 1D parallelism'), so the export shards over d with FSDP and "
            f"keeps the weights gathered through the step (reshard after forward: never): the same bytes on the "
            f"wire as an all-reduce, less optimizer memory than planned")
        return 1, d, "never"
    if zero in (1, 2):
        notes.append(
            f"ZeRO {zero} with d={d}: torchtitan has no optimizer-only sharding, so the export shards over d with "
            f"FSDP and keeps the weights whole from forward to backward (reshard after forward: never); the "
            f"optimizer state is sharded and the gradients "
            + ("are reduce-scattered after each micro-batch (ZeRO 2's memory; FSDP then all-gathers and "
               "reduce-scatters once per micro-batch, more traffic than the plan's one sync per step)" if p == 1 else
               "are held whole until the step ends (torch's pipelining defers FSDP's reduce-scatter): ZeRO 1's memory"))
        if zero == 2 and p > 1:
            note = check_fits(plan, unsharded_extra_bytes(plan, gradients=True, weights=False), "torchtitan",
                              "under pipelining holds each stage's whole gradients until the step ends (torch's "
                              "stage defers FSDP's reduce-scatter to the last micro-batch)",
                              "re-plan with --zero 1 so that the plan counts the whole gradients")
            if note:
                notes.append(note)
        return 1, d, "never"
    if p > 1:
        note = check_fits(plan, unsharded_extra_bytes(plan, gradients=True, weights=True), "torchtitan",
                          "under pipelining holds each stage's whole weights and gradients until the step ends "
                          "(torch's stage defers FSDP's reshard and reduce-scatter to the last micro-batch)",
                          "re-plan with --zero 1, or with --stages 1 for FSDP without pipelining")
        if note:
            notes.append(note)
    return 1, d, "always"  # ZeRO 3: FSDP, weights gathered per use


def _activation_checkpoint(plan: Plan, notes: list[str]) -> list[str]:
    recompute = recompute_of(plan)
    if recompute.mode == "none":
        return ['mode = "none"  # torchtitan\'s default is selective: the plan recomputes nothing']
    if recompute.mixed:
        notes.append(f"the plan recomputes stages {list(recompute.stages)} only; torchtitan's "
                     f"[activation_checkpoint] mode applies to every stage, so it recomputes more than planned")
    if recompute.mode == "full":
        return ['mode = "full"']
    option = plan.settings.selective_ac_option or "op"
    if plan.settings.launcher != "torchtitan":
        # Planned without --launcher torchtitan, selective was the profile's own (Megatron's
        # attention core); --launcher torchtitan costs torchtitan's form (pipeplan.plan.torchtitan_ac).
        notes.append("selective recomputation: torchtitan's per-op policy (selective_ac_option \"op\") keeps the "
                     "attention outputs and recomputes every other matmul, not Megatron's attention core: its memory "
                     "and time differ from the plan's (plan with --launcher torchtitan to cost it)")
    return ['mode = "selective"', f'selective_ac_option = "{option}"']


def _expert_lines(plan: Plan) -> list[str]:
    """A mixture-of-experts plan's degrees as torchtitan's ``[parallelism]`` keys
    (``expert_parallel_degree``, ``expert_tensor_parallel_degree``; its ``ParallelDims`` takes
    ETP = t or 1 only)."""
    par = plan.parallelism
    if par is None or par.expert is None:
        return []
    etp = par.expert_tensor or 1
    if par.expert > 1 and etp not in (1, par.tensor):
        raise BadInputError(f"plan: torchtitan runs expert-tensor parallelism at t ({par.tensor}) or 1 only, not "
                            f"{etp}: re-plan with --expert-tensor-parallel 1 or {par.tensor}")
    return [f"expert_parallel_degree = {par.expert}", f"expert_tensor_parallel_degree = {etp}"]


def _precision_lines(plan: Plan, notes: list[str]) -> list[str]:
    """The plan's precision as torchtitan's model converters (torchao): fp8 as
    ``quantize.linear.float8`` with the tensorwise (current scaling) recipe, mxfp8 as
    ``quantize.linear.mx`` (``mxfp8_cublas``), the output head left in bf16 as planned; quantized
    weights (``--fp8-param-gather``) as ``enable_fsdp_float8_all_gather``. NVFP4 has no torchtitan
    converter (0.2): refused."""
    precision = plan.settings.precision
    if precision is None:
        return []
    gather = bool(plan.settings.fp8_param_gather)
    if precision == "nvfp4" or (precision == "mxfp8" and gather):
        what = "NVFP4 training" if precision == "nvfp4" else "an MXFP8 all-gather (enable_fsdp_float8_all_gather is fp8's)"
        raise BadInputError(f"plan: torchtitan has no {what}; export --format megatron, or re-plan "
                            + ("a profile made with --precision fp8 or mxfp8" if precision == "nvfp4"
                               else "without --fp8-param-gather"))
    notes.append("torchtitan's float8/mx linears (torchao) cast the weights every micro-batch and keep no copies, "
                 "and save the inputs in bf16: less weight memory, more activation memory than the Transformer "
                 "Engine accounting this plan was costed with (docs/cost-model.md, 'Precision')")
    if precision == "fp8":
        table = ["", "[quantize.linear.float8]", 'recipe_name = "tensorwise"', 'filter_fqns = ["output"]']
        if gather:
            table += ["enable_fsdp_float8_all_gather = true", "precompute_float8_dynamic_scale_for_fsdp = true"]
        return ["", "[model]", 'converters = ["quantize.linear.float8"]', *table]
    return ["", "[model]", 'converters = ["quantize.linear.mx"]',
            "", "[quantize.linear.mx]", 'recipe_name = "mxfp8_cublas"', 'filter_fqns = ["output"]']


def async_tp_lines(plan: Plan, degrees, notes: list[str]) -> list[str]:
    """``enable_async_tensor_parallel`` where the plan overlaps the tensor-parallel collectives
    (torchtitan's async TP needs ``compile.enable`` with ``"model"`` in ``compile.components``:
    ``torchtitan/distributed/tensor_parallel.py``, ``maybe_enable_async_tp``); FSDP2's own overlap
    of the gradient reduce and the prefetch has no switch, so a plan without them says so."""
    overlaps = plan_overlaps(plan.settings.overlap, plan.settings.launcher, degrees.zero_stage)
    if (plan.settings.overlap is not None and degrees.data > 1
            and not overlaps >= launcher_overlaps("torchtitan", degrees.zero_stage)):
        notes.append("the plan leaves the data-parallel sync exposed; torchtitan's FSDP2 / DDP overlap it anyway "
                     "(no switch): expect a faster run than planned")
    if degrees.tensor > 1 and "tp-comm" in overlaps:
        notes.append("async tensor parallelism needs [compile] enable = true with \"model\" in components")
        return ["enable_async_tensor_parallel = true"]
    return []


def export_torchtitan(plan: Plan, *, schedule_csv_path: str | None = None, profile=None) -> str:
    """The plan as torchtitan TOML (``[parallelism]``, ``[training]`` and ``[activation_checkpoint]``).

    Parameters
    ----------
    plan : Plan
    profile : Profile, optional
        The plan's profile: maps its layer names to torchtitan's module names by role (see
        :func:`torchtitan_module_names`). Without it, the plan's names must already be
        torchtitan's (torchtitan silently builds empty stages from names its model lacks).
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
        If the plan's stages are inconsistent, its schedule has no torchtitan name and no
        CSV path was given, its layer names are not torchtitan's and cannot be mapped, or the
        whole weights or gradients torchtitan holds under pipelining (ZeRO 2-3) exceed the cap.

    Notes
    -----
    Degrees: ``tensor_parallel_degree = t``, ``pipeline_parallel_degree = p``; ``d`` goes to
    ``data_parallel_replicate_degree`` (ZeRO 0 alone: DDP) or ``data_parallel_shard_degree`` (FSDP:
    ZeRO 3 resharding after forward, ZeRO 0-2 keeping the weights gathered). With ``p > 1``,
    ``training.local_batch_size`` is ``b x m`` (torchtitan cuts it into ``m`` micro-batches of
    ``pipeline_parallel_microbatch_size``); with ``p = 1`` it is ``b`` and torchtitan accumulates
    ``global_batch_size / (b x d) = m`` micro-batches. ``global_batch_size`` is ``b x m x d``.
    O(L) for L layers.
    """
    shape = pipeline_shape(plan)
    degrees = degrees_of(plan)
    name = TORCH_SCHEDULE_NAME.get(plan.schedule)
    pipelined = shape.num_ranks > 1
    if pipelined and name is None and schedule_csv_path is None:
        raise BadInputError(
            f"plan: torchtitan has no schedule named for {plan.schedule!r}; export with a "
            f"schedule CSV (`--schedule-csv`)"
        )
    if profile is not None:
        rename = torchtitan_module_names(profile)
    else:
        foreign = [n for n in shape.layer_order if not TORCHTITAN_NAME.fullmatch(n)]
        if foreign and pipelined:
            raise BadInputError(
                f"plan: layers {foreign[:3]} are not torchtitan module names (tok_embeddings, layers.N, norm, "
                f"output), and torchtitan silently builds empty stages from names its model lacks: give the "
                f"plan's --profile (layers with their kind) so the export can map them"
            )
        rename = {n: n for n in shape.layer_order}
    notes: list[str] = []
    replicate, shard, reshard = _data_parallel(plan, degrees, notes)
    checkpoint = _activation_checkpoint(plan, notes)
    precision = _precision_lines(plan, notes)
    async_tp = async_tp_lines(plan, degrees, notes)
    if degrees.context > 1 and degrees.zero_stage < 3:
        notes.append(f"context_parallel_degree {degrees.context}: torchtitan turns FSDP on over its dp_shard x cp mesh "
                     f"whenever cp > 1 (ParallelDims.fsdp_enabled), so it shards the weights over {shard * degrees.context}"
                     f" GPUs where the plan's ZeRO {degrees.zero_stage} keeps them whole: less memory, more all-gathers")
    notes += tied_weight_notes(plan, profile, "torchtitan")
    if degrees.tensor > 1 and not degrees.sequence_parallel:
        notes.append("torchtitan's tensor parallelism always shards the norms' sequence (sequence parallel): "
                     "less activation memory than this plan counts")
    if not pipelined and shape.virtual_stages > 1:
        notes.append(f"one pipeline rank: torchtitan runs no pipeline schedule; the plan's {shape.virtual_stages} "
                     f"stages are one model there")
    lines = ["# " + line for line in header_lines(plan, "torchtitan")]
    lines.append("# " + degree_line(degrees))
    dropped = [n for n in shape.layer_order if not rename.get(n)]
    renamed = [n for n in shape.layer_order if rename.get(n) and rename[n] != n]
    if pipelined and renamed:
        lines.append(f"# Layer names mapped to torchtitan's by role ({renamed[0]} -> {rename[renamed[0]]}, ...).")
    if pipelined and dropped:
        lines.append(f"# No torchtitan module for {', '.join(dropped)} (kind 'other'): left out.")
    lines += [f"# note: {note}" for note in notes]
    lines.append(f"# Merge into your torchtitan job config (TOML, --job.config_file) and launch on {degrees.num_gpus} "
                 f"GPUs; see docs/launchers.md.")
    lines += ["", "[parallelism]",
              f"data_parallel_replicate_degree = {replicate}",
              f"data_parallel_shard_degree = {shard}"]
    if reshard != "default":
        lines.append(f"fsdp_reshard_after_forward = {_toml_string(reshard)}")
    lines += [f"tensor_parallel_degree = {degrees.tensor}",
              f"pipeline_parallel_degree = {shape.num_ranks}"]
    lines += _expert_lines(plan)
    lines += async_tp
    if degrees.context > 1:
        lines.append(f"context_parallel_degree = {degrees.context}")
    if pipelined:
        # With a CSV, torchtitan still reads the schedule name to place stages (loop or V).
        placement_name = name or ("ZBVZeroBubble" if shape.v_placement else "Interleaved1F1B")
        lines.append(f"pipeline_parallel_schedule = {_toml_string(placement_name)}")
        if schedule_csv_path is not None:
            lines.append(f"pipeline_parallel_schedule_csv = {_toml_string(schedule_csv_path)}")
        lines.append(f"pipeline_parallel_microbatch_size = {plan.microbatch_size}")
        lines.append("module_fqns_per_model_part = [")
        for stage in shape.stages:
            names = ", ".join(_toml_string(rename[n]) for n in stage.layers if rename.get(n))
            lines.append(f"    [{names}],  # stage {stage.index}, rank {stage.rank}")
        lines.append("]")
    lines += ["", "[training]"]
    if pipelined:
        lines += ["# micro-batch size x micro-batches, per data-parallel replica (the pipeline's batch)",
                  f"local_batch_size = {degrees.replica_batch}"]
    else:
        lines += ["# one micro-batch per step of gradient accumulation (no pipeline)",
                  f"local_batch_size = {degrees.microbatch_size}"]
    lines += [f"# local_batch_size x data-parallel replicas x {1 if pipelined else degrees.num_microbatches} "
              f"accumulation step(s)",
              f"global_batch_size = {degrees.global_batch}"]
    if profile is not None and profile.sequence_length:
        # The sequence the plan was profiled at; without it torchtitan trains at its default, 2048.
        lines.append(f"seq_len = {profile.sequence_length}")
    lines += ["", "[activation_checkpoint]", *checkpoint, *precision]
    return "\n".join(lines) + "\n"
