"""The `export`, `check` and `diff` commands: exit codes, files, one-line errors."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.formats.io import dump_model, file_sha256, load_profile
from pipeplan.formats.plan import PlanSettings
from pipeplan.plan import make_plan

from test_export_fixtures import llama_like_profile, profile_bytes

runner = CliRunner()


@pytest.fixture
def repo(tmp_path):
    profiles = tmp_path / "profiles"
    (profiles / "baselines").mkdir(parents=True)
    path = profiles / "tiny.json"
    path.write_bytes(profile_bytes(llama_like_profile(8, head_forward_ms=8.0)))
    settings = PlanSettings(stages=4, global_batch=16, memory_cap_bytes=8 * 2**30, schedule="1f1b")
    plan = make_plan(load_profile(path), settings, profile_sha256=file_sha256(path))
    (profiles / "baselines" / "tiny.plan.json").write_text(dump_model(plan))
    return profiles


def test_check_exit_codes(repo, tmp_path):
    result = runner.invoke(app, ["check", str(repo), "--baseline", str(repo / "baselines")])
    assert result.exit_code == 0, result.output
    assert "all 1 baselines pass" in result.output
    data = json.loads((repo / "tiny.json").read_text())
    for layer in data["layers"]:
        if layer["name"] == "output":
            for cost in layer["costs"]:
                cost["forward_ms"] *= 1.2
                cost["backward_ms"] *= 1.2
    (repo / "tiny.json").write_text(json.dumps(data))
    junit = tmp_path / "report.xml"
    result = runner.invoke(app, ["check", str(repo), "--baseline", str(repo / "baselines"),
                                 "--format", "markdown", "--junit", str(junit)])
    assert result.exit_code == 1
    assert "**FAIL** `tiny`: predicted throughput fell" in result.output
    assert ET.parse(junit).getroot().get("failures") == "1"
    result = runner.invoke(app, ["check", str(repo), "--baseline", str(tmp_path / "nowhere")])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: --baseline:")


def test_export_commands(repo, tmp_path):
    plan = repo / "baselines" / "tiny.plan.json"
    result = runner.invoke(app, ["export", str(plan), "--format", "torch"])
    assert result.exit_code == 0 and json.loads(result.output)["num_stages"] == 4
    out = tmp_path / "out" / "plan.toml"
    result = runner.invoke(app, ["export", str(plan), "--format", "torchtitan", "--schedule-csv", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and (tmp_path / "out" / "plan.schedule.csv").is_file()
    result = runner.invoke(app, ["export", str(plan), "--format", "megatron"])
    assert result.exit_code == 2 and "--profile PATH" in result.output
    result = runner.invoke(app, ["export", str(plan), "--format", "megatron", "--profile", str(repo / "tiny.json")])
    assert result.exit_code == 0 and "--pipeline-model-parallel-layout" in result.output
    result = runner.invoke(app, ["export", str(plan), "--format", "nope"])
    assert result.exit_code == 2


def test_diff_command(repo):
    result = runner.invoke(app, ["diff", str(repo / "tiny.json"), str(repo / "tiny.json"),
                                 "--settings-from", str(repo / "baselines" / "tiny.plan.json"), "--format", "markdown"])
    assert result.exit_code == 0, result.output
    assert "0 layers changed" in result.output and "### Plans: A beside B" in result.output
    result = runner.invoke(app, ["diff", str(repo / "tiny.json"), str(repo / "baselines" / "tiny.plan.json")])
    assert result.exit_code == 2 and "two plans or two profiles" in result.output
