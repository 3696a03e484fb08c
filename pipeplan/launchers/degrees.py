"""A plan's degrees, batch sizes and recomputation, in the terms every launcher export needs.

A plan made with ``--gpus`` records ``parallelism``: ``d`` data-parallel replicas of a pipeline of
``p`` ranks, each rank ``t`` tensor-parallel GPUs (``N = d x t x p``), ``v`` stages per rank, a
ZeRO stage and sequence parallelism. Its ``num_microbatches`` ``m`` is per replica, so the global
batch is ``b x m x d`` (``settings.global_batch``). A plan without ``parallelism`` is one pipeline:
``d = t = 1``, ZeRO 0.

Launchers shard less than some ZeRO stages assume (Megatron-LM's distributed optimizer keeps the
whole gradient buffer; torch's pipelining holds FSDP's unsharded weights and gradients until the
step ends): :func:`unsharded_extra_bytes` says how much more such a launcher holds per GPU, and
:func:`check_fits` refuses the export when that no longer fits the plan's cap.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from pipeplan.errors import BadInputError
from pipeplan.formats.plan import Plan

__all__ = ["Degrees", "degrees_of", "Recompute", "recompute_of", "unsharded_extra_bytes", "check_fits",
           "degree_line"]

_GIB = 2**30


@dataclass(frozen=True)
class Degrees:
    """The layout and batch of a plan, as launchers count them."""

    data: int
    """Data-parallel replicas ``d``."""
    tensor: int
    """Tensor-parallel degree ``t``."""
    pipeline: int
    """Pipeline ranks ``p``."""
    virtual_stages: int
    """Stages per pipeline rank ``v``."""
    zero_stage: int
    """ZeRO stage 0-3 (1 optimizer state, 2 also gradients, 3 also weights, sharded over ``d``)."""
    sequence_parallel: bool
    """Megatron-style sequence parallelism inside the tensor-parallel group."""
    microbatch_size: int
    """Samples per micro-batch ``b``."""
    num_microbatches: int
    """Micro-batches per replica per iteration ``m``."""
    gpus_per_node: int | None
    """From the plan's cluster spec (None without one)."""
    from_cluster_plan: bool
    """Whether the plan records ``parallelism`` (made with ``--gpus``)."""
    context: int = 1
    """Context-parallel degree ``C`` (each sequence split over ``C`` GPUs; 1: none)."""

    @property
    def num_gpus(self) -> int:
        """World size ``d x t x p`` (x ``C``)."""
        return self.data * self.tensor * self.pipeline * self.context

    @property
    def replica_batch(self) -> int:
        """Samples per replica per iteration, ``b x m``."""
        return self.microbatch_size * self.num_microbatches

    @property
    def global_batch(self) -> int:
        """Samples per iteration over all replicas, ``b x m x d``."""
        return self.replica_batch * self.data


def degrees_of(plan: Plan) -> Degrees:
    """Read a plan's degrees (d = t = 1, ZeRO 0 for a plan without ``parallelism``).

    Raises
    ------
    BadInputError
        If ``parallelism`` disagrees with the stages, or the global batch is not ``b x m x d``.

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> plan = NS(parallelism=None, settings=NS(stages=4, global_batch=32, cluster=None),
    ...           virtual_stages=1, microbatch_size=1, num_microbatches=32)
    >>> degrees_of(plan).global_batch
    32
    """
    par = plan.parallelism
    if par is None:
        return Degrees(1, 1, plan.settings.stages, plan.virtual_stages, 0, False, plan.microbatch_size,
                       plan.num_microbatches, None, False)
    if par.pipeline != plan.settings.stages or par.virtual_stages != plan.virtual_stages:
        raise BadInputError(
            f"plan: parallelism.pipeline {par.pipeline} x virtual_stages {par.virtual_stages} differs from "
            f"settings.stages {plan.settings.stages} x virtual_stages {plan.virtual_stages}; "
            f"re-create the plan with `pipeplan plan`")
    out = Degrees(par.data, par.tensor, par.pipeline, par.virtual_stages, par.zero_stage, par.sequence_parallel,
                  plan.microbatch_size, plan.num_microbatches, par.gpus_per_node, True, par.context or 1)
    if plan.settings.global_batch is not None and plan.settings.global_batch != out.global_batch:
        raise BadInputError(
            f"plan: settings.global_batch {plan.settings.global_batch} is not micro-batch {out.microbatch_size} x "
            f"{out.num_microbatches} micro-batches x d {out.data} = {out.global_batch}; re-create the plan "
            f"with `pipeplan plan`")
    return out


@dataclass(frozen=True)
class Recompute:
    """What the plan recomputes, and the one setting a launcher applies to every stage."""

    mode: str
    """``none``, ``selective`` (the attention core) or ``full`` (each layer's forward again)."""
    stages: tuple[int, ...]
    """Stages the plan recomputes (empty for ``none``; every stage for a selective cluster plan)."""
    mixed: bool
    """True when the plan recomputes some stages but not all, or both ways: a launcher's one
    setting then recomputes more than the plan (slower, never more memory)."""


def recompute_of(plan: Plan) -> Recompute:
    """The plan's recomputation, folded into one launcher-wide setting.

    ``full`` wins over ``selective`` (it holds less). Read off the stages: a cluster plan whose
    search chose selective recomputation marks every stage so (older cluster plan files made with
    ``--recompute selective`` said it only in their settings).

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> st = [NS(index=0, recompute=True, recompute_granularity=None), NS(index=1, recompute=False,
    ...       recompute_granularity=None)]
    >>> recompute_of(NS(stages=st, settings=NS(recompute="auto"), parallelism=None))
    Recompute(mode='full', stages=(0,), mixed=True)
    """
    stages = sorted(plan.stages, key=lambda s: s.index)
    full = [s.index for s in stages if s.recompute and s.recompute_granularity != "selective"]
    selective = [s.index for s in stages if s.recompute and s.recompute_granularity == "selective"]
    if plan.parallelism is not None and plan.settings.recompute == "selective" and not full:
        # Cluster plan files from before the stages said so (the search baked it into the costs).
        selective = [s.index for s in stages]
    if full:
        return Recompute("full", tuple(sorted(full + selective)), len(full) != len(stages))
    if selective:
        return Recompute("selective", tuple(selective), len(selective) != len(stages))
    return Recompute("none", (), False)


def unsharded_extra_bytes(plan: Plan, *, gradients: bool, weights: bool) -> int:
    """Bytes per GPU a launcher holds beyond the plan when it keeps gradients or weights whole.

    Parameters
    ----------
    plan : Plan
        A cluster plan (stages with ``gradient_bytes`` / ``weight_bytes``).
    gradients : bool
        The launcher keeps each stage's whole gradients (the plan sharded them: ZeRO 2-3).
    weights : bool
        The launcher keeps each stage's whole weights (the plan sharded them: ZeRO 3).

    Returns
    -------
    int
        The largest excess over the pipeline ranks (0 where the plan shards nothing of that kind).

    Notes
    -----
    Whole gradients are ``d x C`` times the shard; whole weights are ``param_bytes`` (the stage's share at
    its tensor-parallel degree). O(S).
    """
    degrees = degrees_of(plan)
    # ZeRO shards over the d x C ranks that hold the same weights (C = 1 without context parallelism).
    d, zero = degrees.data * degrees.context, degrees.zero_stage
    per_rank: dict[int, int] = {}
    for stage in plan.stages:
        extra = 0
        if gradients and zero >= 2 and stage.gradient_bytes is not None:
            extra += stage.gradient_bytes * (d - 1)
        if weights and zero >= 3 and stage.weight_bytes is not None:
            extra += max(0, stage.param_bytes - stage.weight_bytes)
        per_rank[stage.rank] = per_rank.get(stage.rank, 0) + extra
    return max(per_rank.values(), default=0)


def _cap_bytes(plan: Plan) -> int | None:
    """The plan's cap per GPU (its request's rule, :meth:`PlanSettings.cap_bytes`); None if none is known."""
    try:
        cap = plan.settings.cap_bytes()
    except BadInputError:  # a cluster GPU the table does not know, with no cap given
        return None
    return None if math.isinf(cap) else cap


def check_fits(plan: Plan, extra_bytes: int, launcher: str, why: str, fix: str) -> str | None:
    """Refuse when ``extra_bytes`` more per GPU no longer fits the plan's cap; else a note (or None).

    Raises
    ------
    BadInputError
        If the fullest GPU's planned peak plus the reserve plus ``extra_bytes`` is above the cap.
    """
    if extra_bytes <= 0:
        return None
    peak = max((r.peak_memory_bytes for r in plan.ranks), default=max(s.peak_memory_bytes for s in plan.stages))
    total = peak + (plan.reserve_bytes or 0) + extra_bytes
    cap = _cap_bytes(plan)
    text = (f"{launcher} {why}: about {extra_bytes / _GIB:.2f} GiB more per GPU than planned, "
            f"{total / _GIB:.2f} GiB in all")
    if cap is not None and total > cap:
        raise BadInputError(f"plan: {text}, over the {cap / _GIB:.2f} GiB cap; {fix}")
    return text + (f", within the {cap / _GIB:.2f} GiB cap" if cap is not None else "")


def degree_line(degrees: Degrees) -> str:
    """One comment line: the layout and the batch.

    Examples
    --------
    >>> degree_line(Degrees(2, 4, 4, 1, 1, True, 1, 16, 8, True))
    'd=2 x t=4 x p=4 = 32 GPUs, ZeRO 1, sequence parallel; global batch 32 = micro-batch 1 x 16 micro-batches x d 2'
    """
    sp = ", sequence parallel" if degrees.sequence_parallel else ""
    alone = "" if degrees.from_cluster_plan else " (a pipeline-only plan: plan with --gpus for d, t and ZeRO)"
    context = f" x C={degrees.context}" if degrees.context > 1 else ""
    return (f"d={degrees.data} x t={degrees.tensor}{context} x p={degrees.pipeline} = {degrees.num_gpus} GPUs, "
            f"ZeRO {degrees.zero_stage}{sp}; global batch {degrees.global_batch} = micro-batch "
            f"{degrees.microbatch_size} x {degrees.num_microbatches} micro-batches x d {degrees.data}{alone}")
