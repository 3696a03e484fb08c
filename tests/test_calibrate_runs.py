"""``pipeplan calibrate --runs``: the efficiency model fitted to launcher runs (docs/analytic.md,
"Calibrating from launcher runs").

Runs are synthesised from a known efficiency model (each planned at its layout by the planner
itself), then fitted from the defaults: the fit must return the known terms. Small models,
few runs: each fit plans a few small layouts some tens of times.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cli_checks import invoke, one_line_error, write
from conftest import REPO
from pipeplan.analytic.efficiency import EfficiencyModel
from pipeplan.analytic.fit import fittable_fields, load_efficiency, parse_fit_fields
from pipeplan.api import calibrate_runs
from pipeplan.errors import BadInputError
from pipeplan.formats.runs import LAYOUT_REQUIRED, RunLayout, load_runs
from pipeplan.requests import ClusterRequest

#: A GPT-2-style model small enough to plan in milliseconds and large enough that its GEMMs,
#: not the per-kernel latency, set its time (hidden 1024: a 4096 x 1024 x 1024 GEMM is 8.6 GFLOP).
MODEL = {"model_type": "gpt2", "n_embd": 1024, "n_head": 16, "n_layer": 4, "n_positions": 4096, "vocab_size": 8192,
         "tie_word_embeddings": True, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
#: What the synthetic runs were "measured" with.
TRUTH = EfficiencyModel(gemm=0.62, attention=0.33, memory=0.8, kernel_latency_us=4.0, source="test truth")


def _run(name, seq_len, t, p, b, schedule="1f1b", recompute="none", seconds=1.0, **extra):
    return {"name": name, "source": "synthesised by tests/test_calibrate_runs.py", "model": MODEL,
            "gpu": "a100-80gb", "cluster": "dgx-a100", "seq_len": seq_len, "dtype": "bf16",
            "layout": {"num_gpus": t * p, "data_parallel": 1, "tensor_parallel": t, "stages": p, "virtual_stages": 1,
                       "schedule": schedule, "microbatch_size": b, "global_batch": 4 * b, "recompute": recompute,
                       "zero_stage": 0, "layers_per_stage": "megatron"},
            "measured_iteration_s": seconds, **extra}


#: Three layouts whose attention share differs (sequence 256 to 4096), so gemm and attention
#: are told apart.
LAYOUTS = [("short", 256, 1, 2, 4), ("long", 4096, 2, 2, 1), ("middle", 1024, 1, 1, 2, "1f1b", "selective")]


def _runs_file(tmp_path, seconds=None, name="runs.json"):
    runs = [_run(*layout, seconds=(seconds or {}).get(layout[0], 1.0)) for layout in LAYOUTS]
    return write(tmp_path, {"schema": "pipeplan-runs/1", "runs": runs}, name)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A runs file whose seconds are the planner's own predictions under :data:`TRUTH`."""
    tmp = tmp_path_factory.mktemp("runs")
    truth = write(tmp, TRUTH.model_dump(), "truth.json")
    # The "before" column is the start model's prediction: started from the truth, it is the truth's.
    probe = calibrate_runs(_runs_file(tmp, name="probe.json"), fit="gemm", start=truth)
    return _runs_file(tmp, {row.name: row.before_s for row in probe.rows})


def test_fit_recovers_known_terms_from_a_perturbed_start(synthetic, tmp_path):
    out = tmp_path / "efficiency.json"
    result = calibrate_runs(synthetic, out, fit="gemm,attention")  # from the defaults, 0.75 and 0.5
    assert result.efficiency.gemm == pytest.approx(TRUTH.gemm, rel=2e-3)
    assert result.efficiency.attention == pytest.approx(TRUTH.attention, rel=2e-3)
    assert result.rms_log_error(False, False) > 0.05  # the start really was off
    assert result.rms_log_error(False, True) < 1e-3
    assert result.evaluations < 60 and result.at_bounds == ()
    # The written model is the returned one, and `profile --analytic --efficiency` takes it.
    assert load_efficiency(out) == result.efficiency
    source = result.efficiency.source
    assert "(gemm, attention) to 3 runs: short, long, middle" in source and "; memory, " in source
    profile = tmp_path / "profile.json"
    done = invoke("profile", "llama3-8b", "--analytic", "--gpu", "h100-sxm", "--microbatch-sizes", "1",
                  "--seq-len", "1024", "--efficiency", out, "-o", profile)
    assert done.exit_code == 0, done.stderr
    assert json.loads(profile.read_text())["measurement"]["efficiency"]["gemm"] == result.efficiency.gemm


def test_terms_not_fitted_keep_the_start_and_the_latency_is_recovered(synthetic, tmp_path):
    start = write(tmp_path, {"gemm": 0.62, "attention": 0.33, "kernel_latency_us": 20.0}, "start.json")
    result = calibrate_runs(synthetic, fit="kernel_latency_us", start=start)
    assert result.efficiency.kernel_latency_us == pytest.approx(TRUTH.kernel_latency_us, rel=2e-2)
    assert (result.efficiency.gemm, result.efficiency.attention) == (0.62, 0.33)


def test_holdout_is_predicted_not_fitted(synthetic, tmp_path):
    data = json.loads(synthetic.read_text())
    held = calibrate_runs(synthetic, fit="gemm", holdout=["middle"])
    assert [(r.name, r.held_out) for r in held.rows] == [("short", False), ("long", False), ("middle", True)]
    # A held-out run's measurement does not move the fit...
    data["runs"][2]["measured_iteration_s"] *= 3
    moved = calibrate_runs(write(tmp_path, data, "moved.json"), fit="gemm", holdout=["middle"])
    assert moved.efficiency.gemm == held.efficiency.gemm
    # ...and its error is reported after the fit: predicted right at the truth's terms, not 3 x.
    row = moved.rows[2]
    assert row.after_s == pytest.approx(row.measured_s / 3, rel=0.05)
    assert moved.rms_log_error(True, True) == pytest.approx(abs(math.log(row.after_s / row.measured_s)))
    result = invoke("calibrate", "--runs", synthetic, "--fit", "gemm", "--holdout", "middle", "-o", tmp_path / "e.json")
    assert result.exit_code == 0, result.stderr
    assert "held-out runs: rms log error" in result.stdout and "fitted runs: rms log error" in result.stdout
    assert "held out" in result.stdout


def test_same_inputs_give_byte_identical_output(synthetic, tmp_path):
    outputs = []
    for name in ("a.json", "b.json"):
        result = invoke("calibrate", "--runs", synthetic, "--fit", "gemm", "--holdout", "long", "-o", tmp_path / name)
        assert result.exit_code == 0, result.stderr
        outputs.append((tmp_path / name).read_bytes())
    assert outputs[0] == outputs[1]


def test_more_terms_than_runs_is_refused_unless_allowed(synthetic, tmp_path):
    out = tmp_path / "e.json"
    one_line_error(invoke("calibrate", "--runs", synthetic, "--holdout", "short,long", "-o", out), 2,
                   "--fit", f"{len(fittable_fields())} free terms", "1 run to fit", "--allow-underdetermined")
    assert not out.exists()
    done = invoke("calibrate", "--runs", synthetic, "--fit", "gemm,attention", "--holdout", "short,long",
                  "--allow-underdetermined", "-o", out)
    assert done.exit_code == 0, done.stderr


def _broken(tmp_path, change):
    data = {"schema": "pipeplan-runs/1", "runs": [_run(*layout) for layout in LAYOUTS]}
    change(data)
    return write(tmp_path, data, "bad.json")


BAD = [
    (lambda d: d["runs"][1]["layout"].update(schedule="auto"), ["run 'long' (runs[1])", "layout.schedule", "not auto"]),
    (lambda d: d["runs"][0].pop("measured_iteration_s"), ["run 'short' (runs[0])", "measured_iteration_s", "missing"]),
    (lambda d: d["runs"][2].update(measured_iteration_s=-1), ["run 'middle'", "measured_iteration_s", "greater than 0"]),
    (lambda d: d["runs"][1]["layout"].update(data_parallel=2), ["run 'long'", "layout", "is not num_gpus 4"]),
    (lambda d: d["runs"][1]["layout"].update(zero_stage=7), ["run 'long'", "layout.zero_stage", "3"]),
    (lambda d: d["runs"][1]["layout"].update(layers_per_stage="even"), ["layout.layers_per_stage", "'even'"]),
    (lambda d: d["runs"][0].update(gpu="a99"), ["run 'short'", "'a99' is not a known GPU"]),
    (lambda d: d["runs"][0].update(cluster="no-such.toml"), ["run 'short'", "no-such.toml"]),
    (lambda d: d["runs"][0].update(model={"model_type": "gpt2"}), ["run 'short'", "model", "n_embd"]),
    (lambda d: d["runs"][2].update(name="short"), ["bad.json", "runs", "repeat: short"]),
    (lambda d: d["runs"][2]["layout"].update(tensor_parallel=3, num_gpus=3), ["run 'middle'", "3", "divide"]),
    (lambda d: d.update(runs=[]), ["bad.json", "runs"]),
]


@pytest.mark.parametrize("change, needles", BAD)
def test_bad_runs_files_exit_2_naming_file_run_and_field(tmp_path, change, needles):
    path = _broken(tmp_path, change)
    out = tmp_path / "e.json"
    one_line_error(invoke("calibrate", "--runs", path, "--fit", "gemm", "-o", out), 2, str(path), *needles)
    assert not out.exists()
    with pytest.raises(BadInputError):
        calibrate_runs(path, fit="gemm")


def test_bad_options_exit_2(synthetic, tmp_path):
    out = tmp_path / "e.json"
    one_line_error(invoke("calibrate", "--runs", synthetic, "--fit", "gemm,flops", "-o", out), 2, "--fit", "flops")
    one_line_error(invoke("calibrate", "--runs", synthetic, "--holdout", "longest", "-o", out), 2, "--holdout", "longest")
    one_line_error(invoke("calibrate", "--runs", synthetic, "--holdout", "short,long,middle", "-o", out), 2,
                   "every run is held out")
    one_line_error(invoke("calibrate", "plan.json", "--runs", synthetic, "-o", out), 2, "--runs", "PLAN")
    one_line_error(invoke("calibrate", "plan.json", "report.json", "--fit", "gemm", "-o", out), 2, "--fit", "--runs")
    one_line_error(invoke("calibrate", "-o", out), 2, "PLAN", "--runs")
    one_line_error(invoke("calibrate", "--runs", synthetic, "-o", synthetic), 2, "-o")
    bad = write(tmp_path, {"gemm": 1.5}, "eff.json")
    one_line_error(invoke("calibrate", "--runs", synthetic, "--fit", "gemm", "--efficiency", bad, "-o", out), 2,
                   "eff.json", "gemm")
    one_line_error(invoke("profile", "gpt2-tiny", "--efficiency", bad, "-o", out), 2, "--efficiency", "--analytic")


def test_bad_input_as_a_subprocess(tmp_path):
    path = _broken(tmp_path, lambda d: d["runs"][1]["layout"].update(recompute="auto"))
    done = subprocess.run([sys.executable, "-m", "pipeplan", "calibrate", "--runs", str(path), "-o",
                           str(tmp_path / "e.json")], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "bad.json: run 'long' (runs[1]): layout.recompute:" in done.stderr


def test_the_layout_takes_every_fixed_option_of_a_cluster_request():
    """A run can state anything `plan --gpus` can fix; only what a search alone has is left out."""
    searched_only = {"cluster", "compare", "search_stages", "solver"}
    assert set(ClusterRequest.model_fields) - searched_only == set(RunLayout.model_fields)
    assert all(RunLayout.model_fields[name].is_required() for name in LAYOUT_REQUIRED)


def test_every_bounded_float_term_is_fitted_by_default():
    bounded = [name for name, field in EfficiencyModel.model_fields.items()
               if field.annotation is float and any(hasattr(m, a) for m in field.metadata for a in ("gt", "ge", "lt", "le"))]
    assert list(fittable_fields()) == bounded == parse_fit_fields(None)
    assert {"gemm", "attention", "memory", "kernel_latency_us"} <= set(bounded)
    assert (fittable_fields()["gemm"].lower, fittable_fields()["gemm"].upper) == (0.0, 1.0)


def test_the_korthikanti_runs_file_states_the_benchmark_runs():
    """benchmarks/data/korthikanti_table5_runs.json: the runs of benchmarks/validate_korthikanti.py, exactly."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import validate_korthikanti as bench
    finally:
        sys.path.pop(0)
    runs = load_runs(REPO / "benchmarks" / "data" / "korthikanti_table5_runs.json").runs
    assert len(runs) == len(bench.RUNS)
    for run, (model, gpus, t, p, v, schedule, b, batch, recompute, seconds) in zip(runs, bench.RUNS):
        assert run.model == {**bench.MODELS[model], **bench.COMMON}
        layout = run.layout
        assert (layout.num_gpus, layout.tensor_parallel, layout.stages, layout.virtual_stages, layout.schedule,
                layout.microbatch_size, layout.global_batch, layout.recompute) == (gpus, t, p, v, schedule, b, batch,
                                                                                   recompute)
        assert (layout.data_parallel, layout.zero_stage, layout.optimizer, layout.layers_per_stage) == \
            (1, 0, "adam-fp32-grads", "megatron")
        assert (run.gpu, run.cluster, run.seq_len, run.dtype, run.flash_attention) == \
            ("a100-80gb", "dgx-a100", 2048, "fp16", False)
        assert run.measured_iteration_s == seconds and "2205.05198" in run.source


def test_three_terms_from_three_runs(synthetic, tmp_path):
    """As many terms as runs: gemm, attention and the per-kernel latency, from a start off by 20-400%."""
    start = write(tmp_path, {"kernel_latency_us": 20.0}, "start.json")
    result = calibrate_runs(synthetic, fit="gemm,attention,kernel_latency_us", start=start)
    for term in ("gemm", "attention", "kernel_latency_us"):
        assert getattr(result.efficiency, term) == pytest.approx(getattr(TRUTH, term), rel=1e-3), term


def test_a_run_the_memory_model_puts_over_its_cap_is_still_predicted(synthetic, tmp_path):
    """It ran, so its time is worth predicting: planned without the cap, and flagged."""
    data = json.loads(synthetic.read_text())
    data["runs"][0]["layout"]["memory_cap_bytes"] = 2**20  # 1 MiB: nothing fits
    data["runs"][0]["measured_peak_memory_bytes"] = 3 * 2**30
    path = write(tmp_path, data, "capped.json")
    result = calibrate_runs(path, fit="gemm")
    row = result.rows[0]
    assert row.over_cap and not result.rows[1].over_cap
    assert row.predicted_peak_memory_bytes > 2**20 and row.measured_peak_memory_bytes == 3 * 2**30
    done = invoke("calibrate", "--runs", path, "--fit", "gemm", "-o", tmp_path / "e.json")
    assert done.exit_code == 0, done.stderr
    assert "note: short: the memory model puts the run over its cap" in done.stdout
    assert "3.00 GiB" in done.stdout and "(over cap)" in done.stdout


def test_a_term_starting_on_its_bound_is_fitted_off_it(synthetic, tmp_path):
    """A latency of 0 (its lower bound) has no logarithm: the fit starts it at 1 us and finds 4."""
    start = write(tmp_path, {"gemm": 0.62, "attention": 0.33, "kernel_latency_us": 0.0}, "zero.json")
    result = calibrate_runs(synthetic, fit="kernel_latency_us", start=start)
    assert result.rms_log_error(False, False) > result.rms_log_error(False, True)
    assert result.efficiency.kernel_latency_us == pytest.approx(TRUTH.kernel_latency_us, rel=2e-2)


@pytest.mark.slow
def test_the_korthikanti_runs_are_predicted_as_the_benchmark_predicts_them():
    """The fit's evaluation (plan_any on each run's request) is the benchmark's plan, to the microsecond."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import validate_korthikanti as bench
    finally:
        sys.path.pop(0)
    result = calibrate_runs(REPO / "benchmarks" / "data" / "korthikanti_table5_runs.json", fit="gemm",
                            holdout=["22B-selective,175B-full,175B-selective"])
    with tempfile.TemporaryDirectory() as tmp:
        for row, (model, gpus, t, p, v, schedule, b, batch, recompute, _) in zip(result.rows, bench.RUNS):
            profile = bench._profile(model, Path(tmp), [t], [b])
            plan = bench._plan(profile, "table5", num_gpus=gpus, tensor_parallel=t, stages=p, data_parallel=1,
                               zero_stage=0, virtual_stages=v, schedule=schedule, microbatch_size=b,
                               global_batch=batch, recompute=recompute,
                               layers_per_stage=bench._megatron_counts(profile, p * v))
            assert row.before_s == pytest.approx(plan.predicted.iteration_ms / 1e3, rel=1e-9), row.name


def test_paths_are_read_from_the_runs_files_folder(synthetic, tmp_path):
    """A config path in a runs file means the file beside it, wherever the command runs."""
    folder = tmp_path / "logs"
    (folder / "configs").mkdir(parents=True)
    (folder / "configs" / "small.json").write_text(json.dumps(MODEL))
    data = json.loads(synthetic.read_text())
    for run in data["runs"]:
        run["model"] = "configs/small.json"
    path = write(folder, data, "runs.json")
    inline, by_path = calibrate_runs(synthetic, fit="gemm"), calibrate_runs(path, fit="gemm")
    assert [r.before_s for r in by_path.rows] == [r.before_s for r in inline.rows]
    assert by_path.efficiency.gemm == inline.efficiency.gemm
