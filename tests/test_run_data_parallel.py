"""``pipeplan run`` of plans with data parallelism: d replicas of the pipeline on d x p ranks.

The plans come from ``pipeplan plan --gpus 4 --data-parallel 2 --stages 2`` (the cluster
planner), so the run is checked against what the planner writes: ``num_microbatches`` per
replica, ranks in Megatron's order. The torchrun jobs (CPU, gloo, 4 ranks) use the built-in
GPT-2 with a few thousand parameters; timeouts are generous and nothing is timed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

torch = pytest.importorskip("torch")

from pipeplan.cli import app  # noqa: E402
from pipeplan.formats.io import load_plan  # noqa: E402
from pipeplan.formats.profile import Profile  # noqa: E402
from pipeplan.run import run_plans  # noqa: E402
from pipeplan.run.gradsync import ReplicaGroups, replica_share  # noqa: E402
from pipeplan.run.verify import microbatches  # noqa: E402
from tiny_profiles import SEQ_LEN, tiny_gpt2_profile  # noqa: E402

runner = CliRunner()

TINY = {"hidden": 32, "heads": 2, "vocab": 64, "layers": 2}
DATA, STAGES, MICROBATCH, GLOBAL_BATCH = 2, 2, 1, 8


def _profile_file(tmp_path: Path) -> Path:
    """The tiny analytic profile (tests/tiny_profiles.py) written to a file."""
    profile = tiny_gpt2_profile(TINY["layers"])
    path = tmp_path / "profile.json"
    path.write_text(profile.model_dump_json(by_alias=True, exclude_none=True), encoding="utf-8")
    return path


def _cluster_plan(tmp_path: Path, schedule: str, *extra: str, zero: int = 0) -> Path:
    """``pipeplan plan PROFILE --gpus 4 --data-parallel 2 --stages 2 ...``, written to a file."""
    out = tmp_path / f"plan-{schedule}-zero{zero}.json"
    result = runner.invoke(app, [
        "plan", str(_profile_file(tmp_path)), "--gpus", str(DATA * STAGES), "--cluster", "pcie-l4",
        "--data-parallel", str(DATA), "--tensor-parallel", "1", "--zero", str(zero), "--stages", str(STAGES),
        "--global-batch", str(GLOBAL_BATCH), "--microbatch-size", str(MICROBATCH), "--schedule", schedule,
        "-q", "-o", str(out), *extra])
    assert result.exit_code == 0, result.output
    return out


def _reference():
    """Loss and gradients of one process on the whole global batch, as ``d x m`` micro-batches.

    One torch thread, as each rank has, so that reductions run in the ranks' order whatever
    earlier tests of this pytest process left behind.
    """
    from pipeplan.profile.models import build_model, loss_fn
    from pipeplan.profile.loading import load_bundle, make_microbatch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model("gpt2-tiny", seed=0, **TINY)
        bundle = load_bundle("gpt2-tiny", materialise=[], **TINY)
        (tokens,), target = make_microbatch(bundle, GLOBAL_BATCH, SEQ_LEN, seed=1)
        count = GLOBAL_BATCH // MICROBATCH
        pairs = zip(tokens.tensor_split(count), target.tensor_split(count))
        loss = sum(loss_fn(model(x), y) for x, y in pairs) / count
        loss.backward()
    finally:
        torch.set_num_threads(threads)
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


def test_the_planner_counts_micro_batches_per_replica(tmp_path):
    plan = load_plan(_cluster_plan(tmp_path, "1f1b"))
    assert plan.parallelism.data == DATA and plan.parallelism.pipeline == STAGES
    # G = d x m x b: each replica runs m micro-batches of its 1/d share.
    assert plan.num_microbatches == GLOBAL_BATCH // (DATA * MICROBATCH)


def test_replica_shares_are_the_global_batchs_micro_batches_in_order():
    tokens = torch.arange(24).reshape(12, 2)
    target = torch.arange(12) * 10
    whole = microbatches((tokens,), target, 6)
    shared = []
    for data_rank in range(3):
        inputs, tgt = replica_share((tokens,), target, data_rank, 3)
        shared += microbatches(inputs, tgt, 2)
    assert len(shared) == len(whole)
    for ((x,), y), ((x_ref,), y_ref) in zip(shared, whole):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_replica_groups_follow_megatrons_order():
    from pipeplan.cluster.placement import Layout

    layout = Layout(data=2, tensor=1, pipeline=3, gpus_per_node=6)
    for rank in range(6):
        groups = ReplicaGroups(2, 3, rank, make_groups=False)
        pipeline_rank, data_rank, _ = layout.coordinates(rank)
        assert (groups.pipeline_rank, groups.data_rank) == (pipeline_rank, data_rank)
        assert groups.pipeline_ranks() == [layout.rank(k, data_rank, 0) for k in range(3)]
        assert groups.data_ranks() == list(layout.data_group(pipeline_rank, 0))


@pytest.mark.torch
def test_two_replicas_of_a_two_rank_pipeline_equal_one_process_on_the_global_batch(tmp_path):
    from pipeplan.run.calibrate import calibrate_profile

    # 1F1B; ZBV: two stages per rank, the last stage (and the loss) on pipeline rank 0; 1F1B with
    # ZeRO 1 (the optimizer state sharded over the replicas).
    paths = [_cluster_plan(tmp_path, "1f1b"), _cluster_plan(tmp_path, "zbv"), _cluster_plan(tmp_path, "1f1b", zero=1)]
    plans = [load_plan(path) for path in paths]
    work = tmp_path / "work"
    reports = run_plans(plans, model="gpt2-tiny", model_options=TINY, seq_len=SEQ_LEN, steps=2, work_dir=work,
                        dump_grads=True, echo=False, timeout_s=300, job_timeout_s=900, verify=True)
    loss, grads = _reference()
    for index, (plan, report) in enumerate(zip(plans, reports)):
        where = plan.schedule
        assert report["num_ranks"] == DATA * STAGES and report["data_parallel"] == DATA, where
        assert report["pipeline_ranks"] == STAGES and report["num_microbatches"] == plan.num_microbatches, where
        # Megatron's order: rank = data_rank + d x pipeline_rank.
        assert [(row["rank"], row["pipeline_rank"], row["data_rank"]) for row in report["ranks"]] == \
            [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)], where
        assert all(row["data_parallel_sync_ms"] >= 0 for row in report["ranks"]), where
        assert report["loss"][0] == pytest.approx(loss, rel=1e-5), where
        # Each replica's ranks hold every gradient, equal to one process's on the global batch.
        for data_rank in range(DATA):
            seen = {}
            for pipeline_rank in range(STAGES):
                seen.update(torch.load(work / f"grads-plan{index}-rank{data_rank + DATA * pipeline_rank}.pt"))
            assert sorted(seen) == sorted(grads), (where, data_rank)
            for name, ref in grads.items():
                scale = float(ref.abs().max())
                assert float((seen[name] - ref).abs().max()) <= 1e-5 * scale + 1e-12, (where, data_rank, name)
        verdict = report["verify"]
        assert verdict["passed"], (where, verdict["failures"])
        assert sorted((row["stage"], row["data_rank"]) for row in verdict["stages"]) == \
            sorted((s.index, k) for s in plan.stages for k in range(DATA)), where
    # ZeRO 1 updates the weights as the unsharded optimizer does: the same loss after the step.
    assert plans[2].parallelism.zero_stage == 1
    assert reports[2]["loss"] == pytest.approx(reports[0]["loss"], rel=1e-6)
    # ... while each replica keeps the state of its share only: together, the unsharded state.
    for pipeline_rank in range(STAGES):
        whole, shares = ([row["optimizer_state_bytes"] for row in report["ranks"] if row["pipeline_rank"] == pipeline_rank]
                         for report in (reports[0], reports[2]))
        assert whole[0] > 0 and whole == [whole[0]] * DATA
        assert sum(shares) == whole[0] and max(shares) < whole[0], (pipeline_rank, shares, whole)
    # pipeplan calibrate pools the replicas of each pipeline rank.
    profile = Profile.model_validate_json((tmp_path / "profile.json").read_text(encoding="utf-8"))
    _, factors = calibrate_profile(plans[0], reports[0], profile)
    assert [f["rank"] for f in factors] == list(range(STAGES))
    rows = [row for row in reports[0]["ranks"] if row["pipeline_rank"] == 0]
    pooled_ms = sum(row["forward_ms"] + row["loss_ms"] for row in rows) / len(rows)
    assert factors[0]["measured_forward_ms"] == pytest.approx(pooled_ms, rel=1e-3)


@pytest.mark.torch
@pytest.mark.slow
def test_verify_fails_when_the_replicas_gradients_are_not_averaged(request, tmp_path):
    # The test above already fails without the sync (its gradients are checked directly); this
    # one checks that --verify itself sees it, at the cost of another 4-rank job (~20 s).
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("another 4-rank torchrun job: pytest -m slow tests/test_run_data_parallel.py")
    plan = load_plan(_cluster_plan(tmp_path, "1f1b"))
    report, = run_plans([plan], model="gpt2-tiny", model_options=TINY, seq_len=SEQ_LEN, steps=2,
                        work_dir=tmp_path / "work", echo=False, timeout_s=300, job_timeout_s=900, verify=True,
                        env={"PIPEPLAN_RUN_FAULT": "all:nosync"})
    verdict = report["verify"]
    assert not verdict["passed"]
    # Each replica's gradient is that of its half of the batch: far from the whole batch's.
    assert verdict["max_rel_diff"] > 1e-2


@pytest.mark.parametrize("change, message", [
    ({"tensor": 2, "num_gpus": 8}, "does not run tensor parallelism"),
    ({"zero_stage": 2}, "ZeRO 2: pipeplan run shards only the optimizer state"),
    ({"zero_stage": 3}, "ZeRO 3: pipeplan run shards only the optimizer state"),
])
def test_run_refuses_tensor_parallel_and_zero_2_3_plans_pointing_to_the_exports(tmp_path, change, message):
    path = _cluster_plan(tmp_path, "1f1b")
    data = json.loads(path.read_text(encoding="utf-8"))
    data["parallelism"].update(change)
    path.write_text(json.dumps(data), encoding="utf-8")
    result = runner.invoke(app, ["run", str(path), "--model", "gpt2-tiny", "--steps", "2"])
    assert result.exit_code == 2, result.output
    assert message in result.output and "pipeplan export" in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.torch
@pytest.mark.slow
def test_tied_weights_are_synced_within_each_replica(request, tmp_path):
    """HF GPT-2 (embedding tied to the LM head, traced stages) at d = 2, p = 2 equals one process."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("4 ranks importing transformers and tracing GPT-2 (~1 min): pytest -m slow "
                    "tests/test_run_data_parallel.py")
    pytest.importorskip("transformers")
    from pipeplan.formats.io import write_text_atomic
    from pipeplan.profile import profile_model

    options = {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64}
    profile = profile_model("hf:gpt2", microbatch_sizes=[1], seq_len=SEQ_LEN, repeats=1, warmup=0, options=options,
                            whole_model_check=False)
    profile_path = tmp_path / "gpt2.json"
    write_text_atomic(profile_path, profile.model_dump_json(by_alias=True, exclude_none=True))
    out = tmp_path / "plan.json"
    result = runner.invoke(app, [
        "plan", str(profile_path), "--gpus", "4", "--cluster", "pcie-l4", "--data-parallel", "2",
        "--tensor-parallel", "1", "--zero", "0", "--stages", "2", "--global-batch", "8", "--microbatch-size", "1",
        "--schedule", "1f1b", "-q", "-o", str(out)])
    assert result.exit_code == 0, result.output
    report, = run_plans([load_plan(out)], profile=profile, steps=2, work_dir=tmp_path / "work", echo=False,
                        timeout_s=300, job_timeout_s=900, verify=True, alone_repeats=0)
    assert report["data_parallel"] == 2
    assert report["verify"]["passed"], report["verify"]["failures"]
    assert report["verify"]["max_rel_diff"] < 1e-5


@pytest.mark.torch
@pytest.mark.slow
def test_a_rank_that_hangs_in_the_gradient_sync_is_named_after_the_timeout(request, tmp_path):
    """The data groups wait the run's --timeout, not gloo's 30-minute default."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("a 4-rank job that waits out a timeout: pytest -m slow tests/test_run_data_parallel.py")
    from pipeplan.run import RunFailedError

    plan = load_plan(_cluster_plan(tmp_path, "1f1b"))
    with pytest.raises(RunFailedError, match=r"rank 3 stopped answering \(hung or stuck\)"):
        run_plans([plan], model="gpt2-tiny", model_options=TINY, seq_len=SEQ_LEN, steps=2, work_dir=tmp_path / "work",
                  echo=False, env={"PIPEPLAN_RUN_FAULT": "3:hang-sync"}, timeout_s=10, job_timeout_s=300)
