"""Issue 24's findings (hardening, round two), one test per class member: exit 2 (or 3) and one
line, or the right answer; never an internal error, a hang, a clobbered file or a left process."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import make_profile_dict
from doctor_profiles import llama3_8b, write_profile
from pipeplan.cli import app
from pipeplan.errors import BadInputError

runner = CliRunner()
DOCTOR = Path(__file__).parent / "data" / "doctor"


def write(tmp_path, data, name="p.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, code=2, *needles):
    """The result failed with ``code``, one line on stderr, no traceback, naming every needle."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def profile_file(tmp_path):
    return write(tmp_path, make_profile_dict(n_layers=6), "profile.json")


@pytest.fixture
def plan_file(tmp_path, profile_file):
    out = tmp_path / "plan.json"
    result = invoke("plan", profile_file, "--stages", 2, "--global-batch", 8, "--schedule", "1f1b", "-o", out, "-q")
    assert result.exit_code == 0, result.stderr
    return out


# ---------------------------------------------------------------- outputs
def test_a_fifo_output_is_refused_and_left_a_fifo(tmp_path, profile_file):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    one_line_error(invoke("plan", profile_file, "--stages", 2, "-o", fifo, "-q"), 2, "FIFO")
    assert fifo.is_fifo()


def test_a_link_to_a_device_is_refused(tmp_path, profile_file, plan_file):
    # Through a link so that the old code replaced the link, never /dev/null itself.
    link = tmp_path / "null.json"
    link.symlink_to("/dev/null")
    one_line_error(invoke("plan", profile_file, "--stages", 2, "-o", link, "-q"), 2, "character device")
    one_line_error(invoke("export", plan_file, "--format", "torch", "-o", link), 2, "character device")
    one_line_error(invoke("schema", "plan", "-o", link), 2, "character device")
    assert link.is_symlink() and os.readlink(link) == "/dev/null"


@pytest.mark.parametrize("name", ["", "x" * 300])
def test_empty_and_too_long_output_names_are_one_line(profile_file, name):
    one_line_error(invoke("plan", profile_file, "--stages", 2, "-o", name, "-q"), 2, "-o")


def test_doctor_junit_equal_to_the_profile_is_refused(tmp_path):
    profile = write_profile(llama3_8b(), tmp_path / "p.json")
    before = profile.read_bytes()
    result = invoke("doctor", "torchtitan", DOCTOR / "torchtitan_llama3_8b_pp4.toml", "--profile", profile,
                    "--memory-cap", "80GiB", "--junit", profile)
    one_line_error(result, 2, "--junit", "input")
    assert profile.read_bytes() == before


def test_doctor_fix_sidecar_equal_to_an_input_is_refused(tmp_path):
    # --fix -o ds.json writes ds.parts.json beside it: here that is the profile.
    profile = write_profile(llama3_8b(), tmp_path / "ds.parts.json")
    before = profile.read_bytes()
    result = invoke("doctor", "deepspeed", DOCTOR / "deepspeed_pipeline_ds_config.json", "--profile", profile,
                    "--world-size", "4", "--num-stages", "4", "--fix", "-o", tmp_path / "ds.json")
    one_line_error(result, 2, "ds.parts.json", "input")
    assert profile.read_bytes() == before and not (tmp_path / "ds.json").exists()


@pytest.fixture
def titan_plan(tmp_path):
    """A plan of a Llama-like profile, which exports to torchtitan without its profile."""
    from pipeplan.formats.io import dump_model, file_sha256, load_profile
    from pipeplan.formats.plan import PlanSettings
    from pipeplan.plan import make_plan
    from test_export_fixtures import llama_like_profile, profile_bytes

    path = tmp_path / "tiny.json"
    path.write_bytes(profile_bytes(llama_like_profile(8, head_forward_ms=8.0)))
    settings = PlanSettings(stages=4, global_batch=16, memory_cap_bytes=8 * 2**30, schedule="1f1b")
    plan = make_plan(load_profile(path), settings, profile_sha256=file_sha256(path))
    return write(tmp_path, dump_model(plan), "tiny.plan.json")


def test_export_sidecar_equal_to_an_input_is_refused(tmp_path, titan_plan):
    sidecar = tmp_path / "t.schedule.csv"  # the plan itself, by an odd name
    shutil.copy(titan_plan, sidecar)
    before = sidecar.read_bytes()
    result = invoke("export", sidecar, "--format", "torchtitan", "--schedule-csv", "-o", tmp_path / "t.toml")
    one_line_error(result, 2, "t.schedule.csv", "input")
    assert sidecar.read_bytes() == before and not (tmp_path / "t.toml").exists()


def test_multi_file_export_is_all_or_nothing(tmp_path, titan_plan):
    (tmp_path / "t.schedule.csv").mkdir()  # the CSV cannot be written
    one_line_error(invoke("export", titan_plan, "--format", "torchtitan", "--schedule-csv", "-o", tmp_path / "t.toml"),
                   2, "t.schedule.csv", "directory")
    assert not (tmp_path / "t.toml").exists()


def test_a_failing_rename_puts_every_file_back(tmp_path, monkeypatch):
    from pipeplan.formats import io

    old = write(tmp_path, "old", "a.txt")
    real = os.replace
    calls = []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(io.os, "replace", flaky)
    with pytest.raises(BadInputError, match="b.txt: cannot write: No space left"):
        io.write_files_atomic({old: "new", tmp_path / "b.txt": "b", tmp_path / "c.txt": "c"})
    monkeypatch.setattr(io.os, "replace", real)
    assert old.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_run_report_target_is_checked_before_the_run(tmp_path, plan_file, profile_file):
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    one_line_error(invoke("run", plan_file, "--profile", profile_file, "--report", fifo), 2, "--report", "FIFO")
