"""The search: profile and settings in, the fastest plan that fits out (:func:`make_plan`).

For every configuration in the search space (schedule, stages per rank ``v``, micro-batch
size, which stages recompute their activations) it splits the layer graph into ``p * v``
stages with the exact solvers (:mod:`pipeplan.plan.solve`), then simulates the
schedule with :func:`pipeplan.plan.simulate.simulate`. The simulator is the single source of
truth: the plan's predicted time, bubble, per-rank busy and idle time and per-rank peak
memory are the simulation's, and a configuration whose simulated per-rank peak exceeds the
memory cap is never returned.

Search
------
- ``--schedule auto`` tries every schedule with the ``v`` of :func:`pipeplan.facts.schedules.
  searched_virtual_stages` (to 4; interleaved to 8 where v divides the layers per rank), and at ``p = 1``
  only 1F1B at ``v = 1``; a named schedule fixes it, ``--virtual-stages`` any ``v`` the class takes.
- Micro-batch sizes: every profiled size that divides the global batch (or the fixed one).
- Recomputation (``--recompute auto``): stages are ranked by the micro-batches they hold in
  flight (the early stages first); the candidates are prefixes of that ranking: none, the
  fewest stages that make the split fit the cap, a few more while that still shortens the
  slowest stage, and the fewest with which no rank can exceed the cap (see below). Where the
  profile gives the selective-recomputation fields, the same prefixes are tried with
  ``selective`` as well as ``full`` recomputation.
- Each configuration is simulated once (``O(p m v)``, up to ~80 ms at 16 ranks), not once
  per candidate split: the partitioner picks the split, the simulator checks it. With ``v > 1``
  a second split, the first moved toward equal work per rank (:mod:`pipeplan.plan.ranks`), is
  simulated too where it can win, and kept where it fits and is strictly faster.
- Branch and bound: a rank cannot finish sooner than its own work, so ``m`` times its
  per-micro-batch compute bounds the iteration from below; configurations are simulated in
  the order of that bound, and those whose bound exceeds the best simulated time so far are
  skipped (listed among the alternatives with the bound). With two splits the bound is the
  smaller of theirs.

Memory with ``v > 1``
---------------------
The partitioners constrain each stage; a rank holds ``v`` stages whose peaks need not
coincide. The split is first solved with the whole cap per stage and checked by simulation;
when a rank goes over, the per-stage cap shrinks in proportion (three tries), and finally to
``cap / v``, at which the sum of the rank's stage peaks (an upper bound of its peak) fits.
"""

from __future__ import annotations

import math
import time

from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.formats.plan import Plan, PlanSettings
from pipeplan.plan.assemble import plan_from_partition, precision_update
from pipeplan.plan.ranks import (balance_ranks, balanced_note, busy_lower_bound_ms, rank_end_lower_bounds_ms,
                                 rank_peaks, try_balanced)
from pipeplan.plan.bound import Incumbent, PrunedError, above
from pipeplan.plan.candidates import RECOMPUTE_SEARCH_MAX_LAYERS, Candidate, tie_key
from pipeplan.plan.chain import chain_bottleneck_ms
from pipeplan.plan.explain import explain_choice, infeasible_message, runners_up
from pipeplan.plan.graph import build_layer_graph
from pipeplan.plan.memo import memoised, planning_cache
from pipeplan.plan.memory import stage_in_flight
from pipeplan.plan.problem import CAP_TOLERANCE, Partition, build_problem, stage_costs
from pipeplan.plan.recompute import (block_layers, full_mode, megatron_runs, recompute_order, recompute_prefix,
                                     uniform_recompute, uniform_recompute_sets)
from pipeplan.facts.schedules import (PLANNER_SCHEDULES, allows_virtual_stages, check_schedule, schedule_info,
                                     searched_virtual_stages, stage_ranks, virtual_stages_rule)
from pipeplan.launchers.registry import LAUNCHER_SCHEDULES, check_launcher
from pipeplan.plan.simulate import simulate
from pipeplan.plan.solve import search_partition, solve_partition
from pipeplan.quantities import format_bytes
from pipeplan.formats.plan import DEFAULT_GLOBAL_BATCH_PER_MICROBATCH
from pipeplan.plan.runnable import default_overhead_note, execution_order_note, refuse_unrunnable
from pipeplan.plan.runnable import default_action_overhead_ms
from pipeplan.progress import task

__all__ = [
    "make_plan",
    "candidate_microbatch_sizes",
    "with_profile_defaults",
    "schedule_space",
    "recompute_sets",
    "busy_lower_bound_ms",
    "rank_end_lower_bounds_ms",
    "rank_peaks",
]


def candidate_microbatch_sizes(profile, settings: PlanSettings) -> list[int]:
    """Profiled micro-batch sizes that divide the global batch (or the fixed one).

    Raises
    ------
    BadInputError
        If none qualifies.
    """
    sizes = profile.microbatch_sizes
    if settings.microbatch_size is not None:
        b = settings.microbatch_size
        if b not in sizes:
            raise BadInputError(f"--microbatch-size: {b} was not profiled; the profile has {sizes}")
        if settings.global_batch % b:
            raise BadInputError(
                f"--microbatch-size: {b} does not divide --global-batch {settings.global_batch}; "
                f"choose a divisor"
            )
        return [b]
    chosen = [b for b in sizes if settings.global_batch % b == 0]
    if not chosen:
        raise BadInputError(
            f"--global-batch: {settings.global_batch} is not a multiple of any profiled "
            f"micro-batch size {sizes}; use a multiple of one of them"
        )
    return chosen


def schedule_space(settings: PlanSettings, num_layers: int) -> list[tuple[str, int]]:
    """(schedule, v) pairs to try, in order of preference on ties."""
    p = settings.stages
    if settings.schedule == "auto":
        schedules = PLANNER_SCHEDULES
    elif settings.schedule in PLANNER_SCHEDULES:
        schedules = (settings.schedule,)
    else:
        raise BadInputError(
            f"--schedule: {settings.schedule!r} is not a schedule; use auto or one of {', '.join(PLANNER_SCHEDULES)}"
        )
    if settings.launcher is not None:
        runs = LAUNCHER_SCHEDULES[settings.launcher]
        if settings.schedule != "auto" and settings.schedule not in runs:
            raise BadInputError(f"--schedule: {settings.launcher} runs {', '.join(runs)}, not {settings.schedule}")
        schedules = tuple(s for s in schedules if s in runs)
    if p == 1 and settings.schedule == "auto" and settings.virtual_stages in (None, 1):
        # One rank runs its micro-batches one after another (1F1B's single rank); more stages on it
        # would be recompute pieces no launcher runs at p = 1 (Megatron, torchtitan: one chunk).
        return [("1f1b", 1)]
    space = []
    for schedule in schedules:
        v = settings.virtual_stages
        if v is None:
            space.extend((schedule, v) for v in searched_virtual_stages(schedule, p, num_layers))
        elif not allows_virtual_stages(schedule, v) and settings.schedule != "auto":
            info = schedule_info(schedule)
            raise BadInputError(f"--virtual-stages: {schedule} ({info.torch_class}) takes {virtual_stages_rule(schedule)} "
                                f"stages per rank, not {v}; use {info.min_virtual_stages if v < info.min_virtual_stages else info.max_virtual_stages} or leave it unset")
        elif not allows_virtual_stages(schedule, v):
            continue
        elif p * v <= num_layers:
            space.append((schedule, v))
        elif settings.schedule != "auto":
            raise BadInputError(f"--virtual-stages: {p} ranks x {v} stages per rank = {p * v} stages but the profile "
                                f"has only {num_layers} layers; use fewer stages per rank or ranks")
    if not space:
        raise BadInputError(
            f"--schedule {settings.schedule}: no stages-per-rank value fits {p} ranks and "
            f"{num_layers} layers (each stage needs a layer); use fewer ranks"
        )
    return space


def recompute_sets(profile, graph, settings, schedule, m, v, exact=False) -> list[tuple[tuple[str, ...], Partition | None]]:
    """The recompute sets worth simulating for one (schedule, v, b), with their splits.

    See the module docstring. Feasibility is taken to be monotone in the prefix length
    (more recomputation, less memory); the stages that hold one micro-batch come last,
    where recomputing saves nothing. Where the profile gives the selective fields the same
    prefixes are tried with selective recomputation as well (usually cheaper in time; it saves
    most where the attention core's ``s^2`` tensors are kept, i.e. without flash attention).
    """
    p = settings.stages
    in_flight = stage_in_flight(schedule, p, m, v)
    num_stages = len(in_flight)
    none = ("none",) * num_stages
    cap = float(settings.cap_bytes())
    def solve(recompute):
        problem = build_problem(profile, graph, settings, in_flight, recompute)
        if not exact:
            return search_partition(problem)
        try:
            return solve_partition(problem, settings.solver)
        except InfeasibleError:
            return None

    if settings.recompute == "all":
        everything = (full_mode(settings),) * num_stages
        return [(everything, solve(everything) if megatron_runs(settings, v, everything) else None)]
    if settings.recompute == "selective":
        if not graph.selective_known:
            raise BadInputError(
                "--recompute selective: the profile has no selective_activation_bytes/selective_recompute_ms "
                "(analytic profiles give them: pipeplan profile --analytic); use all or auto"
            )
        everything = ("selective",) * num_stages
        return [(everything, solve(everything))]
    base = solve(none)
    if (settings.recompute == "none" or math.isinf(cap)
            or graph.num_layers > RECOMPUTE_SEARCH_MAX_LAYERS):
        return [(none, base)]
    order = recompute_order(in_flight)
    problem0 = build_problem(profile, graph, settings, in_flight, none)
    # The peaks first: the split they need is costed for its bound anyway, while the uncapped
    # split is solved only to tell whether the cap binds, which matters only where the peaks fit.
    if base is not None and max(rank_peaks(problem0, base, schedule, p, m, v)) <= cap:
        free = search_partition(build_problem(profile, graph, settings, in_flight, none, memory_cap_bytes=math.inf))
        binding = free is not None and base.bottleneck_ms > free.bottleneck_ms * (1 + CAP_TOLERANCE)
        if not binding:
            return [(none, base)]
    if uniform_recompute(settings.launcher):  # Megatron: one recomputation on every stage
        return [(r, base if r == none else solve(r) if megatron_runs(settings, v, r) else None)
                for r in uniform_recompute_sets(num_stages, graph.selective_known, full_mode(settings))]
    modes = ("selective", "full") if graph.selective_known else ("full",)
    out = {none: base}
    for mode in modes:
        for recompute, partition in _recompute_ladder(profile, graph, settings, schedule, m, v, in_flight,
                                                      order, mode, base, solve):
            out.setdefault(recompute, partition)
    if len(out) == 1:
        return [(none, base), (("full",) * num_stages, None)]
    return list(out.items())


def _recompute_ladder(profile, graph, settings, schedule, m, v, in_flight, order, mode, base, solve):
    """The prefixes of ``order`` recomputing with ``mode`` worth simulating (empty if none fits)."""
    p, num_stages, cap = settings.stages, len(in_flight), float(settings.cap_bytes())
    found: dict[int, Partition | None] = {0: base}

    def at(k):
        if k not in found:
            found[k] = solve(recompute_prefix(order, k, num_stages, mode))
        return found[k]

    def safe(k):
        part = at(k)
        if part is None:
            return False
        problem = build_problem(profile, graph, settings, in_flight, recompute_prefix(order, k, num_stages, mode))
        return max(rank_peaks(problem, part, schedule, p, m, v)) <= cap

    def smallest(test, lo):
        # Smallest k in [lo, num_stages] passing ``test``, or None.
        if not test(num_stages):
            return None
        hi = num_stages
        while lo < hi:
            mid = (lo + hi) // 2
            if test(mid):
                hi = mid
            else:
                lo = mid + 1
        return hi

    def fits(k):
        # Feasibility alone: the cheaper bottleneck-only DP for chains.
        if k in found or not graph.chain:
            return at(k) is not None
        return math.isfinite(chain_bottleneck_ms(
            build_problem(profile, graph, settings, in_flight, recompute_prefix(order, k, num_stages, mode))))

    first = smallest(fits, 1)
    if first is None:
        return []
    keep = [first]
    k = first
    # A little more recomputation can buy a better balance; stop once it stops paying.
    while k + 1 <= num_stages and at(k + 1) is not None and at(k + 1).bottleneck_ms < at(k).bottleneck_ms * (1 - CAP_TOLERANCE):
        k += 1
        keep.append(k)
    # With one stage per rank the partitioner's memory is the rank's: what fits is safe.
    sure = first if v == 1 else smallest(safe, first)
    if sure is not None:
        keep.append(sure)
    return [(recompute_prefix(order, k, num_stages, mode), at(k)) for k in sorted(set(keep))]


def evaluate_candidate(profile, graph, settings, cand: Candidate, in_flight, best_ms: float = math.inf) -> None:
    """Check a candidate's per-rank peaks (for ``v > 1`` shrinking the per-stage cap until its
    ranks fit), then simulate it once; for ``v > 1`` its split balanced by rank too, where that
    can beat both it and ``best_ms`` (the best simulated so far), keeping the faster."""
    _evaluate_split(profile, graph, settings, cand, in_flight)
    if cand.virtual_stages > 1 and cand.partition is not None:
        try_balanced(cand, float(settings.cap_bytes()), settings.stages, best_ms)


def _evaluate_split(profile, graph, settings, cand: Candidate, in_flight) -> None:
    cap = float(settings.cap_bytes())
    p, v, m = settings.stages, cand.virtual_stages, cand.num_microbatches
    share = 1.0
    for attempt in range(5):
        peaks = rank_peaks(cand.problem, cand.partition, cand.schedule, p, m, v)
        peak = max(peaks)
        if peak <= cap:
            cand.simulation = simulate(stage_costs(cand.problem, cand.partition), cand.schedule, p, m, v)
            cand.status = "fits"
            return
        cand.status = "over"
        cand.over_bytes = int(peak - cap)
        cand.peak_bytes = int(peak)
        rank = peaks.index(peak)
        cand.reason = (f"over the cap by {format_bytes(peak - cap)}: rank {rank} peaks at "
                       f"{format_bytes(peak)} (cap {format_bytes(cap)})")
        if v == 1 or share <= 1.0 / v:
            return
        share = max(1.0 / v, share * cap / peak * (1 - 1e-6)) if attempt < 3 else 1.0 / v
        problem = build_problem(profile, graph, settings, in_flight, cand.recompute, memory_cap_bytes=share * cap)
        partition = search_partition(problem)
        if partition is None:
            return
        cand.problem, cand.partition = problem, partition


def with_profile_defaults(profile, settings: PlanSettings) -> PlanSettings:
    """``settings`` with what the profile knows filled in where the user gave nothing.

    - ``global_batch``: :data:`pipeplan.formats.plan.DEFAULT_GLOBAL_BATCH_PER_MICROBATCH` x
      the largest profiled micro-batch size;
    - ``action_overhead_ms``: the schedule's own time per action that a calibrated profile
      carries from its run (``measurement.action_overhead_ms``, written by ``pipeplan calibrate``),
      else the measured default for the device and backend the profile was measured on
      (:mod:`pipeplan.plan.runnable`: 1.0 ms on cpu/gloo); and ``precision``, the profile's.

    A plan records the settings after this, so re-planning from a plan file is reproducible.
    """
    update = precision_update(profile, settings)
    if settings.global_batch is None:
        update["global_batch"] = DEFAULT_GLOBAL_BATCH_PER_MICROBATCH * max(profile.microbatch_sizes)
    measured_ms = (profile.measurement or {}).get("action_overhead_ms")
    if settings.action_overhead_ms is None and measured_ms:
        update["action_overhead_ms"] = max(0.0, float(measured_ms))
    elif settings.action_overhead_ms is None:
        # The measured default for where the profile was measured (pipeplan.plan.runnable).
        default = default_action_overhead_ms(profile)
        if default is not None:
            update["action_overhead_ms"] = default[0]
    return settings.model_copy(update=update) if update else settings


def make_plan(profile, settings: PlanSettings, *, profile_sha256: str, record_time: bool = False,
              explain_infeasible: bool = True, incumbent: Incumbent | None = None) -> Plan:
    """The fastest plan of ``profile`` that fits ``settings``, as simulated.

    Parameters
    ----------
    profile : Profile
    settings : PlanSettings
        Ranks (``stages``), global batch, memory cap, optimizer, bandwidth, schedule
        (``auto`` searches), stages per rank, recompute (``auto``, ``none``, ``all``), solver,
        the schedule's own time per action (unset: the profile's
        ``measurement.action_overhead_ms``, which ``pipeplan calibrate`` writes, else none).
    profile_sha256 : str
        Recorded in the plan so that ``check`` can tell which profile it came from.
    record_time : bool
        Record the solver's wall time (plans are then no longer byte-identical across runs).
    explain_infeasible : bool
        Work out what would fit when nothing does (it solves a few more problems). False: the
        :class:`InfeasibleError` says only that nothing fits, and its ``explain()`` returns the
        full message on demand (the cluster search needs it for few of its layouts).
    incumbent : Incumbent, optional
        An outer search's best time and how it times a plan (:mod:`pipeplan.plan.bound`):
        configurations whose bound in that time is above it are not planned. The plan returned
        is the one the search without it returns; if that plan is proven slower than the
        incumbent, :class:`~pipeplan.plan.bound.PrunedError` is raised instead.

    Returns
    -------
    Plan
        Predicted time, bubble and per-rank memory from the simulator; ``alternatives`` lists
        the runners-up with why they lost; ``notes`` says why this one won and what was assumed.

    Raises
    ------
    BadInputError
        Settings that contradict the profile (more stages than layers, unprofiled sizes), or
        a fixed schedule whose class refuses every micro-batch count on offer.
    InfeasibleError
        Nothing fits the memory cap; the message says what would (a cap, more ranks, or
        recomputation).
    PrunedError
        With ``incumbent``: the plan is proven slower than it (its ``lower_bound_ms`` says by
        how much at least).

    Notes
    -----
    With a fixed ``1f1b`` or ``gpipe`` and no recomputation the split of each micro-batch size
    is the exact min-max optimum (the partitioners' model of those schedules' memory is exact).
    The search solves one partition per (schedule, v, micro-batch size, recompute set) and
    simulates each at most a few times; see the module docstring.
    """
    with planning_cache():
        if incumbent is not None:
            try:
                return _make_plan(profile, settings, profile_sha256=profile_sha256, record_time=record_time,
                                  explain_infeasible=explain_infeasible, incumbent=incumbent)
            except _Undecided:
                pass  # its best may beat the incumbent, but a pruned configuration may be faster still
        return _make_plan(profile, settings, profile_sha256=profile_sha256, record_time=record_time,
                          explain_infeasible=explain_infeasible)


class _Undecided(Exception):
    """A pruned search whose best may beat the incumbent: only the full search tells its plan."""


def _rank_param_bytes(graph, partition: Partition, placement, ranks: int) -> list[float]:
    out = [0.0] * ranks
    for layers, rank in zip(partition.stages, placement):
        out[rank] += float(graph.param_bytes[list(layers)].sum())
    return out


def _caller_bound_ms(cand: Candidate, incumbent: Incumbent, graph, p: int) -> float:
    """A lower bound on a candidate's time in the incumbent's terms, from its splits alone (the
    smaller of the two where it has a split balanced by rank: either may win)."""
    placement = stage_ranks(cand.schedule, p, cand.virtual_stages)
    bounds = []
    for partition in (cand.partition, cand.balanced):
        if partition is None:
            continue
        trip, ends = rank_end_lower_bounds_ms(stage_costs(cand.problem, partition), placement, cand.num_microbatches)
        # The round trip ends with the first stage's backward, on its rank.
        ends[placement[0]] = max(ends[placement[0]], trip)
        bounds.append(incumbent.time_ms(ends, _rank_param_bytes(graph, partition, placement, p), cand.num_microbatches))
    return min(bounds)


def _make_plan(profile, settings: PlanSettings, *, profile_sha256: str, record_time: bool,
               explain_infeasible: bool, incumbent: Incumbent | None = None) -> Plan:
    started = time.perf_counter()
    n = len(profile.layers)
    if settings.stages > n:
        raise BadInputError(
            f"--stages: {settings.stages} stages but the profile has only {n} "
            f"layers; use at most {n}"
        )

    refuse_unrunnable(profile)
    overhead_note = default_overhead_note(profile, settings)
    # A traced model runs only splits along its execution order: never solve over the whole DAG.
    order_note = execution_order_note(profile)
    settings = with_profile_defaults(profile, settings)
    space = schedule_space(settings, n)
    sizes = candidate_microbatch_sizes(profile, settings)
    p, cap = settings.stages, float(settings.cap_bytes())
    graphs = {b: memoised("layer_graph", (id(profile), b, block_layers(settings)), (profile,),
                          lambda b=b: build_layer_graph(profile, b, block_layers(settings)))
              for b in sizes}
    # A fixed one-stage-per-rank schedule without recomputation is a small search: solve each
    # micro-batch size's split exactly, so its choice is among exact optima.
    exact = len(space) == 1 and space[0][1] == 1 and settings.recompute == "none" and order_note is None
    candidates, refusals, cut_ms = _candidates(profile, graphs, settings, space, sizes, exact, incumbent)
    # Refused only if nothing was pruned: a size the incumbent cut might have run.
    if refusals and not cut_ms and all(c.status == "refused" for c in candidates):
        raise BadInputError(refusals[0] if len(set(refusals)) == 1 else "; ".join(sorted(set(refusals))))

    best = _simulate_by_bound(profile, graphs, settings, candidates, space, incumbent, cut_ms)
    if cut_ms:
        _raise_pruned(best, graphs, p, incumbent, cut_ms)
    if best is None:
        def explain() -> str:
            return infeasible_message(profile, settings, space, sizes, candidates)

        if explain_infeasible:
            raise InfeasibleError(explain())
        error = InfeasibleError(f"nothing fits --memory-cap {format_bytes(cap)} with {p} ranks")
        error.explain = explain
        raise error

    graph = graphs[best.microbatch_size]
    partition, simulation, notes = _exact_winner(best, graph, settings, exact, order_note, cap)
    notes.extend(explain_choice(best, simulation, candidates, settings, space, graph, profile))
    if partition.method == "rank-balanced":
        notes.append(balanced_note(best, best.problem, partition, p))
    if overhead_note is not None:
        notes.append(overhead_note)
    alternatives = runners_up(best, simulation, candidates)
    seconds = time.perf_counter() - started if record_time else 0.0
    return plan_from_partition(
        profile, settings, best.problem, partition, schedule=best.schedule, virtual_stages=best.virtual_stages,
        microbatch_size=best.microbatch_size, num_microbatches=best.num_microbatches,
        profile_sha256=profile_sha256, seconds=seconds, alternatives=alternatives, notes=notes,
        simulation=simulation,
    )


def _candidates(profile, graphs, settings: PlanSettings, space, sizes, exact: bool, incumbent):
    """Every (schedule, v, micro-batch size, recompute set) with its split and busy-rank lower
    bound; the schedules' refusals; the caller-time bounds of the sizes the incumbent cut."""
    p = settings.stages
    candidates: list[Candidate] = []
    refusals: list[str] = []
    cut_ms: list[float] = []  # the caller-time bounds of what the incumbent pruned
    for schedule, v in space:
        for b in sizes:
            m = settings.global_batch // b
            try:
                check_schedule(schedule, p, m, v)
                check_launcher(settings.launcher, schedule, p, m, v)
            except BadInputError as error:
                refusals.append(str(error))
                candidates.append(Candidate(schedule, v, b, m, ("none",) * (p * v), status="refused",
                                            reason=f"refused: {error}"))
                continue
            if incumbent is not None and above(incumbent.microbatch_bound_ms.get(b, 0.0), incumbent):
                cut_ms.append(incumbent.microbatch_bound_ms[b])
                continue
            in_flight = stage_in_flight(schedule, p, m, v)
            placement = stage_ranks(schedule, p, v)
            for recompute, partition in recompute_sets(profile, graphs[b], settings, schedule, m, v, exact):
                problem = build_problem(profile, graphs[b], settings, in_flight, recompute)
                cand = Candidate(schedule, v, b, m, recompute, problem, partition)
                if partition is None:
                    cand.status = "nosplit"
                    cand.reason = "over the memory cap at every split"
                else:
                    cand.lower_bound_ms = busy_lower_bound_ms(stage_costs(problem, partition), placement, m)
                    # Either split may win: the bound must hold for both.
                    cand.balanced = balance_ranks(problem, partition, placement) if v > 1 else None
                    if cand.balanced is not None:
                        cand.lower_bound_ms = min(cand.lower_bound_ms, busy_lower_bound_ms(
                            stage_costs(problem, cand.balanced), placement, m))
                candidates.append(cand)
    for index, cand in enumerate(candidates):
        cand.order = index
    return candidates, refusals, cut_ms


def _simulate_by_bound(profile, graphs, settings: PlanSettings, candidates, space, incumbent, cut_ms):
    """Branch and bound on the busy-rank lower bound: simulate in its order; the fastest that fits."""
    p = settings.stages
    best: Candidate | None = None
    pending = sorted((c for c in candidates if c.status == "new"),
                     key=lambda c: (c.lower_bound_ms, tie_key(c, space)))
    with task(f"pipeline search on {p} ranks: schedule x v x micro-batch x recomputation",
              total=len(pending)) as shown:
        for cand in pending:
            shown.advance(note="" if best is None else f"best {best.iteration_ms:.1f} ms ({best.schedule})")
            if best is not None and cand.lower_bound_ms > best.iteration_ms:
                cand.status = "pruned"
                continue
            if incumbent is not None:
                bound = _caller_bound_ms(cand, incumbent, graphs[cand.microbatch_size], p)
                if above(bound, incumbent):
                    cand.status = "pruned"
                    cut_ms.append(bound)
                    continue
            evaluate_candidate(profile, graphs[cand.microbatch_size], settings, cand, cand.problem.in_flight,
                               math.inf if best is None else best.iteration_ms)
            if cand.status == "fits" and (best is None or (cand.iteration_ms, tie_key(cand, space))
                                          < (best.iteration_ms, tie_key(best, space))):
                best = cand
    return best


def _raise_pruned(best, graphs, p: int, incumbent, cut_ms) -> None:
    """The incumbent cut part of the space: the search is pruned (PrunedError, with the least
    bound of what was cut and of the best found) unless the best found beats the incumbent,
    which the cut parts may still have beaten (_Undecided)."""
    if best is not None:
        placement = stage_ranks(best.schedule, p, best.virtual_stages)
        ends = [0.0] * p
        for event in best.simulation.events:
            ends[event.rank] = max(ends[event.rank], event.end_ms)
        own_ms = incumbent.time_ms(ends, _rank_param_bytes(graphs[best.microbatch_size], best.partition,
                                                           placement, p), best.num_microbatches)
        if not above(own_ms, incumbent):
            raise _Undecided()
        cut_ms.append(own_ms)
    raise PrunedError(min(cut_ms), incumbent.iteration_ms)


def _exact_winner(best, graph, settings: PlanSettings, exact: bool, order_note, cap: float):
    """The winner's split and simulation, its DAG split solved exactly where the search only
    split it along a few orders (kept if it fits and simulates no slower); and the notes."""
    partition, simulation, problem = best.partition, best.simulation, best.problem
    p = settings.stages
    notes = []
    if order_note is not None and not graph.chain:
        notes.append(order_note)
    elif not exact and (not graph.chain or settings.solver == "ilp"):
        # The search split DAGs along a few orders; solve the winner exactly.
        try:
            exact = solve_partition(problem, settings.solver)
        except InfeasibleError:
            exact = None
        if exact is not None:
            exact_sim = simulate(stage_costs(problem, exact), best.schedule, p, best.num_microbatches,
                                 best.virtual_stages)
            # A split balanced by rank won its simulation: the exact one must beat it there too.
            balanced = partition.method == "rank-balanced"
            fits = exact_sim.peak_memory_bytes <= cap
            if fits and (not balanced or exact_sim.iteration_ms < simulation.iteration_ms):
                partition, simulation = exact, exact_sim
            elif fits:
                notes.append(f"kept the split balanced by rank: the exact min-max split simulates "
                             f"{exact_sim.iteration_ms:.3f} ms")
            else:
                notes.append("the exact split goes over the cap on some rank when simulated; "
                             "kept the best split along the layer orders")
    return partition, simulation, notes
