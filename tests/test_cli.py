"""The CLI through typer's runner and as a subprocess: exit codes and messages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, make_profile_dict, pipedream_path
from cli_checks import invoke, write
from pipeplan.cli import app



def test_plan_writes_a_valid_plan_and_is_byte_identical(tmp_path):
    prof = write(tmp_path, make_profile_dict(n_layers=8))
    out1, out2 = tmp_path / "a.json", tmp_path / "b.json"
    for out in (out1, out2):
        result = invoke("plan", prof, "--stages", 4, "--global-batch", 8, "-o", out, "--schedule", "1f1b")
        assert result.exit_code == 0, result.output
    assert out1.read_bytes() == out2.read_bytes()
    result = invoke("validate", out1)
    assert result.exit_code == 0 and "valid plan" in result.output
    result = invoke("show", out1)
    assert result.exit_code == 0 and "stages" in result.output


def test_compare_lists_the_baselines(tmp_path):
    prof = write(tmp_path, make_profile_dict(n_layers=12))
    result = invoke("compare", prof, "--stages", 3, "--global-batch", 8)
    assert result.exit_code == 0, result.output
    for name in ("optimal", "uniform", "params", "greedy"):
        assert name in result.output


def _broken_profiles():
    base = make_profile_dict
    d = base(); d["layers"][1]["costs"][0]["forward_ms"] = -1.0
    yield "negative", d, "forward_ms"
    d = base(); d["layers"][1]["costs"][0]["backward_ms"] = float("nan")
    yield "nan", json.dumps(d).replace("NaN", "NaN"), "backward_ms"
    d = base(); del d["layers"][0]["param_bytes"]
    yield "missing", d, "param_bytes: missing field"
    d = base(edges=[["layer0", "layer1"], ["layer1", "nope"]])
    yield "unknown-edge", d, "unknown layer 'nope'"
    d = base(edges=[["layer0", "layer1"], ["layer2", "layer1"]])
    yield "cycle", d, "goes backwards"
    d = base(); d["layers"][2]["name"] = "layer1"
    yield "duplicate", d, "duplicate layer name"
    yield "truncated", json.dumps(base())[:-20], "not valid JSON"


@pytest.mark.parametrize("label,data,needle", list(_broken_profiles()), ids=[c[0] for c in _broken_profiles()])
def test_bad_profiles_exit_2_with_one_line_per_problem(tmp_path, label, data, needle):
    prof = write(tmp_path, data)
    for args in (("validate", prof), ("plan", prof, "--stages", 2, "--global-batch", 4)):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert needle in result.output
        assert str(prof) in result.output
        assert "Traceback" not in result.output


def test_more_stages_than_layers_exits_2(tmp_path):
    prof = write(tmp_path, make_profile_dict(n_layers=3))
    result = invoke("plan", prof, "--stages", 5, "--global-batch", 8)
    assert result.exit_code == 2
    assert "only 3 layers" in result.output


def test_bad_option_values_exit_2(tmp_path):
    prof = write(tmp_path, make_profile_dict(sizes=(2, 4)))
    result = invoke("plan", prof, "--stages", 2, "--memory-cap", "lots")
    assert result.exit_code == 2 and "--memory-cap" in result.output
    result = invoke("plan", prof, "--stages", 2, "--global-batch", 3)
    assert result.exit_code == 2 and "--global-batch" in result.output


def test_infeasible_cap_exits_3_and_says_what_fits(tmp_path):
    prof = write(tmp_path, make_profile_dict(n_layers=6, param_bytes=10**9))
    result = invoke("plan", prof, "--stages", 2, "--global-batch", 8, "--memory-cap", "1GiB", "--schedule", "1f1b")
    assert result.exit_code == 3, result.output
    assert "fits" in result.output
    assert "Traceback" not in result.output


def test_import_pipedream_keeps_the_dag(tmp_path):
    out = tmp_path / "resnet50.json"
    result = invoke("import", "pipedream", pipedream_path("resnet50"), "--batch-size", 128, "-o", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert len(data["layers"]) == 177 and len(data["edges"]) == 193
    assert data["layers"][0]["costs"][0]["forward_ms"] == 0.0  # Input: data loading, zeroed


def test_import_of_a_bad_file_exits_2(tmp_path):
    bad = write(tmp_path, "node1 -- Conv -- forward_compute_time=x\n", "g.txt")
    result = invoke("import", "pipedream", bad, "--batch-size", 8, "-o", tmp_path / "o.json")
    assert result.exit_code == 2 and str(bad) in result.output


def test_every_command_has_help_and_a_docstring():
    import typer.main

    group = typer.main.get_command(app)
    names = []
    def walk(cmd, prefix=()):
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, prefix + (name,))
        if not getattr(cmd, "commands", None):
            names.append(prefix)
            assert cmd.help, f"{' '.join(prefix)} has no help text"
    walk(group)
    assert ("plan",) in names and ("import", "pipedream") in names
    for name in names:
        result = invoke(*name, "--help")
        assert result.exit_code == 0


def test_schema_is_published(tmp_path):
    for kind in ("profile", "plan", "report"):
        result = invoke("schema", kind)
        assert result.exit_code == 0
        assert json.loads(result.output)["title"].lower() == {"report": "runreport"}.get(kind, kind)
        committed = REPO / "docs" / "schemas" / f"{kind}.schema.json"
        assert committed.read_text() == result.output, "regenerate with: pipeplan schema KIND -o docs/schemas/KIND.schema.json"


def test_cli_as_a_subprocess(tmp_path):
    prof = write(tmp_path, make_profile_dict(n_layers=6))
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-m", "pipeplan.cli", "plan", str(prof), "--stages", "2",
                           "--global-batch", "4", "-o", str(out), "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["schema_version"] == 1
    done = subprocess.run([sys.executable, "-m", "pipeplan.cli", "validate", str(tmp_path / "missing.json")],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "no such file" in done.stderr and "Traceback" not in done.stderr


def test_a_defaulted_global_batch_is_said_and_show_prints_the_global_batch(tmp_path):
    prof = write(tmp_path, make_profile_dict(n_layers=6, sizes=(1, 2)))
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-m", "pipeplan", "plan", str(prof), "--stages", "2", "-o", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "note: no --global-batch: planned at 16 samples per iteration (8 x the largest profiled micro-batch)" \
        in done.stderr
    shown = invoke("show", out)
    assert shown.exit_code == 0 and "global batch" in shown.output and "16 samples" in shown.output
    # Given, or with -q, nothing is said (in process: the subprocess above is the real one).
    for extra in (["--global-batch", "8"], ["-q"]):
        done = invoke("plan", prof, "--stages", "2", *extra)
        assert done.exit_code == 0 and "--global-batch" not in done.stderr, done.stderr
