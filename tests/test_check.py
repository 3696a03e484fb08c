"""`pipeplan check` and `pipeplan diff`: re-planning against baselines, reports, exit codes."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from pipeplan.check import (
    PlanDiff, ProfileDiff, check_junit, check_profiles, diff_files, render_check, render_diff,
)
from pipeplan.errors import BadInputError
from pipeplan.formats.io import dump_model, file_sha256, load_plan, load_profile
from pipeplan.formats.plan import PlanSettings
from pipeplan.formats.profile import Profile
from pipeplan.plan import make_plan

from test_export_fixtures import llama_like_profile, profile_bytes

SETTINGS = PlanSettings(stages=4, global_batch=16, memory_cap_bytes=8 * 2**30, schedule="1f1b")


@pytest.fixture
def repo(tmp_path):
    """profiles/tiny.json and its baseline profiles/baselines/tiny.plan.json, made by the planner."""
    profiles = tmp_path / "profiles"
    (profiles / "baselines").mkdir(parents=True)
    path = profiles / "tiny.json"
    # A large output head (big vocabulary) is the bottleneck stage on its own.
    path.write_bytes(profile_bytes(llama_like_profile(8, head_forward_ms=8.0)))
    plan = make_plan(load_profile(path), SETTINGS, profile_sha256=file_sha256(path))
    (profiles / "baselines" / "tiny.plan.json").write_text(dump_model(plan))
    return profiles


def _edit_profile(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(Profile.model_validate(data).model_dump(mode="json", exclude_none=True), indent=2))


def _slowest_unit_of_bottleneck(plan, profile):
    stage = plan.stages[plan.predicted.bottleneck_stage]
    cost = {l.name: l.cost_at(plan.microbatch_size) for l in profile.layers}
    return max(stage.layers, key=lambda n: cost[n].forward_ms + cost[n].backward_ms)


def test_check_passes_on_unchanged_profiles(repo):
    report = check_profiles(repo, repo / "baselines")
    assert report.exit_code == 0 and len(report.checks) == 1
    check = report.checks[0]
    assert check.throughput_change == pytest.approx(0.0)
    assert not check.profile_changed and not check.failed
    assert "all 1 baselines pass" in render_check(report, "table")


def test_check_fails_when_one_unit_gets_20_percent_slower(repo):
    baseline = load_plan(repo / "baselines" / "tiny.plan.json")
    unit = _slowest_unit_of_bottleneck(baseline, load_profile(repo / "tiny.json"))
    assert unit == "output"

    def slower(data):
        for layer in data["layers"]:
            if layer["name"] == unit:
                for cost in layer["costs"]:
                    cost["forward_ms"] *= 1.2
                    cost["backward_ms"] *= 1.2

    _edit_profile(repo / "tiny.json", slower)
    report = check_profiles(repo, repo / "baselines", tolerance=0.02)
    assert report.exit_code == 1
    check = report.checks[0]
    assert check.profile_changed and check.throughput_change < -0.02
    fails = [f for f in check.findings if f.severity == "fail"]
    assert [f.topic for f in fails] == ["throughput"]
    assert "predicted throughput fell" in fails[0].message and "2% tolerance" in fails[0].message
    text = render_check(report, "table")
    assert "1 of 1 baselines failed" in text and "FAIL" in text and "tiny-llama (changed)" in text
    markdown = render_check(report, "markdown")
    assert markdown.startswith("### pipeplan check: 1 of 1 baselines failed")
    assert "| tiny |" in markdown and "**FAIL** `tiny`: predicted throughput fell" in markdown
    # A looser tolerance lets the same change through.
    assert check_profiles(repo, repo / "baselines", tolerance=0.5).exit_code == 0


def test_check_fails_when_the_cap_is_below_the_plans_peak(repo):
    baseline_path = repo / "baselines" / "tiny.plan.json"
    baseline = load_plan(baseline_path)
    peak = max(s.peak_memory_bytes for s in baseline.stages)
    # A cap under the committed plan's peak, given on the command line...
    report = check_profiles(repo, repo / "baselines", memory_cap_bytes=peak - 1)
    assert report.exit_code == 1
    messages = [f.message for f in report.checks[0].findings if f.severity == "fail"]
    assert any("committed baseline: rank" in m and "over the" in m for m in messages)
    # ... or written into the baseline's settings.
    data = json.loads(baseline_path.read_text())
    data["settings"]["memory_cap_bytes"] = peak * 9 // 10
    baseline_path.write_text(json.dumps(data))
    report = check_profiles(repo, repo / "baselines")
    assert report.exit_code == 1
    topics = {f.topic for f in report.checks[0].findings if f.severity == "fail"}
    assert "memory" in topics
    junit = ET.fromstring(check_junit(report))
    assert junit.get("failures") == "1"
    case = junit.find("testsuite/testcase")
    assert case.get("name") == "tiny" and case.find("failure") is not None


def test_check_reports_infeasible_as_failure(repo):
    from pipeplan.errors import InfeasibleError

    def nothing_fits(profile, settings, *, profile_sha256):
        raise InfeasibleError("over the memory cap at every split; the smallest cap that fits is 1 GiB")

    report = check_profiles(repo, repo / "baselines", planner=nothing_fits)
    check = report.checks[0]
    assert report.exit_code == 1 and check.current is None
    assert [f.message for f in check.findings if f.topic == "infeasible"] == [
        "no plan fits any more: over the memory cap at every split; the smallest cap that fits is 1 GiB"]
    assert "-" in render_check(report, "table")


def test_check_reports_infeasible_with_the_real_planner(repo):
    report = check_profiles(repo, repo / "baselines", memory_cap_bytes=1000)
    check = report.checks[0]
    assert report.exit_code == 1 and check.current is None
    assert any(f.topic == "infeasible" and "no plan fits any more" in f.message for f in check.findings)
    assert "FAIL" in render_check(report, "markdown")
    assert ET.fromstring(check_junit(report)).get("failures") == "1"


def test_check_matches_profile_by_model_and_updates(repo):
    (repo / "tiny.json").rename(repo / "renamed.json")
    report = check_profiles(repo, repo / "baselines")
    assert report.checks[0].profile_path.endswith("renamed.json") and report.exit_code == 0
    (repo / "renamed.json").unlink()
    with pytest.raises(BadInputError, match="no profile"):
        check_profiles(repo, repo / "baselines")


def test_check_update_rewrites_the_baseline(repo):
    def faster(data):
        for layer in data["layers"]:
            for cost in layer["costs"]:
                cost["forward_ms"] *= 0.5
                cost["backward_ms"] *= 0.5

    _edit_profile(repo / "tiny.json", faster)
    report = check_profiles(repo, repo / "baselines", update=True)
    assert report.exit_code == 0 and report.updated
    assert any("rose" in f.message for f in report.checks[0].findings)
    again = check_profiles(repo, repo / "baselines")
    assert again.checks[0].throughput_change == pytest.approx(0.0) and not again.checks[0].profile_changed


def test_check_bad_input(repo, tmp_path):
    with pytest.raises(BadInputError, match="tolerance"):
        check_profiles(repo, repo / "baselines", tolerance=-0.1)
    with pytest.raises(BadInputError, match="not a folder"):
        check_profiles(repo, tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BadInputError, match="no baseline plans"):
        check_profiles(repo, empty)
    (repo / "baselines" / "tiny.plan.json").write_text("{")
    with pytest.raises(BadInputError, match="not valid JSON"):
        check_profiles(repo, repo / "baselines")


def test_reports_are_deterministic(repo):
    a = check_profiles(repo, repo / "baselines")
    b = check_profiles(repo, repo / "baselines")
    for fmt in ("table", "markdown"):
        assert render_check(a, fmt) == render_check(b, fmt)
    assert check_junit(a) == check_junit(b)


# --------------------------------------------------------------------------- diff


def test_diff_two_plans_shows_moved_layers(repo, tmp_path):
    profile = load_profile(repo / "tiny.json")
    a = make_plan(profile, SETTINGS, profile_sha256="a")
    b = make_plan(profile, SETTINGS.model_copy(update={"stages": 3}), profile_sha256="a")
    (tmp_path / "a.json").write_text(dump_model(a))
    (tmp_path / "b.json").write_text(dump_model(b))
    diff = diff_files(tmp_path / "a.json", tmp_path / "b.json")
    assert isinstance(diff, PlanDiff) and diff.moved
    assert len(diff.stages) == 4 and diff.stages[3].layers[1] == 0
    text = render_diff(diff, "table")
    assert "moved layers" in text and "samples/s" in text
    assert "#### Moved layers" in render_diff(diff, "markdown")


def test_diff_two_profiles_with_and_without_settings(repo, tmp_path):
    old = tmp_path / "old.json"
    old.write_bytes((repo / "tiny.json").read_bytes())

    def edit(data):
        for layer in data["layers"]:
            if layer["name"] == "layers.3":
                for cost in layer["costs"]:
                    cost["forward_ms"] *= 3
                    cost["activation_bytes"] *= 2

    _edit_profile(repo / "tiny.json", edit)
    diff = diff_files(old, repo / "tiny.json")
    assert isinstance(diff, ProfileDiff) and diff.plan_diff is None
    assert [d.name for d in diff.changed] == ["layers.3"] and diff.unchanged == 10
    assert diff.changed[0].time_change_ms > 0 and diff.changed[0].bytes_change > 0
    assert "--stages" in render_diff(diff, "table")
    diff = diff_files(old, repo / "tiny.json", settings=SETTINGS)
    assert diff.plan_diff is not None
    assert diff.plan_diff.b.predicted.samples_per_second < diff.plan_diff.a.predicted.samples_per_second
    assert "### Plans: A beside B" in render_diff(diff, "markdown")


def test_diff_refuses_a_plan_and_a_profile(repo):
    with pytest.raises(BadInputError, match="two plans or two profiles"):
        diff_files(repo / "tiny.json", repo / "baselines" / "tiny.plan.json")


# --------------------------------------------------------------------------- commands


def test_run_check_writes_junit_and_renders(repo, tmp_path):
    from pipeplan.check.commands import run_check

    peak = max(s.peak_memory_bytes for s in load_plan(repo / "baselines" / "tiny.plan.json").stages)
    report, text = run_check(repo, repo / "baselines", format="markdown", junit_path=tmp_path / "j.xml",
                             memory_cap=str(peak * 9 // 10))
    assert report.exit_code == 1
    assert text.startswith("### pipeplan check")
    assert ET.parse(tmp_path / "j.xml").getroot().get("tests") == "1"
    with pytest.raises(BadInputError, match="--format"):
        run_check(repo, repo / "baselines", format="html")
    with pytest.raises(BadInputError, match="--memory-cap"):
        run_check(repo, repo / "baselines", memory_cap="lots")


def test_run_diff_settings(repo, tmp_path):
    from pipeplan.check.commands import run_diff

    text = run_diff(repo / "tiny.json", repo / "tiny.json", stages=2, global_batch=8)
    assert "plans: A beside B" in text and "0 layers changed" in text
    text = run_diff(repo / "tiny.json", repo / "tiny.json", format="markdown",
                    settings_from=repo / "baselines" / "tiny.plan.json")
    assert "### Plans: A beside B" in text
    with pytest.raises(BadInputError, match="--global-batch"):
        run_diff(repo / "tiny.json", repo / "tiny.json", stages=2)


# --------------------------------------------------------------------------- shipped baselines

REPO_PROFILES = __import__("pathlib").Path(__file__).resolve().parents[1] / "profiles"


def _shipped_baselines():
    folder = REPO_PROFILES / "baselines"
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


@pytest.mark.skipif(not _shipped_baselines(), reason="no baselines shipped in profiles/baselines/")
def test_shipped_baselines_pass():
    report = check_profiles(REPO_PROFILES, REPO_PROFILES / "baselines")
    assert report.exit_code == 0, render_check(report, "markdown")
    for check in report.checks:
        assert check.throughput_change == pytest.approx(0.0, abs=1e-9)
        assert not check.profile_changed


def _copy_with_one_baseline(tmp_path, baseline):
    import shutil

    target = tmp_path / "profiles"
    shutil.copytree(REPO_PROFILES, target)
    for other in (target / "baselines").glob("*.json"):
        if other.name != baseline.name:
            other.unlink()
    return target


@pytest.mark.skipif(not _shipped_baselines(), reason="no baselines shipped in profiles/baselines/")
def test_shipped_baselines_fail_when_one_unit_is_20_percent_slower(tmp_path):
    """In a tmp copy, the heaviest unit of each baseline's bottleneck stage gets 20% slower."""
    from pipeplan.check.regress import find_profile

    failed = []
    for index, baseline in enumerate(_shipped_baselines()):
        repo = _copy_with_one_baseline(tmp_path / str(index), baseline)
        plan = load_plan(baseline)
        profile_path = find_profile(repo / "baselines" / baseline.name, plan, repo)
        unit = _slowest_unit_of_bottleneck(plan, load_profile(profile_path))

        def slower(data):
            for layer in data["layers"]:
                if layer["name"] == unit:
                    for cost in layer["costs"]:
                        for key in ("forward_ms", "backward_ms", "backward_input_ms", "backward_weight_ms"):
                            if cost.get(key) is not None:
                                cost[key] *= 1.2

        _edit_profile(profile_path, slower)
        report = check_profiles(repo, repo / "baselines")
        check = report.checks[0]
        # The re-plan may absorb one slower unit by moving boundaries (then the check passes).
        assert check.profile_changed
        assert report.exit_code == (1 if check.throughput_change < -0.02 else 0)
        if report.exit_code:
            failed.append(baseline.name)
            assert "predicted throughput fell" in render_check(report, "markdown")
    assert failed, "no shipped baseline lost more than 2% from one unit 20% slower"


@pytest.mark.skipif(not _shipped_baselines(), reason="no baselines shipped in profiles/baselines/")
def test_shipped_baselines_fail_under_a_cap_below_their_peak(tmp_path):
    from pipeplan.check.regress import rank_peaks

    for index, baseline in enumerate(_shipped_baselines()):
        repo = _copy_with_one_baseline(tmp_path / str(index), baseline)
        peak = max(rank_peaks(load_plan(baseline)).values())
        report = check_profiles(repo, repo / "baselines", memory_cap_bytes=peak - 1)
        assert report.exit_code == 1
        assert any("committed baseline: rank" in f.message for f in report.checks[0].findings)
