"""What doctor says: its findings, the diagnosis of one config, and the findings every layout
gets (the iteration by parts, the gap to the best plan, the recipe that closes it).

Shared by :mod:`pipeplan.doctor.diagnose` (the pipeline view) and
:mod:`pipeplan.doctor.diagnose_cluster` (the whole cluster's), which both build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeplan.launchers.config import LauncherConfig, Layout
from pipeplan.formats.plan import Plan
from pipeplan.launchers.registry import LAUNCHERS

__all__ = ["SAME_SPEED", "GAP_WARNING", "Finding", "Diagnosis", "zero_setting", "parts_text", "time_findings", "split_setting",
           "gap_findings"]


#: The best plan must be predicted at least this much faster for the gap to be a warning.
GAP_WARNING = 1.10

#: Within this ratio the config is "as fast as" the best plan: no change is stated, so ``--fix``
#: changes nothing (the model's own rounding is far finer; the predictions' errors far coarser).
SAME_SPEED = 1 + 1e-3


@dataclass(frozen=True)
class Finding:
    """One thing doctor has to say."""

    code: str
    severity: str
    setting: str
    message: str
    fix: str = ""


@dataclass
class Diagnosis:
    """Everything ``doctor`` found about one config."""

    config: LauncherConfig
    layout: Layout
    findings: list[Finding] = field(default_factory=list)
    plan: Plan | None = None
    """The config's own layout, costed (None where it cannot be: refused, empty stages...)."""
    best: Plan | None = None
    """The best plan the same launcher can run on the same ranks."""
    stage_layers: list[list[str]] = field(default_factory=list)
    """Profile layer names of each stage of the config's layout."""
    notes: list[str] = field(default_factory=list)
    memory_checked: bool = True
    """Whether peaks were checked against a cap (without ``--cluster``, not with t > 1 or ZeRO)."""
    cluster_cost: object = None
    """With ``--cluster``: the layout's :class:`pipeplan.doctor.cluster.ClusterCost` (memory per rank)."""
    best_any: Plan | None = None
    """With ``--cluster``: the best plan over every d x t x p of the same GPUs."""

    @property
    def exit_code(self) -> int:
        return 1 if any(f.severity == "error" for f in self.findings) else 0

    @property
    def speedup(self) -> float | None:
        if self.plan is None or self.best is None or self.best.predicted.iteration_ms <= 0:
            return None
        return self.plan.predicted.iteration_ms / self.best.predicted.iteration_ms


def zero_setting(launcher: str, zero_stage: int) -> str:
    """The launcher setting that gives ``zero_stage``, as a user writes it (its record's words)."""
    return LAUNCHERS[launcher].settings.zero(zero_stage)


def parts_text(plan: Plan) -> str:
    """The iteration as its named parts, e.g. ``17338.5 ms = compute 11796.9 + ...``."""
    pr = plan.predicted
    tp, dp, opt = pr.tensor_parallel_ms or 0.0, pr.data_parallel_ms or 0.0, pr.optimizer_ms or 0.0
    text = (f"{pr.iteration_ms:.6g} ms per iteration = compute {pr.compute_ms:.6g} + bubble {pr.bubble_ms:.6g}"
            + (f" + overhead {pr.overhead_ms:.6g}" if pr.overhead_ms else "")
            + f" + pipeline transfers {pr.transfer_ms:.6g}")
    if plan.parallelism is not None:
        text += f" + tensor-parallel {tp:.6g}"
        if pr.expert_dispatch_ms is not None:
            text += (f" + expert dispatch {pr.expert_dispatch_ms:.6g} + routed experts {pr.expert_compute_ms or 0:.6g}"
                     f" + expert combine {pr.expert_combine_ms or 0:.6g} + shared experts {pr.shared_expert_ms or 0:.6g}")
        if pr.quantize_ms is not None:
            text += f" + {plan.settings.precision} casts {pr.quantize_ms:.6g}"
        if pr.context_exchange_ms is not None:
            text += f" + context-parallel exchange {pr.context_exchange_ms:.6g}"
        if pr.host_wait_ms is not None:
            text += f" + host launches {pr.host_wait_ms:.6g}"
        text += f" + data-parallel sync {dp:.6g}"
        if pr.gradient_reduce_ms is not None:  # an overlap of the sync: its exposed parts and what hid
            text += (f" (exposed: gradient reduce {pr.gradient_reduce_ms:.6g} + all-gather {pr.param_gather_ms or 0:.6g};"
                     f" {pr.data_parallel_hidden_ms or 0:.6g} hidden)")
        text += f" + optimizer {opt:.6g}"
        if pr.cpu_offload_ms is not None:
            text += f" + CPU offload {pr.cpu_offload_ms:.6g}"
    text += " ms"
    if pr.tokens_per_second_per_gpu is not None:
        text += f"; {pr.tokens_per_second_per_gpu:.4g} tokens/s per GPU"
    if pr.model_flops_utilization is not None:
        text += f", MFU {100 * pr.model_flops_utilization:.3g}%"
    return text


def time_findings(config: LauncherConfig, plan: Plan) -> list[Finding]:
    """The imbalance (slowest stage vs the mean) and the iteration by parts."""
    out = []
    times = [s.forward_ms + s.backward_ms for s in plan.stages]
    # One stage has nothing to be imbalanced against.
    if len(times) > 1 and min(times) >= 0 and sum(times) > 0:
        ratio = max(times) / (sum(times) / len(times))
        slow = max(range(len(times)), key=lambda i: times[i])
        out.append(Finding("imbalance", "info", split_setting(config),
                           f"slowest stage {slow} (rank {plan.stages[slow].rank}) takes {ratio:.2f}x the mean "
                           f"stage time ({max(times):.4g} ms vs {sum(times) / len(times):.4g} ms per micro-batch)"))
    if plan.parallelism is not None:
        text = f"predicted {parts_text(plan)}"
    else:
        text = (f"predicted iteration {plan.predicted.iteration_ms:.6g} ms: compute {plan.predicted.compute_ms:.6g} "
                f"+ bubble {plan.predicted.bubble_ms:.6g} + transfer {plan.predicted.transfer_ms:.6g} ms")
    out.append(Finding("bubble", "info", "schedule / micro-batches",
                       f"{text} ({100 * plan.predicted.bubble_fraction:.3g}% idle)"))
    return out


def split_setting(config: LauncherConfig) -> str:
    """Where the launcher says the layers per stage (its record's words)."""
    return LAUNCHERS[config.launcher].settings.split


def _recipe(result: Diagnosis) -> tuple[str, str]:
    """The steps from the config to the best plan, and the launcher settings they change."""
    best, plan, config = result.best, result.plan, result.config
    words = LAUNCHERS[config.launcher].settings
    steps, settings = [], []
    if plan is not None:
        mine = {}
        for stage in plan.stages:
            mine.setdefault(stage.rank, 0)
            mine[stage.rank] += len(stage.layers)
        theirs = {}
        for stage in best.stages:
            theirs.setdefault(stage.rank, 0)
            theirs[stage.rank] += len(stage.layers)
        moves = [(r, mine.get(r, 0) - theirs.get(r, 0)) for r in sorted(mine)]
        for r, delta in moves:
            if delta > 0:
                steps.append(f"move {delta} layer{'s' * (delta > 1)} off rank {r}")
                settings.append(words.split)
    if best.schedule != config.schedule or best.virtual_stages != config.virtual_stages:
        steps.append(f"use {best.schedule}" + (f" with v = {best.virtual_stages}" if best.virtual_stages > 1 else ""))
        settings.append(words.schedule)
    zero = best.parallelism.zero_stage if best.parallelism is not None else config.zero_stage
    if zero != config.zero_stage:
        steps.append(f"use {zero_setting(config.launcher, zero)} (ZeRO {zero})")
        settings.append(words.zero(zero))
    if best.microbatch_size != config.microbatch_size:
        steps.append(f"micro-batch size {best.microbatch_size} ({best.num_microbatches} micro-batches)")
        settings.append(words.microbatch)
    modes = {("selective" if s.recompute_granularity == "selective" else "full") if s.recompute else "none"
             for s in best.stages}
    best_mode = modes.pop() if len(modes) == 1 else "mixed"
    if best_mode != config.recompute:
        steps.append({"none": "drop recomputation", "full": "recompute every stage in full",
                      "selective": "selective recomputation on every stage"}.get(best_mode, "recompute per stage"))
        settings.append(words.recompute)
    if not steps:
        return "same schedule, different split", words.split
    return ", ".join(steps), "; ".join(dict.fromkeys(settings))


def gap_findings(result: Diagnosis) -> list[Finding]:
    best, config = result.best, result.config
    if best is None:
        return [Finding("no-plan", "warning", "memory cap",
                        "no plan of this launcher fits the memory cap on these ranks", "add ranks or memory")]
    if result.plan is None:
        return [Finding("best-plan", "info", "",
                        f"pipeplan's best plan for {config.pipeline_degree} ranks: {best.schedule}, "
                        f"{len(best.stages)} stages, {best.num_microbatches} micro-batches of {best.microbatch_size}, "
                        f"predicted "
                        f"{best.predicted.iteration_ms:.6g} ms per iteration", "--fix writes it")]
    speedup = result.speedup
    if speedup <= SAME_SPEED:
        return [Finding("gap-to-best", "info", "",
                        f"the config is as fast as pipeplan's best plan for these ranks "
                        f"({result.plan.predicted.iteration_ms:.6g} ms per iteration)")]
    # A gap found without checking memory may not fit: report it, do not flag it.
    severity = "warning" if speedup >= GAP_WARNING and result.memory_checked else "info"
    recipe, settings = _recipe(result)  # the finding names the settings its steps change
    return [Finding("gap-to-best", severity, settings,
                    f"pipeplan's plan is predicted {speedup:.2f}x faster "
                    f"({best.predicted.iteration_ms:.6g} vs {result.plan.predicted.iteration_ms:.6g} ms): "
                    f"{recipe}", "--fix writes it" if speedup > 1 + 1e-9 else "")]
