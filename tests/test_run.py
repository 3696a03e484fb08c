"""``pipeplan run`` / ``calibrate`` without starting torchrun: command lines, plans, reports, messages."""

from __future__ import annotations

import json

import pytest

from pipeplan.errors import BadInputError
from pipeplan.formats.plan import SCHEDULES
from pipeplan.formats.profile import Profile
from pipeplan.facts.schedules import stage_ranks
from pipeplan.plan.simulate import simulate
from pipeplan.run import balanced_plan, build_report, report_table, run_plans, simulate_plan, torchrun_command
from pipeplan.run.calibrate import calibrate_profile
from pipeplan.run.launch import resolve_model
from pipeplan.run.supervise import failure_message
from pipeplan.run.plans import stage_costs


def _profile(layers: int = 6, model: str = "gpt2-tiny") -> Profile:
    names = ["embed", *[f"blocks.{i}" for i in range(layers)], "norm", "head"]
    return Profile.model_validate({
        "schema_version": 1, "model": model, "source": "measured", "device": {"name": "cpu"},
        "dtype": "fp32", "sequence_length": 16,
        "measurement": {"model_options": {"layers": layers, "hidden": 32}},
        "layers": [{"name": name, "param_bytes": 1000 * (i + 1), "costs": [
            {"microbatch_size": b, "forward_ms": (1.0 + i % 3) * b, "backward_ms": 2.0 * (1.0 + i % 3) * b,
             "backward_input_ms": 1.0 * (1.0 + i % 3) * b, "backward_weight_ms": 1.0 * (1.0 + i % 3) * b,
             "activation_bytes": 100 * b, "output_bytes": 10 * b} for b in (1, 2)]}
            for i, name in enumerate(names)],
    })


# ---------------------------------------------------------------- command line
def test_torchrun_command_one_node_and_several():
    one = torchrun_command("/tmp/c.json", 4, python="py")
    assert one[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--standalone" in one and one[-3:] == ["-m", "pipeplan.run.worker", "/tmp/c.json"]
    two = torchrun_command("/tmp/c.json", 2, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500",
                           rdzv_id="job", python="py")
    assert "--standalone" not in two
    joined = " ".join(two)
    assert "--nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id job" in joined
    assert "--nproc-per-node 2" in joined
    # The worker takes no options: nothing after the module but the config path.
    assert two[two.index("pipeplan.run.worker") + 1:] == ["/tmp/c.json"]
    with pytest.raises(BadInputError, match="--rdzv-endpoint"):
        torchrun_command("c.json", 1, nnodes=2)


# ---------------------------------------------------------------- plans for every schedule
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_balanced_plan_places_stages_like_the_schedule_and_predicts_by_simulation(schedule, ranks):
    profile = _profile(layers=8)
    plan = balanced_plan(profile, schedule=schedule, ranks=ranks, microbatch_size=2, num_microbatches=2 * ranks)
    v = plan.virtual_stages
    assert len(plan.stages) == ranks * v
    assert [s.rank for s in plan.stages] == stage_ranks(schedule, ranks, v)
    assert [name for s in plan.stages for name in s.layers] == [layer.name for layer in profile.layers]
    sim = simulate_plan(plan, profile)
    assert plan.predicted.iteration_ms == pytest.approx(sim.iteration_ms)
    assert [r.busy_ms for r in plan.ranks] == pytest.approx(list(sim.rank_busy_ms))


def test_balanced_plan_refuses_what_torch_refuses():
    with pytest.raises(BadInputError, match="not a multiple of the 2 rounds"):
        balanced_plan(_profile(), schedule="interleaved", ranks=2, microbatch_size=1, num_microbatches=5)
    with pytest.raises(BadInputError, match="needs 16 stages"):
        balanced_plan(_profile(layers=2), schedule="zbv", ranks=8, microbatch_size=1, num_microbatches=16)
    with pytest.raises(BadInputError, match="was not profiled"):
        balanced_plan(_profile(), schedule="1f1b", ranks=2, microbatch_size=4, num_microbatches=2)


def test_stage_costs_split_backward_and_transfers():
    profile = _profile(layers=2)
    cost, last = stage_costs(profile, [["embed", "blocks.0"], ["blocks.1", "norm", "head"]], 1,
                             bandwidth_bytes_per_s=1e4, latency_ms=0.5)
    assert (cost.forward_ms, cost.backward_input_ms, cost.backward_weight_ms) == (3.0, 3.0, 3.0)
    assert cost.backward_ms == 6.0
    assert cost.send_ms == pytest.approx(10 / 1e4 * 1000 + 0.5)
    assert last.send_ms == 0.0
    with pytest.raises(BadInputError, match="'nope' is not in the profile"):
        stage_costs(profile, [["nope"]], 1)


# ---------------------------------------------------------------- model resolution and checks
def test_resolve_model_reads_layers_from_the_plan_or_the_profile():
    profile = _profile(layers=4)
    plan = balanced_plan(profile, schedule="1f1b", ranks=2, microbatch_size=1, num_microbatches=2)
    assert resolve_model(plan, model="gpt2-tiny")["model_options"] == {"layers": 4}
    spec = resolve_model(plan, profile=profile)
    assert spec["model"] == "gpt2-tiny" and spec["model_options"] == {"layers": 4, "hidden": 32}
    assert spec["seq_len"] == 16
    with pytest.raises(BadInputError, match="--model NAME"):
        resolve_model(plan)
    other = _profile(layers=2)
    with pytest.raises(BadInputError, match="'blocks.2' is not in the profile"):
        resolve_model(plan, profile=other)


def test_run_checks_before_starting_anything():
    profile = _profile()
    two = balanced_plan(profile, schedule="1f1b", ranks=2, microbatch_size=1, num_microbatches=2)
    four = balanced_plan(profile, schedule="1f1b", ranks=4, microbatch_size=1, num_microbatches=4)
    with pytest.raises(BadInputError, match="one job runs plans of one size"):
        run_plans([two, four], model="gpt2-tiny")
    with pytest.raises(BadInputError, match="--steps"):
        run_plans([two], model="gpt2-tiny", steps=1)
    with pytest.raises(BadInputError, match="--nnodes 3 does not divide"):
        run_plans([two], model="gpt2-tiny", nnodes=3, rdzv_endpoint="127.0.0.1:1")
    broken = two.model_copy(deep=True)
    broken.stages[1].rank = 0
    with pytest.raises(BadInputError, match="rank 1 has no stage|stages for 1 ranks"):
        run_plans([broken], model="gpt2-tiny")
    with pytest.raises(BadInputError, match="2 plans but 1 profiles; give one profile per plan"):
        run_plans([two, two], profile=[profile])


# ---------------------------------------------------------------- failure messages
def _write_error(tmp_path, rank, kind, message, when):
    (tmp_path / f"error-rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "type": kind, "message": message, "time": when, "traceback": ""}))


ROOT_CAUSE = """Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_23:54:42
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 12798)
""".splitlines()


def test_failure_message_names_the_first_real_error(tmp_path):
    _write_error(tmp_path, 0, "RuntimeError", "Connection closed by peer [127.0.0.1]:1. This is typically x", 2.0)
    _write_error(tmp_path, 1, "BadInputError", "unit 'x' is not in 'gpt2-tiny'", 1.0)
    text = failure_message(tmp_path, [], 1, None, 2)
    assert text == "rank 1 failed: BadInputError: unit 'x' is not in 'gpt2-tiny' (then rank 0 stopped too)"


def test_failure_message_names_a_silent_crash_and_a_hang(tmp_path):
    _write_error(tmp_path, 0, "RuntimeError", "Connection closed by peer [127.0.0.1]:1. This is typically x", 2.0)
    crash = [line.format(code=-9) for line in ROOT_CAUSE]
    text = failure_message(tmp_path, crash, 1, None, 2)
    assert text.startswith("rank 1 died without an error report (SIGKILL (killed: out of host memory?))")
    assert "rank 0 then failed: RuntimeError: Connection closed by peer [127.0.0.1]:1" in text
    assert "typically" not in text
    (tmp_path / "error-rank0.json").unlink()
    _write_error(tmp_path, 0, "RuntimeError", "Timed out waiting 8000ms for recv operation to complete", 2.0)
    hang = [line.replace("rank      : 1 (local_rank: 1)", "rank      : 0 (local_rank: 0)").format(code=1)
            for line in ROOT_CAUSE]
    text = failure_message(tmp_path, hang, 1, None, 2)
    assert text.startswith("rank 1 stopped answering (hung or stuck); rank 0 gave up waiting")
    assert failure_message(tmp_path, [], None, 60.0, 2).startswith("the job ran past --job-timeout 60 s")


def test_failure_message_quotes_what_an_aborted_rank_printed(tmp_path):
    # The C++ runtime's line (and the fault handler's, which every rank has on) name the abort.
    tail = ["terminate called without an active exception", "Fatal Python error: Aborted", "",
            "Thread 0x00007f0492b126c0 (most recent call first):", "  <no Python frame>",
            *[line.format(code=-6) for line in ROOT_CAUSE]]
    text = failure_message(tmp_path, tail, 1, None, 2)
    assert text == ('rank 1 died without an error report (SIGABRT): "terminate called without an active '
                    'exception"; see its output above')
    _write_error(tmp_path, 0, "RuntimeError", "Connection closed by peer [127.0.0.1]:1", 2.0)
    text = failure_message(tmp_path, tail, 1, None, 2)
    assert text.startswith('rank 1 died without an error report (SIGABRT): "terminate called without an active')
    assert text.endswith("rank 0 then failed: RuntimeError: Connection closed by peer [127.0.0.1]:1")
    # Nothing quoted when the rank printed nothing of the kind.
    assert '"' not in failure_message(tmp_path, [line.format(code=-6) for line in ROOT_CAUSE], 1, None, 2)


# ---------------------------------------------------------------- report and calibration
def _results(plan, forward_scale=1.0, backward_scale=1.0, steps=4):
    """Fake worker results: every rank's compute exactly the profile's, scaled."""
    results = []
    for summary in plan.ranks:
        stages = [s for s in plan.stages if s.rank == summary.rank]
        f = plan.num_microbatches * sum(s.forward_ms for s in stages) * forward_scale
        b = plan.num_microbatches * sum(s.backward_ms for s in stages) * backward_scale
        results.append({
            "rank": summary.rank, "stages": [s.index for s in stages],
            "step_ms": [3 * plan.predicted.iteration_ms] + [plan.predicted.iteration_ms * 1.1] * (steps - 1),
            "pipeline_ms": [3 * plan.predicted.iteration_ms] + [plan.predicted.iteration_ms * 1.05] * (steps - 1),
            "compute_ms": [{"forward": f, "backward": b, "weight": 0.0, "loss": 0.0}] * steps,
            "losses": [4.0, 3.0, 2.5, 2.0][:steps] if summary.rank == plan.stages[-1].rank else [],
            "peak_memory_bytes": 1000, "memory_method": "test",
        })
    return results


def test_report_puts_measured_beside_predicted():
    from rich.console import Console

    profile = _profile()
    plan = balanced_plan(profile, schedule="zbv", ranks=2, microbatch_size=1, num_microbatches=4)
    report = build_report(plan, _results(plan), profile=profile, run={"model": "gpt2-tiny"})
    assert report["ratio"] == pytest.approx(1.05)
    assert report["simulated_ratio"] == pytest.approx(1.05)
    assert report["loss"] == [4.0, 3.0, 2.5, 2.0]
    assert report["measured"]["timed_steps"] == 3
    for row in report["ranks"]:
        assert row["busy_ratio"] == pytest.approx(1.0)
    console = Console(width=160, record=True)
    console.print(report_table(report))
    assert "ratio 1.05" in console.export_text()


def test_report_says_the_traced_builders_whole_model_is_in_the_measured_memory():
    profile = _profile()
    plan = balanced_plan(profile, schedule="1f1b", ranks=2, microbatch_size=1, num_microbatches=4)
    plain = build_report(plan, _results(plan))
    assert not any("whole model" in note for note in plain["notes"])
    results = _results(plan)
    for r in results:
        r["whole_model_param_bytes"] = 497_759_232  # GPT-2 small in fp32
        r["whole_model_released"] = True
        r["verify"] = {"stages": []}
        r["memory_method"] = "peak RSS (VmHWM) minus RSS before the stages were built"
    notes = [n for n in build_report(plan, results)["notes"] if "whole model" in n]
    assert len(notes) == 1 and ("(474.70 MiB of parameters) and --verify's one-process reference step; "
                                "released after the build") in notes[0]
    results[1]["whole_model_released"] = False
    assert any("NOT released" in n for n in build_report(plan, results)["notes"])
    # On CUDA the peak is taken after the build: nothing to say.
    for r in results:
        r["memory_method"] = "torch.cuda.max_memory_allocated after the stages were built"
    assert not any("whole model" in n for n in build_report(plan, results)["notes"])


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_report_replays_the_schedule_with_the_measured_compute(schedule):
    profile = _profile()
    plan = balanced_plan(profile, schedule=schedule, ranks=2, microbatch_size=1, num_microbatches=4)
    same = build_report(plan, _results(plan))
    assert same["predicted"]["replayed_iteration_ms"] == pytest.approx(plan.predicted.iteration_ms, rel=1e-4)
    assert same["replayed_ratio"] == pytest.approx(1.05, rel=1e-3)
    # All compute 20% slower and transfers free: the replayed iteration is 20% longer, and the
    # 5% the fake run adds beyond it is the non-compute error.
    slower = build_report(plan, _results(plan, forward_scale=1.2, backward_scale=1.2))
    assert slower["predicted"]["replayed_iteration_ms"] == pytest.approx(1.2 * plan.predicted.iteration_ms, rel=1e-4)
    assert slower["replayed_ratio"] == pytest.approx(1.05 / 1.2, rel=1e-3)



def test_report_takes_the_machines_drift_out_with_stages_retimed_alone():
    profile = _profile()
    plan = balanced_plan(profile, schedule="zbv", ranks=2, microbatch_size=1, num_microbatches=4)
    results = _results(plan)
    no_alone = build_report(plan, results)
    assert "alone_ratio" not in no_alone and "adjusted_iteration_ms" not in no_alone["predicted"]
    # The machine ran the same stages 25% slower than at profiling (the median of timings at
    # 30%, 25% and 20% over, through the run): the prediction scaled by that is 1.25x, and what
    # is left of the run's 1.05 is the cost model's own error.
    for result in results:
        result["alone"] = [
            {"stage": s.index, "step": step, "forward_ms": s.forward_ms * k, "backward_ms": s.backward_ms * k}
            for step, k in ((1, 1.3), (2, 1.25), (3, 1.2))
            for s in plan.stages if s.index in result["stages"]
        ]
    report = build_report(plan, results)
    assert report["alone_ratio"] == pytest.approx(1.25)
    for row in report["ranks"]:
        assert row["alone_ratio"] == pytest.approx(1.25)
        assert len(row["alone_steps_ms"]) == 3
        assert row["alone_before_ms"] == pytest.approx(1.3 * row["predicted_alone_ms"], rel=1e-3)
        assert row["alone_after_ms"] == pytest.approx(1.2 * row["predicted_alone_ms"], rel=1e-3)
    assert report["predicted"]["adjusted_iteration_ms"] == pytest.approx(1.25 * plan.predicted.iteration_ms, rel=1e-4)
    assert report["adjusted_ratio"] == pytest.approx(1.05 / 1.25, rel=1e-3)
    assert report["ratio"] == pytest.approx(report["alone_ratio"] * report["adjusted_ratio"], rel=1e-3)
    assert any("1.25x their profiled time" in note and "slower" in note for note in report["notes"])
    # A rank that timed only some of its stages gives no ratio rather than a wrong one.
    results[0]["alone"] = [t for t in results[0]["alone"] if t["stage"] == results[0]["stages"][0]]
    partial = build_report(plan, results)
    assert "alone_ratio" not in partial and "alone_ratio" not in partial["ranks"][0]


def test_report_measures_the_schedules_own_time_per_action_and_calibrate_keeps_it():
    profile = _profile()
    plan = balanced_plan(profile, schedule="1f1b", ranks=2, microbatch_size=2, num_microbatches=4)
    results = _results(plan)
    for result, (post, wait) in zip(results, ((2.0, 10.0), (6.0, 3.0))):
        result["compute_ms"] = [dict(c, post=post, wait=wait) for c in result["compute_ms"]]
    report = build_report(plan, results)
    for row in report["ranks"]:
        # 4 micro-batches x (forward, backward) per rank under 1F1B.
        assert row["actions"] == 8
        assert row["overhead_per_action_ms"] == pytest.approx((row["post_ms"] + row["overhead_ms"]) / 8, abs=1e-4)
    pooled = sum(row["post_ms"] + row["overhead_ms"] for row in report["ranks"]) / 16
    assert report["measured"]["action_overhead_ms"] == pytest.approx(pooled, abs=1e-4)
    calibrated, _ = calibrate_profile(plan, report, profile)
    assert calibrated.measurement["action_overhead_ms"] == pytest.approx(pooled, abs=1e-4)
    # The next plan made from the calibrated profile counts it before every action.
    from pipeplan.formats.plan import PlanSettings
    from pipeplan.plan import make_plan

    again = make_plan(calibrated, PlanSettings(stages=2, global_batch=8, microbatch_size=2, schedule="1f1b"),
                      profile_sha256="0" * 64)
    assert again.settings.action_overhead_ms == calibrated.measurement["action_overhead_ms"]
    assert again.predicted.overhead_ms == pytest.approx(8 * again.settings.action_overhead_ms, rel=1e-4)


def test_calibrated_profile_predicts_the_measured_compute():
    profile = _profile()
    plan = balanced_plan(profile, schedule="1f1b", ranks=2, microbatch_size=2, num_microbatches=4)
    report = build_report(plan, _results(plan, forward_scale=1.5, backward_scale=0.8))
    calibrated, factors = calibrate_profile(plan, report, profile)
    assert [f["forward_factor"] for f in factors] == [1.5, 1.5]
    assert [f["backward_factor"] for f in factors] == [0.8, 0.8]
    sim = simulate_plan(plan, calibrated)
    assert list(sim.rank_busy_ms) == pytest.approx([row["busy_ms"] for row in report["ranks"]], rel=1e-3)
    # Every micro-batch size is scaled, and the B/W split still adds up (the format checks it).
    assert calibrated.layers[0].cost_at(1).forward_ms == pytest.approx(1.5)
    assert calibrated.measurement["calibration"]["microbatch_size"] == 2
    wrong = dict(report, num_microbatches=8)
    with pytest.raises(BadInputError, match="num_microbatches is 8 but the plan's is 4"):
        calibrate_profile(plan, wrong, profile)


def test_simulate_matches_plan_prediction_for_planner_schedules():
    profile = _profile()
    plan = balanced_plan(profile, schedule="gpipe", ranks=3, microbatch_size=1, num_microbatches=3)
    costs = stage_costs(profile, [s.layers for s in plan.stages], 1)
    assert simulate(costs, "gpipe", 3, 3).iteration_ms == pytest.approx(plan.predicted.iteration_ms)


# ---------------------------------------------------------------- CLI (no job started)
def test_cli_calibrate_and_run_errors(tmp_path):
    typer_testing = pytest.importorskip("typer.testing")
    from pipeplan.cli import app
    from pipeplan.formats.io import load_profile, write_json_atomic, write_text_atomic

    profile = _profile()
    plan = balanced_plan(profile, schedule="1f1b", ranks=2, microbatch_size=2, num_microbatches=4)
    write_json_atomic(tmp_path / "profile.json", profile)
    from pipeplan.formats.io import file_sha256

    # calibrate checks that the profile is the one the plan was made from.
    plan = plan.model_copy(update={"profile": plan.profile.model_copy(
        update={"sha256": file_sha256(tmp_path / "profile.json")})})
    write_json_atomic(tmp_path / "plan.json", plan)
    report = build_report(plan, _results(plan, forward_scale=2.0), profile_path=str(tmp_path / "profile.json"))
    write_text_atomic(tmp_path / "report.json", json.dumps(report))
    runner = typer_testing.CliRunner()
    result = runner.invoke(app, ["calibrate", str(tmp_path / "plan.json"), str(tmp_path / "report.json"),
                                 "-o", str(tmp_path / "calibrated.json")])
    assert result.exit_code == 0, result.output
    assert load_profile(tmp_path / "calibrated.json").layers[0].cost_at(2).forward_ms == pytest.approx(4.0)

    result = runner.invoke(app, ["run", str(tmp_path / "plan.json"), "--model", "gpt2-tiny", "--steps", "1"])
    assert result.exit_code == 2 and "--steps: 1 must be an integer >= 2" in result.output
    result = runner.invoke(app, ["run", str(tmp_path / "plan.json")])
    assert result.exit_code == 2 and "--profile PROFILE.json" in result.output


def test_failure_message_names_a_crashed_rank_even_when_torchrun_saw_its_peer_first(tmp_path):
    # The race seen in CI: rank 1 exits 3, rank 0 fails on the closed connection and torchrun
    # reports rank 0 as the root cause; rank 1's exit is listed among the other failures.
    _write_error(tmp_path, 0, "RuntimeError", "Connection closed by peer [127.0.0.1]:46294", 2.0)
    tail = """Failures:
[1]:
  time      : 2026-11-30_01:13:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 3 (pid: 4242)
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_01:13:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4241)
""".splitlines()
    text = failure_message(tmp_path, tail, 1, None, 2)
    assert text.startswith("rank 1 died without an error report (exit code 3)")
    assert "rank 0 then failed: RuntimeError: Connection closed by peer" in text
