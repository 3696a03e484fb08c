"""Cluster runners-up planned in full and ``pipeplan plan --compare`` (issue 25).

The runners-up a cluster plan lists with a label are planned exactly after the search; each must
hold what planning that layout alone (``--data-parallel d --tensor-parallel t --stages p``) gives,
and a ``--compare`` layout the same, beside the winner in the plan file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_checks import invoke, one_line_error
from pipeplan.cluster import search as search_module
from pipeplan.cluster.presets import PRESETS
from pipeplan.formats.io import file_sha256, load_plan, load_profile
from pipeplan.formats.plan import PlanSettings

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "profiles" / "transformer32-analytic.json"
BASE = dict(num_gpus=16, cluster=PRESETS["dgx-a100"], global_batch=64, schedule="1f1b", recompute="auto",
            memory_cap_bytes=40 * 2**30)
CLI = [PROFILE, "--gpus", 16, "--cluster", "dgx-a100", "--global-batch", 64, "--schedule", "1f1b",
       "--memory-cap", "40GiB"]


def _plan(**kw):
    settings = PlanSettings(**{**BASE, **kw})
    return search_module.plan_cluster(load_profile(PROFILE), settings, profile_sha256=file_sha256(PROFILE))


@pytest.fixture(scope="module")
def searched():
    return _plan()


def _alone(alternative):
    """The same request with the runner-up's layout fixed: the plan of that layout alone."""
    return _plan(data_parallel=alternative.data, tensor_parallel=alternative.tensor, stages=alternative.pipeline)


def _same_plan(alternative, plan):
    assert alternative.iteration_ms == pytest.approx(plan.predicted.iteration_ms, rel=1e-12)
    par = plan.parallelism
    assert (alternative.zero_stage, alternative.schedule, alternative.virtual_stages, alternative.microbatch_size) \
        == (par.zero_stage, plan.schedule, plan.virtual_stages, plan.microbatch_size)
    assert alternative.peak_memory_bytes == max(r.peak_memory_bytes for r in plan.ranks)


def test_labelled_runners_up_are_each_layouts_own_plan(searched, monkeypatch):
    labelled = [a for a in searched.alternatives if a.label is not None]
    assert 2 <= len(labelled) <= search_module.RUNNER_UP_LAYOUTS
    assert {a.label.split(";")[0] for a in labelled} >= {"pure data parallel", "t=1 (the largest t)"}
    # At least one of them the search itself had cut by its bound: planning it again is what
    # makes the row a time.
    calls = []
    real = search_module._exact_best

    def spy(search, trials, unbounded):
        calls.append({t.status for t in trials})
        return real(search, trials, unbounded)

    monkeypatch.setattr(search_module, "_exact_best", spy)
    _plan()
    assert any("pruned" in statuses for statuses in calls)
    times = [a.iteration_ms for a in labelled]
    assert times == sorted(times) and min(times) >= searched.predicted.iteration_ms
    for alternative in labelled:
        _same_plan(alternative, _alone(alternative))
        gap = alternative.iteration_ms - searched.predicted.iteration_ms
        assert f"slower by {gap:.1f} ms" in alternative.reason


def test_tensor_degree_rows_and_their_proof_against_every_layout_alone():
    """Llama 3 8B on 16 H100s, t = 1, 2, 8: one row per tensor degree but the winner's, each its
    layout's own plan; "proven best of its kind" holds against planning every layout of the kind
    alone, and "not ruled out" counts the layouts whose bound is below the row's time."""
    from pipeplan.analytic.api import analytic_profile
    from pipeplan.facts.gpus import get_gpu

    profile = analytic_profile("llama3-8b", get_gpu("h100-sxm"), seq_len=2048, dtype="bf16",
                               microbatch_sizes=[1, 2], tensor_parallel=[1, 2, 8])
    settings = PlanSettings(num_gpus=16, cluster=PRESETS["dgx-h100"], global_batch=32, schedule="1f1b",
                            recompute="auto", memory_cap_bytes=40 * 2**30)

    def plan(**kw):
        return search_module.plan_cluster(profile, settings.model_copy(update=kw), profile_sha256="test")

    searched = plan()
    alone = {(a.data, a.tensor, a.pipeline): plan(data_parallel=a.data, tensor_parallel=a.tensor, stages=a.pipeline)
             for a in searched.alternatives}
    labelled = {a.label.split(";")[0]: a for a in searched.alternatives if a.label is not None}
    winner_t = searched.parallelism.tensor
    assert {f"t={t}" for t in (1, 2) if t != winner_t} | {"t=8 (the largest t)"} <= set(labelled)
    for label, row in labelled.items():
        _same_plan(row, alone[(row.data, row.tensor, row.pipeline)])
        if not label.startswith("t="):
            continue
        kind = [p.predicted.iteration_ms for (d, t, p_), p in alone.items() if t == row.tensor]
        if row.label.endswith("proven best of its kind"):
            assert row.iteration_ms == pytest.approx(min(kind), rel=1e-12)
    assert any(";" in a.label for a in labelled.values())


def test_unlabelled_rows_keep_their_bounds(searched):
    labelled = {(a.data, a.tensor, a.pipeline) for a in searched.alternatives if a.label is not None}
    for a in searched.alternatives:
        if a.label is None:
            assert (a.data, a.tensor, a.pipeline) not in labelled
            assert a.iteration_ms is not None or a.lower_bound_ms is not None or "infeasible" in a.reason \
                or "training state" in a.reason


def test_compare_plans_the_named_layout_and_records_it(tmp_path):
    out = tmp_path / "plan.json"
    result = invoke("plan", *CLI, "--compare", "d=2,t=1,p=8", "--compare", "d=2,t=1,p=8,zero=3,mbs=1",
                    "-o", out, "-q")
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    first, fixed = plan.comparisons
    assert (first.label, fixed.label) == ("d=2,t=1,p=8", "d=2,t=1,p=8,zero=3,mbs=1")
    _same_plan(first, _plan(data_parallel=2, tensor_parallel=1, stages=8))
    _same_plan(fixed, _plan(data_parallel=2, tensor_parallel=1, stages=8, zero_stage=3, microbatch_size=1))
    assert plan.settings.compare == ["d=2,t=1,p=8", "d=2,t=1,p=8,zero=3,mbs=1"]
    # The winner is the search's, unchanged by what was compared, and the file is reproducible.
    again = tmp_path / "again.json"
    assert invoke("plan", *CLI, "--compare", "d=2,t=1,p=8", "--compare", "d=2,t=1,p=8,zero=3,mbs=1",
                  "-o", again, "-q").exit_code == 0
    assert again.read_bytes() == out.read_bytes()
    plain = tmp_path / "plain.json"
    assert invoke("plan", *CLI, "-o", plain, "-q").exit_code == 0
    data, plain_data = json.loads(out.read_text()), json.loads(plain.read_text())
    for key in ("comparisons",):
        data.pop(key)
    data["settings"].pop("compare")
    assert data == plain_data
    shown = invoke("show", out)
    assert shown.exit_code == 0
    text = shown.stdout
    assert "compared layouts (--compare)" in text and "runners-up planned in full" in text
    gap = first.iteration_ms / plan.predicted.iteration_ms - 1
    assert f"{gap:+.1%}" in text and f"{first.iteration_ms:.1f}" in text


def test_compare_an_infeasible_layout_is_recorded_with_why(tmp_path):
    out = tmp_path / "plan.json"
    result = invoke("plan", *CLI, "--compare", "d=16,t=1,p=1,zero=0", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    (row,) = load_plan(out).comparisons
    assert row.iteration_ms is None and row.zero_stage == 0
    assert "infeasible" in row.reason or "training state" in row.reason
    assert "d=16 t=1 p=1 ZeRO 0" in invoke("show", out).stdout


@pytest.mark.parametrize("layout, needles", [
    ("d=3,t=1,p=5", ("--compare 'd=3,t=1,p=5'", "is not --gpus 16")),
    ("d=8,t=1", ("--compare", "give p=..")),
    ("d=8,t=1,p=2,x=1", ("--compare", "KEY=VALUE")),
    ("d=8,t=t,p=2", ("--compare", "not a whole number")),
    ("d=8,t=1,p=2,zero=4", ("--compare", "zero=4 must be 0..3")),
    ("d=8,t=1,p=2,mbs=3", ("--compare", "mbs=3 is not a profiled micro-batch size")),
    ("d=8,t=2,p=1", ("--compare 'd=8,t=2,p=1'", "t: the profile has no costs at degree 2")),
    ("d=1,t=1,p=16,e=2", ("--compare", "no experts")),
])
def test_compare_refuses_a_layout_the_rules_refuse(layout, needles):
    one_line_error(invoke("plan", *CLI, "--compare", layout, "-q"), 2, *needles)


def test_compare_needs_gpus():
    one_line_error(invoke("plan", PROFILE, "--stages", 2, "--compare", "d=1,t=1,p=2", "-q"), 2,
                   "--compare", "needs --gpus")
