"""Findings on a cluster (``doctor --cluster``): time by parts, MFU, memory per rank by part, and the
best plans for the same GPUs.

:func:`diagnose_on_cluster` is the cluster branch of :func:`pipeplan.doctor.diagnose.diagnose`: it
costs the launcher's layout at its real d x t x p, ZeRO stage and sequence parallelism
(:mod:`pipeplan.doctor.cluster`), flags ranks over the cap by part and by how much (and whether
the launcher's ZeRO setting would fix it), and finds the best plan at the config's own degrees
(what ``--fix`` writes) and, with ``search_layouts``, over every d x t x p of the same GPUs.
"""

from __future__ import annotations

from pipeplan.cluster.profile_view import tensor_degrees
from pipeplan.doctor.findings import (GAP_WARNING, Finding, gap_findings, split_setting, time_findings,
                                     zero_setting)
from pipeplan.doctor.cluster import LAUNCHER_ZERO_STAGES, ClusterCost, best_on_cluster, cost_on_cluster
from pipeplan.errors import BadInputError
from pipeplan.formats.plan import PlanSettings
from pipeplan.quantities import format_bytes
from pipeplan.cluster import PRESETS
from pipeplan.launchers.registry import LAUNCHERS

__all__ = ["diagnose_on_cluster", "profile_sequence_parallel", "SEARCH_ZERO_STAGES"]

#: The ZeRO stages the search over every layout tries, per launcher (each record's
#: ``search_zero_stages``, with its source).
SEARCH_ZERO_STAGES = {name: record.search_zero_stages for name, record in LAUNCHERS.items()}


def profile_sequence_parallel(profile) -> bool | None:
    """Whether the profile's tensor-parallel entries shard activations by sequence; None if it has none."""
    flags = {c.sequence_parallel for layer in profile.layers for c in layer.costs
             if (getattr(c, "tensor_parallel", None) or 1) > 1 and getattr(c, "sequence_parallel", None) is not None}
    return None if not flags else bool(flags == {True})


def _finding(*args, **kwargs):
    return Finding(*args, **kwargs)


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g}"


def _memory_text(r) -> str:
    experts = f" + experts {_gib(r.expert_bytes)}" if r.expert_bytes else ""
    experts += f" + quantized weight copies {_gib(r.quantized_weight_bytes)}" if r.quantized_weight_bytes else ""
    return (f"weights {_gib(r.weight_bytes)} + gradients {_gib(r.gradient_bytes)} + optimizer "
            f"{_gib(r.optimizer_bytes)}{experts} + activations {_gib(r.activation_bytes)} + reserve "
            f"{_gib(r.reserve_bytes)} GiB")


def _zero_fix(config, profile, settings, counts, cluster, cost: ClusterCost, mode: str, sha: str):
    """A higher ZeRO stage of the launcher that makes every rank fit, costed; or None."""
    d = config.data_degree or 1
    if d == 1:
        return None
    for zero in LAUNCHER_ZERO_STAGES[config.launcher]:
        if zero <= config.zero_stage:
            continue
        other = cost_on_cluster(profile, settings, counts, cluster=cluster, data=d, tensor=config.tensor_degree,
                                zero_stage=zero, schedule=config.schedule, virtual_stages=config.virtual_stages,
                                microbatch_size=config.microbatch_size, num_microbatches=config.num_microbatches,
                                recompute=mode, profile_sha256=sha, expert=config.expert_degree)
        if not other.over_cap:
            return zero, other
    return None


def _memory_findings(config, cost: ClusterCost, zero_fix, split_setting: str) -> list:
    out = []
    layout_text = f"d={config.data_degree or 1} x t={config.tensor_degree} x p={config.pipeline_degree}"
    for r in cost.over_cap:
        fix = "move layers off this rank or recompute (--fix writes a plan that fits)"
        setting = split_setting
        if zero_fix is not None:
            zero, other = zero_fix
            worst = max(other.memory, key=lambda m: m.total_bytes)
            setting = zero_setting(config.launcher, config.zero_stage)
            fix = (f"use {zero_setting(config.launcher, zero)} (ZeRO {zero}): the fullest rank then needs "
                   f"{format_bytes(worst.total_bytes)}, within the cap")
        out.append(_finding(
            "over-memory", "error", setting,
            f"rank {r.rank} ({layout_text}, ZeRO {config.zero_stage}) is predicted to need "
            f"{format_bytes(r.total_bytes)} per GPU ({_memory_text(r)}), {format_bytes(r.total_bytes - cost.cap_bytes)} "
            f"over the {format_bytes(cost.cap_bytes)} cap", fix))
    return out


def _expert_notes(config, profile, cost: ClusterCost) -> list[str]:
    """How much of each GPU a mixture-of-experts model's routed experts take at the config's E."""
    experts = getattr(profile, "experts", None)
    if experts is None:
        return []
    worst = max(cost.memory, key=lambda m: m.expert_bytes)
    setting = LAUNCHERS[config.launcher].settings.expert
    return [f"experts: {setting} {config.expert_degree}: each GPU holds {experts.num_experts // config.expert_degree} "
            f"of the {experts.num_experts} experts of each MoE layer; their weights, gradients and optimizer state "
            f"take up to {format_bytes(worst.expert_bytes)} per GPU (rank {worst.rank}), "
            f"{worst.expert_bytes / max(1, cost.cap_bytes):.0%} of the {format_bytes(cost.cap_bytes)} cap"]


def _sequence_findings(config, profile, notes: list[str]) -> list:
    """Sequence parallelism: the config's against the profile's (which costs the activations)."""
    if config.tensor_degree == 1:
        return []
    sp = profile_sequence_parallel(profile)
    out = []
    flag = LAUNCHERS[config.launcher].sequence_parallel_flag
    if not config.sequence_parallel and flag is not None:
        out.append(_finding(
            "sequence-parallel", "info", flag,
            f"tensor-parallel {config.tensor_degree} without {flag}: every GPU of a tensor group keeps "
            f"the norms' and dropouts' activations whole", f"add {flag} (same collectives' bytes, "
            "activations of those layers divided by t)"))
    if sp is None or sp == config.sequence_parallel:
        return out
    if sp:
        notes.append("the profile was built with sequence parallelism but the config does not use it: the "
                     "activations shown are under-predicted (build the profile with --no-sequence-parallel to cost "
                     "the config as written)")
    else:
        notes.append("the profile was built without sequence parallelism but the config uses it: the activations "
                     "shown are over-predicted (build the profile with --sequence-parallel)")
    return out


def diagnose_on_cluster(result, profile, settings: PlanSettings, positions, *, mode: str, recompute_options,
                        cluster, search_layouts: bool, costable: bool, profile_sha256: str):
    """Fill ``result`` (a Diagnosis) on ``cluster``: the layout costed, findings, best plans.

    Raises
    ------
    BadInputError
        The profile has no entries at the config's tensor-parallel degree, or the degrees do not
        fit the cluster (t above the GPUs per node).
    """
    config = result.config
    d = config.data_degree
    if d is None:
        d = 1
        result.notes.append("the data-parallel size is not known (give --world-size / --gpus): costed at d = 1")
    if config.launcher == "torchtitan" and d > 1:
        s = config.settings
        replicate = int(s.get("parallelism.data_parallel_replicate_degree", 1))
        if replicate > 1 and d // replicate > 1:
            result.notes.append(f"HSDP (replicate {replicate} x shard {d // replicate}) is costed as FSDP over all "
                                f"{d} data-parallel GPUs: its state memory is under-predicted")
    t, p = config.tensor_degree, config.pipeline_degree
    degrees = tensor_degrees(profile)
    if t not in degrees:
        setting = LAUNCHERS[config.launcher].settings.tensor
        raise BadInputError(f"--profile: {profile.model!r} has costs at tensor_parallel {', '.join(map(str, degrees))}, "
                            f"not at {t} ({config.path}: {setting} {t}); build it with pipeplan profile --analytic "
                            f"--tensor-parallel {t}")
    result.findings += _sequence_findings(config, profile, result.notes)
    c = config.context_degree
    num_gpus = d * t * p * c
    G = d * config.samples_per_replica
    try:
        if costable:
            counts = [len(pos) for pos in positions]
            cost = cost_on_cluster(profile, settings, counts, cluster=cluster, data=d, tensor=t,
                                   zero_stage=config.zero_stage, schedule=config.schedule,
                                   virtual_stages=config.virtual_stages, microbatch_size=config.microbatch_size,
                                   num_microbatches=config.num_microbatches, recompute=mode,
                                   profile_sha256=profile_sha256, expert=config.expert_degree, context=c)
            result.plan, result.cluster_cost = cost.plan, cost
            result.notes += _expert_notes(config, profile, cost)
            fix = _zero_fix(config, profile, settings, counts, cluster, cost, mode, profile_sha256) \
                if cost.over_cap else None
            result.findings += _memory_findings(config, cost, fix, split_setting(config))
            result.findings += time_findings(config, cost.plan)
        # At the config's degrees: its own ZeRO stage, and (Megatron, DeepSpeed) the higher one the
        # launcher has, a switch --fix can write; torchtitan's is tied to its data-parallel degrees.
        zeros = (config.zero_stage,)
        if d > 1 and LAUNCHERS[config.launcher].zero_is_a_switch:
            zeros += tuple(z for z in LAUNCHER_ZERO_STAGES[config.launcher] if z > config.zero_stage)
        result.best, skipped = best_on_cluster(
            profile, settings, launcher=config.launcher, cluster=cluster, num_gpus=num_gpus, global_batch=G,
            degrees=(d, t, p), zero_stages=zeros, recompute_options=recompute_options, profile_sha256=profile_sha256,
            expert=config.expert_degree, context=c)
        if search_layouts:
            result.best_any, _ = best_on_cluster(
                profile, settings, launcher=config.launcher, cluster=cluster, num_gpus=num_gpus, global_batch=G,
                degrees=None, zero_stages=SEARCH_ZERO_STAGES[config.launcher], recompute_options=recompute_options,
                profile_sha256=profile_sha256, context=c)
    except BadInputError as exc:
        raise BadInputError(f"--cluster {cluster.name}: {exc}") from None
    result.memory_checked = True
    if result.best is None and skipped:
        result.notes.append(f"no plan at d={d} t={t} p={p} fits: {skipped[0]}")
    result.findings += gap_findings(result)
    result.findings += _layout_gap_findings(result, G)
    return result


def _layout_gap_findings(result, global_batch: int) -> list:
    """The best plan over every d x t x p of the same GPUs, where it beats the config's degrees."""
    best_any, config = result.best_any, result.config
    if best_any is None:
        return []
    mine = result.plan if result.plan is not None else result.best
    par = best_any.parallelism
    what = (f"d={par.data} x t={par.tensor} x p={par.pipeline}, ZeRO {par.zero_stage}, "
            + (f"{best_any.schedule}" + (f" v = {best_any.virtual_stages}" if best_any.virtual_stages > 1 else "")
               + f", {best_any.num_microbatches} micro-batches" if par.pipeline > 1
               else f"no pipeline, {best_any.num_microbatches} batches")
            + f" of {best_any.microbatch_size} per replica")
    same = (par.data, par.tensor, par.pipeline) == (config.data_degree or 1, config.tensor_degree, config.pipeline_degree)
    if mine is None or same:
        return []
    speedup = mine.predicted.iteration_ms / best_any.predicted.iteration_ms
    if speedup <= 1 + 1e-3:
        return []

    name = best_any.settings.cluster.name
    settings_text = {
        "megatron": f"--tensor-model-parallel-size {par.tensor} --pipeline-model-parallel-size {par.pipeline}"
                    + (" --use-distributed-optimizer" if par.zero_stage else ""),
        "torchtitan": f"tensor_parallel_degree = {par.tensor}, pipeline_parallel_degree = {par.pipeline}, "
                      + (f"data_parallel_shard_degree = {par.data}" if par.zero_stage == 3
                         else f"data_parallel_replicate_degree = {par.data}"),
        "deepspeed": f"PipelineModule num_stages = {par.pipeline}, tensor-parallel {par.tensor}, "
                     f"zero_optimization.stage = {par.zero_stage}",
    }[config.launcher]
    what += f" ({settings_text})"
    command = (f"pipeplan plan PROFILE --gpus {par.num_gpus} --cluster {name if name in PRESETS else 'CLUSTER.toml'} "
               f"--global-batch {global_batch} --launcher {config.launcher}")
    return [_finding(
        "gap-to-best-layout", "warning" if speedup >= GAP_WARNING else "info",
        "tensor / pipeline / data-parallel sizes",
        f"pipeplan's best plan for the same {par.num_gpus} GPUs is predicted {speedup:.2f}x faster "
        f"({best_any.predicted.iteration_ms:.6g} vs {mine.predicted.iteration_ms:.6g} ms): {what}",
        f"{command} (then pipeplan export) writes it")]
