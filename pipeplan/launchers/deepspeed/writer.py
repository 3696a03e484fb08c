"""DeepSpeed: a plan's stage boundaries as ``PipelineModule.parts``, its topology, and the ds_config keys.

DeepSpeed's ``PipelineModule`` runs one stage per rank over a flat list of layers, layers
``parts[s]`` to ``parts[s + 1] - 1`` on stage ``s``. Its ``partition_method`` ('uniform',
'parameters', 'type:regex') cannot take given boundaries, so docs/launchers.md shows a small
subclass that sets ``self.parts`` from this export. The layer list must follow ``layers`` here
(stage after stage), which is the profile's order for chains.

Degrees: ``topology`` is ``PipeModelDataParallelTopology(num_pp=p, num_mp=t, num_dp=d)`` (ranks
model-innermost, then data, then pipe: Megatron's order, which the plan uses); ``ds_config`` has
``zero_optimization.stage`` and ``train_batch_size = b x m x d``. What DeepSpeed cannot combine:
its ``PipelineEngine`` asserts ``zero_optimization_stage() < ZeroStageEnum.gradients`` ("ZeRO-2 and
ZeRO-3 are incompatible with pipeline parallelism", deepspeed/runtime/pipe/engine.py, 0.19.8), so
ZeRO 2-3 with ``p > 1`` is refused; it runs one stage per rank (no virtual stages); it does not
split a layer over ``t`` GPUs itself (the layers must be tensor-parallel, e.g. Megatron-DeepSpeed's).
"""

from __future__ import annotations

from pipeplan.errors import BadInputError
from pipeplan.launchers.common import compact_json, header_lines, pipeline_shape, precision_notes, tied_weight_notes
from pipeplan.launchers.registry import LAUNCHERS, plan_overlaps
from pipeplan.launchers.degrees import degree_line, degrees_of, recompute_of
from pipeplan.launchers.common import compact_json, header_lines, pipeline_shape, precision_notes, tied_weight_notes
from pipeplan.launchers.registry import LAUNCHERS
from pipeplan.launchers.degrees import degree_line, degrees_of, recompute_of
from pipeplan.formats.plan import Plan

__all__ = ["export_deepspeed", "DEEPSPEED_PIPELINE_ZERO_RULE"]

#: DeepSpeed 0.19.8's PipelineEngine.__init__ assertion, verbatim.
DEEPSPEED_PIPELINE_ZERO_RULE = "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"


def _zero(degrees, notes: list[str]) -> dict:
    zero = degrees.zero_stage
    if zero >= 2 and degrees.pipeline > 1:
        raise BadInputError(
            f"plan: ZeRO {zero} with p={degrees.pipeline} pipeline ranks: DeepSpeed's PipelineEngine asserts "
            f"zero_optimization.stage < 2 ({DEEPSPEED_PIPELINE_ZERO_RULE!r}, deepspeed/runtime/pipe/engine.py); "
            f"re-plan with --zero 1 (or 0) for DeepSpeed, or with --stages 1 for ZeRO {zero} without a pipeline")
    if zero >= 2:
        notes.append(f"p = 1 with ZeRO {zero}: give deepspeed.initialize the plain model, not a PipelineModule "
                     f"(its PipelineEngine refuses ZeRO 2-3: {DEEPSPEED_PIPELINE_ZERO_RULE})")
    return {"stage": zero}


def overlap_keys(plan: Plan, degrees, notes: list[str]) -> dict:
    """The plan's overlap as ``zero_optimization`` keys: ``overlap_comm`` (the gradient reduce behind
    the backward; DeepSpeed's default is true at stage 3 only) and, at stage 3 without the prefetch,
    ``stage3_prefetch_bucket_size = 0``. Written only where they differ from DeepSpeed's defaults.
    The PipelineEngine reduces after the last backward (``_exec_reduce_grads``): nothing overlaps there."""
    overlaps = plan_overlaps(plan.settings.overlap, plan.settings.launcher, degrees.zero_stage)
    zero, out = degrees.zero_stage, {}
    if degrees.data == 1 or (plan.settings.overlap is None and plan.settings.launcher != "deepspeed"):
        return out  # a plan that assumed no launcher's overlap: DeepSpeed's defaults (an upper bound)
    if degrees.pipeline > 1 or zero == 0:
        if overlaps & {"grad-reduce", "param-gather"}:
            notes.append("the plan overlaps the data-parallel sync, which DeepSpeed runs after the last backward "
                         "here (PipelineEngine / ZeRO 0): expect a slower run than planned")
        return out
    grad = "grad-reduce" in overlaps
    if grad != (zero == 3):
        out["overlap_comm"] = grad
    if zero == 3 and "param-gather" not in overlaps:
        out["stage3_prefetch_bucket_size"] = 0
    if zero < 3 and "param-gather" in overlaps:
        notes.append("the plan overlaps the updated weights' all-gather, which DeepSpeed's ZeRO 1/2 runs after the "
                     "step: expect a slower run than planned")
    return out


def _activation_checkpoint_interval(plan: Plan, notes: list[str]) -> int:
    recompute = recompute_of(plan)
    if recompute.mode == "none":
        return 0
    if recompute.mode == "selective":
        notes.append("the plan recomputes the attention core (selective); PipelineModule has no such setting "
                     "(activation_checkpoint_interval checkpoints whole layers): recompute it inside your layers "
                     "(Megatron-DeepSpeed: --recompute-granularity selective), else DeepSpeed holds more than planned")
        return 0
    if recompute.mixed:
        notes.append(f"the plan recomputes stages {list(recompute.stages)} only; PipelineModule's "
                     f"activation_checkpoint_interval applies to every stage (slower than planned, never more memory)")
    return 1  # checkpoint each layer: each keeps its input and rebuilds its activations alone


def _moe(plan: Plan, profile, notes: list[str]) -> dict | None:
    """A mixture-of-experts plan's experts as DeepSpeed-MoE's layer arguments
    (``deepspeed.moe.layer.MoE(hidden_size, expert, num_experts, ep_size, k, ...,
    enable_expert_tensor_parallelism)``): DeepSpeed keeps them in the model code, not the
    ds_config, and builds its expert and expert-data groups from ``ep_size``
    (``deepspeed.utils.groups._create_expert_and_data_parallel``)."""
    par, experts = plan.parallelism, getattr(profile, "experts", None)
    if par is None or par.expert is None or experts is None:
        return None
    etp = par.expert_tensor or 1
    if etp not in (1, par.tensor):
        raise BadInputError(f"plan: expert-tensor parallelism {etp} with t = {par.tensor}: DeepSpeed-MoE shards "
                            f"experts over the whole tensor-parallel group or not at all "
                            f"(enable_expert_tensor_parallelism); re-plan with --expert-tensor-parallel 1 or "
                            f"{par.tensor}")
    notes.append(f"experts: build each MoE layer as deepspeed.moe.layer.MoE(..., num_experts={experts.num_experts}, "
                 f"ep_size={par.expert}, k={experts.experts_per_token}) (the 'moe' entry): each GPU holds "
                 f"{experts.num_experts // par.expert} experts; the ds_config has no expert-parallel key")
    return {"num_experts": experts.num_experts, "ep_size": par.expert, "k": experts.experts_per_token,
            "enable_expert_tensor_parallelism": etp > 1}


def export_deepspeed(plan: Plan, profile=None) -> str:
    """The plan as JSON: ``layers``, ``parts``, ``topology``, ``pipeline_module`` and a ``ds_config`` fragment.

    Parameters
    ----------
    plan : Plan
    profile : Profile, optional
        The plan's profile: its tied weights get a note (build them with ``TiedLayerSpec``).

    Returns
    -------
    str
        JSON with ``parts`` (S + 1 layer indices for S stages), ``layers`` (names in that
        indexing), ``num_stages``, ``topology`` (``num_pp``, ``num_mp``, ``num_dp`` for
        ``PipeModelDataParallelTopology``), ``pipeline_module`` (``activation_checkpoint_interval``)
        and ``ds_config`` (``train_micro_batch_size_per_gpu`` = b, ``gradient_accumulation_steps``
        = m, ``train_batch_size`` = b x m x d, ``zero_optimization.stage``).

    Raises
    ------
    BadInputError
        If the plan puts more than one stage on a rank (DeepSpeed's pipeline engine runs one), or
        uses ZeRO 2-3 with more than one pipeline rank (the engine asserts ZeRO < 2).

    Notes
    -----
    DeepSpeed checks ``train_batch_size == train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x`` its data-parallel world size (``d``, from the topology's grid)
    and runs ``gradient_accumulation_steps`` micro-batches through the pipeline per step. O(L).
    """
    if plan.parallelism is not None and (plan.parallelism.context or 1) > 1:
        raise BadInputError(
            f"plan: context parallelism C={plan.parallelism.context}: DeepSpeed's PipeModelDataParallelTopology "
            f"has no context axis (axes pipe, data, model) and its sequence parallelism is Ulysses' all-to-all of "
            f"heads, not Megatron's KV ring this plan costs: re-plan without --context-parallel for DeepSpeed, or "
            f"export for megatron or torchtitan")
    shape = pipeline_shape(plan)
    degrees = degrees_of(plan)
    if shape.virtual_stages != 1:
        raise BadInputError(
            f"plan: {shape.virtual_stages} stages per rank; DeepSpeed's PipelineModule runs one "
            f"stage per rank: re-plan with --schedule 1f1b for DeepSpeed"
        )
    parts = [0]
    for stage in shape.stages:
        parts.append(parts[-1] + len(stage.layers))
    notes = list(header_lines(plan, "DeepSpeed")) + [degree_line(degrees)]
    if plan.schedule not in LAUNCHERS["deepspeed"].schedules:
        notes.append(f"DeepSpeed runs its own 1F1B-like TrainSchedule; the plan's numbers are for {plan.schedule}")
    notes += precision_notes(plan, "DeepSpeed")
    zero = _zero(degrees, notes)
    interval = _activation_checkpoint_interval(plan, notes)
    notes += tied_weight_notes(plan, profile, "deepspeed")
    if degrees.tensor > 1:
        notes.append(
            f"t = {degrees.tensor}: DeepSpeed places ranks by the topology but does not split layers itself; the "
            f"layers must be tensor-parallel over the topology's 'model' axis (e.g. Megatron-DeepSpeed's)"
            + (", with sequence parallelism" if degrees.sequence_parallel else ""))
    moe = _moe(plan, profile, notes)
    data = {
        "pipeplan": {"launcher": "deepspeed", "model": plan.profile.model,
                     "profile_sha256": plan.profile.sha256, "notes": notes},
        "num_stages": shape.num_ranks,
        "parts": parts,
        "layers": shape.layer_order,
        "topology": {"num_pp": degrees.pipeline, "num_mp": degrees.tensor, "num_dp": degrees.data},
        "pipeline_module": {"activation_checkpoint_interval": interval},
        "ds_config": {
            "train_micro_batch_size_per_gpu": degrees.microbatch_size,
            "gradient_accumulation_steps": degrees.num_microbatches,
            "train_batch_size": degrees.global_batch,
            "zero_optimization": {**zero, **overlap_keys(plan, degrees, notes)},
        },
    }
    if moe is not None:
        data["moe"] = moe
    return compact_json(data) + "\n"
