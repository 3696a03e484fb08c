"""The planner on PipeDream's real profiles (shipped in profiles/pipedream)."""

from __future__ import annotations

import pytest

from conftest import PIPEDREAM_BATCH, pipedream_path
from pipeplan.formats.plan import PlanSettings
from pipeplan.importers import import_pipedream
from pipeplan.plan import make_plan


def _plan(name, stages, **kw):
    batch = PIPEDREAM_BATCH[name]
    profile = import_pipedream(pipedream_path(name), batch)
    settings = PlanSettings(stages=stages, global_batch=batch * 16, bandwidth_bytes_per_s=None,
                            schedule="1f1b", recompute="none", **kw)
    return profile, make_plan(profile, settings, profile_sha256="0" * 64)


def _bottleneck(plan):
    return max(s.forward_ms + s.backward_ms + s.transfer_ms for s in plan.stages)


@pytest.mark.parametrize("name,stages,pipedream_ms", [("vgg16", 4, 216.45), ("resnet50", 8, 56.684)])
def test_no_worse_than_pipedreams_optimizer(name, stages, pipedream_ms):
    _, plan = _plan(name, stages)
    assert _bottleneck(plan) <= pipedream_ms + 1e-6
    assert plan.solver.optimal


def test_resnet50_beats_the_best_split_along_one_order():
    # PipeDream's README: 59.09 ms along one topological order; the DAG optimum is lower.
    _, plan = _plan("resnet50", 8)
    assert _bottleneck(plan) < 59.09


@pytest.mark.parametrize("name", sorted(PIPEDREAM_BATCH))
@pytest.mark.parametrize("stages", [4, 8, 16])
def test_every_profile_plans(name, stages):
    profile, plan = _plan(name, stages)
    names = [layer for s in plan.stages for layer in s.layers]
    assert sorted(names) == sorted(layer.name for layer in profile.layers)
    assert len(plan.stages) == stages
    if not plan.solver.optimal:
        assert "dp-orders" in plan.solver.method or "ilp" in plan.solver.method


def test_memory_cap_is_respected_and_shifts_layers_later():
    _, free = _plan("resnet50", 8)
    cap = int(max(s.peak_memory_bytes for s in free.stages) * 0.8)
    _, capped = _plan("resnet50", 8, memory_cap_bytes=cap)
    assert all(s.peak_memory_bytes <= cap for s in capped.stages)
    assert capped.stages[0].activation_bytes <= free.stages[0].activation_bytes


@pytest.mark.parametrize("name,stages", [("resnet18", 4), ("resnet50", 8), ("squeezenet1_0", 4)])
def test_ilp_and_ideal_dp_agree_on_real_profiles(name, stages):
    import math

    from pipeplan.plan.graph import build_layer_graph
    from pipeplan.plan.ilp import partition_ilp
    from pipeplan.plan.memory import in_flight_microbatches
    from pipeplan.plan import CostModel, PartitionProblem, partition_along_orders, partition_ideals

    batch = PIPEDREAM_BATCH[name]
    profile = import_pipedream(pipedream_path(name), batch)
    graph = build_layer_graph(profile, batch)
    problem = PartitionProblem(graph=graph, num_stages=stages, in_flight=in_flight_microbatches("1f1b", stages, 8),
                               cost=CostModel(bandwidth_bytes_per_s=25e9, static_bytes_per_param_byte=4.0),
                               memory_cap_bytes=math.inf)
    dp = partition_ideals(problem)
    ilp = partition_ilp(problem, upper_bound=partition_along_orders(problem))
    assert ilp.optimal and dp.optimal
    assert ilp.bottleneck_ms == pytest.approx(dp.bottleneck_ms, rel=1e-6)
