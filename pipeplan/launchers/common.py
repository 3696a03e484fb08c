"""What every launcher export needs: the plan's stages in order, their placement, the profile check.

The exporters never re-plan: they restate a plan in a launcher's words. Everything they say
comes from the plan file (and, for launchers that name layers by role, the profile it was made
from, checked by sha256).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipeplan.errors import BadInputError
from pipeplan.formats.plan import Plan, PlanStage
from pipeplan.facts.schedules import SCHEDULE_INFO, SCHEDULES

__all__ = ["precision_notes", 
    "TORCH_SCHEDULE_NAME",
    "PipelineShape",
    "pipeline_shape",
    "check_profile_matches",
    "header_lines",
    "compact_json",
    "tied_weight_notes",
]

#: The name ``torch.distributed.pipelining.schedules.get_schedule_class`` (and torchtitan's
#: ``pipeline_parallel_schedule``) accepts for each pipeplan schedule (from the schedule records).
TORCH_SCHEDULE_NAME = {name: SCHEDULE_INFO[name].torch_name for name in SCHEDULES}


@dataclass(frozen=True)
class PipelineShape:
    """A plan's pipeline, checked: stages in index order and where they run."""

    stages: tuple[PlanStage, ...]
    """Every (virtual) stage, ordered by ``index`` (0, 1, ...): the order data flows through."""
    num_ranks: int
    """Pipeline ranks (GPUs), ``p``."""
    virtual_stages: int
    """Stages per rank, ``v``; ``len(stages) == num_ranks * virtual_stages``."""
    stage_to_rank: tuple[int, ...]
    """``stage_to_rank[s]`` is the rank that runs stage ``s``."""
    v_placement: bool
    """True for the V placement (zbv, dualpipev), False for the loop placement ``s % p``."""

    @property
    def layer_order(self) -> list[str]:
        """Every layer name, stage after stage."""
        return [name for stage in self.stages for name in stage.layers]


def pipeline_shape(plan: Plan) -> PipelineShape:
    """Check a plan's stages and placement, and return them in pipeline order.

    Parameters
    ----------
    plan : Plan

    Returns
    -------
    PipelineShape

    Raises
    ------
    BadInputError
        If the stage indices are not 0..S-1, the stage count is not ranks x virtual stages,
        a layer appears twice, or the ranks differ from the placement torch's schedule class
        uses for the plan's schedule (which the launchers follow).

    Notes
    -----
    O(S + L) for S stages and L layers.
    """
    stages = tuple(sorted(plan.stages, key=lambda s: s.index))
    indices = [s.index for s in stages]
    if indices != list(range(len(stages))):
        raise BadInputError(
            f"plan: stage indices {indices} must be 0..{len(stages) - 1}, each once; "
            f"re-create the plan with `pipeplan plan`"
        )
    p, v = plan.settings.stages, plan.virtual_stages
    if len(stages) != p * v:
        raise BadInputError(
            f"plan: {len(stages)} stages but settings.stages x virtual_stages = {p} x {v} = {p * v}; "
            f"re-create the plan with `pipeplan plan`"
        )
    seen: dict[str, int] = {}
    for stage in stages:
        for name in stage.layers:
            if name in seen:
                raise BadInputError(
                    f"plan: layer {name!r} is in stage {seen[name]} and stage {stage.index}; "
                    f"each layer belongs to one stage"
                )
            seen[name] = stage.index
    v_placement = plan.schedule in SCHEDULE_INFO and SCHEDULE_INFO[plan.schedule].v_placement
    if v_placement:
        expected = [s if s < p else 2 * p - 1 - s for s in range(p * v)]
    else:
        expected = [s % p for s in range(p * v)]
    actual = [s.rank for s in stages]
    if actual != expected:
        style = "V placement (rank r holds stages r and 2p-1-r)" if v_placement else "stage s on rank s % p"
        raise BadInputError(
            f"plan: stage ranks {actual} differ from {expected}, the placement torch's "
            f"{TORCH_SCHEDULE_NAME.get(plan.schedule, plan.schedule)} schedule uses ({style}); "
            f"launchers place stages that way, so re-create the plan with `pipeplan plan`"
        )
    return PipelineShape(stages, p, v, tuple(actual), v_placement)


def check_profile_matches(plan: Plan, profile, profile_sha256: str | None) -> None:
    """Raise unless ``profile`` is the profile the plan was made from.

    Parameters
    ----------
    plan : Plan
    profile : Profile
    profile_sha256 : str or None
        sha256 of the profile file's bytes; None skips the byte check (the names are still
        checked).

    Raises
    ------
    BadInputError
        If the sha256 differs from ``plan.profile.sha256`` or a plan layer is not in the profile.
    """
    if profile_sha256 is not None and profile_sha256 != plan.profile.sha256:
        raise BadInputError(
            f"--profile: its sha256 {profile_sha256[:12]}... differs from the plan's "
            f"{plan.profile.sha256[:12]}... (model {plan.profile.model!r}); give the profile the plan "
            f"was made from, or re-plan with this one"
        )
    names = {layer.name for layer in profile.layers}
    missing = [name for stage in plan.stages for name in stage.layers if name not in names]
    if missing:
        raise BadInputError(
            f"--profile: plan layers {missing[:5]} are not in profile {profile.model!r}; "
            f"give the profile the plan was made from"
        )


#: The Transformer Engine recipe class of each quantized precision (pipeplan.facts.precision).
_TE_RECIPES = {"fp8": "Float8CurrentScaling", "mxfp8": "MXFP8BlockScaling", "nvfp4": "NVFP4BlockScaling"}


def precision_notes(plan, launcher: str) -> list[str]:
    """For a launcher whose config has no precision setting (DeepSpeed, torch): how to run the
    plan's quantized GEMMs, which its time and memory assume (empty for a plan in its dtype)."""
    precision = getattr(plan.settings, "precision", None)
    if precision is None:
        return []
    return [f"the plan's block GEMMs run in {precision} (docs/cost-model.md, 'Precision'); {launcher}'s config "
            f"has no such setting: build them as Transformer Engine modules and run the forward under "
            f"te.autocast / fp8_autocast with recipe {_TE_RECIPES[precision]}"
            + (" and quantized weights (quantized_model_init)" if plan.settings.fp8_param_gather else "")]


def header_lines(plan: Plan, launcher: str) -> list[str]:
    """Comment lines (without the comment marker) saying where an export came from.

    Examples
    --------
    >>> from pipeplan.formats.plan import *
    >>> plan = Plan(schema_version=1, profile=PlanProfileRef(model="m", sha256="ab" * 32),
    ...     settings=PlanSettings(stages=1, global_batch=4), schedule="gpipe", microbatch_size=2,
    ...     num_microbatches=2, stages=[PlanStage(index=0, rank=0, layers=["a"], forward_ms=1,
    ...     backward_ms=2, send_bytes=0, peak_memory_bytes=10)], predicted=Predicted(
    ...     iteration_ms=6, bubble_fraction=0, samples_per_second=666.7, bottleneck_stage=0),
    ...     solver=SolverInfo(method="dp-chain", optimal=True, seconds=0))
    >>> header_lines(plan, "torch")[0]
    'pipeplan export for torch: model m (profile sha256 abababababab...)'
    """
    p = plan.settings.stages
    return [
        f"pipeplan export for {launcher}: model {plan.profile.model} "
        f"(profile sha256 {plan.profile.sha256[:12]}...)",
        f"{len(plan.stages)} stages on {p} ranks ({plan.virtual_stages} per rank), schedule {plan.schedule}, "
        f"{plan.num_microbatches} micro-batches of {plan.microbatch_size}",
        f"predicted: {plan.predicted.samples_per_second:.6g} samples/s, iteration "
        f"{plan.predicted.iteration_ms:.6g} ms, bubble {100 * plan.predicted.bubble_fraction:.3g}%",
    ]


def compact_json(data, indent: int = 2, _level: int = 0) -> str:
    """JSON with objects indented and lists of plain values on one line (easier to read and diff).

    Examples
    --------
    >>> print(compact_json({"parts": [0, 3, 5], "stages": [["a", "b"], ["c"]]}))
    {
      "parts": [0, 3, 5],
      "stages": [
        ["a", "b"],
        ["c"]
      ]
    }
    """
    pad, inner = " " * (indent * _level), " " * (indent * (_level + 1))
    if isinstance(data, dict):
        if not data:
            return "{}"
        items = [f"{inner}{json.dumps(str(k))}: {compact_json(v, indent, _level + 1)}" for k, v in data.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(data, (list, tuple)):
        if all(not isinstance(v, (dict, list, tuple)) for v in data):
            return "[" + ", ".join(json.dumps(v, allow_nan=False) for v in data) + "]"
        return "[\n" + ",\n".join(inner + compact_json(v, indent, _level + 1) for v in data) + "\n" + pad + "]"
    return json.dumps(data, allow_nan=False)


#: What each launcher must do with a weight several stages hold (a tied weight).
_TIED_ADVICE = {
    "megatron": ("Megatron-LM ties the word embeddings and the output layer unless "
                 "--untie-embeddings-and-output-weights is given, and all-reduces that gradient between the "
                 "first and last pipeline stages itself (its embedding group): leave the flag off"),
    "torchtitan": ("torchtitan's stage split keeps a copy per stage and does not sum their gradients: "
                   "all-reduce them over those ranks after each backward, before the optimizer (as "
                   "pipeplan run does), or untie the weights in the model"),
    "deepspeed": ("build the layers that share it with DeepSpeed's TiedLayerSpec (one key for all of them), "
                  "so that PipelineModule all-reduces the tied gradient over the stages that hold it"),
    "torch": ("torch.distributed.pipelining copies it into each stage and does not sum their gradients: "
              "all-reduce them over those ranks after schedule.step() and before the optimizer, as pipeplan "
              "run does (pipeplan.run.gradsync.TiedGrads)"),
}
_UNTIED_MEGATRON = ("the profile's embedding and output head do not share weights: pass "
                    "--untie-embeddings-and-output-weights (Megatron-LM ties them by default)")
#: Megatron-LM's multi-token prediction shares the main model's embedding and output layer itself.
_MTP_MEGATRON = ("a multi-token prediction depth shares it with the main model: Megatron-LM with "
                 "--mtp-num-layers builds the embedding on the MTP's stage too and all-reduces its gradient "
                 "over the embedding group itself (megatron.core.distributed.finalize_model_grads)")


def _embedding_head_tie(layers, kind_of) -> bool:
    """Whether a tie is the token table shared by the embedding and the head (or of layers whose
    roles the profile does not say: taken to be that, as before roles were recorded)."""
    kinds = {kind_of.get(name) for name in layers}
    return None in kinds or {"embedding", "head"} <= kinds


def _ties(profile) -> list[tuple[str, list[str]]]:
    """``(parameter, layers)`` of each tied weight: the profile's ``tied_weights``, or an analytic
    profile's tied embeddings (the embedding and head layers)."""
    if profile.tied_weights:
        return [(tie.name, list(tie.layers)) for tie in profile.tied_weights]
    if (profile.measurement or {}).get("tied_embeddings"):
        layers = [layer.name for layer in profile.layers if layer.kind in ("embedding", "head")]
        if len(layers) >= 2:
            return [("the token embedding", layers)]
    return []


def tied_weight_notes(plan: Plan, profile, launcher: str) -> list[str]:
    """What ``launcher`` must do with each tied weight of ``profile``, where the plan's stages hold it.

    A weight all of whose layers sit in one stage needs nothing; one whose stages share a rank
    needs its copies' gradients summed there; otherwise across the ranks named. Megatron-LM also
    gets told to untie a model whose profile has an embedding and a head but no tie (it ties by
    default), a tie that is not the embedding's with the head (a multi-token prediction depth's)
    is left to Megatron-LM's MTP. No profile, no notes (the plan does not record ties).

    >>> from types import SimpleNamespace as NS
    >>> plan = NS(stages=[NS(index=0, rank=0, layers=["emb", "h0"]), NS(index=1, rank=1, layers=["h1", "head"])])
    >>> profile = NS(tied_weights=[NS(name="emb.weight", layers=["emb", "head"])], measurement=None, layers=[])
    >>> tied_weight_notes(plan, profile, "deepspeed")[0][:68]
    'tied weight emb.weight (layers emb, head): stages 0, 1 on ranks 0, 1'
    """
    if profile is None:
        return []
    ties = _ties(profile)
    kind_of = {layer.name: layer.kind for layer in profile.layers}
    notes = []
    if launcher == "megatron" and {"embedding", "head"} <= set(kind_of.values()) \
            and not any(_embedding_head_tie(layers, kind_of) for _, layers in ties):
        notes.append(_UNTIED_MEGATRON)
    for name, layers in ties:
        held = [stage for stage in plan.stages if set(stage.layers) & set(layers)]
        if len(held) < 2:
            continue
        ranks = sorted({stage.rank for stage in held})
        stages = ", ".join(str(s.index) for s in held)
        advice = _TIED_ADVICE[launcher]
        if launcher == "megatron" and not _embedding_head_tie(layers, kind_of):
            advice = _MTP_MEGATRON
        if len(ranks) > 1:
            what = f"stages {stages} on ranks {', '.join(map(str, ranks))}; {advice}"
        else:
            what = (f"stages {stages}, all on rank {ranks[0]}: sum the copies' gradients there after each "
                    f"backward, before the optimizer (as pipeplan run does)")
        notes.append(f"tied weight {name} (layers {', '.join(layers)}): {what}")
    return notes
