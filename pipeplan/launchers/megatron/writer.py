"""Megatron-LM: a plan as command-line flags, with ``--pipeline-model-parallel-layout``.

Megatron-LM (megatron-core >= 0.13) describes any split, even or not, with a layout string:
stages separated by ``|``, ``E`` the embedding, ``t`` one transformer decoder layer, ``L`` the loss
(with the final norm and the output layer), ``(...)*N`` and ``x*N`` repeats, commas cosmetic.
Stages are listed virtual-stage-major: entry ``vpp_rank * p + pp_rank``, which is pipeplan's
stage index for the loop placement. The layout alone sets the virtual stages per rank; Megatron
refuses ``--num-virtual-stages-per-pipeline-rank`` beside it.

How a profile's layers map (by their ``kind``): ``embedding`` layers give the one ``E`` (they must
come first); each ``block`` is one ``t``; ``norm`` and ``head`` layers after the last block give the
one ``L``, on the stage of the last of them (Megatron builds the final norm with the loss, so a
final norm that the plan put one stage earlier moves there, and the export says so); ``other``
layers (e.g. a parameter-free rotary embedding) have no symbol and are left out, with a note.

Degrees (a plan made with ``--gpus``): ``--tensor-model-parallel-size``, ``--sequence-parallel``,
``--use-distributed-optimizer`` for ZeRO 1 (and 2, which Megatron-LM runs with ZeRO 1's memory:
checked against the cap), no ZeRO 3 (refused), and ``--global-batch-size`` with ``d`` in it, so
that megatron-core's ``ConstantNumMicroBatchesCalculator`` derives the plan's micro-batch count.
"""

from __future__ import annotations

import re
import shlex

from pipeplan.errors import BadInputError
from pipeplan.launchers.common import check_profile_matches, header_lines, pipeline_shape, tied_weight_notes
from pipeplan.launchers.degrees import check_fits, degree_line, degrees_of, recompute_of, unsharded_extra_bytes
from pipeplan.launchers.registry import plan_overlaps
from pipeplan.launchers.common import check_profile_matches, header_lines, pipeline_shape, tied_weight_notes
from pipeplan.launchers.degrees import check_fits, degree_line, degrees_of, recompute_of, unsharded_extra_bytes
from pipeplan.facts.precision import get_precision
from pipeplan.formats.plan import Plan
from pipeplan.launchers.megatron.record import interleaved_refusal

__all__ = ["export_megatron", "precision_flags", "megatron_layout", "expand_layout", "interleaved_refusal"]


def _compress_stage(symbols: list[str]) -> str:
    out, i = "", 0
    while i < len(symbols):
        j = i
        while j < len(symbols) and symbols[j] == symbols[i]:
            j += 1
        out += symbols[i] + (f"*{j - i}" if j - i > 1 else "")
        i = j
    return out


def _compress_layout(stage_strings: list[str]) -> str:
    # Runs of identical stages become "(s|)*r," (Megatron's own style, e.g. "Et|(tt|)*29,m|L").
    parts, i, n = [], 0, len(stage_strings)
    while i < n:
        j = i
        while j < n and stage_strings[j] == stage_strings[i]:
            j += 1
        run = j - i
        if j == n:  # the last run ends the string without a trailing "|"
            if run - 1 >= 2:
                parts.append(f"({stage_strings[i]}|)*{run - 1},{stage_strings[i]}")
            else:
                parts.append("|".join([stage_strings[i]] * run))
        elif run >= 2:
            parts.append(f"({stage_strings[i]}|)*{run},")
        else:
            parts.append(stage_strings[i] + "|")
        i = j
    return "".join(parts)


def expand_layout(layout: str) -> list[str]:
    """Stage strings of a layout, expanded the way Megatron-LM's ``parse_str_to_list`` does.

    Examples
    --------
    >>> expand_layout("Et*3|(tt|)*2,t|L")
    ['Ettt', 'tt', 'tt', 't', 'L']
    >>> expand_layout("E||t|L")
    ['E', '', 't', 'L']
    """
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    for char in text:
        if char not in "ELtm|":
            raise BadInputError(f"layout {layout!r}: {char!r} is not one of E, L, t, m, |")
    return text.split("|")


def megatron_layout(plan: Plan, profile) -> tuple[str, int, list[str]]:
    """The plan's split as a ``--pipeline-model-parallel-layout`` string.

    Parameters
    ----------
    plan : Plan
    profile : Profile
        The profile the plan was made from; its layers' ``kind`` names their roles.

    Returns
    -------
    layout : str
        Compressed layout, stages in index (virtual-stage-major) order.
    num_layers : int
        Decoder layers (``t``), for ``--num-layers``.
    notes : list of str
        What the mapping changed or left out.

    Raises
    ------
    BadInputError
        If a layer has no ``kind``, the roles are out of order (embedding first, blocks, then
        norm/head), there is no embedding or no norm/head, or the schedule places stages in a V.

    Notes
    -----
    O(L) for L layers.
    """
    shape = pipeline_shape(plan)
    if shape.v_placement:
        raise BadInputError(
            f"plan: schedule {plan.schedule} places stages in a V; Megatron-LM places stage s on "
            f"rank s % p: re-plan with --schedule 1f1b or interleaved for Megatron-LM"
        )
    kind_of = {layer.name: layer.kind for layer in profile.layers}
    order = shape.layer_order
    unknown = [name for name in order if kind_of.get(name) is None]
    if unknown:
        raise BadInputError(
            f"profile {profile.model!r}: layers {unknown[:5]} have no 'kind'; Megatron-LM's layout "
            f"names layers by role: give each layer kind embedding, block, norm, head or other"
        )
    roles = [kind_of[name] for name in order if kind_of[name] != "other"]
    skipped = [name for name in order if kind_of[name] == "other"]
    # Roles must read: embedding+ block* (norm|head)+
    pattern = "".join({"embedding": "E", "block": "t", "norm": "n", "head": "h"}[r] for r in roles)
    if not re.fullmatch(r"E+t*[nh]+", pattern):
        raise BadInputError(
            f"profile {profile.model!r}: layer roles in pipeline order read {pattern!r} "
            f"(E embedding, t block, n norm, h head); Megatron-LM's layout needs the embedding "
            f"first, then the blocks, then the final norm and head: fix the layers' kind"
        )
    stage_of = {name: stage.index for stage in shape.stages for name in stage.layers}
    embeddings = [n for n in order if kind_of[n] == "embedding"]
    tail = [n for n in order if kind_of[n] in ("norm", "head")]
    loss_stage = stage_of[tail[-1]]
    notes = []
    moved = [n for n in tail if stage_of[n] != loss_stage]
    if moved:
        notes.append(
            f"{', '.join(moved)} moved to stage {loss_stage}: Megatron-LM builds the final norm "
            f"and output layer with the loss (L)"
        )
    if len({stage_of[n] for n in embeddings}) > 1:
        notes.append(f"embedding layers {embeddings} all build on stage {stage_of[embeddings[0]]} (E)")
    if skipped:
        notes.append(f"layers of kind 'other' have no Megatron-LM symbol and are left out: {skipped}")
    symbols: list[list[str]] = [[] for _ in shape.stages]
    symbols[stage_of[embeddings[0]]].append("E")
    for name in order:
        if kind_of[name] == "block":
            symbols[stage_of[name]].append("t")
    symbols[loss_stage].append("L")
    stage_strings = [_compress_stage(s) for s in symbols]
    layout = _compress_layout(stage_strings)
    expanded = ["".join(expand_layout(s)[0]) for s in stage_strings]
    if expand_layout(layout) != expanded:  # a compression bug must never reach a launcher
        raise AssertionError(f"layout {layout!r} does not expand to {expanded}")
    return layout, pattern.count("t"), notes


def _recompute_flags(plan: Plan, notes: list[str]) -> list[tuple[str, str | tuple[str, ...] | None]]:
    recompute = recompute_of(plan)
    if recompute.mode == "none":
        return []
    if recompute.mode == "selective":
        if recompute.mixed:
            notes.append(f"the plan recomputes the attention core on stages {list(recompute.stages)}; "
                         "Megatron-LM applies --recompute-granularity selective to every layer")
        modules = plan.settings.recompute_modules
        # Megatron's default modules are ["core_attn"], what a plan without them costs.
        return [("--recompute-granularity", "selective")] + (
            [("--recompute-modules", tuple(modules))] if modules else [])  # nargs="*": one word each
    if recompute.mixed:
        notes.append(f"the plan recomputes stages {list(recompute.stages)} only; Megatron-LM applies full "
                     "recomputation to every rank, so it recomputes more than planned (slower, never more memory)")
    if plan.settings.recompute_method == "block":
        # the first N blocks of each stage (model chunk) recompute in full, as planned
        return [("--recompute-granularity", "full"), ("--recompute-method", "block"),
                ("--recompute-num-layers", str(plan.settings.recompute_num_layers))]
    # uniform, 1 layer per chunk: each layer keeps its input and rebuilds its activations alone
    return [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
            ("--recompute-num-layers", "1")]


def cpu_offload_flags(plan: Plan) -> list[tuple[str, str | None]]:
    """Megatron's CPU activation offload for a plan made with ``--cpu-offload-layers N``
    (megatron-core's ``cpu_offloading``, ``cpu_offloading_num_layers``; pipeplan.plan.offload)."""
    n = plan.settings.cpu_offload_layers
    return [] if n is None else [("--cpu-offloading", None), ("--cpu-offloading-num-layers", str(n))]


def _optimizer_flags(plan: Plan, degrees, notes: list[str]) -> list[tuple[str, str | None]]:
    zero = degrees.zero_stage
    if zero == 0:
        return []
    if zero == 3:
        raise BadInputError(
            f"plan: ZeRO 3 (weights sharded over d={degrees.data}): Megatron-LM's distributed optimizer shards "
            f"only the optimizer state, and its sharded-weights mode (Megatron FSDP, --use-megatron-fsdp) is "
            f"a different runtime that pipeplan does not export; re-plan with --zero 1 for Megatron-LM "
            f"(--use-distributed-optimizer), or export this plan --format torchtitan")
    if zero == 2:
        note = check_fits(
            plan, unsharded_extra_bytes(plan, gradients=True, weights=False), "Megatron-LM",
            "keeps the whole gradient buffer under --use-distributed-optimizer (it reduce-scatters "
            "gradients, as ZeRO 2 does, but shards only the optimizer state: ZeRO 1 memory)",
            "re-plan with --zero 1 (--use-distributed-optimizer) so that the plan counts the whole gradients")
        if note:
            notes.append(note)
    return [("--use-distributed-optimizer", None)]


def _expert_flags(plan: Plan, profile) -> list[tuple[str, str | None]]:
    """A mixture-of-experts plan's experts as Megatron-LM's flags (its ``_add_moe_args``): the
    experts and their shape from the profile, the degrees from the plan, and the all-to-all
    token dispatcher the plan's dispatch and combine are timed as."""
    par, experts = plan.parallelism, getattr(profile, "experts", None)
    if par is None or par.expert is None or experts is None:
        return []
    flags = [
        ("--num-experts", str(experts.num_experts)),
        ("--moe-router-topk", str(experts.experts_per_token)),
        ("--moe-ffn-hidden-size", str(experts.expert_intermediate_size)),
        ("--expert-model-parallel-size", str(par.expert)),
        ("--expert-tensor-parallel-size", str(par.expert_tensor or 1)),
        ("--moe-token-dispatcher-type", "alltoall"),
    ]
    if experts.shared_expert_intermediate_size:
        flags.append(("--moe-shared-expert-intermediate-size", str(experts.shared_expert_intermediate_size)))
    return flags


def precision_flags(plan: Plan) -> list[tuple[str, str | None]]:
    """The plan's precision as Megatron-LM's Transformer Engine flags (its
    ``_add_transformer_engine_args``): ``--fp8-format``/``--fp8-recipe`` (fp8: ``hybrid`` +
    ``tensorwise``, current scaling; mxfp8: ``e4m3`` + ``mxfp8``) or ``--fp4-format e2m1
    --fp4-recipe nvfp4``, and ``--fp8-param-gather`` / ``--fp4-param-gather`` for quantized
    weights (:mod:`pipeplan.facts.precision`). None for a plan in its dtype."""
    precision = plan.settings.precision
    if precision is None:
        return []
    flags = list(get_precision(precision).megatron_flags)
    if plan.settings.fp8_param_gather:
        flags.append(("--fp4-param-gather" if precision == "nvfp4" else "--fp8-param-gather", None))
    return flags


def overlap_flags(plan: Plan, degrees, notes: list[str]) -> list[tuple[str, str | None]]:
    """The communication overlap the plan costs, as Megatron-LM's flags (all off by default there):
    ``--overlap-grad-reduce`` (with ``--ddp-bucket-size`` where the plan gives one),
    ``--overlap-param-gather`` (needs the distributed optimizer) and ``--tp-comm-overlap`` (needs
    sequence parallelism and Transformer Engine). docs/cluster-model.md."""
    overlaps = plan_overlaps(plan.settings.overlap, plan.settings.launcher, degrees.zero_stage)
    flags: list[tuple[str, str | None]] = []
    if degrees.data > 1 and "grad-reduce" in overlaps:
        flags.append(("--overlap-grad-reduce", None))
        if plan.settings.ddp_bucket_size is not None:
            flags.append(("--ddp-bucket-size", str(plan.settings.ddp_bucket_size)))
    if degrees.data > 1 and "param-gather" in overlaps:
        if degrees.zero_stage >= 1 and "grad-reduce" in overlaps:
            flags.append(("--overlap-param-gather", None))
        else:
            notes.append("the plan overlaps the parameter all-gather, which Megatron-LM runs only with "
                         "--use-distributed-optimizer and --overlap-grad-reduce: left out")
    if degrees.tensor > 1 and "tp-comm" in overlaps:
        if degrees.sequence_parallel:
            flags.append(("--tp-comm-overlap", None))
        else:
            notes.append("the plan overlaps the tensor-parallel collectives, which Megatron-LM does only with "
                         "--sequence-parallel: --tp-comm-overlap left out")
    return flags


def export_megatron(plan: Plan, profile, *, profile_sha256: str | None = None) -> str:
    """The plan as a bash array of Megatron-LM flags.

    Parameters
    ----------
    plan : Plan
    profile : Profile
        The profile the plan was made from (required: layers' roles come from it).
    profile_sha256 : str, optional
        sha256 of the profile file; checked against the plan's.

    Returns
    -------
    str
        A bash snippet defining ``PIPEPLAN_MEGATRON_ARGS``; use
        ``source plan.sh; torchrun ... pretrain_gpt.py "${PIPEPLAN_MEGATRON_ARGS[@]}" ...``.

    Raises
    ------
    BadInputError
        See :func:`megatron_layout`; also a profile that is not the plan's, ZeRO 3 (Megatron-LM's
        distributed optimizer shards only the optimizer state), ZeRO 2 when the whole gradient
        buffer Megatron-LM keeps no longer fits the cap, and interleaved micro-batch counts
        Megatron-LM refuses.

    Notes
    -----
    Flags: ``--tensor-model-parallel-size t``, ``--pipeline-model-parallel-size p``, the layout
    (which sets the virtual stages), ``--sequence-parallel``, ``--use-distributed-optimizer`` (ZeRO 1
    and 2), recomputation, ``--micro-batch-size b`` and ``--global-batch-size b x m x d``: Megatron-LM
    takes ``d`` from the world size (``N / (t p)``) and runs ``global / (b d) = m`` micro-batches per
    replica. O(L).
    """
    if profile is None:
        raise BadInputError(
            "megatron export needs the profile (--profile PATH): Megatron-LM's layout names layers "
            "by role, which only the profile's 'kind' fields give"
        )
    check_profile_matches(plan, profile, profile_sha256)
    degrees = degrees_of(plan)
    layout, num_layers, notes = megatron_layout(plan, profile)
    shape = pipeline_shape(plan)
    lines = ["# " + line for line in header_lines(plan, "Megatron-LM")]
    if plan.schedule not in ("1f1b", "interleaved"):
        runs = "interleaved 1F1B" if shape.virtual_stages > 1 and shape.num_ranks > 1 else "1F1B"
        notes.append(
            f"Megatron-LM runs {runs} with this split; the plan's numbers are for {plan.schedule}"
        )
    notes += tied_weight_notes(plan, profile, "megatron")
    recompute = _recompute_flags(plan, notes) + cpu_offload_flags(plan)
    optimizer = _optimizer_flags(plan, degrees, notes)
    overlap = overlap_flags(plan, degrees, notes)
    if degrees.tensor > 1 and not degrees.sequence_parallel:
        notes.append("the plan has no sequence parallelism: --sequence-parallel is left out")
    if shape.num_ranks == 1:
        notes.append(
            "one pipeline rank: no layout (Megatron-LM runs no pipeline schedule at p = 1"
            + (f"; the plan's {shape.virtual_stages} stages are one model chunk there)" if shape.virtual_stages > 1
               else ")"))
    elif shape.virtual_stages > 1:
        why = interleaved_refusal(shape.num_ranks, plan.num_microbatches)
        if why is not None:
            good = next(k for k in range(plan.num_microbatches, 2 * plan.num_microbatches + shape.num_ranks)
                        if interleaved_refusal(shape.num_ranks, k) is None)
            raise BadInputError(
                f"plan: Megatron-LM's interleaved schedule refuses {plan.num_microbatches} micro-batches on "
                f"{shape.num_ranks} ranks ({why}): re-plan with a global batch of {good} x the micro-batch size "
                f"x d (or any micro-batch count it accepts), or with --schedule 1f1b"
            )
        notes.append(
            f"the layout sets {shape.virtual_stages} virtual stages per rank; Megatron-LM refuses "
            f"--num-virtual-stages-per-pipeline-rank beside it"
        )
    lines.append("# " + degree_line(degrees))
    lines += [f"# note: {note}" for note in notes]
    lines.append("# Usage: source this file, then pass \"${PIPEPLAN_MEGATRON_ARGS[@]}\" to pretrain_gpt.py on "
                 f"{degrees.num_gpus} GPUs (Megatron-LM takes d = {degrees.data} from the world size).")
    flags: list[tuple[str, str | None]] = [
        ("--tensor-model-parallel-size", str(degrees.tensor)),
        ("--pipeline-model-parallel-size", str(shape.num_ranks)),
    ]
    if shape.num_ranks > 1:
        flags.append(("--pipeline-model-parallel-layout", layout))
    flags.append(("--num-layers", str(num_layers)))
    if degrees.sequence_parallel:
        flags.append(("--sequence-parallel", None))
    if degrees.context > 1:
        # The ring exchange the plan costs is Megatron-core's default (cp_comm_type "p2p").
        flags += [("--context-parallel-size", str(degrees.context)), ("--cp-comm-type", "p2p")]
    flags += optimizer + recompute + _expert_flags(plan, profile) + precision_flags(plan)
    flags += overlap
    flags += [
        ("--micro-batch-size", str(degrees.microbatch_size)),
        ("--global-batch-size", str(degrees.global_batch)),
    ]
    if profile.sequence_length:
        # The sequence the plan's costs and memory were profiled at (Megatron-LM has no default).
        flags.append(("--seq-length", str(profile.sequence_length)))
    # The profile's training precision: Megatron-LM trains in fp32 without one of these.
    precision = {"bf16": "--bf16", "fp16": "--fp16"}.get(getattr(profile, "dtype", None))
    if precision:
        flags.append((precision, None))
    if precision == "--bf16" and plan.settings.optimizer == "adam":
        # The plan keeps 16-bit gradients; Megatron-LM keeps fp32 main gradients for bf16 unless
        # told (megatron/training/arguments.py: accumulate_allreduce_grads_in_fp32).
        flags.append(("--grad-reduce-in-bf16", None))
    lines.append("PIPEPLAN_MEGATRON_ARGS=(")
    lines += [f"    {flag}" + ("" if value is None else " " + " ".join(shlex.quote(v) for v in
                                                         ((value,) if isinstance(value, str) else value)))
              for flag, value in flags]
    lines.append(")")
    return "\n".join(lines) + "\n"
