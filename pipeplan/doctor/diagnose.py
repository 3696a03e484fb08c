"""Findings: what is wrong with a launcher config, how bad, which setting, and the fix.

``diagnose`` takes a parsed config and its layout, costs the layout with the planner's model
(``evaluate.py``), finds the best plan the same launcher can run on the same GPUs, and turns
the differences into :class:`Finding` s. Severities: ``error`` (the launcher refuses it at start
or run time, layers are lost or repeated, a rank is over the memory cap), ``warning`` (runs, but
wastes a rank or leaves a large gap to the best plan), ``info`` (numbers worth knowing).
"""

from __future__ import annotations

from pipeplan.launchers.config import LAUNCHERS, LauncherConfig, Layout
from pipeplan.doctor.diagnose_cluster import diagnose_on_cluster
from pipeplan.doctor.findings import Diagnosis, Finding, gap_findings, split_setting, time_findings
from pipeplan.doctor.evaluate import best_plan, cost_split
from pipeplan.doctor.units import stage_positions, unit_positions
from pipeplan.errors import BadInputError
from pipeplan.launchers.megatron.reader import megatron_cpu_offload_layers
from pipeplan.plan.loss import with_launcher_loss
from pipeplan.plan.recompute import with_selective_modules
from pipeplan.plan.torchtitan_ac import with_torchtitan_selective
from pipeplan.formats.plan import Plan, PlanSettings
from pipeplan.quantities import format_bytes
from pipeplan.launchers.deepspeed.checks import startup_problems as deepspeed_startup
from pipeplan.launchers.megatron.checks import startup_problems as megatron_startup
from pipeplan.launchers.registry import LAUNCHERS as RECORDS, launcher_refusal
from pipeplan.launchers.torchtitan.checks import startup_problems as torchtitan_startup

__all__ = ["diagnose", "launcher_refusal"]

def _layout_findings(config: LauncherConfig, layout: Layout) -> list[Finding]:
    out = [Finding(pr.code, pr.severity, pr.setting, pr.message, pr.fix) for pr in layout.problems]
    if not layout.stages:
        return out
    built = layout.built_units
    counts: dict[str, int] = {}
    for unit in built:
        counts[unit] = counts.get(unit, 0) + 1
    split_setting = RECORDS[config.launcher].settings.layout
    lost = [u for u in layout.all_units if u not in counts]
    if lost:
        # Count transformer layers where the launcher has them apart from embedding and loss.
        special = ("embedding", "loss", "mtp", "tok_embeddings", "norm", "output")
        layers = [u for u in layout.all_units if u not in special] if config.launcher != "deepspeed" \
            else list(layout.all_units)
        lost_layers = [u for u in lost if u in layers]
        what = RECORDS[config.launcher].settings.units
        out.append(Finding(
            "layers-lost", "error", split_setting,
            f"{len(lost_layers)} of {len(layers)} {what} are on no stage ({_ranges(lost)}): only "
            f"{len(layers) - len(lost_layers)} are trained" + (" (what Megatron-LM versions without the divisibility checks built)"
                              if config.launcher == "megatron" else ""),
            "use the layout of pipeplan's plan (--fix writes it)"))
    repeated = [u for u, c in counts.items() if c > 1]
    if repeated:
        out.append(Finding("layers-duplicated", "error", split_setting,
                           f"{len(repeated)} units are on more than one stage ({_ranges(repeated)})",
                           "list each module in one model part"))
    empty = [s for s in layout.stages if not s.units]
    if empty:
        where = ", ".join(f"rank {s.rank}" + (f" virtual stage {s.vstage}" if config.virtual_stages > 1 else "")
                          for s in empty)
        out.append(Finding("empty-stage", RECORDS[config.launcher].empty_stage_severity, split_setting,
                           f"{len(empty)} stage(s) hold no layers ({where}): the GPU only forwards activations",
                           "give every stage layers (--fix writes a split that does)"))
    return out


def _ranges(units: list[str]) -> str:
    text = ", ".join(units[:6])
    return text + (f", ... ({len(units)} in all)" if len(units) > 6 else "")


#: What each launcher refuses at start-up (its home's checks).
_STARTUP_CHECKS = {"megatron": megatron_startup, "torchtitan": torchtitan_startup, "deepspeed": deepspeed_startup}


def _batch_findings(config: LauncherConfig) -> list[Finding]:
    return [Finding(pr.code, pr.severity, pr.setting, pr.message, pr.fix)
            for pr in _STARTUP_CHECKS[config.launcher](config)]


def _schedule_findings(config: LauncherConfig, layout: Layout) -> list[Finding]:
    m, p, v = config.num_microbatches, config.pipeline_degree, config.virtual_stages
    if m is None or not layout.stages or p == 1:
        return []
    group = config.settings.get("--microbatch-group-size-per-virtual-pipeline-stage")
    why = launcher_refusal(config.launcher, config.schedule, p, m, v, int(group) if group else None)
    if why is None:
        return []
    setting = RECORDS[config.launcher].settings.batch
    good = next((k for k in range(m, 4 * m + 4 * p) if launcher_refusal(config.launcher, config.schedule, p, k, v,
                                                                        int(group) if group else None) is None), None)
    return [Finding("schedule-refuses", "error", setting,
                    f"{m} micro-batches on {p} ranks x {v} virtual stages: the {config.schedule} schedule refuses it "
                    f"at run time ({why})",
                    f"use {good} micro-batches per replica" if good else "change the micro-batch count")]


def _settings_for(config: LauncherConfig, base: PlanSettings) -> PlanSettings:
    return base.model_copy(update={"stages": config.pipeline_degree, "launcher": config.launcher,
                                   "global_batch": config.samples_per_replica})


def _precision_findings(config: LauncherConfig, profile) -> list[Finding]:
    """Megatron's training precision (``--fp16``, ``--bf16``, else fp32) against the profile's."""
    if config.launcher != "megatron":
        return []
    s = config.settings
    dtype = getattr(profile, "dtype", "bf16")
    if "--fp16" in s or "--bf16" in s:
        flag = "--fp16" if "--fp16" in s else "--bf16"
        if profile.dtype_bytes == 2:
            if flag == "--fp16" and dtype != "fp16":
                return [Finding("precision", "info", flag,
                                f"fp16 with dynamic loss scaling: the same bytes per value as the profile's {dtype} "
                                f"and the same tensor-core peak on A100 and H100, so it is costed as the profile")]
            return []
        return [Finding("precision", "warning", flag,
                        f"16-bit training but the profile is {dtype}: weights, gradients and activations are costed "
                        f"at {profile.dtype_bytes} bytes per value instead of 2",
                        f"build the profile with --dtype {flag.lstrip('-')}")]
    if profile.dtype_bytes == 2:
        return [Finding("precision", "warning", "--fp16 / --bf16",
                        f"neither --fp16 nor --bf16: Megatron trains in fp32, twice the profile's {dtype} bytes per "
                        f"weight and activation and at the fp32 peak",
                        "add --bf16 (what the profile costs), or build the profile with --dtype fp32")]
    return []


def diagnose(config: LauncherConfig, layout: Layout, profile, base_settings: PlanSettings, *,
             profile_sha256: str, cluster=None, search_layouts: bool = True) -> Diagnosis:
    """Findings about ``config``, its layout costed, and the best plan for the same ranks.

    Parameters
    ----------
    base_settings : PlanSettings
        Memory cap, optimizer, bandwidth (its ``stages`` and ``global_batch`` are replaced by the
        config's ranks and one replica's samples).
    cluster : ClusterSpec, optional
        Cost the layout at its real d x t x p, ZeRO stage and sequence parallelism on this
        cluster (:mod:`pipeplan.doctor.diagnose_cluster`); without it, one pipeline replica at
        t = 1, unsharded, on ``base_settings``' bandwidth.
    search_layouts : bool
        With ``cluster``: also search every d x t x p of the same GPUs for the best plan.

    Raises
    ------
    BadInputError
        When the profile is not the config's model (block count, missing roles, or no entries at
        the config's tensor-parallel degree with ``cluster``).
    """
    result = Diagnosis(config, layout)
    result.findings += _layout_findings(config, layout)
    result.findings += _batch_findings(config)
    result.findings += _precision_findings(config, profile)
    result.findings += _schedule_findings(config, layout)
    parallel = config.tensor_degree > 1 or (config.data_degree or 1) > 1 or config.sharded_optimizer
    if parallel and cluster is None:
        result.notes.append(
            f"tensor-parallel {config.tensor_degree}, data-parallel {config.data_degree or 'unknown'}"
            f"{', sharded optimizer' if config.sharded_optimizer else ''}: parsed, but time and memory here are "
            f"for one pipeline at tensor-parallel 1 without sharding; give --cluster to cost them")
    if config.samples_per_replica is None:
        return result
    units, mapping = unit_positions(config.launcher, profile, config.num_layers)
    if config.launcher == "deepspeed" and len(layout.all_units) != len(units):
        raise BadInputError(f"--profile: {len(units)} layers but the PipelineModule has {len(layout.all_units)}")
    settings = _settings_for(config, base_settings)
    if config.recompute_modules:
        # Selective recomputation of the launcher's modules, costed from the profile's parts.
        profile = with_selective_modules(profile, config.recompute_modules)
        settings = settings.model_copy(update={"recompute_modules": list(config.recompute_modules)})
    if config.launcher == "torchtitan":
        # torchtitan's selective form (per op, or every N-th block; 0: every block) as costed.
        option = config.settings.get("activation_checkpoint.selective_ac_option", "2")
        settings = settings.model_copy(update={"selective_ac_option": "1" if option == "0" else option})
        profile = with_torchtitan_selective(profile, settings.model_copy(update={"recompute": "auto"}))
        if config.settings.get("activation_checkpoint.mode") == "memory_budget":
            result.notes.append("activation_checkpoint.mode memory_budget: the compiler chooses what to keep; not "
                                "costed (costed as no recomputation)")
    # The launcher's loss as the head's working memory (pipeplan.plan.loss).
    profile = with_launcher_loss(profile, config.launcher)
    selective_known = all(c.selective_activation_bytes is not None for layer in profile.layers for c in layer.costs
                          if c.degree == 1)
    mode = {"full": "all", "selective": "selective"}.get(config.recompute, "none")
    method, layers = config.settings.get("--recompute-method"), config.settings.get("--recompute-num-layers")
    if mode == "all" and method == "block" and (layers or "").isdigit() and int(layers) > 0:
        # Megatron's block method: the first N blocks of each model chunk recompute, as costed.
        settings = settings.model_copy(update={"recompute_method": "block", "recompute_num_layers": int(layers)})
    elif mode == "all" and (method, layers) not in ((None, None), ("uniform", "1")):
        result.notes.append(f"--recompute-method {method} --recompute-num-layers {layers}: costed as uniform 1 (every "
                            f"layer recomputed, each keeping its input); larger uniform groups are not costed yet")
    if config.launcher == "megatron" and megatron_cpu_offload_layers(config.settings) is not None:
        # --cpu-offloading: costed as the planner's --cpu-offload-layers (pipeplan.plan.offload).
        settings = settings.model_copy(update={"cpu_offload_layers": megatron_cpu_offload_layers(config.settings)})
    if mode == "selective" and not selective_known:
        mode = "none"
        result.notes.append("the profile has no selective-recomputation costs (selective_activation_bytes): "
                            "selective recomputation is costed as none")
    sharded = config.sharded_optimizer and (config.data_degree or 1) > 1
    if cluster is None and settings.memory_cap_bytes is not None and (config.tensor_degree > 1 or sharded):
        # One pipeline rank at t = 1 without sharding: against the cap it would flag every rank
        # of a tensor-parallel or ZeRO job.
        settings = settings.model_copy(update={"memory_cap_bytes": None})
        result.notes.append("memory is not checked against the cap without --cluster: per-rank peaks shown are "
                            "at t = 1, unsharded")
    positions, costable = [], False
    if layout.stages:
        positions = stage_positions(profile, [s.units for s in layout.stages], mapping)
        result.stage_layers = [[profile.layers[i].name for i in pos] for pos in positions]
        costable = all(positions) and not any(f.code in ("refused", "schedule-refuses", "layers-duplicated", "layers-lost")
                                              for f in result.findings)
        if config.microbatch_size not in profile.microbatch_sizes:
            result.notes.append(f"micro-batch size {config.microbatch_size} was not profiled "
                                f"({profile.microbatch_sizes}): the config's own layout is not costed")
            costable = False
    if cluster is not None:
        options = ("none", "selective", "all") if selective_known else ("none", "all")
        return diagnose_on_cluster(result, profile, settings, positions, mode=mode, recompute_options=options,
                                   cluster=cluster, search_layouts=search_layouts, costable=costable,
                                   profile_sha256=profile_sha256)
    if costable:
        result.plan = cost_split(profile, settings, positions, schedule=config.schedule,
                                 virtual_stages=config.virtual_stages, microbatch_size=config.microbatch_size,
                                 num_microbatches=config.num_microbatches,
                                 recompute=mode, profile_sha256=profile_sha256)
        result.findings += _cost_findings(config, result.plan, settings)
    refuse = (lambda schedule, p, m, v: launcher_refusal(config.launcher, schedule, p, m, v))
    memory_checked = settings.memory_cap_bytes is not None
    # Without a memory check, dropping recomputation always looks faster: keep the user's.
    if memory_checked:
        recompute = ("none", "selective", "all") if selective_known else ("none", "all")
    else:
        recompute = (mode,)
    result.best, skipped = best_plan(profile, settings, LAUNCHERS[config.launcher], refuse=refuse,
                                     recompute_options=recompute, profile_sha256=profile_sha256)
    result.memory_checked = memory_checked
    if skipped:
        result.notes.append(f"{len(skipped)} schedule / micro-batch combination(s) left out of the best plan because "
                            f"{config.launcher} refuses them, e.g. {skipped[0]}")
    result.findings += gap_findings(result)
    return result


def _rank_layers(plan: Plan, rank: int) -> list[str]:
    return [name for stage in plan.stages if stage.rank == rank for name in stage.layers]


def _cost_findings(config: LauncherConfig, plan: Plan, settings: PlanSettings) -> list[Finding]:
    out = []
    cap = settings.memory_cap_bytes
    if cap is not None:
        for rank in plan.ranks:
            if rank.peak_memory_bytes > cap:
                heavy = [n for n in _rank_layers(plan, rank.rank)
                         if not n.split(".")[-1].isdigit()][:3]
                out.append(Finding(
                    "over-memory", "error", split_setting(config),
                    f"rank {rank.rank} is predicted to peak at {format_bytes(rank.peak_memory_bytes)}, "
                    f"{format_bytes(rank.peak_memory_bytes - cap)} over the {format_bytes(cap)} cap"
                    + (f" ({', '.join(heavy)} sit there)" if heavy else ""),
                    "move layers off this rank or recompute (--fix writes a plan that fits)"))
    return out + time_findings(config, plan)


