"""The cluster plan from the search's trials: the winner's plan with its layout, memory by part,
the iteration's parts and notes; the runners-up per layout and why they lost; what would fit
when nothing does. Pure: trials in, a :class:`pipeplan.formats.plan.Plan` (or a message) out.
"""

from __future__ import annotations

import math
from typing import Optional

from pipeplan.cluster.context import context_buffer_bytes, context_notes, ranks_with_buffers
from pipeplan.cluster.experts import expert_note, moe_stage_memory, moe_static_bytes, view_expert_bytes
from pipeplan.cluster.iteration import model_flops_utilization, tokens_per_s_per_gpu
from pipeplan.cluster.memory import job_fixed_bytes, job_fragmentation, job_memory, trial_layout
from pipeplan.cluster.profile_view import DegreeView
from pipeplan.errors import BadInputError
from pipeplan.facts.gpus import get_gpu
from pipeplan.facts.training_state import precision_of
from pipeplan.formats.plan import Alternative, Parallelism, Plan, PlanSettings, ReserveParts
from pipeplan.plan.assemble import plan_cost_model, stage_state_memory
from pipeplan.quantities import format_bytes

__all__ = ["assemble_cluster_plan", "infeasible_message", "trial_reason", "hbm_bytes_per_s", "peak_flops_per_s"]


def _gpu_figure(profile, cluster, key: str):
    gpu = (profile.measurement or {}).get("gpu") or {}
    if gpu.get("name") == cluster.gpu and key in gpu:
        return gpu[key]
    try:
        return getattr(get_gpu(cluster.gpu), key)
    except BadInputError:
        return gpu.get(key)


def hbm_bytes_per_s(profile, cluster) -> Optional[float]:
    """The cluster GPU's memory bandwidth: from the GPU table, else the profile's GPU; None if unknown."""
    value = _gpu_figure(profile, cluster, "hbm_bytes_per_s")
    return None if value is None else float(value)


def peak_flops_per_s(profile, cluster) -> Optional[float]:
    """The cluster GPU's dense peak in the profile's dtype; None if unknown."""
    flops = _gpu_figure(profile, cluster, "peak_flops") or {}
    value = flops.get(profile.dtype)
    return None if value is None else float(value)


def trial_reason(trial) -> str:
    """Why a trial lost; an infeasible one's full message is worked out here, on first use."""
    explain = trial.extras.pop("explain", None) if trial.status == "infeasible" else None
    if explain is not None:
        trial.reason = f"infeasible: {explain().splitlines()[0]}"
    return trial.reason


def infeasible_message(trials, settings: PlanSettings, cluster, usable: int, cap: int, total_state_bytes: float,
                        needs=(math.inf, None, 0)) -> str:
    """What would fit: the least per-GPU memory the state needs, and a GPU count it could fit in."""
    G = cluster.gpus_per_node
    gpus = max(1, math.ceil(total_state_bytes / max(usable, 1)))
    gpus = gpus if gpus <= G else math.ceil(gpus / G) * G
    least = min((t.extras.get("state_per_gpu", math.inf) for t in trials), default=math.inf)
    planned = sorted({trial_reason(t) for t in trials if t.status == "infeasible"})
    fixed = job_fixed_bytes(cluster, settings.launcher, (1, 1, 1)).fixed_bytes
    share = job_fragmentation(cluster, settings.launcher)
    lines = [f"nothing fits {format_bytes(cap)} per GPU ({format_bytes(usable)} plannable after the "
             f"{format_bytes(fixed)} reserve (CUDA context, workspaces; NCCL buffers per layout on top) and "
             f"{share:.0%} for fragmentation) on {settings.num_gpus} GPUs of {cluster.name}"]
    if math.isfinite(least):
        lines.append(f"the training state alone needs at least {format_bytes(least)} per GPU in the best layout "
                     f"tried; fully sharded (ZeRO 3) it fits only from about {gpus} GPUs (activations not counted)")
    peak, key, zero = needs
    if key is not None and math.isfinite(peak):
        d, t, p, _, e = key
        planned_cap = math.ceil(peak) + job_memory(peak, cluster, settings.launcher, (d, t, p, 1, e)).total_bytes
        experts = f" E={e}" if settings.expert_parallel is not None or e > 1 else ""
        lines.append(f"a cap of {format_bytes(planned_cap)} per GPU fits d={d} t={t} p={p}{experts} ZeRO {zero} "
                     f"without recomputation")
    elif planned:
        lines.append(f"with the state fitting, {planned[0]}")
    return "; ".join(lines)


def _layout_rank(trial):
    # Planned by their time and pruned by their bound, together: a layout shows a planned time only
    # where none of its pruned trials could be faster, so that it is the layout's best; then the
    # rest (infeasible, state over the cap).
    return ((0, trial.parts.iteration_ms, 0, trial.order) if trial.status == "planned" else
            (0, trial.lower_bound_ms, 1, trial.order) if trial.status == "pruned" else (1, 0.0, 0, trial.order))


def _shown(trials):
    """The trial that stands for a set of trials (a layout's): the best by :func:`_layout_rank`."""
    return min(trials, key=_layout_rank)


def _row(trial, best, default_microbatch: int, mfu, label: Optional[str] = None) -> Alternative:
    """One runner-up (or ``--compare``) row: ``trial``'s plan, or why it has none, against ``best``."""
    plan = trial.plan if trial.status == "planned" else None
    if trial is best:
        reason = "the winner"
    elif plan is not None:
        gap = trial.parts.iteration_ms - best.parts.iteration_ms
        reason = (f"slower by {gap:.1f} ms ({gap / best.parts.iteration_ms:+.1%})" if gap >= 0 else
                  f"faster by {-gap:.1f} ms ({gap / best.parts.iteration_ms:+.1%}), outside the layouts searched")
    else:
        reason = trial_reason(trial)
    return Alternative(
        schedule=plan.schedule if plan else "-", virtual_stages=plan.virtual_stages if plan else 1,
        microbatch_size=plan.microbatch_size if plan else default_microbatch,
        recompute=("selective" if trial.family == "selective" else
                   ("some" if plan and any(s.recompute for s in plan.stages) else "none")),
        iteration_ms=round(trial.parts.iteration_ms, 6) if plan else None,
        lower_bound_ms=round(trial.lower_bound_ms, 6) if trial.status == "pruned" else None,
        peak_memory_bytes=max(r.peak_memory_bytes for r in plan.ranks) if plan and plan.ranks else None,
        reason=f"d={trial.data} t={trial.tensor} p={trial.pipeline}" + (f" E={trial.expert}" if trial.moe else "")
               + (f" C={trial.context}" if trial.context > 1 else "") + f" ZeRO {trial.zero_stage}: {reason}",
        data=trial.data, tensor=trial.tensor, pipeline=trial.pipeline, expert=trial.expert if trial.moe else None,
        zero_stage=trial.zero_stage, label=label,
        model_flops_utilization=None if plan is None or mfu is None else round(mfu(trial.parts.iteration_ms), 6),
    )


def _alternatives(best, trials, default_microbatch: int, runners, mfu) -> list[Alternative]:
    """The runners-up planned in full (``runners``: label, the layout's trials, its exact best or
    None where none fits), in the order of their times, then the best trial of each other
    (d, t, p), and why it lost."""
    by_key: dict = {}
    for trial in trials:
        by_key.setdefault(trial.key, []).append(trial)
    listed = {best.key} | {group[0].key for _, group, _ in runners}
    exact = sorted(((_layout_rank(found or _shown(group)), label, found or _shown(group))
                    for label, group, found in runners), key=lambda item: item[0])
    out = [_row(trial, best, default_microbatch, mfu, label) for _, label, trial in exact]
    for key in sorted((k for k in by_key if k not in listed), key=lambda k: _layout_rank(_shown(by_key[k]))):
        out.append(_row(_shown(by_key[key]), best, default_microbatch, mfu))
    return out


def _mfu_of(profile, settings: PlanSettings, cluster):
    """Iteration ms -> MFU on this request's GPUs, or None where the model FLOPs or the peak are unknown."""
    flops_per_token = (profile.measurement or {}).get("model_flops_per_token")
    peak = peak_flops_per_s(profile, cluster)
    if not (profile.sequence_length and flops_per_token and peak):
        return None
    return lambda iteration_ms: model_flops_utilization(
        flops_per_token * settings.global_batch * profile.sequence_length, iteration_ms, settings.num_gpus, peak)


def _predicted(plan, parts, best, profile, settings, cluster):
    """The winner's predicted record with the cluster's parts, and its MFU function (or None)."""
    c = best.context
    iteration_ms = parts.iteration_ms
    G = settings.global_batch
    predicted = plan.predicted.model_copy(update={
        "iteration_ms": round(iteration_ms, 6),
        "samples_per_second": round(G / (iteration_ms / 1e3), 6),
        "compute_ms": round(parts.compute_ms, 6),
        "tensor_parallel_ms": round(parts.tensor_parallel_ms, 6),
        "transfer_ms": round(parts.pipeline_transfer_ms, 6),
        "bubble_ms": round(parts.bubble_ms - (plan.predicted.overhead_ms or 0.0), 6),
        "data_parallel_ms": round(parts.data_parallel_ms, 6),
        "optimizer_ms": round(parts.optimizer_ms, 6),
        **({"context_exchange_ms": round(parts.context_exchange_ms, 6)} if c > 1 else {}),
        **({"cpu_offload_ms": round(parts.cpu_offload_ms, 6)} if settings.cpu_offload_layers else {}),
    })
    if best.moe:
        predicted = predicted.model_copy(update={
            name: round(getattr(parts, name), 6)
            for name in ("expert_dispatch_ms", "expert_compute_ms", "expert_combine_ms", "shared_expert_ms")})
    if settings.precision is not None:
        predicted = predicted.model_copy(update={"quantize_ms": round(parts.quantize_ms, 6)})
    predicted = predicted.model_copy(update={
        name: round(best.extras[name], 6) for name in ("gradient_reduce_ms", "param_gather_ms",
                                                       "data_parallel_hidden_ms", "tensor_parallel_hidden_ms",
                                                       "expert_all_to_all_hidden_ms")
        if best.extras.get(name) is not None})
    if parts.host_wait_ms > 0:
        predicted = predicted.model_copy(update={"host_wait_ms": round(parts.host_wait_ms, 6)})
    if profile.sequence_length:
        predicted = predicted.model_copy(update={"tokens_per_second_per_gpu": round(
            tokens_per_s_per_gpu(G, profile.sequence_length, iteration_ms, settings.num_gpus), 6)})
    mfu = _mfu_of(profile, settings, cluster)
    if mfu is not None:
        predicted = predicted.model_copy(update={"model_flops_utilization": round(mfu(iteration_ms), 6)})
    return predicted, mfu


def assemble_cluster_plan(best, trials, profile, settings: PlanSettings, view: DegreeView, cluster, cap: int,
                          state, runners=(), compared=()) -> Plan:
    """The winner's plan with the cluster's parts; ``runners`` (label, a layout's trials, its exact
    best or None) lead the runners-up, ``compared`` (text, exact best or None, trials) are the
    ``--compare`` layouts."""
    plan, parts = best.plan, best.parts
    d, t, p = best.data, best.tensor, best.pipeline
    # The selective family's view bakes the attention core's recomputation into every unit's
    # costs, so its pipeline plan says "none"; the plan must say what runs (every stage selective),
    # or exports and doctor would drop --recompute-granularity selective.
    selective = best.family == "selective"
    c = best.context
    # The ring's received KV chunks (context parallelism), at the plan's micro-batch size.
    buffers = context_buffer_bytes(profile, plan.microbatch_size, t, c)
    stages = []
    for stage in plan.stages:
        if selective:
            stage = stage.model_copy(update={"recompute": True, "recompute_granularity": "selective",
                                             "selective_activation_bytes": stage.activation_bytes})
        # The replica's plan carries the trial's ZeRO stage and d: its cost model is the plan's.
        memory = stage_state_memory(plan, stage, profile.dtype_bytes)
        static = math.ceil(plan_cost_model(plan, profile.dtype_bytes).static_bytes_per_param_byte * stage.param_bytes)
        update = {}
        if best.moe:
            # The dense part as ZeRO shards it over d, the routed experts' over EDP (the cost model's).
            experts = view_expert_bytes(view, stage.layers)
            memory, expert_state = moe_stage_memory(stage.param_bytes, experts, profile.dtype_bytes, state,
                                                    best.zero_stage, d, best.expert_data)
            static = math.ceil(moe_static_bytes(settings.optimizer, profile.dtype_bytes, best.zero_stage, d,
                                                best.expert_data, stage.param_bytes, experts, *precision_of(settings)))
            update["expert_state_bytes"] = int(expert_state)
        update.update({"context_buffer_bytes": buffers, "peak_memory_bytes": stage.peak_memory_bytes + buffers} if c > 1 else {})
        stages.append(stage.model_copy(update={
            "weight_bytes": memory.weight_bytes + (best.extras["gathered"] if best.zero_stage == 3 else 0),
            "gradient_bytes": memory.gradient_bytes, "optimizer_bytes": memory.optimizer_bytes,
            "quantized_weight_bytes": memory.quantized_weight_bytes or None,
            "peak_activation_bytes": max(0, stage.peak_memory_bytes - static) + buffers, **update,
        }))
    predicted, mfu = _predicted(plan, parts, best, profile, settings, cluster)
    peak_rank = buffers + (max(r.peak_memory_bytes for r in plan.ranks) if plan.ranks else
                           max(s.peak_memory_bytes for s in plan.stages))
    fast_link, domain_text = _fast_link(cluster, settings.num_gpus)
    link_text = {"inter": "the network", "intra": fast_link, "local": "no link"}[best.extras["link"]]
    notes = [note.replace(", recompute none", ", recompute selective on every stage") if selective else note
             for note in plan.notes] + [
        f"layout d={d} x t={t} x p={p} on {cluster.name} ({cluster.gpus_per_node} GPUs per node{domain_text}), "
        f"ranks in Megatron's order (tensor, data, pipeline); pipeline transfers on {link_text}",
        _sync_note(settings, best) if d > 1 else "no data parallelism: no gradient sync",
    ]
    notes = context_notes(notes, len(plan.notes), profile, (d, t, p, c), cluster.domain_gpus_for(settings.num_gpus))
    if best.moe:
        notes.append(expert_note(profile, view.experts, best.expert_data, fast_link))
    if hbm_bytes_per_s(profile, cluster) is None:
        notes.append(f"optimizer step not timed: no HBM bandwidth known for {cluster.gpu}")
    default_microbatch = settings.microbatch_size or min(profile.microbatch_sizes)
    out_settings = settings.model_copy(update={
        "stages": p, "search_stages": True if settings.stages is None else None,
        "bandwidth_bytes_per_s": plan.settings.bandwidth_bytes_per_s,
    })
    return plan.model_copy(update={
        "schema_version": 2, "settings": out_settings, "stages": stages, "predicted": predicted,
        "alternatives": _alternatives(best, trials, default_microbatch, runners, mfu), "notes": notes,
        "comparisons": [_row(found or _shown(group), best, default_microbatch, mfu, text)
                        for text, found, group in compared] or None,
        "parallelism": Parallelism(num_gpus=settings.num_gpus, data=d, tensor=t, pipeline=p,
                                   virtual_stages=plan.virtual_stages, zero_stage=best.zero_stage,
                                   sequence_parallel=bool(t > 1 and _sequence_parallel(profile)),
                                   gpus_per_node=cluster.gpus_per_node,
                                   expert=best.expert if best.moe else None,
                                   expert_tensor=best.expert_tensor if best.moe else None,
                                   context=c if c > 1 else None),
        **({"ranks": ranks_with_buffers(plan.ranks, buffers)} if c > 1 else {}),
        **_reserve(job_memory(peak_rank, cluster, settings.launcher, trial_layout(best))),
    })


def _reserve(job) -> dict:
    """The plan's ``reserve_bytes`` and its parts (cluster.memory.job_memory)."""
    parts = ReserveParts(cuda_context_bytes=job.cuda_context_bytes, cublas_workspace_bytes=job.cublas_workspace_bytes,
                         nccl_buffer_bytes=job.nccl_buffer_bytes, fragmentation_bytes=job.fragmentation_bytes,
                         spec_reserve_bytes=job.fixed_override_bytes)
    return {"reserve_bytes": job.total_bytes, "reserve_parts": parts}


def _fast_link(cluster, num_gpus: int) -> tuple[str, str]:
    """What the plan's notes call the fast link, and the layout note's words on the NVLink domain
    (none where the domain is the node, so that those plans keep their words)."""
    if cluster.nvlink_domain_gpus == cluster.gpus_per_node:
        return "the intra-node link", ""
    segment = cluster.domain_gpus_for(num_gpus)
    return ("NVLink (inside an NVLink domain)",
            f"; NVLink domains of {cluster.nvlink_domain_gpus}, this job's in segments of {segment} GPUs")


def _sequence_parallel(profile) -> bool:
    return any(getattr(c, "sequence_parallel", None) for layer in profile.layers for c in layer.costs)


def _sync_note(settings: PlanSettings, best) -> str:
    """The plan's note on how much of the data-parallel sync is hidden (the words of plans before
    the overlaps were modelled where none is)."""
    legacy = f"{int(round(100 * (settings.data_parallel_overlap or 0)))}%"
    overlaps = best.extras.get("overlaps")
    if not overlaps:
        return f"data-parallel sync: {legacy} assumed hidden behind compute (--data-parallel-overlap)"
    source = "--overlap" if settings.overlap is not None else f"the {settings.launcher} launcher's defaults"
    return (f"data-parallel sync: {', '.join(overlaps)} overlapped with compute ({source}; docs/cluster-model.md, "
            f"\"Overlap as each launcher runs it\"), {best.extras['data_parallel_hidden_ms']:.1f} ms of the last "
            f"rank's sync hidden" + (f", {legacy} more assumed hidden (--data-parallel-overlap)"
                                    if settings.data_parallel_overlap else ""))
