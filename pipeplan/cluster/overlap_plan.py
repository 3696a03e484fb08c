"""The overlaps of :mod:`pipeplan.cluster.overlap` applied to one trial of the cluster search: which
overlaps a trial runs, each pipeline rank's stages as :class:`StageUnits` (from the pipeline plan
and its simulation), the ranks' exposed syncs and the plan's record of them.
"""

from __future__ import annotations

from pipeplan.cluster.dataparallel import data_parallel_sync, moe_data_parallel_sync
from pipeplan.cluster.overlap import StageUnits, exposed_sync_ms
from pipeplan.cluster.placement import cluster_layout
from pipeplan.cluster.profile_view import DegreeView
from pipeplan.launchers.registry import gradient_bucket_params, launcher_overlaps, plan_overlaps
from pipeplan.formats.plan import PlanSettings

__all__ = ["SYNC_OVERLAPS", "trial_overlaps", "tp_comm_launcher", "view_overlaps", "bound_overlap", "rank_syncs", "rank_stage_units",
           "overlapped_rank_sync", "overlap_parts"]

#: The overlaps that hide part of the data-parallel sync (the rest, tp-comm, is the view's).
SYNC_OVERLAPS = frozenset({"grad-reduce", "param-gather"})


def trial_overlaps(settings: PlanSettings, zero_stage: int) -> frozenset:
    """What a trial overlaps: ``--overlap`` as given, else the launcher's defaults at its ZeRO stage."""
    return plan_overlaps(settings.overlap, settings.launcher, zero_stage)


def tp_comm_launcher(settings: PlanSettings):
    """The launcher whose tensor-parallel overlap the views model (``"megatron"`` without one), or None."""
    overlaps = settings.overlap if settings.overlap is not None else launcher_overlaps(settings.launcher, 1)
    return (settings.launcher or "megatron") if "tp-comm" in overlaps else None


def view_overlaps(settings: PlanSettings) -> dict:
    """The overlaps the views model, as :func:`pipeplan.cluster.context.context_view`'s keywords:
    ``tp_comm`` (:func:`tp_comm_launcher`) and ``moe_a2a`` (``moe-a2a`` given in ``--overlap``; no
    launcher turns it on by default: megatron-core's ``overlap_moe_expert_parallel_comm`` is False)."""
    return {"tp_comm": tp_comm_launcher(settings), "moe_a2a": "moe-a2a" in (settings.overlap or ())}


def bound_overlap(settings: PlanSettings, trial, overlap: float) -> float:
    """The share of the sync a lower bound may take as hidden: all of it where an overlap of the
    sync is modelled (its exposed part needs the split and the schedule), else the legacy share."""
    return 1.0 if trial_overlaps(settings, trial.zero_stage) & SYNC_OVERLAPS else overlap


def rank_syncs(trial, rank_params, rank_experts, m: int, span, cluster, state):
    """Each pipeline rank's whole sync (:class:`DataParallelSync`, nothing hidden)."""
    if not trial.moe:
        return [data_parallel_sync(p, state, trial.zero_stage, span, cluster, m) for p in rank_params]
    layout = cluster_layout(cluster, trial.data, trial.tensor, trial.pipeline)
    expert_span = layout.loose_span(layout.expert_data_group(trial.expert, trial.expert_tensor))
    return [moe_data_parallel_sync(total - expert, expert, state, trial.zero_stage, layout.data_span(), expert_span,
                                   cluster, m) for total, expert in zip(rank_params, rank_experts)]


def rank_stage_units(plan, sim, view: DegreeView, settings: PlanSettings, trial) -> list[list[StageUnits]]:
    """Per pipeline rank, its stages in order as :class:`StageUnits`: each unit's parameters and
    passes at the plan's micro-batch size, the stage's last backward (from the simulation), and its
    gradient buckets (Megatron: buckets of ``bucket_size`` on the first stage only, one bucket per
    later stage or chunk; the other launchers: one per unit)."""
    layers = {layer.name: layer for layer in view.profile.layers}
    dtype_bytes = view.profile.dtype_bytes
    last: dict = {}
    for event in sim.events:
        if event.kind in ("FULL_B", "W") and (event.stage not in last or event.end_ms > last[event.stage][1]):
            last[event.stage] = (event.start_ms, event.end_ms)
    bucket = gradient_bucket_params(settings.launcher, trial.data, settings.ddp_bucket_size)
    out: list[list[StageUnits]] = [[] for _ in range(trial.pipeline)]
    for stage in sorted(plan.stages, key=lambda s: s.index):
        costs = [next(c for c in layers[name].costs if c.microbatch_size == plan.microbatch_size)
                 for name in stage.layers]
        size = bucket if (settings.launcher != "megatron" or stage.index == 0) else None
        out[stage.rank].append(StageUnits(
            params=tuple(layers[name].param_bytes / dtype_bytes for name in stage.layers),
            forward_ms=tuple(c.forward_ms for c in costs), backward_ms=tuple(c.backward_ms for c in costs),
            last_backward=last.get(stage.index, (0.0, 0.0)), bucket_params=size))
    return out


def overlap_parts(parts, split, rank_end, sync, overlap: float, overlaps, tp_hidden_ms,
                  expert_hidden_ms=None) -> dict:
    """The trial's overlap record for the plan (``{}`` where nothing is overlapped): the exposed
    sync of the rank that ends last split into gradient reduce and parameter all-gather, what the
    overlaps hid of that rank's sync, the tensor-parallel collectives hidden and the MoE
    all-to-alls hidden (``moe-a2a``: the critical rank's)."""
    out: dict = {}
    if tp_hidden_ms is not None:
        out["tensor_parallel_hidden_ms"] = tp_hidden_ms
    if expert_hidden_ms is not None:
        out["expert_all_to_all_hidden_ms"] = expert_hidden_ms
    if split is None:
        return out
    last = max(range(len(rank_end)), key=lambda r: (rank_end[r] + sync[r], -r))
    gradient, gather, whole = split[last]
    exposed = parts.data_parallel_ms
    share = gradient / (gradient + gather) if gradient + gather > 0 else 1.0
    out.update(overlaps=sorted(overlaps), gradient_reduce_ms=exposed * share,
               param_gather_ms=exposed * (1 - share), data_parallel_hidden_ms=whole - (1 - overlap) * (gradient + gather))
    return out


def overlapped_rank_sync(plan, sim, view: DegreeView, settings: PlanSettings, trial, overlaps, rank_params,
                         rank_experts, rank_end, span, cluster, state, overlap: float):
    """Each pipeline rank's exposed sync with the trial's overlaps (then ``overlap``, the legacy
    ``--data-parallel-overlap`` share, of what is left hidden too), and per rank (exposed gradient
    reduce, exposed all-gather, the whole sync) for the plan's parts."""
    m = plan.num_microbatches
    syncs = rank_syncs(trial, rank_params, rank_experts, m, span, cluster, state)
    units = rank_stage_units(plan, sim, view, settings, trial)
    split = [exposed_sync_ms(one.gradient_ms, one.weight_gather_ms, trial.zero_stage, overlaps, units[r],
                             rank_end[r], m) for r, one in enumerate(syncs)]
    sync = [(1 - overlap) * (gradient + gather) for gradient, gather in split]
    return sync, [(gradient, gather, one.total_ms) for (gradient, gather), one in zip(split, syncs)]
