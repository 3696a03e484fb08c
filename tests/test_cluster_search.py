"""The cluster search (``pipeplan plan --gpus N --cluster C``) end to end on shipped profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.cluster import bounds as bounds_module
from pipeplan.cluster import search as search_module
from pipeplan.cluster.presets import PRESETS
from pipeplan.errors import InfeasibleError
from pipeplan.formats.io import dump_model, file_sha256, load_plan, load_profile
from pipeplan.formats.plan import PlanSettings

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "profiles" / "transformer32-analytic.json"
runner = CliRunner()


def _settings(**kw):
    base = dict(num_gpus=16, cluster=PRESETS["dgx-a100"], global_batch=64, schedule="1f1b", recompute="auto")
    base.update(kw)
    return PlanSettings(**base)


def _plan(**kw):
    profile = load_profile(PROFILE)
    return search_module.plan_cluster(profile, _settings(**kw), profile_sha256=file_sha256(PROFILE))


def _parts_sum(p):
    return (p.compute_ms + (p.tensor_parallel_ms or 0) + p.bubble_ms + (p.overhead_ms or 0) + p.transfer_ms
            + (p.data_parallel_ms or 0) + (p.optimizer_ms or 0) + (p.host_wait_ms or 0))


def test_cluster_plan_parts_add_up_and_layout_is_recorded():
    plan = _plan()
    par = plan.parallelism
    assert plan.schema_version == 2
    assert par.data * par.tensor * par.pipeline == 16
    assert plan.settings.stages == par.pipeline and plan.settings.search_stages is True
    assert _parts_sum(plan.predicted) == pytest.approx(plan.predicted.iteration_ms, abs=1e-5)
    assert plan.predicted.samples_per_second == pytest.approx(64 / (plan.predicted.iteration_ms / 1e3), rel=1e-6)
    # each replica runs G / d samples in micro-batches of b
    assert plan.num_microbatches * plan.microbatch_size * par.data == 64
    for stage in plan.stages:
        assert stage.weight_bytes + stage.gradient_bytes + stage.optimizer_bytes + stage.peak_activation_bytes \
            == pytest.approx(stage.peak_memory_bytes, abs=4)
    assert {a.reason.split(":")[0] for a in plan.alternatives}  # one row per other layout
    if par.data > 1:
        assert plan.predicted.data_parallel_ms > 0


def _exhaustive(monkeypatch, plan):
    """``plan()`` with every bound switched off: every layout planned in full."""
    with monkeypatch.context() as patch:
        patch.setattr(search_module, "pipeline_lower_bound_ms", lambda *a, **k: 0.0)
        patch.setattr(bounds_module, "round_trip_lower_bound_ms", lambda *a, **k: 0.0)
        patch.setattr(search_module, "_unbounded", lambda *a, **k: (0.0, float("inf"), 0))
        patch.setattr(search_module, "PRUNE_AGAINST_BEST", False)
        return plan()


def _layout(alternative):
    return alternative.reason.split(" ZeRO")[0]


def _check_pruning_keeps_the_winner(pruned, exhaustive):
    # The winner is the same plan, byte for byte, but for the runners-up table.
    assert dump_model(pruned.model_copy(update={"alternatives": []})) == \
        dump_model(exhaustive.model_copy(update={"alternatives": []}))
    planned = {_layout(a): a.iteration_ms for a in exhaustive.alternatives if a.iteration_ms is not None}
    assert all(ms >= exhaustive.predicted.iteration_ms for ms in planned.values())
    bounded = [a for a in pruned.alternatives if a.lower_bound_ms is not None]
    for a in bounded:
        # Marked as a bound, never as a time, and truly a lower bound of the layout's planned time.
        assert a.iteration_ms is None and "lower bound" in a.reason and "\u2265 best" in a.reason
        assert a.lower_bound_ms >= pruned.predicted.iteration_ms
        if _layout(a) in planned:
            assert planned[_layout(a)] >= a.lower_bound_ms * (1 - 1e-9)
    for a in pruned.alternatives:
        if a.iteration_ms is not None:
            assert a.iteration_ms == pytest.approx(planned[_layout(a)])
    return bounded


def test_pruning_never_loses_the_best_layout(monkeypatch):
    """With the lower bounds switched off every candidate is planned; the winner must not change."""
    pruned = _plan()
    exhaustive = _exhaustive(monkeypatch, _plan)
    assert exhaustive.parallelism == pruned.parallelism
    _check_pruning_keeps_the_winner(pruned, exhaustive)


def test_pruning_against_the_best_keeps_the_winner_with_zero_and_tensor_parallel(monkeypatch):
    """Llama 3 8B on 64 H100s under a 40 GiB cap: many layouts, ZeRO stages and recomputation;
    the layouts' own searches pruned against the best so far give the same winner and plan, and
    a pruned layout shows a lower bound that its full plan respects."""
    from pipeplan.analytic.api import analytic_profile
    from pipeplan.facts.gpus import get_gpu

    profile = analytic_profile("llama3-8b", get_gpu("h100-sxm"), seq_len=4096, dtype="bf16",
                               microbatch_sizes=[1, 2], tensor_parallel=[1, 2, 4])
    settings = PlanSettings(num_gpus=64, cluster=PRESETS["dgx-h100"], global_batch=128, schedule="auto",
                            recompute="auto", memory_cap_bytes=40 * 2**30)

    def plan():
        return search_module.plan_cluster(profile, settings, profile_sha256="test")

    pruned = plan()
    assert dump_model(plan()) == dump_model(pruned)  # deterministic
    bounded = _check_pruning_keeps_the_winner(pruned, _exhaustive(monkeypatch, plan))
    assert bounded  # the case does prune


def test_fixed_degrees_are_kept():
    plan = _plan(data_parallel=4, stages=4, zero_stage=2)
    assert (plan.parallelism.data, plan.parallelism.pipeline, plan.parallelism.zero_stage) == (4, 4, 2)
    assert plan.settings.search_stages is None
    assert plan.alternatives == []  # one layout, one ZeRO stage: nothing to lose to


def test_zero_shards_the_state_over_d():
    z0 = _plan(data_parallel=4, stages=4, zero_stage=0)
    z3 = _plan(data_parallel=4, stages=4, zero_stage=3)
    s0, s3 = z0.stages[0], z3.stages[0]
    assert s3.optimizer_bytes == pytest.approx(s0.optimizer_bytes / 4, rel=1e-3, abs=4)
    assert s3.gradient_bytes == pytest.approx(s0.gradient_bytes / 4, rel=1e-3, abs=4)
    assert z3.predicted.data_parallel_ms > z0.predicted.data_parallel_ms  # gathers every micro-batch


def test_cli_plan_is_byte_identical_and_show_prints_the_layout(tmp_path):
    args = ["plan", str(PROFILE), "--gpus", "16", "--cluster", "dgx-a100", "--global-batch", "64",
            "--schedule", "1f1b", "-q"]
    one, two = tmp_path / "a.json", tmp_path / "b.json"
    assert runner.invoke(app, args + ["-o", str(one)]).exit_code == 0
    assert runner.invoke(app, args + ["-o", str(two)]).exit_code == 0
    assert one.read_bytes() == two.read_bytes()
    shown = runner.invoke(app, ["show", str(one)])
    assert shown.exit_code == 0, shown.output
    for text in ("data-parallel sync", "optimizer step", "pipeline bubble", "GPUs 0-", "memory per GPU"):
        assert text in shown.output
    assert load_plan(one).parallelism is not None
    data = json.loads(one.read_text())
    assert data["settings"]["cluster"]["name"] == "dgx-a100"


@pytest.mark.parametrize("args,code,message", [
    (["--gpus", "12", "--cluster", "dgx-a100"], 2, "12 is not a whole number of 8-GPU nodes"),
    (["--gpus", "16", "--cluster", "dgx-a100", "--tensor-parallel", "16"], 2, "above the 8 GPUs of a node"),
    (["--gpus", "16"], 2, "give --cluster"),
    (["--gpus", "16", "--cluster", "nope"], 2, "neither a preset"),
    (["--stages", "4", "--zero", "1"], 2, "--zero: needs --gpus"),
    # 16, not 24, since the reserve is its documented parts (648 MiB fixed on an A100, not 2 GiB:
    # docs/cluster-model.md, Memory a real job sees): 7.02 GiB of the 8 are plannable.
    (["--gpus", "16", "--cluster", "dgx-a100", "--memory-cap", "8GiB"], 3, "fits only from about 16 GPUs"),
    (["--gpus", "16", "--cluster", "dgx-a100", "--memory-cap", "12GiB", "--recompute", "none"], 3,
     "per GPU fits d=8 t=1 p=2 ZeRO"),
    (["--gpus", "16", "--cluster", "dgx-a100", "--data-parallel", "3"], 2, "--data-parallel: 3 does not divide"),
])
def test_cli_cluster_errors(args, code, message):
    result = runner.invoke(app, ["plan", str(PROFILE), "--global-batch", "64", "-q", *args])
    assert result.exit_code == code, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_infeasible_says_what_would_fit():
    result = runner.invoke(app, ["plan", str(PROFILE), "--global-batch", "64", "-q", "--gpus", "8",
                                 "--cluster", "pcie-l4", "--memory-cap", "4GiB"])
    assert result.exit_code == 3
    assert "fits only from about" in result.output and "GPUs" in result.output


def test_a_data_parallel_plan_exports_with_its_degrees(tmp_path):
    # run's own handling of such plans: tests/test_run_data_parallel.py; exports: tests/test_export_parallel.py.
    path = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(PROFILE), "--global-batch", "64", "-q", "--gpus", "16",
                                 "--cluster", "dgx-a100", "--data-parallel", "4", "--schedule", "1f1b", "-o", str(path)])
    assert result.exit_code == 0, result.output
    exported = runner.invoke(app, ["export", str(path), "--format", "torchtitan"])
    assert exported.exit_code == 0 and "global_batch_size = 64" in exported.output, exported.output


def test_layers_per_stage_fixes_the_split(tmp_path):
    gpt2 = REPO / "profiles" / "gpt2-tiny-cpu.json"
    out = tmp_path / "given.json"
    result = runner.invoke(app, ["plan", str(gpt2), "--stages", "2", "--layers-per-stage", "3,4", "--schedule",
                                 "1f1b", "-b", "2", "-q", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert [len(s.layers) for s in plan.stages] == [3, 4] and plan.solver.method == "given"
    cluster = runner.invoke(app, ["plan", str(PROFILE), "--gpus", "16", "--cluster", "dgx-a100", "--layers-per-stage",
                                  "9,8,9,9", "--schedule", "1f1b", "-b", "1", "--global-batch", "64", "-q",
                                  "-o", str(tmp_path / "c.json")])
    assert cluster.exit_code == 0, cluster.output
    plan = load_plan(tmp_path / "c.json")
    assert [len(s.layers) for s in plan.stages] == [9, 8, 9, 9] and plan.parallelism.pipeline == 4


@pytest.mark.parametrize("extra,message", [
    (["--layers-per-stage", "9,8,9", "--stages", "4"], "3 counts for --stages 4"),
    (["--layers-per-stage", "9,8,x"], "not a list of whole numbers"),
    (["--layers-per-stage", "9,8,9,9", "--schedule", "auto"], "needs a named --schedule"),
])
def test_layers_per_stage_errors(extra, message):
    args = ["plan", str(PROFILE), "--gpus", "16", "--cluster", "dgx-a100", "-b", "1", "--global-batch", "64", "-q"]
    if "--schedule" not in extra:
        args += ["--schedule", "1f1b"]
    result = runner.invoke(app, args + extra)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_check_replans_a_cluster_baseline(tmp_path):
    import shutil

    profiles, baselines = tmp_path / "profiles", tmp_path / "baselines"
    profiles.mkdir()
    shutil.copy(PROFILE, profiles / PROFILE.name)
    result = runner.invoke(app, ["plan", str(profiles / PROFILE.name), "--gpus", "16", "--cluster", "dgx-a100",
                                 "--global-batch", "64", "--schedule", "1f1b", "-q",
                                 "-o", str(baselines / "transformer32-analytic.plan.json")])
    assert result.exit_code == 0, result.output
    checked = runner.invoke(app, ["check", str(profiles), "--baseline", str(baselines)])
    assert checked.exit_code == 0, checked.output
    assert "+0.00%" in checked.output


def test_memoised_search_is_byte_identical_to_an_uncached_one(monkeypatch):
    """The planning cache (pipeplan/plan/memo.py) only saves work: the plan file is the same without it."""
    import contextlib

    import pipeplan.plan.memo as memo
    import pipeplan.plan.search as plan_search

    kw = dict(schedule="auto", memory_cap_bytes=12 * 2**30)
    # Every layout planned in full, so that some (at 12 GiB) are infeasible and their reasons explained lazily.
    monkeypatch.setattr(search_module, "PRUNE_AGAINST_BEST", False)
    cached = _plan(**kw)
    assert any("infeasible" in a.reason for a in cached.alternatives)  # the lazily explained reasons are shown
    monkeypatch.setattr(memo, "planning_cache", contextlib.nullcontext)
    monkeypatch.setattr(plan_search, "planning_cache", contextlib.nullcontext)
    uncached = _plan(**kw)
    assert cached.model_dump_json() == uncached.model_dump_json()


def test_infeasible_explained_on_demand_is_the_eager_message():
    from pipeplan.errors import InfeasibleError
    from pipeplan.plan import make_plan

    profile = load_profile(PROFILE)
    settings = PlanSettings(stages=2, global_batch=8, memory_cap_bytes=2**20)
    with pytest.raises(InfeasibleError) as eager:
        make_plan(profile, settings, profile_sha256="x")
    with pytest.raises(InfeasibleError) as lazy:
        make_plan(profile, settings, profile_sha256="x", explain_infeasible=False)
    assert lazy.value.explain() == str(eager.value)
    assert str(lazy.value).startswith("nothing fits")


def test_a_tied_weight_is_sharded_like_its_first_user_at_degree_t():
    """At t = 2 the copy a later stage keeps of a tied (vocabulary-parallel) embedding is half of it."""
    from pipeplan.cluster.profile_view import degree_view
    from pipeplan.formats.profile import Profile

    def cost(t):
        entry = {"microbatch_size": 1, "tensor_parallel": t, "forward_ms": 1.0, "backward_ms": 2.0,
                 "activation_bytes": 10, "output_bytes": 4, "param_bytes": 1000 // t}
        if t > 1:
            entry.update(tensor_parallel_collective="all_reduce", tensor_parallel_forward_bytes=8,
                         tensor_parallel_forward_count=1, tensor_parallel_backward_bytes=8,
                         tensor_parallel_backward_count=1)
        return entry

    profile = Profile.model_validate({
        "schema_version": 2, "model": "m", "source": "analytic", "device": {"name": "t"}, "dtype": "bf16",
        "layers": [{"name": n, "param_bytes": 1000, "costs": [cost(1), cost(2)]} for n in ("wte", "h", "head")],
        "tied_weights": [{"name": "wte.weight", "layers": ["wte", "head"], "param_bytes": 1000}]})
    view = degree_view(profile, 2, PRESETS["dgx-h100"])
    assert [tie.param_bytes for tie in view.profile.tied_weights] == [500]
    assert degree_view(profile, 1, PRESETS["dgx-h100"]).profile.tied_weights[0].param_bytes == 1000


@pytest.mark.parametrize("launcher", ["megatron", "deepspeed"])
def test_a_searched_plan_for_a_launcher_uses_a_zero_stage_it_runs_and_exports(tmp_path, launcher):
    # Megatron-LM keeps the whole gradient buffer and has no ZeRO 3; DeepSpeed's PipelineEngine
    # refuses ZeRO 2 and 3 with pipeline parallelism: the search must not pick what the export refuses.
    assert _plan(data_parallel=4, stages=4, memory_cap_bytes=16 * 2**30).parallelism.zero_stage == 2
    with pytest.raises(InfeasibleError):  # ZeRO 1 does not fit 16 GiB
        _plan(data_parallel=4, stages=4, memory_cap_bytes=16 * 2**30, launcher=launcher)
    plan = _plan(data_parallel=4, stages=4, memory_cap_bytes=20 * 2**30, launcher=launcher)
    assert plan.parallelism.zero_stage == 1
    path = tmp_path / "plan.json"
    path.write_text(dump_model(plan))
    exported = runner.invoke(app, ["export", str(path), "--format", launcher, "--profile", str(PROFILE)])
    assert exported.exit_code == 0, exported.output


def test_a_global_batch_that_leaves_out_data_parallel_degrees_says_so():
    # 1001 = 7 x 11 x 13: on 16 GPUs only d = 1 divides it, and the search tried only that.
    plan = _plan(global_batch=1001)
    assert plan.parallelism.data == 1
    note = next(n for n in plan.notes if n.startswith("global batch 1001 leaves out d = 2, 4, 8, 16"))
    assert "only d = 1 was searched; a global batch of 992 or 1008 keeps every d" in note
    assert not any(n.startswith("global batch") for n in _plan(global_batch=64).notes)



def test_fixed_virtual_stages_leave_out_pipelines_too_deep_for_them():
    """With --virtual-stages v a rank needs v units: deeper pipelines are no layout (not an error), and a
    fixed --stages that leaves a stage without a unit is refused naming both options."""
    from pipeplan.errors import BadInputError

    plan = _plan(schedule="interleaved", virtual_stages=5, num_gpus=8)  # 35 units: at most 7 ranks of 5
    assert plan.virtual_stages == 5 and plan.parallelism.pipeline * 5 <= 35
    with pytest.raises(BadInputError, match="--virtual-stages: 8 ranks x 5 stages per rank = 40 stages"):
        _plan(schedule="interleaved", virtual_stages=5, num_gpus=8, stages=8)


@pytest.mark.parametrize("overlap", [["grad-reduce", "param-gather"], ["grad-reduce", "param-gather", "tp-comm"]],
                         ids=str)
def test_pruning_keeps_the_winner_when_the_sync_overlaps(monkeypatch, overlap):
    """The bounds take an overlapped sync as fully hidden (its exposed part needs the split), so
    they stay lower bounds: the same winner and plan as with every bound off."""
    pruned = _plan(overlap=overlap, launcher="megatron", schedule="auto")
    exhaustive = _exhaustive(monkeypatch, lambda: _plan(overlap=overlap, launcher="megatron", schedule="auto"))
    _check_pruning_keeps_the_winner(pruned, exhaustive)
    p = pruned.predicted
    assert _parts_sum(p) == pytest.approx(p.iteration_ms, abs=1e-5)
    if pruned.parallelism.data > 1:
        assert p.gradient_reduce_ms + p.param_gather_ms == pytest.approx(p.data_parallel_ms, abs=1e-5)
