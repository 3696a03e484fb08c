"""The Python API behind `pipeplan plan`: the same plan as the CLI, and plans of a given split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeplan.api import plan_profile, plan_split
from pipeplan.cli import app
from pipeplan.errors import BadInputError
from pipeplan.formats.io import dump_model, load_plan, load_profile
from pipeplan.formats.plan import SOLVER_METHODS, PlanSettings
from pipeplan.plan import make_plan

REPO = Path(__file__).resolve().parents[1]
PROFILES = REPO / "profiles"


@pytest.mark.parametrize("name,options,settings", [
    ("gpt2-tiny-cpu", ["--stages", "2"], {"stages": 2}),
    ("llama-small-cpu", ["--stages", "4", "--memory-cap", "4GiB"], {"stages": 4, "memory_cap_bytes": 4 * 2**30}),
    ("bert-tiny-cpu", ["--stages", "2", "--schedule", "zb", "--global-batch", "16"],
     {"stages": 2, "schedule": "zb", "global_batch": 16}),
])
def test_the_cli_and_the_api_make_the_same_plan(tmp_path, name, options, settings):
    profile = PROFILES / f"{name}.json"
    out = tmp_path / "cli.plan.json"
    result = CliRunner().invoke(app, ["plan", str(profile), *options, "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    api = plan_profile(profile, PlanSettings(**settings), tmp_path / "api.plan.json")
    assert (tmp_path / "api.plan.json").read_bytes() == out.read_bytes()
    assert dump_model(api) == out.read_text()


def test_plan_settings_defaults_are_the_clis():
    s = PlanSettings(stages=2)
    assert (s.schedule, s.recompute, s.optimizer, s.solver, s.bandwidth_bytes_per_s) == (
        "auto", "auto", "adam", "auto", 25e9)
    profile = load_profile(PROFILES / "gpt2-tiny-cpu.json")
    plan = make_plan(profile, s, profile_sha256="0" * 64)
    assert plan.settings.global_batch == 8 * max(profile.microbatch_sizes)


def test_an_infinite_bandwidth_survives_the_plan_file(tmp_path):
    profile = PROFILES / "gpt2-tiny-cpu.json"
    plan = plan_profile(profile, PlanSettings(stages=2, bandwidth_bytes_per_s=None), tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["settings"]["bandwidth_bytes_per_s"] is None
    assert load_plan(tmp_path / "p.json").settings.bandwidth_bytes_per_s is None
    # A file from before the 25 GB/s default omitted the null: it still means infinite.
    del data["settings"]["bandwidth_bytes_per_s"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_plan(tmp_path / "old.json").settings.bandwidth_bytes_per_s is None
    assert plan.stages[0].transfer_ms == 0


def test_every_solver_method_is_documented_in_the_schema():
    from pipeplan.formats.schema import json_schema_text

    schema = json.loads(json_schema_text("plan"))
    method = schema["$defs"]["SolverInfo"]["properties"]["method"]
    assert set(method["enum"]) == set(SOLVER_METHODS)
    assert all(name in method["description"] for name in SOLVER_METHODS)


def test_plan_split_costs_a_given_split_like_the_planner():
    profile = load_profile(PROFILES / "gpt2-tiny-cpu.json")
    settings = PlanSettings(stages=2, schedule="1f1b", microbatch_size=2, global_batch=16, recompute="none")
    best = make_plan(profile, settings, profile_sha256="0" * 64)
    counts = [len(s.layers) for s in best.stages]
    given = plan_split(profile, settings, counts, profile_sha256="0" * 64)
    assert given.solver.method == "given"
    assert [s.layers for s in given.stages] == [s.layers for s in best.stages]
    assert given.predicted == best.predicted
    assert [s.model_dump() for s in given.stages] == [s.model_dump() for s in best.stages]
    # Another split is no faster than the optimum.
    moved = [counts[0] + 1, counts[1] - 1] if counts[1] > 1 else [counts[0] - 1, counts[1] + 1]
    other = plan_split(profile, settings, moved)
    assert other.predicted.iteration_ms >= best.predicted.iteration_ms - 1e-9


def test_plan_split_takes_virtual_stages_from_the_schedule():
    profile = load_profile(PROFILES / "gpt2-tiny-cpu.json")
    n = len(profile.layers)
    settings = PlanSettings(stages=2, schedule="zbv", microbatch_size=1, global_batch=8)
    counts = [n // 4] * 3 + [n - 3 * (n // 4)]
    plan = plan_split(PROFILES / "gpt2-tiny-cpu.json", settings, counts)
    assert plan.virtual_stages == 2 and [s.rank for s in plan.stages] == [0, 1, 1, 0]
    assert [len(s.layers) for s in plan.stages] == counts


@pytest.mark.parametrize("counts,message", [
    ([3], "1 counts for 2 ranks x 1 stages per rank; give 2"),
    ([0, 100], "stage 0 has 0 units; every stage needs at least 1"),
    ([1, 1], "add up to 2 but the profile has"),
    ([1.5, 2], "must be whole numbers"),
])
def test_plan_split_names_what_is_wrong_with_the_counts(counts, message):
    profile = load_profile(PROFILES / "gpt2-tiny-cpu.json")
    settings = PlanSettings(stages=2, schedule="1f1b", microbatch_size=1, global_batch=8)
    with pytest.raises(BadInputError, match=message.replace("(", r"\(")):
        plan_split(profile, settings, counts)


def test_plan_split_needs_a_named_schedule():
    profile = load_profile(PROFILES / "gpt2-tiny-cpu.json")
    with pytest.raises(BadInputError, match="named schedule"):
        plan_split(profile, PlanSettings(stages=2, microbatch_size=1), [1, len(profile.layers) - 1])
