"""The cluster search: the fastest data x tensor x pipeline plan of a profile on N GPUs.

For every layout (d, t, p) the rules allow (:mod:`pipeplan.cluster.space`), every ZeRO stage and
recomputation family, the pipeline planner (:func:`pipeplan.plan.search.make_plan`) finds the
fastest exact split, schedule, stages per rank and micro-batch size of one replica: ``G / d``
samples on ``p`` ranks, from the profile at degree ``t`` on the cluster's links
(:func:`pipeplan.cluster.profile_view.degree_view`), with the ZeRO-sharded training state and
each GPU's plannable memory (the cap less the reserve). The cluster then adds each pipeline
rank's data-parallel sync and the optimizer step (:func:`pipeplan.cluster.iteration.iteration_parts`).

Pruning: candidates are evaluated in the order of a lower bound that needs no split (some rank
does at least ``1/p`` of each micro-batch's work and the slowest step follows,
:func:`pipeplan.cluster.iteration.pipeline_lower_bound_ms`); a candidate whose bound is above the
best iteration found is not planned, and one whose state alone cannot fit (``1/p`` of the
model's training state on some rank) is skipped. Ties go to the earlier candidate in a fixed
order, so the same inputs give the same plan.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Optional

from pipeplan.cluster.assemble import assemble_cluster_plan, hbm_bytes_per_s, infeasible_message
from pipeplan.cluster.bounds import seed_estimate_ms, unit_sums
from pipeplan.cluster.context import (best_over_context, check_context_request, context_choices, context_profile,
                                      context_view, largest_buffer_bytes, stage_context_ms)
from pipeplan.cluster.dataparallel import DEFAULT_OVERLAP, data_parallel_sync
from pipeplan.cluster.overlap_plan import (SYNC_OVERLAPS, bound_overlap, overlap_parts, overlapped_rank_sync,
                                           trial_overlaps, view_overlaps)
from pipeplan.cluster.experts import (check_expert_request, expert_choices, expert_data_degree, expert_group,
                                      moe_rank_tails, moe_static_bytes, moe_tails_lower_bound,
                                      no_expert_layout_message, view_expert_bytes)
from pipeplan.cluster.iteration import iteration_parts, pipeline_lower_bound_ms
from pipeplan.cluster.memory import plannable_for, trial_layout, zero3_gathered_bytes
from pipeplan.cluster.placement import cluster_layout
from pipeplan.cluster.profile_view import DegreeView, head_counts, stage_pass_ms, tensor_degrees
from pipeplan.cluster.runners import compare_search, informative_layouts, kind_label
from pipeplan.cluster.space import batch_divisor_note, candidates, parallel_degrees, recompute_families, zero_stages
from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.facts.schedules import valid_virtual_stages
from pipeplan.facts.training_state import optimizer_step_ms, precision_of, state_bytes_per_param_byte, training_state
from pipeplan.formats.plan import Plan, PlanSettings
from pipeplan.plan import make_plan, plan_simulation, with_profile_defaults
from pipeplan.plan.bound import Incumbent, PrunedError
from pipeplan.plan.given import fixed_split_stages, plan_split
from pipeplan.plan.memo import planning_cache
from pipeplan.plan.offload import offload_view
from pipeplan.plan.recompute import recomputed_layers
from pipeplan.progress import task
from pipeplan.quantities import format_bytes

__all__ = ["plan_cluster"]

#: Achieved share of HBM bandwidth by the fused optimizer kernels.
OPTIMIZER_HBM_EFFICIENCY = 0.8

#: Prune each layout's own pipeline search against the best iteration found so far (False: plan
#: every layout that the layout-level bounds do not prune, for testing that it changes nothing).
PRUNE_AGAINST_BEST = True

#: Trials planned before the branch and bound, by an estimate, to start it with an incumbent.
SEED_TRIALS = 3

#: Runner-up layouts planned in full after the search (runners.informative_layouts chooses them);
#: each costs about one layout's pipeline search, mostly from the search's cache.
RUNNER_UP_LAYOUTS = 5


@dataclass
class _Trial:
    """One (d, t, p, ZeRO, recomputation family) the search considers."""

    data: int
    tensor: int
    pipeline: int
    zero_stage: int
    family: str              # "plain" (none / full, per stage) or "selective"
    order: int
    lower_bound_ms: float = 0.0
    status: str = "new"      # new, planned, infeasible, pruned, state-over-cap
    reason: str = ""
    plan: Optional[Plan] = None
    parts: object = None
    extras: dict = field(default_factory=dict)
    expert: int = 1
    """E (1: no expert parallelism, every dense plan)."""
    expert_tensor: int = 1
    expert_data: int = 1
    """EDP = t x d / (E x ETP) (d for a dense profile)."""
    moe: bool = False
    """Whether the profile has experts (their state and sync are split from the dense ones)."""
    context: int = 1
    """C: the context-parallel degree (1: none)."""

    shard = property(lambda self: self.data * self.context,
                     doc="The ranks that hold the same weights: d x C (ZeRO and the gradient sync run over them).")

    @property
    def key(self):
        return (self.data, self.tensor, self.pipeline, self.expert)

    @property
    def view_key(self):
        return (self.tensor, self.family, self.expert)


def plan_cluster(profile, settings: PlanSettings, *, profile_sha256: str, record_time: bool = False) -> Plan:
    """The fastest cluster plan of ``profile`` for ``settings.num_gpus`` GPUs of ``settings.cluster``.

    Raises
    ------
    BadInputError
        No cluster, a GPU count no layout makes, a fixed degree that breaks a rule.
    InfeasibleError
        Nothing fits the memory; the message gives the least memory or GPUs that could.

    Notes
    -----
    The whole search runs inside :func:`pipeplan.plan.memo.planning_cache`, so the layer graphs,
    chain partitions and stage costs that recur across its pipeline plans are computed once.
    """
    with planning_cache():
        choices = context_choices(profile, settings)
        if len(choices) == 1:
            return _plan_cluster(profile, settings, profile_sha256=profile_sha256, record_time=record_time)
        return best_over_context(lambda c, full: _plan_cluster(
            profile, settings.model_copy(update={"context_parallel": c}), profile_sha256=profile_sha256,
            record_time=record_time, runners_up=full), choices)


@dataclass
class _Search:
    """What the steps of one cluster search share."""

    profile: object
    settings: PlanSettings
    cluster: object
    cap: int
    """The cap per GPU the request means."""
    usable: int
    """What may be planned of it: the cap less the reserve and the fragmentation share."""
    state: object
    """The optimizer's training state per parameter (:class:`pipeplan.facts.training_state.TrainingState`)."""
    hbm: Optional[float]
    overlap: float
    sizes_all: list
    profile_sha256: str
    record_time: bool
    views: dict = field(default_factory=dict)
    """(t, recomputation family, E) -> the profile one GPU sees (:class:`DegreeView`)."""
    groups: dict = field(default_factory=dict)
    """(t, E) -> the expert group of the views (:class:`pipeplan.cluster.profile_view.ExpertGroup`)."""
    trials: list = field(default_factory=list)
    batch_note: Optional[str] = None
    """The data-parallel degrees the global batch leaves out (:func:`batch_divisor_note`), if any."""
    context: int = 1
    """C, the same for every trial (:mod:`pipeplan.cluster.context`)."""
    context_source: object = None
    """The profile one GPU of a context-parallel group sees, before the tensor-parallel view."""

    def view(self, tensor: int, selective: bool, experts) -> DegreeView:
        """The profile one GPU sees at degree ``tensor`` (and C), collectives and exchange timed."""
        view = context_view(self.profile, self.context_source, self.context, tensor, self.cluster, selective,
                            experts, self.settings.num_gpus, **view_overlaps(self.settings))
        return offload_view(view, self.settings.cpu_offload_layers, self.cluster.gpu)
    compares: list = field(default_factory=list)
    """Each ``--compare`` layout's trials (:class:`pipeplan.cluster.runners.Compare`)."""

    def run(self, trial: _Trial, best_ms: Optional[float] = None) -> None:
        # Each layout's own NCCL communicators come out of its plannable bytes (cluster.memory).
        usable = plannable_for(self.cap, self.cluster, self.settings.launcher, trial_layout(trial))
        _run_trial(trial, self.profile, self.settings, self.views[trial.view_key], self.cluster,
                   usable, self.state, self.hbm, self.overlap, self.profile_sha256, self.record_time, best_ms)


def _plan_cluster(profile, settings: PlanSettings, *, profile_sha256: str, record_time: bool,
                  runners_up: bool = True) -> Plan:
    search = _start(profile, settings, profile_sha256, record_time)
    _bound_trials(search)
    for compare in search.compares:
        if compare.fresh:
            _bound_trials(compare.search, compare.trials)
    best, unbounded = _branch_and_bound(search)
    settings, cluster, trials = search.settings, search.cluster, search.trials
    if best is None:
        total_state = training_state(settings.optimizer, profile.dtype_bytes, *precision_of(settings)).total_bytes * sum(
            layer.param_bytes for layer in profile.layers) / profile.dtype_bytes
        needs = min(((peak, key, zero) for key, (_, peak, zero) in unbounded.items()),
                    default=(math.inf, None, 0))
        raise InfeasibleError(infeasible_message(trials, settings, cluster, search.usable, search.cap, total_state,
                                                  needs))
    # The runners-up worth a row (runners.informative_layouts), each planned exactly, and the
    # --compare layouts; all inside the search's planning cache, so most of their work is shared.
    # (runners_up False: only the winner's time is wanted, e.g. of one C of a search over C.)
    runners = [(label, group, _exact_best(search, group, unbounded), rivals)
               for label, group, rivals in informative_layouts(trials, best, RUNNER_UP_LAYOUTS if runners_up else 0)]
    runners = [(kind_label(label, found, rivals), group, found) for label, group, found, rivals in runners]
    compared = [(compare.text, _exact_best(compare.search, compare.trials, unbounded if compare.unbounded is None else compare.unbounded),
                 compare.trials) for compare in search.compares]
    plan = assemble_cluster_plan(best, trials, profile, settings, search.views[best.view_key], cluster,
                                 search.cap, search.state, runners=runners, compared=compared)
    return plan.model_copy(update={"notes": [*plan.notes, search.batch_note]}) if search.batch_note else plan


def _start(profile, settings: PlanSettings, profile_sha256: str, record_time: bool) -> _Search:
    """The request read (defaults, a re-planned file, a fixed split), and its trials: every
    (d, t, p) some micro-batch size runs, x ZeRO stage x recomputation family."""
    settings = with_profile_defaults(profile, settings)
    if settings.search_stages:  # re-planning a plan file whose pipeline degree was searched
        settings = settings.model_copy(update={"stages": None, "search_stages": None})
    cluster = settings.cluster
    if cluster is None:
        raise BadInputError("--gpus: give the cluster (--cluster NAME or FILE; pipeplan cluster lists them)")
    if settings.layers_per_stage is not None:
        settings = fixed_split_stages(settings)
    units = len(profile.layers)
    check_expert_request(profile, settings)
    # With --virtual-stages v a pipeline rank needs v units: at most units // v ranks.
    v = settings.virtual_stages or 1
    if settings.stages is not None and settings.stages * v > units:
        raise BadInputError(f"--virtual-stages: {settings.stages} ranks x {v} stages per rank = {settings.stages * v} "
                            f"stages but the profile has only {units} units; use fewer stages per rank or ranks")
    context = check_context_request(profile, settings)
    degrees = parallel_degrees(settings.num_gpus, cluster.gpus_per_node, units // v, head_counts(profile),
                               tensor_degrees(profile), data=settings.data_parallel, tensor=settings.tensor_parallel,
                               pipeline=settings.stages, gpus_per_domain=cluster.domain_gpus_for(settings.num_gpus),
                               context=context)
    cap = settings.cap_bytes()
    search = _Search(
        profile=profile, settings=settings, cluster=cluster, cap=cap,
        usable=plannable_for(cap, cluster, settings.launcher),
        state=training_state(settings.optimizer, profile.dtype_bytes, *precision_of(settings)),
        hbm=hbm_bytes_per_s(profile, cluster),
        overlap=DEFAULT_OVERLAP if settings.data_parallel_overlap is None else settings.data_parallel_overlap,
        sizes_all=profile.microbatch_sizes if settings.microbatch_size is None else [settings.microbatch_size],
        profile_sha256=profile_sha256, record_time=record_time,
        batch_note=batch_divisor_note(degrees, settings.global_batch,
                                      profile.microbatch_sizes if settings.microbatch_size is None
                                      else [settings.microbatch_size]),
        context=context, context_source=context_profile(profile, context))
    # The (d, t, p) that some micro-batch size b runs with d x b dividing the batch (space.candidates
    # raises, naming the sizes, when none does).
    runnable = sorted({(c.data, c.tensor, c.pipeline) for c in candidates(degrees, settings.global_batch,
                                                                           search.sizes_all)})
    for d, t, p in runnable:
        search.trials.extend(_layout_trials(search, d, t, p, len(search.trials)))
    if getattr(profile, "experts", None) is not None and not search.trials:
        raise BadInputError(no_expert_layout_message(profile, settings))
    search.compares = [compare_search(search, text, _layout_trials) for text in settings.compare or ()]
    return search


def _layout_trials(search: _Search, d: int, t: int, p: int, order: int, expert: Optional[int] = None,
                   zero: Optional[int] = None) -> list[_Trial]:
    """The trials of one layout (x E x ZeRO stage x recomputation family), numbered from ``order``;
    ``expert`` and ``zero`` fix those (``--compare``)."""
    profile, settings, cluster = search.profile, search.settings, search.cluster
    selective_ok = all(getattr(c, "selective_activation_bytes", None) is not None
                       for layer in profile.layers for c in layer.costs)
    moe = getattr(profile, "experts", None) is not None
    etp = settings.expert_tensor_parallel or 1
    out = []
    for e in ([expert] if expert is not None else expert_choices(profile, settings, d, t)):
        group = expert_group(settings, cluster, d, t, p, e)
        search.groups[(t, e)] = group
        if (t, "plain", e) not in search.views:
            search.views[(t, "plain", e)] = search.view(t, False, group)
        for z in ([zero] if zero is not None else zero_stages(settings, d, p)):
            for family, _ in recompute_families(settings, selective_ok):
                out.append(_Trial(d, t, p, z, family, order + len(out), expert=e, expert_tensor=etp, moe=moe,
                                  context=search.context,
                                  expert_data=expert_data_degree(d, t, e, etp) if moe else d))
    return out


def _bound_trials(search: _Search, trials: Optional[list] = None) -> None:
    """Each trial's lower bounds (per micro-batch size), its seed estimate, and the state-only
    memory check (a trial whose training state alone is over the plannable bytes is dropped);
    of ``trials``, else of the search's own."""
    profile, settings, cluster, views = search.profile, search.settings, search.cluster, search.views
    state, usable, hbm, overlap, G = search.state, search.usable, search.hbm, search.overlap, settings.global_batch
    bandwidth_only = cluster.model_copy(update={
        "intra_node": cluster.intra_node.model_copy(update={"latency_us": 0.0}),
        "inter_node": cluster.inter_node.model_copy(update={"latency_us": 0.0})})
    sums_of: dict = {}
    for trial in search.trials if trials is None else trials:
        vkey = trial.view_key
        if vkey not in views:
            views[vkey] = search.view(trial.tensor, trial.family == "selective",
                                      search.groups[(trial.tensor, trial.expert)])
        view = views[vkey]
        replica_batch = G // trial.data
        sizes = tuple(b for b in search.sizes_all if replica_batch % b == 0)
        if (vkey, sizes) not in sums_of:
            sums_of[(vkey, sizes)] = unit_sums(view, sizes)
        sums = sums_of[(vkey, sizes)]
        params = sum(layer.param_bytes for layer in view.profile.layers) / profile.dtype_bytes
        expert_params = view_expert_bytes(view, [layer.name for layer in view.profile.layers]) / profile.dtype_bytes
        if trial.moe:
            static = moe_static_bytes(settings.optimizer, profile.dtype_bytes, trial.zero_stage, trial.data,
                                      trial.expert_data, params * profile.dtype_bytes, expert_params * profile.dtype_bytes,
                                      *precision_of(settings))
        else:
            static = state_bytes_per_param_byte(settings.optimizer, profile.dtype_bytes, trial.zero_stage,
                                                trial.shard, *precision_of(settings)) * params * profile.dtype_bytes
        trial.extras["state_per_gpu"] = static / trial.pipeline
        if static / trial.pipeline > usable:
            trial.status = "state-over-cap"
            trial.reason = (f"training state alone is {format_bytes(static / trial.pipeline)} per GPU on average, "
                            f"over the {format_bytes(usable)} plannable")
            continue
        shard = params / trial.pipeline / (trial.shard if trial.zero_stage >= 1 else 1)
        if trial.moe and trial.zero_stage >= 1:
            shard = ((params - expert_params) / trial.data + expert_params / trial.expert_data) / trial.pipeline
        step = optimizer_step_ms(shard, state, hbm, OPTIMIZER_HBM_EFFICIENCY, profile.dtype == "fp16") if hbm else 0.0
        trial.extras["step_lb"] = step
        span = cluster_layout(cluster, trial.shard, trial.tensor, trial.pipeline).data_span()
        by_size, pipeline_by_size = {}, {}
        for b, at in sums.items():
            m, work, largest = replica_batch // b, at.work_ms, at.largest_unit_ms
            # Averaged over the ranks: some rank's busy time plus sync is at least the mean's
            # (bandwidth terms only, which are linear in the parameters).
            hidden = bound_overlap(settings, trial, overlap)
            if trial.moe:
                sync = moe_rank_tails(trial, [params / trial.pipeline], [expert_params / trial.pipeline], m,
                                      bandwidth_only, state, None, hidden, False, OPTIMIZER_HBM_EFFICIENCY)[0][0]
            else:
                sync = data_parallel_sync(params / trial.pipeline, state, trial.zero_stage, span, bandwidth_only,
                                          m, hidden).exposed_ms
            round_trip = at.round_trip_ms(m) if trial.pipeline > 1 else 0.0
            by_size[b] = max(pipeline_lower_bound_ms(work, m, trial.pipeline) + sync, m * largest, round_trip) + step
            pipeline_by_size[b] = max(pipeline_lower_bound_ms(work, m, trial.pipeline, largest_unit_ms=largest),
                                      round_trip)
        trial.extras["bound_by_size"], trial.extras["pipeline_bound_by_size"] = by_size, pipeline_by_size
        trial.lower_bound_ms = min(by_size.values())
        trial.extras["estimate_ms"] = min(seed_estimate_ms(bound, replica_batch // b, trial.pipeline, sums[b],
                                                            static / trial.pipeline, usable)
                                          for b, bound in by_size.items())


def _branch_and_bound(search: _Search):
    """The best trial (or None) and, per layout, its pipeline optimum without a memory cap."""
    settings = search.settings
    # Branch and bound. A trial's bound is refined once, by its layout's pipeline optimum without
    # a memory cap (memory only ever constrains, so no ZeRO stage or recomputation beats it).
    best: Optional[_Trial] = None
    unbounded: dict = {}
    open_trials = [t for t in search.trials if t.status == "new"]
    with task(f"cluster search on {settings.num_gpus} GPUs: layouts x ZeRO x recomputation",
              total=len(open_trials)) as shown:
        layouts = len({t.key for t in search.trials})

        def done(best):
            shown.advance(note=f"{layouts} layouts; best " + (
                "none yet" if best is None else
                f"{best.parts.iteration_ms:.1f} ms (d={best.data} t={best.tensor} p={best.pipeline})"))

        # Seed: plan first the trials most likely to be fast (by an estimate with a bubble, which
        # the bounds leave out), so that the bounds of the layouts with deep pipelines are refined
        # against an incumbent rather than in full. The order changes only how much is pruned.
        for trial in sorted(open_trials, key=lambda t: (t.extras["estimate_ms"], t.order))[:SEED_TRIALS]:
            search.run(trial)
            if trial.status == "planned":
                best = trial
            done(best)
            if best is not None:
                break
        best = _search_heap(search, best, unbounded, done)
    return best, unbounded


def _better(trial, best) -> bool:
    """Faster to the plan file's 1e-6 ms, or as fast and earlier (a bound equal to a time may differ in its last bit)."""
    return best is None or (round(trial.parts.iteration_ms, 6), trial.order) < (round(best.parts.iteration_ms, 6), best.order)


def _search_heap(search: _Search, best, unbounded: dict, done, trials: Optional[list] = None):
    """Branch and bound over the trials left (of ``trials``, else all), in the order of their lower bounds."""
    profile, settings, cluster, views = search.profile, search.settings, search.cluster, search.views
    profile_sha256 = search.profile_sha256
    heap = [(t.lower_bound_ms, t.order, False, t) for t in (search.trials if trials is None else trials)
            if t.status == "new"]
    heapq.heapify(heap)
    while heap:
        bound, _, refined, trial = heapq.heappop(heap)
        best_ms = None if best is None else best.parts.iteration_ms
        if best is not None and round(bound, 6) > round(best_ms, 6):  # a tie to the plan's 1e-6 ms is kept
            _prune(trial, bound, best_ms)
            done(best)
            continue
        if not refined:
            family = "plain" if any(f == "plain" for f, _ in recompute_families(settings, True)) else "selective"
            key = (trial.data, trial.tensor, trial.pipeline, family, trial.expert)
            if key not in unbounded:
                unbounded[key] = _unbounded(profile, settings, views[(trial.tensor, family, trial.expert)], trial,
                                            family, cluster, profile_sha256, best_ms)
            trial.lower_bound_ms = max(bound, unbounded[key][0] + trial.extras["step_lb"])
            heapq.heappush(heap, (trial.lower_bound_ms, trial.order, True, trial))
            continue
        search.run(trial, best_ms)
        if trial.status == "planned" and _better(trial, best):
            best = trial
        done(best)
    return best


def _exact_best(search: _Search, trials: list, unbounded: dict):
    """The best of ``trials`` (one layout's, or one ``--compare``'s) planned exactly: a branch and
    bound among them alone, so a trial pruned against the overall best is planned again unless a
    trial of its own set beats its bound. The same trial planning ``--data-parallel d
    --tensor-parallel t --stages p`` would choose (the same trials, the same order of ties)."""
    best = None
    for trial in trials:
        if trial.status == "pruned":
            trial.status = "new"  # its bound (lower_bound_ms) stays: it is still one
        elif trial.status == "planned" and _better(trial, best):
            best = trial
    return _search_heap(search, best, unbounded, lambda best: None, trials)


def _pipeline_plan(view: DegreeView, sub: PlanSettings, settings: PlanSettings, profile_sha256: str,
                   record_time: bool = False, incumbent: Optional[Incumbent] = None) -> Plan:
    """The pipeline planner's best plan of one replica, or the given split's (--layers-per-stage);
    with ``incumbent``, pruned against the best iteration so far (PrunedError)."""
    if settings.layers_per_stage is None:
        # What would fit is worked out only for the layouts whose reason the plan shows (_reason).
        return make_plan(view.profile, sub, profile_sha256=profile_sha256, record_time=record_time,
                         explain_infeasible=False, incumbent=incumbent if PRUNE_AGAINST_BEST else None)
    plan = plan_split(view.profile, sub, settings.layers_per_stage, profile_sha256=profile_sha256)
    cap = sub.memory_cap_bytes
    peak = max(r.peak_memory_bytes for r in plan.ranks)
    if cap is not None and peak > cap:
        raise InfeasibleError(f"the given split needs {format_bytes(peak)} on its fullest rank, over the "
                              f"{format_bytes(cap)} plannable")
    return plan


def _pipeline_link(cluster, trial):
    # Ranks ordered tensor, context, data, pipeline: a layout of d x C "data" ranks has the same
    # pipeline ranks, and its data groups are the d x C ranks the gradients are reduced over.
    layout = cluster_layout(cluster, trial.shard, trial.tensor, trial.pipeline)
    links = {layout.pipeline_link(i, (i + 1) % trial.pipeline) for i in range(trial.pipeline)} - {"local"}
    return layout, links, (cluster.inter_node if "inter" in links else cluster.intra_node)


def _sub_settings(settings: PlanSettings, trial, link, cap, recompute: str) -> PlanSettings:
    """The pipeline planner's settings for one replica of a trial."""
    return settings.model_copy(update={
        "stages": trial.pipeline, "global_batch": settings.global_batch // trial.data,
        "memory_cap_bytes": cap, "bandwidth_bytes_per_s": link.achieved_bytes_per_s,
        "recompute": recompute, "zero_stage": trial.zero_stage, "data_parallel": trial.shard,
        "num_gpus": None, "cluster": None, "tensor_parallel": None, "layers_per_stage": None,
        "data_parallel_overlap": None, "search_stages": None, "expert_parallel": None,
        "expert_tensor_parallel": None, "expert_imbalance": None, "context_parallel": None,
        "expert_data_parallel": trial.expert_data if trial.moe else None,
    })


def _prune(trial: _Trial, bound_ms: float, best_ms: float) -> None:
    trial.status = "pruned"
    trial.lower_bound_ms = bound_ms
    trial.reason = f"lower bound {bound_ms:.1f} ms \u2265 best {best_ms:.1f} ms (not planned)"


def _unbounded(profile, settings: PlanSettings, view: DegreeView, trial, family: str, cluster,
               profile_sha256: str, best_ms: Optional[float] = None) -> tuple[float, float, int]:
    """The layout's fastest pipeline with no memory cap: a lower bound on every trial of it.

    Returns its make-span, its fullest rank's planned bytes and the ZeRO stage they are at: the
    memory that one plan of the layout needs, for the infeasible message. With ``best_ms`` (the
    best iteration so far) the pipeline search prunes against it, less the trial's least
    optimizer step; a make-span proven above that comes back as its lower bound.
    """
    _, _, link = _pipeline_link(cluster, trial)
    recompute = dict(recompute_families(settings, True))[family]
    sub = _sub_settings(settings, trial, link, None, "none" if recompute == "auto" else recompute)
    incumbent = None
    if best_ms is not None and settings.layers_per_stage is None:
        incumbent = Incumbent(max(0.0, best_ms - trial.extras["step_lb"]), _makespan_ms,
                              trial.extras["pipeline_bound_by_size"])
    try:
        plan = _pipeline_plan(view, sub, settings, profile_sha256, incumbent=incumbent)
    except PrunedError as error:
        return error.lower_bound_ms, math.inf, trial.zero_stage
    except (InfeasibleError, BadInputError):
        return 0.0, math.inf, trial.zero_stage
    return plan.predicted.iteration_ms, max(r.peak_memory_bytes for r in plan.ranks), trial.zero_stage


def _makespan_ms(rank_end_ms, rank_param_bytes, num_microbatches) -> float:
    return max(rank_end_ms)


def _rank_tails(trial: _Trial, rank_params, m: int, span, cluster, state, hbm, overlap: float, fp16: bool):
    """Each pipeline rank's exposed data-parallel sync and optimizer step, from its parameters."""
    sync = [data_parallel_sync(p, state, trial.zero_stage, span, cluster, m, overlap).exposed_ms for p in rank_params]
    shard = [p / (trial.shard if trial.zero_stage >= 1 else 1) for p in rank_params]
    step = [optimizer_step_ms(s, state, hbm, OPTIMIZER_HBM_EFFICIENCY, fp16) if hbm else 0.0 for s in shard]
    return sync, step


def _run_trial(trial: _Trial, profile, settings: PlanSettings, view: DegreeView, cluster, usable: int, state,
               hbm, overlap: float, profile_sha256: str, record_time: bool, best_ms: Optional[float] = None) -> None:
    layout, links, link = _pipeline_link(cluster, trial)
    largest_unit_params = max(layer.param_bytes for layer in view.profile.layers) / profile.dtype_bytes
    gathered = zero3_gathered_bytes(largest_unit_params, state, trial.shard) if trial.zero_stage == 3 else 0
    # The ring's received KV chunks, at the largest micro-batch size the replica may run (a bound).
    buffers = largest_buffer_bytes(profile, settings.microbatch_size, trial.tensor, trial.context)
    recompute = dict(recompute_families(settings, True))[trial.family]
    sub = _sub_settings(settings, trial, link, max(1, usable - gathered - buffers), recompute)
    span, fp16 = layout.data_span(), profile.dtype == "fp16"
    incumbent = None
    lower_overlap = bound_overlap(settings, trial, overlap)
    if best_ms is not None and settings.layers_per_stage is None:
        def iteration_ms(rank_end_ms, rank_param_bytes, m):
            params = [b / profile.dtype_bytes for b in rank_param_bytes]
            if trial.moe:  # only each rank's total is known here: a lower bound
                sync, step = moe_tails_lower_bound(trial, params, m, cluster, state, hbm, lower_overlap, fp16,
                                                   OPTIMIZER_HBM_EFFICIENCY)
            else:
                sync, step = _rank_tails(trial, params, m, span, cluster, state, hbm, lower_overlap, fp16)
            return max(end + s for end, s in zip(rank_end_ms, sync)) + max(step)

        incumbent = Incumbent(best_ms, iteration_ms, trial.extras["bound_by_size"])
    try:
        plan = _pipeline_plan(view, sub, settings, profile_sha256, record_time, incumbent=incumbent)
    except PrunedError as error:
        _prune(trial, error.lower_bound_ms, best_ms)
        return
    except InfeasibleError as error:
        trial.status = "infeasible"
        trial.reason = f"infeasible: {str(error).splitlines()[0]}"
        trial.extras["explain"] = getattr(error, "explain", None)
        return
    sim = plan_simulation(plan)
    m = plan.num_microbatches
    rank_end = [0.0] * trial.pipeline
    for event in sim.events:
        rank_end[event.rank] = max(rank_end[event.rank], event.end_ms)
    rank_params = [0.0] * trial.pipeline
    rank_experts = [0.0] * trial.pipeline
    rank_tp = [0.0] * trial.pipeline
    rank_tp_hidden = [0.0] * trial.pipeline
    rank_cp = [0.0] * trial.pipeline
    rank_moe = [dict() for _ in range(trial.pipeline)]
    for stage in plan.stages:
        rank_params[stage.rank] += stage.param_bytes / profile.dtype_bytes
        again = recomputed_layers(stage, plan.settings, view.profile)  # the layers whose forward runs twice
        rank_tp[stage.rank] += m * view.stage_tensor_parallel_ms(stage.layers, plan.microbatch_size, again)
        rank_tp_hidden[stage.rank] += m * view.stage_tensor_parallel_hidden_ms(stage.layers, plan.microbatch_size, again)
        for part, per_unit in (("quantize", view.quantize_ms), ("host_wait", view.host_wait_ms)):
            if per_unit:  # the precision's casts, the GPU's wait for the host: per unit, out of compute
                ms = stage_pass_ms(per_unit, stage.layers, plan.microbatch_size, again)
                rank_moe[stage.rank][part] = rank_moe[stage.rank].get(part, 0.0) + m * ms
        rank_cp[stage.rank] += m * stage_context_ms(view, stage.layers, plan.microbatch_size, stage.recompute)
        if trial.moe:
            rank_experts[stage.rank] += view_expert_bytes(view, stage.layers) / profile.dtype_bytes
            for part, ms in view.stage_expert_ms(stage.layers, plan.microbatch_size, again).items():
                rank_moe[stage.rank][part] = rank_moe[stage.rank].get(part, 0.0) + m * ms
    if trial.moe:
        sync, step = moe_rank_tails(trial, rank_params, rank_experts, m, cluster, state, hbm, overlap, fp16,
                                    OPTIMIZER_HBM_EFFICIENCY)
    else:
        sync, step = _rank_tails(trial, rank_params, m, span, cluster, state, hbm, overlap, fp16)
    overlaps = trial_overlaps(settings, trial.zero_stage)
    split = None
    if overlaps & SYNC_OVERLAPS and trial.shard > 1:
        sync, split = overlapped_rank_sync(plan, sim, view, settings, trial, overlaps, rank_params, rank_experts,
                                           rank_end, span, cluster, state, overlap)
    critical = sim.critical_rank
    trial.parts = iteration_parts(sim.compute_ms, min(rank_tp[critical], sim.compute_ms), sim.transfer_ms,
                                  sim.bubble_ms + sim.overhead_ms, rank_end, sync, step,
                                  expert_ms=rank_moe[critical] if trial.moe or view.quantize_ms or view.host_wait_ms else None,
                                  context_ms=rank_cp[critical],
                                  offload_ms=m * view.offload_ms.get(plan.microbatch_size, 0.0))
    trial.plan = plan
    trial.status = "planned"
    trial.extras = {"layout": layout, "link": "inter" if "inter" in links else ("intra" if links else "local"),
                    "gathered": gathered, "buffers": buffers,
                    **overlap_parts(trial.parts, split, rank_end, sync, overlap, overlaps, rank_tp_hidden[critical]
                                    if view.tensor_parallel_hidden_ms else None, rank_moe[critical].get("a2a_hidden"))}



