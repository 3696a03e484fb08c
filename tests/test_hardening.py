"""Issue 16's findings, one test each: bad input gets exit 2 and one line naming the file, field and
problem; never a traceback, a partial file or an internal error (exit 1)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from cli_checks import invoke, one_line_error, runner, write
from conftest import REPO, make_profile_dict
from pipeplan.cli import app



# ---------------------------------------------------------------- internal errors from bad input
def test_param_bytes_beyond_float_is_refused_by_validate_and_plan(tmp_path):
    text = json.dumps(make_profile_dict()).replace('"param_bytes": 1000', '"param_bytes": 1e400', 1)
    path = write(tmp_path, text)
    for command in (("validate", path), ("plan", path, "--stages", 2)):
        one_line_error(invoke(*command), 2, "p.json", "layers[0].param_bytes")


def test_huge_memory_cap_and_bandwidth_are_refused(profile_file):
    one_line_error(invoke("plan", profile_file, "--stages", 2, "--memory-cap", "1e400"), 2, "--memory-cap", "2**53")
    one_line_error(invoke("plan", profile_file, "--stages", 2, "--bandwidth", "1e400"), 2, "--bandwidth")


@pytest.mark.parametrize("value", [1e308, 1e10])
def test_times_beyond_the_finite_range_are_refused(tmp_path, value, recwarn):
    data = make_profile_dict()
    data["layers"][2]["costs"][0]["backward_ms"] = value
    path = write(tmp_path, data)
    one_line_error(invoke("validate", path), 2, "layers[2].costs[0].backward_ms", "1000000000")
    one_line_error(invoke("plan", path, "--stages", 2, "-o", tmp_path / "out.json"), 2)
    assert not (tmp_path / "out.json").exists()
    assert not [w for w in recwarn if "overflow" in str(w.message)]


@pytest.mark.parametrize("value", [5e-324, 1e-300, 1e-7])
def test_times_too_small_to_measure_are_refused(tmp_path, value):
    # Such times made samples_per_second overflow to a value no plan may hold (exit 1 before).
    data = make_profile_dict(n_layers=1, sizes=(1,))
    data["layers"][0]["costs"][0].update(forward_ms=0, backward_ms=value)
    path = write(tmp_path, data)
    one_line_error(invoke("plan", path, "--stages", 1), 2, "backward_ms", "1 ns")


def test_the_largest_allowed_values_plan_to_finite_numbers(tmp_path):
    from pipeplan.formats.limits import MAX_BYTES, MAX_MS

    data = make_profile_dict(n_layers=4)
    for layer in data["layers"]:
        layer["param_bytes"] = MAX_BYTES
        for cost in layer["costs"]:
            cost.update(forward_ms=MAX_MS, backward_ms=MAX_MS, activation_bytes=MAX_BYTES, output_bytes=MAX_BYTES)
    path = write(tmp_path, data)
    out = tmp_path / "plan.json"
    result = invoke("plan", path, "--stages", 2, "--global-batch", 4096, "-o", out)
    assert result.exit_code in (0, 3), result.stderr
    if result.exit_code == 0:
        assert invoke("validate", out).exit_code == 0


def test_all_zero_profile_is_refused_not_divided_by(tmp_path):
    data = make_profile_dict(n_layers=1, sizes=(1,))
    data["layers"][0]["costs"][0].update(forward_ms=0, backward_ms=0)
    path = write(tmp_path, data)
    one_line_error(invoke("plan", path, "--stages", 1), 2, "p.json", "every forward_ms and backward_ms")


def test_calibrate_with_nan_in_the_report_names_the_field(tmp_path, plan_file, profile_file):
    report = _report_for(plan_file, profile_file)
    report["ranks"][0]["forward_ms"] = float("nan")
    path = write(tmp_path, json.dumps(report), "report.json")
    one_line_error(invoke("calibrate", plan_file, path, "-o", tmp_path / "c.json"), 2,
                   "report.json", "ranks[0].forward_ms", "finite")


def test_report_without_forward_ms_names_the_field(tmp_path, plan_file, profile_file):
    report = _report_for(plan_file, profile_file)
    del report["ranks"][1]["forward_ms"]
    path = write(tmp_path, json.dumps(report), "report.json")
    one_line_error(invoke("calibrate", plan_file, path, "-o", tmp_path / "c.json"), 2,
                   "report.json", "ranks[1].forward_ms: missing field")
    one_line_error(invoke("validate", path), 2, "ranks[1].forward_ms")


def _report_for(plan_path, profile_path):
    from pipeplan.formats.io import load_plan
    from pipeplan.run import build_report

    plan = load_plan(plan_path)
    results = []
    for rank in range(plan.settings.stages):
        stages = [s.index for s in plan.stages if s.rank == rank]
        compute = [{"forward": 4.0, "backward": 8.0, "weight": 0.0, "loss": 0.0}] * 3
        results.append({"rank": rank, "stages": stages, "step_ms": [30.0] * 3, "pipeline_ms": [29.0] * 3,
                        "compute_ms": compute, "losses": [1.0, 0.9, 0.8], "peak_memory_bytes": None})
    return build_report(plan, results, profile_path=str(profile_path))


def test_a_good_report_validates_and_calibrates(tmp_path, plan_file, profile_file):
    path = write(tmp_path, json.dumps(_report_for(plan_file, profile_file)), "report.json")
    result = invoke("validate", path)
    assert result.exit_code == 0 and "valid run report" in result.stdout
    result = invoke("calibrate", plan_file, path, "-o", tmp_path / "c.json")
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("target", ["/proc/p.json", "/sys/p.json", "DIR"])
def test_unwritable_outputs_exit_2(tmp_path, profile_file, target):
    if target == "DIR":
        target = tmp_path
    elif not os.path.isdir(os.path.dirname(target)):
        pytest.skip(f"no {os.path.dirname(target)} here")
    line = one_line_error(invoke("plan", profile_file, "--stages", 2, "-o", target, "-q"), 2, str(target))
    assert "cannot write" in line or "is a directory" in line


def test_deeply_nested_json_names_the_file(tmp_path):
    path = write(tmp_path, "[" * 100_000 + "]" * 100_000, "deep.json")
    for command in (("validate", path), ("plan", path, "--stages", 2), ("show", path)):
        one_line_error(invoke(*command), 2, "deep.json", "nested too deep")


# ---------------------------------------------------------------- blow-ups
def test_huge_global_batch_is_refused_with_the_limit(profile_file):
    from pipeplan.formats.limits import MAX_MICROBATCHES

    line = one_line_error(invoke("plan", profile_file, "--stages", 2, "--global-batch", 10**12), 2, "--global-batch")
    assert str(MAX_MICROBATCHES) in line
    # At the limit it plans (fixed micro-batch size and schedule: seconds).
    result = invoke("plan", profile_file, "--stages", 2, "--global-batch", MAX_MICROBATCHES, "-b", 1,
                    "--schedule", "1f1b", "-q")
    assert result.exit_code == 0, result.stderr


def test_infeasible_names_the_smallest_stage_count_that_fits_or_says_none_does(tmp_path):
    path = write(tmp_path, make_profile_dict(n_layers=6), "p.json")
    line = one_line_error(invoke("plan", path, "--stages", 2, "--memory-cap", 5000), 3)
    assert line.startswith("infeasible:") and "6 ranks fit under this cap" in line
    line = one_line_error(invoke("plan", path, "--stages", 2, "--memory-cap", 3500), 3)
    assert "no stage count from 3 to 6 fits under this cap either" in line
    line = one_line_error(invoke("plan", path, "--stages", 6, "--memory-cap", 3500), 3)
    assert "more ranks cannot help" in line


def test_explanations_do_not_divide_by_a_zero_iteration():
    from pipeplan.plan.explain import percent_text

    assert percent_text(1.0, 0.0) == "-" and percent_text(1.0, 4.0) == "25.0%"


# ---------------------------------------------------------------- accepted although wrong
def _mutate_plan(plan_file, how):
    data = json.loads(plan_file.read_text())
    if how == "schedule warp":
        data["schedule"] = "warp"
        needle = "schedule"
    elif how == "layer in two stages":
        data["stages"][1]["layers"].append(data["stages"][0]["layers"][0])
        needle = "is in stage 0 and stage 1"
    elif how == "rank 99":
        data["stages"][1]["rank"] = 99
        needle = "stages[1].rank: 99 is out of range"
    elif how == "NaN iteration_ms":
        data["predicted"]["iteration_ms"] = float("nan")
        needle = "predicted.iteration_ms"
    plan_file.write_text(json.dumps(data))
    return needle


@pytest.mark.parametrize("how", ["schedule warp", "layer in two stages", "rank 99", "NaN iteration_ms"])
@pytest.mark.parametrize("command", ["validate", "show", "export", "calibrate", "run", "diff"])
def test_one_plan_validator_for_every_command(tmp_path, plan_file, profile_file, how, command):
    good = tmp_path / "good.json"
    good.write_bytes(plan_file.read_bytes())
    report = write(tmp_path, json.dumps(_report_for(plan_file, profile_file)), "report.json")
    needle = _mutate_plan(plan_file, how)
    args = {
        "validate": ("validate", plan_file),
        "show": ("show", plan_file),
        "export": ("export", plan_file, "--format", "torch"),
        "calibrate": ("calibrate", plan_file, report, "-o", tmp_path / "c.json"),
        "run": ("run", plan_file, "--model", "gpt2-tiny"),
        "diff": ("diff", good, plan_file),
    }[command]
    one_line_error(invoke(*args), 2, "plan.json", needle)


def test_calibrate_refuses_a_profile_the_plan_was_not_made_from(tmp_path, plan_file, profile_file):
    report = write(tmp_path, json.dumps(_report_for(plan_file, profile_file)), "report.json")
    other = make_profile_dict(n_layers=6)
    other["layers"][0]["costs"][0]["forward_ms"] = 9.0
    other_path = write(tmp_path, other, "other.json")
    one_line_error(invoke("calibrate", plan_file, report, "-o", tmp_path / "c.json", "--profile", other_path), 2,
                   "other.json", "sha256")


def test_output_equal_to_an_input_is_refused(tmp_path, profile_file, plan_file):
    before = profile_file.read_bytes()
    one_line_error(invoke("plan", profile_file, "--stages", 2, "-o", profile_file), 2, "is the input file")
    assert profile_file.read_bytes() == before
    one_line_error(invoke("plan", profile_file, "--stages", 2, "-o", f"{tmp_path}/./profile.json"), 2)
    one_line_error(invoke("export", plan_file, "--format", "torch", "-o", plan_file), 2, "is the input file")
    one_line_error(invoke("show", plan_file, "--timeline-out", plan_file), 2, "is the input file")
    report = write(tmp_path, json.dumps(_report_for(plan_file, profile_file)), "report.json")
    one_line_error(invoke("calibrate", plan_file, report, "-o", report), 2, "is the input file")
    one_line_error(invoke("calibrate", plan_file, report, "-o", profile_file), 2, "is the input file")


@pytest.mark.parametrize("change, needle", [
    (lambda d: d["layers"][0]["costs"][0].update(forward_ms=True), "found a boolean"),
    (lambda d: d["layers"][0]["costs"][0].update(forward_ms="1.5"), "found the string"),
    (lambda d: d.update(dtype="fp7"), "dtype"),
    (lambda d: d["layers"][1].update(name="layer\x001"), "U+0000"),
    (lambda d: d["layers"][1].update(name="evil\u202etxt.exe"), "U+202E"),
    (lambda d: d.update(model="\x1b[31mred"), "U+001B"),
    (lambda d: d.update(edges=[["layer0", "layer1"], ["layer0", "layer1"]]), "repeats edges[0]"),
])
def test_profile_values_accepted_wrongly_before(tmp_path, change, needle):
    data = make_profile_dict(n_layers=3)
    change(data)
    path = write(tmp_path, data)
    line = one_line_error(invoke("validate", path), 2, "p.json", needle)
    assert "\x1b" not in line and "\u202e" not in line and "\x00" not in line


def test_control_characters_from_options_are_escaped_in_messages(profile_file):
    line = one_line_error(invoke("plan", profile_file, "--stages", 2, "--optimizer", "\x1b[31madam\u202e"), 2,
                          "--optimizer")
    assert "\x1b" not in line and "\u202e" not in line


def test_control_characters_never_reach_the_terminal_in_an_error():
    from pipeplan.cli_common import one_line

    assert one_line("bad name 'a\x1b[2Jb\u202e'") == "bad name 'a\\u001b[2Jb\\u202e'"


def test_empty_memory_cap_is_not_taken_as_no_cap(profile_file):
    one_line_error(invoke("plan", profile_file, "--stages", 2, "--memory-cap", ""), 2, "--memory-cap", "not a size")


# ---------------------------------------------------------------- messages
def test_plan_for_profile_and_the_reverse_in_one_line(profile_file, plan_file):
    one_line_error(invoke("plan", plan_file, "--stages", 2), 2, "this is a plan, not a profile")
    one_line_error(invoke("show", profile_file), 2, "this is a profile, not a plan")
    one_line_error(invoke("export", profile_file, "--format", "torch"), 2, "this is a profile, not a plan")


def test_validation_errors_are_the_first_plus_a_count(tmp_path):
    data = make_profile_dict(n_layers=3)
    for layer in data["layers"]:
        del layer["param_bytes"]
    line = one_line_error(invoke("validate", write(tmp_path, data)), 2, "layers[0].param_bytes: missing field")
    assert "(and 2 more problems)" in line


def test_option_messages_name_the_option(tmp_path, profile_file):
    one_line_error(invoke("plan", profile_file, "--stages", 2, "--virtual-stages", 0), 2, "--virtual-stages")
    line = one_line_error(invoke("plan", profile_file, "--stages", 2, "--action-overhead-ms", "inf"), 2,
                          "--action-overhead-ms", "finite")
    assert "StageCost" not in line
    data = make_profile_dict()
    data["schema_version"] = "1"
    one_line_error(invoke("validate", write(tmp_path, data)), 2, "schema_version", "is a string")


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_debug_is_accepted_anywhere(tmp_path, where):
    args = ["validate", str(tmp_path / "missing.json")]
    args.insert({"first": 0, "middle": 1, "last": 2}[where], "--debug")
    result = runner.invoke(app, args)
    # With --debug the traceback is shown, and the exit code is still the error's.
    assert result.exit_code == 2, result.stderr
    assert "Traceback" in result.stderr and "no such file" in result.stderr


@pytest.mark.parametrize("args", [
    ("plan", "x.json", "--stages", "abc"), ("diff", "x.json"), ("plan",), ("nosuchcommand",),
    ("plan", "x.json", "--stages", "2", "--bogus"),
])
def test_usage_errors_are_one_line(args):
    result = runner.invoke(app, list(args))
    line = one_line_error(result, 2)
    assert line.startswith("error: pipeplan") and "--help" in line and "╭" not in result.stderr


def test_summary_says_ranks_and_stages_and_names_both_bubbles(tmp_path):
    path = write(tmp_path, make_profile_dict(n_layers=16), "p.json")
    result = invoke("plan", path, "--stages", 4, "--global-batch", 16, "--schedule", "dualpipev", "-b", 1)
    assert result.exit_code == 0, result.stderr
    assert "4 ranks x 2 stages each (8 stages), dualpipev" in result.stdout
    assert "idle time of the bottleneck rank" in result.stdout
    assert "idle share of all ranks' time" in result.stdout


def test_compare_without_a_cap_says_no_cap(tmp_path):
    path = write(tmp_path, make_profile_dict(n_layers=8))
    result = invoke("compare", path, "--stages", 2, "--global-batch", 8)
    assert result.exit_code == 0, result.stderr
    assert "no cap" in result.stdout and " yes " not in result.stdout
    result = invoke("compare", path, "--stages", 2, "--global-batch", 8, "--memory-cap", "80GiB")
    assert " yes " in result.stdout or "yes" in result.stdout


# ---------------------------------------------------------------- files
def test_every_output_gets_the_umask_mode(tmp_path, profile_file, plan_file):
    old = os.umask(0o027)
    try:
        outputs = {
            "plan": ("plan", profile_file, "--stages", 2, "-o", tmp_path / "a.json", "-q"),
            "svg": ("show", plan_file, "--timeline-out", tmp_path / "t.svg"),
            "export": ("export", plan_file, "--format", "torch", "-o", tmp_path / "e.json"),
            "schema": ("schema", "report", "-o", tmp_path / "s.json"),
        }
        for name, args in outputs.items():
            result = invoke(*args)
            assert result.exit_code == 0, (name, result.stderr)
            written = args[args.index("-o") + 1] if "-o" in args else args[-1]
            assert stat.S_IMODE(os.stat(written).st_mode) == 0o640, name
    finally:
        os.umask(old)


def test_one_atomic_writer():
    """Every output goes through formats.io's writer (the timeline's SVG/PNG included)."""
    import pipeplan.plan.timeline as timeline

    source = (REPO / "pipeplan" / "plan" / "timeline.py").read_text()
    assert "write_bytes_atomic(path, buffer.getvalue())" in source and "from pipeplan.formats.io import" in source
    assert timeline.write_timeline_image is not None


def test_report_schema_is_published():
    from pipeplan.formats.schema import json_schema_text

    assert (REPO / "docs" / "schemas" / "report.schema.json").read_text() == json_schema_text("report")


# ---------------------------------------------------------------- profiler messages (docs/profiling.md)
def test_profiler_failure_names_the_innermost_cause():
    from pipeplan.profile.api import forward_failure

    try:
        try:
            raise ValueError("shapes (2, 3) and (4, 5) do not match")
        except ValueError as inner:
            raise RuntimeError("\n        Failed to run stage backward input:\n") from inner
    except RuntimeError as exc:
        error = forward_failure(exc, 1, 64, "unit 'out'")
    assert "ValueError: shapes (2, 3) and (4, 5) do not match" in str(error)


@pytest.mark.torch
@pytest.mark.slow
def test_profiling_docs_build_from_spec_example_profiles(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import re
    import sys

    text = (REPO / "docs" / "profiling.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "def build_from_spec" in b)
    (tmp_path / "docs_spec_models.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("docs_spec_models", None)
    from pipeplan.profile import profile_to_file

    out = tmp_path / "spec.json"
    profile_to_file("docs_spec_models:build_from_spec", str(out), microbatch_sizes="1", seq_len=64,
                    repeats=1, warmup=0)
    assert invoke("validate", out).exit_code == 0
