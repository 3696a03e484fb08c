"""The second split for several stages per rank (v > 1), balanced by rank (pipeplan.plan.ranks).

With ``v > 1`` the slowest *rank* (the sum of its stages) is what the pipeline waits for, and the
min-max-stage split does not see it. These tests check that the planner's plan is never slower
in prediction than the min-max-stage split of the same configuration, that the balanced split
never has a larger largest rank load, a GPT-2-like zbv case where the old split is unbalanced,
and how close the single-unit local search gets to the brute-force best largest rank load.
"""

from __future__ import annotations

import itertools
import random

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hyp_settings, strategies as st

from pipeplan.formats.io import dump_model
from pipeplan.formats.plan import PlanSettings
from pipeplan.plan import make_plan
from pipeplan.plan.graph import LayerGraph, build_layer_graph
from pipeplan.plan.memory import stage_in_flight
from pipeplan.plan.problem import (PartitionProblem, build_problem, evaluate_split, split_fits, stage_cost_at, stage_costs,
                                   stage_fits)
from pipeplan.plan.ranks import balance_ranks, rank_loads_ms, stage_busy_ms
from pipeplan.facts.schedules import stage_ranks, valid_virtual_stages
from pipeplan.plan.search import with_profile_defaults
from pipeplan.plan.simulate import simulate
from pipeplan.plan.solve import search_partition

from test_schedule_planning import assert_plan_is_its_simulation, chain_profile

V_SCHEDULES = [(s, v) for s in ("interleaved", "zb", "zbv", "dualpipev") for v in valid_virtual_stages(s) if v > 1]

#: GPT-2-like: a small embedding, twelve equal blocks, a large LM head (vocabulary 50k against a
#: narrow model), with the backward split half and half.
GPT2_LIKE_FORWARD_MS = [0.5] + [4.0] * 12 + [30.0]


def _min_max_split(profile, plan_settings, schedule, v, b):
    """The min-max-stage split of one configuration (the planner's old split), its problem and simulation."""
    settings = with_profile_defaults(profile, plan_settings)
    p, m = settings.stages, settings.global_batch // b
    problem = build_problem(profile, build_layer_graph(profile, b), settings, stage_in_flight(schedule, p, m, v))
    old = search_partition(problem)
    return problem, old, simulate(stage_costs(problem, old), schedule, p, m, v)


def _max_rank_load(problem, partition, placement):
    return max(rank_loads_ms(stage_costs(problem, partition), placement))


def test_gpt2_like_zbv_split_is_balanced_by_rank_and_predicted_faster():
    profile = chain_profile(GPT2_LIKE_FORWARD_MS, split=0.5)
    settings = PlanSettings(stages=2, schedule="zbv", global_batch=16, microbatch_size=1)
    plan = make_plan(profile, settings, profile_sha256="0" * 64)
    problem, old, old_sim = _min_max_split(profile, settings, "zbv", 2, 1)
    placement = stage_ranks("zbv", 2, 2)
    # The old split puts the two middle stages, the large ones, on rank 1 (the V).
    assert [len(s) for s in old.stages] == [5, 4, 4, 1]
    assert [round(x, 1) for x in rank_loads_ms(stage_costs(problem, old), placement)] == [139.5, 96.0]
    assert plan.solver.method == "rank-balanced" and not plan.solver.optimal
    assert [len(s.layers) for s in plan.stages] == [3, 6, 4, 1]
    new = evaluate_split(problem, [tuple(int(n[len("layer"):]) for n in s.layers) for s in plan.stages])
    assert [round(x, 1) for x in rank_loads_ms(stage_costs(problem, new), placement)] == [115.5, 120.0]
    # Measurably faster in prediction: 2232.0 -> 1952.5 ms.
    assert old_sim.iteration_ms == pytest.approx(2232.0)
    assert plan.predicted.iteration_ms == pytest.approx(1952.5, abs=1e-5)
    assert any("split balanced by rank" in note and "2232.000 ms" in note for note in plan.notes)
    assert_plan_is_its_simulation(profile, plan)
    # Deterministic: the same inputs give the same plan file.
    again = make_plan(profile, settings, profile_sha256="0" * 64)
    assert dump_model(plan) == dump_model(again)


def test_an_already_balanced_split_is_kept_as_it_was():
    # Equal units: the min-max split is balanced by rank too, so the plan is the old one.
    profile = chain_profile([2.0] * 16, split=0.5)
    for schedule in ("zbv", "interleaved"):
        plan = make_plan(profile, PlanSettings(stages=2, schedule=schedule, global_batch=8, microbatch_size=1,
                                               virtual_stages=2), profile_sha256="0" * 64)
        assert plan.solver.method == "dp-chain-direct"
        assert not any("balanced by rank" in note for note in plan.notes)


@st.composite
def small_chains(draw):
    n = draw(st.integers(5, 12))
    forward = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0]), min_size=n, max_size=n))
    schedule, v = draw(st.sampled_from(V_SCHEDULES))
    p = draw(st.integers(2, 3))
    if p * v > n:
        p = 2
    if p * v > n:
        schedule, v = "zbv", 2
    m = p * draw(st.sampled_from([2, 4]))
    bandwidth = draw(st.sampled_from([None, 1e6]))
    return forward, schedule, v, p, m, bandwidth


@hyp_settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_chains())
def test_the_plan_is_never_slower_than_the_min_max_stage_split(case):
    forward, schedule, v, p, m, bandwidth = case
    profile = chain_profile(forward, sizes=(1,), split=0.5)
    settings = PlanSettings(stages=p, schedule=schedule, virtual_stages=v, global_batch=m, microbatch_size=1,
                            bandwidth_bytes_per_s=bandwidth, action_overhead_ms=0.0)
    plan = make_plan(profile, settings, profile_sha256="0" * 64)
    problem, old, old_sim = _min_max_split(profile, settings, schedule, v, 1)
    assert plan.predicted.iteration_ms <= round(old_sim.iteration_ms, 6) + 1e-6
    placement = stage_ranks(schedule, p, v)
    balanced = balance_ranks(problem, old, placement)
    if balanced is not None:
        assert split_fits(problem, balanced)
        assert _max_rank_load(problem, balanced, placement) <= _max_rank_load(problem, old, placement) + 1e-9
    if plan.solver.method == "rank-balanced":
        assert plan.predicted.iteration_ms < old_sim.iteration_ms
    else:
        assert plan.predicted.iteration_ms == pytest.approx(old_sim.iteration_ms, abs=1e-5)


def _brute_force_max_rank_load(problem, placement):
    """The least largest rank load over every split into runs of the layer order that fits (each
    stage costed once per (stage, start, end) with the problem's own stage cost and memory rule)."""
    n, k = problem.graph.num_layers, problem.num_stages
    out_bytes = problem.graph.output_bytes
    stage = {}
    for j in range(k):
        for lo in range(n):
            for hi in range(lo + 1, n + 1):
                layers = tuple(range(lo, hi))
                in_bytes = int(out_bytes[lo - 1]) if j > 0 else 0
                if stage_fits(problem, j, layers, in_bytes):
                    cost = stage_cost_at(problem, j, layers, in_bytes, int(out_bytes[hi - 1]) if j < k - 1 else 0)
                    stage[j, lo, hi] = stage_busy_ms(cost)
    best = np.inf
    for inner in itertools.combinations(range(1, n), k - 1):
        cuts = (0, *inner, n)
        if all((j, cuts[j], cuts[j + 1]) in stage for j in range(k)):
            loads = [0.0] * (max(placement) + 1)
            for j in range(k):
                loads[placement[j]] += stage[j, cuts[j], cuts[j + 1]]
            best = min(best, max(loads))
    return best


def _lumpy_chain(rng):
    n = rng.randint(6, 10)
    return [rng.choice([0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0]) for _ in range(n)]


def _transformer_like_chain(rng):
    n = rng.randint(8, 11)
    return ([rng.choice([0.2, 0.5, 1.0])] + [rng.choice([3.8, 4.0, 4.2]) for _ in range(n - 2)]
            + [rng.choice([2.0, 8.0, 16.0])])


@pytest.mark.parametrize("chain, least_exact, worst_ratio", [
    # Measured: 81 of 120 at the optimum, the worst 1.44 x it.
    (_lumpy_chain, 75, 1.5),
    # Measured: 93 of 120 at the optimum, the worst 1.028 x it.
    (_transformer_like_chain, 88, 1.05),
])
def test_the_local_search_against_the_brute_force_best_rank_load(chain, least_exact, worst_ratio):
    """Not exact: moves of one boundary by one unit (and, when stuck, of two nearby boundaries
    together) stop at local optima.

    On 120 seeded random chains each (2 ranks, zbv and interleaved v = 2 and 3), against every
    split into runs of the layer order: the split kept (balanced, or the old one where no move
    helps) is never worse than the min-max-stage split nor better than the brute-force best
    largest rank load, reaches that best in 81 of 120 lumpy chains (units 0.5-13 ms) and 93 of
    120 transformer-like ones (equal blocks, a small embedding, a head), and
    stays within 1.5 x and 1.05 x of it respectively.
    """
    rng = random.Random(14)
    exact = 0
    ratio = 1.0
    for _ in range(120):
        forward = chain(rng)
        schedule, v = rng.choice([("zbv", 2), ("interleaved", 2), ("interleaved", 3)])
        profile = chain_profile(forward, sizes=(1,), split=0.5)
        settings = PlanSettings(stages=2, global_batch=8, microbatch_size=1, action_overhead_ms=0.0)
        problem, old, _ = _min_max_split(profile, settings, schedule, v, 1)
        placement = stage_ranks(schedule, 2, v)
        balanced = balance_ranks(problem, old, placement)
        found = _max_rank_load(problem, balanced or old, placement)
        best = _brute_force_max_rank_load(problem, placement)
        assert best - 1e-9 <= found <= _max_rank_load(problem, old, placement) + 1e-9
        exact += found <= best + 1e-9
        ratio = max(ratio, found / best)
    print(f"{chain.__name__}: {exact} of 120 at the brute-force best, the worst {ratio:.3f} x it")
    assert exact >= least_exact
    assert ratio < worst_ratio


def test_a_split_that_is_not_a_run_of_the_layer_order_is_left_alone():
    # A diamond: a -> (b, c) -> d; the stages {a, c}, {b}, ... are not runs of the order 0..3.
    g = nx.DiGraph([(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (4, 5)])
    ones = np.ones(6)
    graph = LayerGraph(names=tuple("abcdef"), forward_ms=ones, backward_ms=2 * ones, backward_input_ms=ones,
                       backward_weight_ms=ones, backward_split_measured=False, param_bytes=ones,
                       activation_bytes=ones, output_bytes=ones, graph=g, chain=False)
    problem = PartitionProblem(graph=graph, num_stages=4, in_flight=(4, 3, 2, 1))
    split = evaluate_split(problem, [(0, 2), (1,), (3, 4), (5,)])
    assert balance_ranks(problem, split, [0, 1, 1, 0]) is None
    # A prefix split of the same DAG is balanced like a chain's.
    prefix = evaluate_split(problem, [(0, 1, 2), (3,), (4,), (5,)])
    balanced = balance_ranks(problem, prefix, [0, 1, 1, 0])
    assert balanced is not None and split_fits(problem, balanced)
    assert _max_rank_load(problem, balanced, [0, 1, 1, 0]) < _max_rank_load(problem, prefix, [0, 1, 1, 0])


def test_the_balanced_split_respects_the_per_stage_cap():
    profile = chain_profile(GPT2_LIKE_FORWARD_MS, split=0.5, activation_bytes=1000)
    settings = PlanSettings(stages=2, schedule="zbv", global_batch=16, microbatch_size=1)
    free, old, _ = _min_max_split(profile, settings, "zbv", 2, 1)
    placement = stage_ranks("zbv", 2, 2)
    balanced = balance_ranks(free, old, placement)
    assert balanced is not None
    # A cap that the old split meets but the free balanced split's stage 0 does not.
    from pipeplan.plan.problem import stage_breakdowns

    old_peaks = [s.memory.peak_bytes for s in stage_breakdowns(free, old)]
    new_peaks = [s.memory.peak_bytes for s in stage_breakdowns(free, balanced)]
    cap = max(old_peaks)
    assert max(new_peaks) > cap
    capped = free.replace(memory_cap_bytes=cap)
    held = balance_ranks(capped, old, placement)
    if held is not None:
        assert split_fits(capped, held)
        assert _max_rank_load(capped, held, placement) <= _max_rank_load(capped, old, placement)
