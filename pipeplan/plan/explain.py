"""Why the plan won, what lost and why, and what would fit when nothing does.

The plan's ``notes`` (:func:`explain_choice`), its ``alternatives`` (:func:`runners_up`) and
the message of the :class:`pipeplan.errors.InfeasibleError` the search raises
(:func:`infeasible_message`: the smallest cap that fits, with and without recomputation,
and how many ranks would).
"""

from __future__ import annotations

import math

from pipeplan.errors import BadInputError
from pipeplan.formats.plan import Alternative
from pipeplan.plan.candidates import RECOMPUTE_SEARCH_MAX_LAYERS, Candidate, recompute_text, tie_key
from pipeplan.plan.chain import fits_along_order
from pipeplan.plan.graph import build_layer_graph
from pipeplan.plan.memory import stage_in_flight
from pipeplan.plan.problem import build_problem
from pipeplan.facts.schedules import PLANNER_SCHEDULES, SCHEDULE_INFO
from pipeplan.plan.simulate import Simulation
from pipeplan.plan.solve import search_partition
from pipeplan.quantities import format_bytes

__all__ = ["explain_choice", "runners_up", "infeasible_message", "smallest_cap_without_recompute",
           "MAX_ALTERNATIVES", "percent_text"]

#: Most runners-up recorded in a plan.
MAX_ALTERNATIVES = 24


def explain_choice(best: Candidate, sim: Simulation, candidates, settings, space, graph, profile) -> list[str]:
    """The plan's notes: why this configuration won, why it recomputes, what was assumed."""
    notes = []
    cap = float(settings.cap_bytes())
    evaluated = [c for c in candidates if c.status in ("fits", "over")]
    fitting = [c for c in evaluated if c.status == "fits"]
    chosen = (f"{best.schedule}, {best.virtual_stages} stage(s) per rank, micro-batch size "
              f"{best.microbatch_size} ({best.num_microbatches} micro-batches), recompute "
              f"{recompute_text(best.recompute)}")
    if len(space) > 1 or len(candidates) > 1:
        runner = min((c for c in fitting if c is not best),
                     key=lambda c: (c.iteration_ms, tie_key(c, space)), default=None)
        counts = {}
        for c in candidates:
            counts[c.status] = counts.get(c.status, 0) + 1
        others = [f"{counts[k]} {label}" for k, label in (
            ("pruned", "slower by their lower bound alone"), ("over", "over the cap"),
            ("nosplit", "without a split under the cap"), ("refused", "refused by the schedule")) if counts.get(k)]
        text = (f"chose {chosen}: the fastest of {len(fitting)} simulated configurations that fit"
                + (f"; {', '.join(others)}" if others else "") + f" ({len(candidates)} considered)")
        if runner is not None:
            gap = runner.iteration_ms - sim.iteration_ms
            text += (f"; the runner-up ({runner.label()}) is {gap:.3f} ms "
                     f"({percent_text(gap, sim.iteration_ms)}) slower")
        notes.append(text)
    else:
        notes.append(f"chose {chosen}")
    if best.recompute_count:
        same = [c for c in candidates if (c.schedule, c.virtual_stages, c.microbatch_size)
                == (best.schedule, best.virtual_stages, best.microbatch_size) and not c.recompute_count]
        why = "without it this configuration does not fit the cap"
        if same and same[0].status == "over":
            why = f"without it this configuration is {same[0].reason}"
        elif same and same[0].status == "fits":
            why = (f"it allows a better-balanced split: without it this configuration takes "
                   f"{same[0].iteration_ms:.3f} ms")
        elif best.virtual_stages == 1 and not math.isinf(cap) and graph.chain:
            need = smallest_cap_without_recompute(profile, graph, settings, best.problem.in_flight)
            if need is not None:
                why = (f"without it no split fits: the smallest per-rank peak is "
                       f"{format_bytes(need)}, over the {format_bytes(cap)} cap")
                if same:
                    same[0].reason = (f"over the cap at every split: its smallest per-rank peak is "
                                      f"{format_bytes(need)}, {format_bytes(need - cap)} over")
                    same[0].over_bytes = int(need - cap)
        how = ("they keep all but each layer's attention core and recompute it before that layer's backward"
               if "selective" in best.recompute else
               f"the first {graph.recompute_block_layers} transformer blocks of each stage keep only their inputs "
               f"and run their forward again before their backward (Megatron's --recompute-method block)"
               if "block" in best.recompute else
               "each layer keeps only its input per micro-batch in flight and runs its forward again, one layer at "
               "a time, just before its backward")
        notes.append(f"recomputation on {recompute_text(best.recompute)} ({how}): {why}")
    if SCHEDULE_INFO[best.schedule].split_backward and not graph.backward_split_measured:
        notes.append(
            f"{best.schedule} runs input and weight gradients apart, but the profile lacks "
            f"backward_input_ms/backward_weight_ms: the split was estimated as half of backward_ms "
            f"each, so the prediction depends on that estimate"
        )
    if not graph.chain:
        notes.append(
            "branchy layer graph: stages are ideals of the DAG; a boundary sends every tensor crossing it"
        )
    if profile.source == "imported":
        notes.append("imported profile: activation_bytes approximated by each layer's output size")
    notes.append("time and per-rank memory predicted by the event simulator of the schedule "
                 "(docs/schedules.md, docs/cost-model.md)")
    return notes


def runners_up(best: Candidate, sim: Simulation, candidates) -> list[Alternative]:
    """Runners-up ranked: simulated and fitting by time, then pruned by bound, then over the cap."""
    rank = {"fits": 0, "pruned": 2, "over": 3, "nosplit": 4, "refused": 5}
    own = (best.schedule, best.virtual_stages, best.microbatch_size)

    def group(c):
        # The winner without its recomputation shows why it recomputes.
        if c.status != "fits" and not c.recompute_count and (c.schedule, c.virtual_stages, c.microbatch_size) == own:
            return 1
        return rank[c.status]

    others = [c for c in candidates if c is not best]
    others.sort(key=lambda c: (
        group(c),
        c.iteration_ms if c.status == "fits" else (c.lower_bound_ms if c.status == "pruned" else c.over_bytes),
        c.order,
    ))
    out = []
    for c in others[:MAX_ALTERNATIVES]:
        iteration = None
        peak = None
        if c.status == "fits":
            gap = c.iteration_ms - sim.iteration_ms
            reason = f"slower by {gap:.3f} ms ({percent_text(gap, sim.iteration_ms)})"
            iteration, peak = c.iteration_ms, c.simulation.peak_memory_bytes
        elif c.status == "pruned":
            gap = c.lower_bound_ms - sim.iteration_ms
            reason = (f"slower by at least {gap:.3f} ms: its busiest rank alone needs "
                      f"{c.lower_bound_ms:.3f} ms (not simulated)")
        elif c.status == "over":
            reason = c.reason
            peak = c.peak_bytes
        else:
            reason = c.reason
        out.append(Alternative(
            schedule=c.schedule, virtual_stages=c.virtual_stages, microbatch_size=c.microbatch_size,
            recompute=recompute_text(c.recompute),
            iteration_ms=None if iteration is None else round(iteration, 6),
            peak_memory_bytes=peak, reason=reason,
        ))
    return out


# ----------------------------------------------------------------------------------------
# What would fit


def _smallest_cap(fits, relative_tolerance: float) -> float | None:
    """Smallest cap in bytes for which ``fits(cap)`` holds (monotone): doubling, then bisection."""
    hi = 1.0
    while not fits(hi):
        hi *= 2
        if hi > 1e18:
            return None
    lo = hi / 2
    while hi - lo > hi * relative_tolerance:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def smallest_cap_without_recompute(profile, graph, settings, in_flight) -> float | None:
    """Bisection on the cap with the along-order feasibility test (exact for chains)."""
    def fits(cap):
        return fits_along_order(build_problem(profile, graph, settings, in_flight, memory_cap_bytes=cap))

    return _smallest_cap(fits, relative_tolerance=1e-4)


def _smallest_cap_with_recompute(profile, graph, settings, in_flight) -> float | None:
    """Bisection on the cap with every stage recomputing (chains only)."""
    recompute = ("full",) * len(in_flight)

    def fits(cap):
        return search_partition(build_problem(profile, graph, settings, in_flight, recompute, memory_cap_bytes=cap)) is not None

    if not graph.chain or graph.num_layers > RECOMPUTE_SEARCH_MAX_LAYERS:
        return None
    return _smallest_cap(fits, relative_tolerance=1e-3)


def percent_text(part: float, whole: float) -> str:
    """``part`` as a share of ``whole``; a profile whose times are all 0 has no share to give."""
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _smallest_fitting_stages(profile, settings, sizes) -> int | None:
    n = len(profile.layers)
    for p in range(settings.stages + 1, min(n, 8 * settings.stages) + 1):
        for b in sizes:
            m = settings.global_batch // b
            schedule = "1f1b" if m >= p else "gpipe"
            if settings.schedule == "gpipe":
                schedule = "gpipe"
            graph = build_layer_graph(profile, b)
            in_flight = stage_in_flight(schedule, p, m, 1)
            if fits_along_order(build_problem(profile, graph, settings, in_flight)):
                return p
    return None


def infeasible_message(profile, settings, space, sizes, candidates) -> str:
    """What the InfeasibleError says: what came closest and what would fit."""
    cap = float(settings.cap_bytes())
    schedules = sorted({s for s, _ in space}, key=PLANNER_SCHEDULES.index)
    head = (
        f"nothing fits --memory-cap {format_bytes(cap)} with {settings.stages} ranks "
        f"(schedules {', '.join(schedules)}; micro-batch sizes {sizes}; recompute {settings.recompute})"
    )
    over = [c for c in candidates if c.status == "over"]
    hints = []
    least = min(over, key=lambda c: (c.over_bytes, c.order)) if over else None
    # The smallest caps with the most frugal v = 1 schedule: 1F1B where it runs, else GPipe.
    best_plain, best_recompute = None, None
    for b in sizes:
        m = settings.global_batch // b
        schedule = "1f1b" if m >= settings.stages else "gpipe"
        if settings.schedule not in ("auto", schedule):
            schedule = settings.schedule if settings.schedule in ("1f1b", "gpipe") else schedule
        try:
            in_flight = stage_in_flight(schedule, settings.stages, m, 1)
        except BadInputError:
            continue
        graph = build_layer_graph(profile, b)
        need = smallest_cap_without_recompute(profile, graph, settings, in_flight)
        if need is not None and (best_plain is None or need < best_plain[0]):
            best_plain = (need, b, schedule)
        if settings.recompute != "none":
            need = _smallest_cap_with_recompute(profile, graph, settings, in_flight)
            if need is not None and (best_recompute is None or need < best_recompute[0]):
                best_recompute = (need, b, schedule)
    smallest_cap = min((x[0] for x in (best_plain, best_recompute) if x is not None), default=math.inf)
    if least is not None and least.peak_bytes is not None and least.peak_bytes < smallest_cap:
        hints.append(f"closest: {least.label()} is {least.reason}")
    if best_plain is not None:
        exact = "" if profile.edges is None else " or less"
        hints.append(
            f"a cap of {format_bytes(math.ceil(best_plain[0]))}{exact} fits {best_plain[2]} at micro-batch "
            f"size {best_plain[1]} without recomputation"
        )
    if best_recompute is not None and (best_plain is None or best_recompute[0] < best_plain[0]):
        hints.append(
            f"a cap of {format_bytes(math.ceil(best_recompute[0]))} fits {best_recompute[2]} at micro-batch "
            f"size {best_recompute[1]} with every stage recomputing"
        )
    elif settings.recompute == "none":
        hints.append("--recompute auto may fit (stages keep only their inputs)")
    more = _smallest_fitting_stages(profile, settings, sizes)
    if more is not None:
        hints.append(f"{more} ranks fit under this cap without recomputation "
                     f"({'gpipe' if settings.schedule == 'gpipe' else '1f1b'})")
    else:
        limit = min(len(profile.layers), 8 * settings.stages)
        if limit > settings.stages:
            hints.append(f"no stage count from {settings.stages + 1} to {limit} fits under this cap either")
        else:
            hints.append(f"more ranks cannot help: {settings.stages} ranks already hold one layer each or fewer")
    if not hints:
        hints.append("no cap fits: a single layer exceeds it; split that layer or use a smaller micro-batch")
    return head + "; " + "; ".join(hints)
