"""The schedule simulator: known figures as equations, and properties of every simulation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipeplan.errors import BadInputError
from pipeplan.plan.actions import Action, rank_actions
from pipeplan.facts.schedules import (
    SCHEDULES,
    TORCH_SCHEDULE_CLASS,
    check_schedule,
    stage_ranks,
    valid_virtual_stages,
)
from pipeplan.plan.simulate import StageCost, simulate

F_MS, B_MS, W_MS = 1.0, 1.5, 0.5  # per rank and micro-batch; W is a real share of backward


def uniform(p: int, v: int, f=F_MS, b=B_MS, w=W_MS, act=1, static=0, send=0.0):
    """Equal stages; a rank's v stages together cost f, b, w (as if one stage had been cut in v)."""
    return [
        StageCost(f / v, b / v, w / v, send_ms=send, static_memory_bytes=static, activation_bytes=act)
    ] * (p * v)


def accepted(schedule, p, m, v) -> bool:
    try:
        check_schedule(schedule, p, m, v)
    except BadInputError:
        return False
    return True



def test_action_overhead_occupies_the_rank_but_hides_in_waiting():
    """GPipe on 2 ranks, f = b = 2 ms, 1 ms of the schedule's own work before every action.

    Rank 0 runs F F then, after rank 1's backward, B B. Rank 1's first overhead overlaps
    with waiting for its input; the overheads of back-to-back actions do not overlap with
    compute. The parts still add up to the iteration."""
    cost = StageCost(2.0, 1.0, 1.0, action_overhead_ms=1.0)
    sim = simulate([cost, cost], "gpipe", num_ranks=2, num_microbatches=2)
    starts = {(e.rank, e.kind, e.microbatch): e.start_ms for e in sim.events}
    assert starts[(0, "F", 0)] == 1.0 and starts[(0, "F", 1)] == 4.0
    assert starts[(1, "F", 0)] == 3.0  # overhead done while waiting for F(0, 0), which ended at 3
    assert starts[(1, "F", 1)] == 6.0  # F(0, 1) ended at 6; the overhead (5-6) overlapped the wait
    assert sim.rank_overhead_ms == (4.0, 4.0)
    assert sim.rank_busy_ms == (8.0, 8.0)
    assert sim.compute_ms + sim.overhead_ms + sim.bubble_ms + sim.transfer_ms == pytest.approx(sim.iteration_ms)
    none = simulate([StageCost(2.0, 1.0, 1.0)] * 2, "gpipe", num_ranks=2, num_microbatches=2)
    assert none.overhead_ms == 0.0 and sim.iteration_ms > none.iteration_ms

# --------------------------------------------------------------------- known figures


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uniform_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule):
    for p in range(1, 9):
        for m in range(1, 4 * p + 2):
            if not accepted(schedule, p, m, 1):
                continue
            sim = simulate(uniform(p, 1), schedule, p, m)
            assert sim.iteration_ms == pytest.approx((m + p - 1) * (F_MS + B_MS + W_MS))
            assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_interleaved_cuts_fill_and_drain_by_v():
    """m (f+b+w) of work, plus a fill/drain of (p-1)(f+b+w)/v instead of (p-1)(f+b+w)."""
    for p in range(1, 9):
        for m in range(p, 4 * p + 1):
            for v in valid_virtual_stages("interleaved"):
                if not accepted("interleaved", p, m, v):
                    continue
                sim = simulate(uniform(p, v), "interleaved", p, m, v)
                work = F_MS + B_MS + W_MS
                assert sim.iteration_ms == pytest.approx(m * work + (p - 1) * work / v), (p, m, v)
                assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_gpipe_holds_all_m_micro_batches():
    for p in (1, 2, 4, 8):
        for m in (1, 3, 8, 13):
            sim = simulate(uniform(p, 1, act=7, static=100), "gpipe", p, m)
            assert sim.stage_peak_in_flight == (m,) * p
            assert sim.rank_peak_memory_bytes == (100 + 7 * m,) * p


def test_1f1b_holds_min_m_p_minus_s_at_stage_s():
    for p in (1, 2, 3, 4, 8):
        for m in range(p, 3 * p + 1):
            sim = simulate(uniform(p, 1, act=7, static=100), "1f1b", p, m)
            assert sim.stage_peak_in_flight == tuple(min(m, p - s) for s in range(p))
            assert sim.rank_peak_memory_bytes == tuple(100 + 7 * min(m, p - s) for s in range(p))


def test_zb_with_one_stage_per_rank_peaks_like_1f1b():
    """ZB-H1: the largest per-rank peak is 1F1B's (p micro-batches on rank 0).

    Later ranks delay their weight gradients, so each holds p micro-batches at
    its peak (1F1B: p - s); none holds more than 1F1B's first rank.
    """
    for p in (1, 2, 3, 4, 8):
        for m in range(p, 3 * p + 1):
            if not accepted("zb", p, m, 1):
                continue
            zb = simulate(uniform(p, 1, act=7, static=100), "zb", p, m, 1)
            one_f_one_b = simulate(uniform(p, 1, act=7, static=100), "1f1b", p, m)
            assert max(zb.rank_peak_memory_bytes) == max(one_f_one_b.rank_peak_memory_bytes)
            assert max(zb.stage_peak_in_flight) == min(m, p)


def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w():
    """ZB-H1 (zb, v = 1) with w <= min(f, b): iteration = m (f+b+w) + (p-1)(f+b-w)."""
    for f, b, w in ((1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0), (1.0, 2.0, 0.25)):
        for p in range(1, 9):
            for m in range(p, 3 * p + 1):
                if not accepted("zb", p, m, 1):
                    continue
                sim = simulate(uniform(p, 1, f, b, w), "zb", p, m, 1)
                assert sim.iteration_ms == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))


@pytest.mark.parametrize("schedule,v", [("zb", 1), ("zb", 2), ("zbv", 2), ("dualpipev", 2)])
def test_zero_bubble_schedules_beat_1f1b_when_w_is_real(schedule, v):
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            if not accepted(schedule, p, m, v):
                continue
            ours = simulate(uniform(p, v), schedule, p, m, v)
            base = simulate(uniform(p, 1), "1f1b", p, m)
            assert ours.bubble_fraction < base.bubble_fraction, (p, m)
            assert ours.iteration_ms < base.iteration_ms


def test_zero_bubble_gains_nothing_without_w():
    """With w = 0 the B/W split has nothing to move: ZB-H1 is 1F1B."""
    for p in (2, 4):
        for m in (p, 2 * p):
            zb = simulate(uniform(p, 1, w=0.0), "zb", p, m, 1)
            base = simulate(uniform(p, 1, w=0.0), "1f1b", p, m)
            assert zb.iteration_ms == pytest.approx(base.iteration_ms)


def test_transfer_breakdown_on_two_ranks():
    """GPipe, one micro-batch, two ranks: f0 + s + f1 + b1 + s + b0; both sends exposed."""
    f, b, s = 1.0, 2.0, 0.5
    sim = simulate([StageCost(f, b, 0.0, send_ms=s)] * 2, "gpipe", 2, 1)
    assert sim.iteration_ms == pytest.approx(2 * f + 2 * b + 2 * s)
    assert sim.transfer_ms == pytest.approx(2 * s)
    assert sim.compute_ms == pytest.approx(f + b)
    assert sim.bubble_ms == pytest.approx(f + b)


def test_v_placement_sends_nothing_between_a_ranks_two_stages():
    """zbv: stages p-1 and p share rank p-1, so their send_ms never counts."""
    p, m = 2, 4
    base = uniform(p, 2)
    slow_middle = list(base)
    slow_middle[p - 1] = StageCost(
        base[0].forward_ms, base[0].backward_input_ms, base[0].backward_weight_ms, send_ms=100.0,
        activation_bytes=1,
    )
    assert simulate(slow_middle, "zbv", p, m, 2).iteration_ms == simulate(base, "zbv", p, m, 2).iteration_ms


# --------------------------------------------------------------------- inputs


def test_check_schedule_rules():
    with pytest.raises(BadInputError, match="micro-batches >= ranks"):
        check_schedule("1f1b", 4, 3, 1)
    with pytest.raises(BadInputError, match="multiple of the 2 rounds"):
        check_schedule("interleaved", 2, 5, 2)
    with pytest.raises(BadInputError, match="virtual stages = 3"):
        check_schedule("zbv", 2, 4, 3)
    with pytest.raises(BadInputError, match="virtual stages = 1"):
        check_schedule("interleaved", 2, 4, 1)
    with pytest.raises(BadInputError, match="virtual stages = 2"):
        check_schedule("gpipe", 2, 4, 2)
    with pytest.raises(BadInputError, match="at least 8 micro-batches"):
        check_schedule("dualpipev", 4, 7, 2)
    with pytest.raises(BadInputError, match="unknown"):
        check_schedule("pipedream", 2, 4, 1)
    check_schedule("interleaved", 4, 3, 2)  # one round of 3
    check_schedule("zbv", 4, 1, 2)


def test_simulate_rejects_wrong_number_of_costs():
    with pytest.raises(BadInputError, match="one StageCost per stage"):
        simulate(uniform(2, 1), "interleaved", 2, 4, 2)


def test_stage_cost_rejects_negative_and_nan():
    with pytest.raises(BadInputError, match="forward_ms"):
        StageCost(-1.0, 1.0, 1.0)
    with pytest.raises(BadInputError, match="send_ms"):
        StageCost(1.0, 1.0, 1.0, send_ms=math.nan)
    with pytest.raises(BadInputError, match="activation_bytes"):
        StageCost(1.0, 1.0, 1.0, activation_bytes=-1)


def test_action_strings_use_torch_letters():
    assert [str(Action(1, 0, k)) for k in ("F", "B", "W", "FULL_B")] == ["1F0", "1I0", "1W0", "1B0"]
    for text in ("0F0", "12B3", "2I1", "2W10"):
        assert str(Action.from_str(text)) == text
    with pytest.raises(BadInputError):
        Action.from_str("0X0")


def test_stage_ranks_loop_and_v():
    assert stage_ranks("interleaved", 3, 2) == [0, 1, 2, 0, 1, 2]
    assert stage_ranks("dualpipev", 3, 2) == [0, 1, 2, 2, 1, 0]


def test_schedule_names_match_the_plan_format():
    from pipeplan.formats.plan import SCHEDULES as PLAN_SCHEDULES

    assert SCHEDULES == PLAN_SCHEDULES
    assert set(TORCH_SCHEDULE_CLASS) == set(SCHEDULES)


# --------------------------------------------------------------------- properties


def _draw_schedule(draw, max_ranks: int, max_microbatches: int):
    """A schedule with a (v, p, m) its class accepts."""
    schedule = draw(st.sampled_from(SCHEDULES))
    v = draw(st.sampled_from(valid_virtual_stages(schedule)))
    p = draw(st.integers(1, max_ranks))
    m = draw(st.integers(1, max_microbatches))
    assume(accepted(schedule, p, m, v))
    return schedule, v, p, m


@st.composite
def cases(draw):
    schedule, v, p, m = _draw_schedule(draw, 5, 12)
    ms = st.floats(0.0, 5.0, allow_nan=False, allow_infinity=False)
    # The planner gives every stage the same per-action overhead; often none.
    overhead = draw(st.sampled_from([0.0, 0.0, 0.3, 1.0]))
    costs = [
        StageCost(
            draw(ms), draw(ms), draw(ms),
            send_ms=draw(st.floats(0.0, 2.0)),
            static_memory_bytes=draw(st.integers(0, 1000)),
            activation_bytes=draw(st.integers(0, 100)),
            action_overhead_ms=overhead,
        )
        for _ in range(p * v)
    ]
    return schedule, p, m, v, costs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_simulation_properties(case):
    schedule, p, m, v, costs = case
    sim = simulate(costs, schedule, p, m, v)
    placement = sim.stage_ranks
    eps = 1e-9

    # Each rank runs exactly its listed actions, in order, one at a time.
    by_rank = [[e for e in sim.events if e.rank == r] for r in range(p)]
    for r, (events, actions) in enumerate(zip(by_rank, rank_actions(schedule, p, m, v))):
        assert [(e.stage, e.microbatch, e.kind) for e in events] == [
            (a.stage, a.microbatch, a.kind) for a in actions
        ]
        # ...each after its overhead, which follows the rank's previous action.
        if events:
            assert events[0].start_ms >= costs[events[0].stage].action_overhead_ms - eps
        for before, after in zip(events, events[1:]):
            assert after.start_ms >= before.end_ms + costs[after.stage].action_overhead_ms - eps
        assert all(placement[e.stage] == r for e in events)
        assert sim.rank_overhead_ms[r] == pytest.approx(sum(costs[e.stage].action_overhead_ms for e in events))

    # Dependencies: forward chain, backward chain with transfers, F before B before W.
    ends = {}
    for e in sim.events:
        key = ("B" if e.kind == "FULL_B" else e.kind, e.stage, e.microbatch)
        assert key not in ends
        ends[key] = e
    n = p * v
    for s in range(n):
        for i in range(m):
            forward = ends[("F", s, i)]
            backward = ends[("B", s, i)]
            assert backward.start_ms >= forward.end_ms - eps
            if backward.kind == "B":
                assert ends[("W", s, i)].start_ms >= backward.end_ms - eps
            else:
                assert ("W", s, i) not in ends
            if s > 0:
                hop = costs[s - 1].send_ms if placement[s - 1] != placement[s] else 0.0
                assert forward.start_ms >= ends[("F", s - 1, i)].end_ms + hop - eps
            if s < n - 1:
                hop = costs[s].send_ms if placement[s + 1] != placement[s] else 0.0
                assert backward.start_ms >= ends[("B", s + 1, i)].end_ms + hop - eps

    # Time accounting.
    assert sim.iteration_ms >= max(sim.rank_busy_ms) - eps
    for r in range(p):
        assert sim.rank_busy_ms[r] + sim.rank_overhead_ms[r] + sim.rank_idle_ms[r] == pytest.approx(sim.iteration_ms)
    assert sim.compute_ms + sim.overhead_ms + sim.bubble_ms + sim.transfer_ms == pytest.approx(sim.iteration_ms)
    assert min(sim.bubble_ms, sim.transfer_ms) >= 0
    # The bubble is the critical rank's waiting, measured on its events' idle intervals, which
    # lie between its actions; with its compute and overhead they cover the iteration.
    for r in range(p):
        intervals = sim.rank_idle_intervals(r)
        spans = sorted([(e.start_ms, e.end_ms) for e in by_rank[r]] + intervals)
        assert all(a[1] <= b[0] + eps for a, b in zip(spans, spans[1:])), "idle overlaps compute"
        waits = sum(end - start for start, end in intervals)
        assert waits == pytest.approx(sim.rank_idle_ms[r], abs=1e-9)
    waits = sum(end - start for start, end in sim.rank_idle_intervals(sim.critical_rank))
    assert sim.bubble_ms == pytest.approx(max(0.0, waits - sim.transfer_ms), abs=1e-9)
    assert 0.0 <= sim.bubble_fraction < 1.0 or sim.iteration_ms == 0
    total = sum(c.forward_ms + c.backward_ms for c in costs) * m
    assert sum(sim.rank_busy_ms) == pytest.approx(total)

    # Memory: starts and ends at the static bytes, peak is the timeline's maximum.
    for r in range(p):
        static = sum(c.static_memory_bytes for s, c in enumerate(costs) if placement[s] == r)
        timeline = sim.rank_memory_timeline[r]
        assert timeline[0] == (0.0, static)
        assert timeline[-1][1] == static
        assert sim.rank_peak_memory_bytes[r] == max(b for _, b in timeline)
        assert all(t2 >= t1 - eps for (t1, _), (t2, _) in zip(timeline, timeline[1:]))
    assert all(1 <= k <= m for k in sim.stage_peak_in_flight)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases(), st.floats(0.0, 3.0))
def test_slower_transfers_or_more_overhead_never_speed_up_and_free_transfers_cost_nothing(case, extra_ms):
    schedule, p, m, v, costs = case
    base = simulate(costs, schedule, p, m, v)
    slower = [replace(c, send_ms=c.send_ms + extra_ms) for c in costs]
    assert simulate(slower, schedule, p, m, v).iteration_ms >= base.iteration_ms - 1e-9
    busier = [replace(c, action_overhead_ms=c.action_overhead_ms + extra_ms) for c in costs]
    assert simulate(busier, schedule, p, m, v).iteration_ms >= base.iteration_ms - 1e-9
    free = [replace(c, send_ms=0.0) for c in costs]
    free_sim = simulate(free, schedule, p, m, v)
    assert free_sim.transfer_ms == 0.0
    assert base.iteration_ms - base.transfer_ms == pytest.approx(free_sim.iteration_ms)


def test_every_accepted_configuration_simulates():
    """No accepted (schedule, p, m, v) deadlocks, and each action appears once (the interleaved
    classes also at VP 5 and 8, which their classes take as they take any v)."""
    for schedule in SCHEDULES:
        more = (5, 8) if schedule in ("interleaved", "zb") else ()
        for v in valid_virtual_stages(schedule) + more:
            for p in range(1, 7):
                for m in range(1, 3 * p + 3):
                    if not accepted(schedule, p, m, v):
                        continue
                    sim = simulate(uniform(p, v), schedule, p, m, v)
                    kinds = {}
                    for e in sim.events:
                        kinds[e.kind] = kinds.get(e.kind, 0) + 1
                    assert kinds.get("F") == p * v * m
                    assert kinds.get("FULL_B", 0) + kinds.get("B", 0) == p * v * m
                    assert kinds.get("W", 0) == kinds.get("B", 0)


@pytest.mark.parametrize("schedule,v", [("zb", 1), ("zb", 2), ("zbv", 2), ("dualpipev", 2)])
def test_split_backward_as_torch_runs_it(schedule, v):
    """A split backward takes B then W (which may cost more than the whole backward); stage 0's
    B does nothing and its W runs the whole backward, as in torch 2.13; schedules that do not
    split take ``full_backward_ms``."""
    p, m = 2, 4
    cost = StageCost(forward_ms=1.0, backward_input_ms=1.5, backward_weight_ms=1.25, full_backward_ms=2.0)
    assert cost.backward_ms == 2.0
    sim = simulate([cost] * (p * v), schedule, p, m, v)
    durations = {(e.stage == 0, e.kind): set() for e in sim.events}
    for e in sim.events:
        durations[(e.stage == 0, e.kind)].add(round(e.end_ms - e.start_ms, 9))
    assert durations[(True, "W")] == {2.0}
    assert durations.get((True, "B"), {0.0}) == {0.0}
    assert durations[(False, "B")] == {1.5} and durations[(False, "W")] == {1.25}
    assert all(d == {2.0} for (first, kind), d in durations.items() if kind == "FULL_B")
    base = simulate([cost] * p, "1f1b", p, m)
    assert {round(e.end_ms - e.start_ms, 9) for e in base.events if e.kind == "FULL_B"} == {2.0}


def test_full_backward_defaults_to_the_two_passes():
    cost = StageCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=0.5)
    assert cost.full_backward_ms is None and cost.backward_ms == 1.5
    with pytest.raises(BadInputError, match="full_backward_ms"):
        StageCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=0.5, full_backward_ms=-1.0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_the_planners_pruning_bound_never_exceeds_the_simulation(case):
    """``--schedule auto`` skips configurations whose lower bound exceeds the best simulated
    time, so the bound must hold for every schedule, split backward and overhead."""
    from pipeplan.plan.search import busy_lower_bound_ms as _busy_lower_bound_ms

    schedule, p, m, v, costs = case
    sim = simulate(costs, schedule, p, m, v)
    assert _busy_lower_bound_ms(costs, list(sim.stage_ranks), m) <= sim.iteration_ms + 1e-9


@st.composite
def unit_cases(draw):
    """A schedule and a chain of units split into its ``p * v`` contiguous stages."""
    schedule, v, p, m = _draw_schedule(draw, 4, 10)
    k = p * v
    n = draw(st.integers(k, k + 6))
    ms = st.floats(0.0, 5.0, allow_nan=False, allow_infinity=False)
    units = [(draw(ms), draw(ms), draw(ms)) for _ in range(n)]   # forward, input and weight backward
    cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1, unique=True))) if k > 1 else []
    bounds = [0, *cuts, n]
    send = draw(st.floats(0.0, 2.0))
    costs = [StageCost(sum(u[0] for u in units[lo:hi]), sum(u[1] for u in units[lo:hi]),
                       sum(u[2] for u in units[lo:hi]), send_ms=send)
             for lo, hi in zip(bounds, bounds[1:])]
    return schedule, p, m, v, units, costs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(unit_cases())
def test_the_cluster_searchs_round_trip_bound_never_exceeds_the_simulation(case):
    """The cluster search prunes layouts with one micro-batch's round trip, bounded without a
    split (:func:`pipeplan.cluster.iteration.round_trip_lower_bound_ms`); the planner with the
    split's own trip on the first stage's rank: both must hold for every schedule and split."""
    from pipeplan.cluster.iteration import round_trip_lower_bound_ms
    from pipeplan.plan.search import rank_end_lower_bounds_ms

    schedule, p, m, v, units, costs = case
    sim = simulate(costs, schedule, p, m, v)
    bound = round_trip_lower_bound_ms([u[0] for u in units], [min(u[1], u[1] + u[2]) for u in units],
                                      [u[0] + u[1] + u[2] for u in units], m)
    assert bound <= sim.iteration_ms + 1e-9
    trip, _ = rank_end_lower_bounds_ms(costs, list(sim.stage_ranks), m)
    first_rank_end = max(e.end_ms for e in sim.events if e.rank == sim.stage_ranks[0])
    assert trip <= first_rank_end + 1e-9
