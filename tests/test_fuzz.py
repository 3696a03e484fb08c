"""Fuzzing every command that reads a file: exit 0, 2 or 3 (1 only as check's verdict), one line on
stderr, never a traceback.

Inputs come two ways: documents drawn from the published JSON Schemas (docs/schemas/, by
:func:`from_schema`), and valid files mutated at one place (numbers at the edges of float
range, wrong types, odd strings, deep nesting, a field removed). Each drives ``validate``,
``plan``, ``show``, ``export``, ``calibrate`` and ``check`` through typer's runner; one
subprocess smoke check runs the installed entry point. Derandomized with bounded example
counts, so CI sees the same examples every run.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from conftest import REPO, make_profile_dict
from pipeplan.cli import app

runner = CliRunner()

FUZZ = settings(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])

#: Numbers at the edges of what JSON and float can hold (and just past the formats' limits).
EDGE_NUMBERS = [0, -0.0, -1, 1, 5e-324, 2.2250738585072014e-308, 1e-300, 0.5, 1e9, 1e9 + 1, 2**53, 2**53 + 1,
                2**63, 2**64, 1e18, 1e19, 1e300, 1.7976931348623157e308, -1.7976931348623157e308,
                float("nan"), float("inf"), float("-inf"), 10**400]
ODD_STRINGS = ["", " ", "\x00", "a\x00b", "\u202eevil", "\x1b[31mred", "\n", "é", "🙂", "a" * 5000, "../../etc/passwd",
               "1", "1.5", "true", "null", "NaN", "-1", "fp7", "1f1b", "auto"]
WRONG_TYPES = [True, False, None, [], {}, [1, 2], {"a": 1}]


def _deep(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


REPLACEMENTS = st.one_of(
    st.sampled_from(EDGE_NUMBERS),
    st.sampled_from(ODD_STRINGS),
    st.sampled_from(WRONG_TYPES),
    st.integers(min_value=2, max_value=300).map(_deep),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.just("<delete>"),
)


def _paths(value, prefix=()):
    """Every path into a JSON document (keys and list indexes)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value[:3]):  # the first few items stand for all
            yield from _paths(item, prefix + (index,))


def _mutated(document, path, replacement):
    data = copy.deepcopy(document)
    if not path:
        return replacement if replacement != "<delete>" else {}
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    if replacement == "<delete>":
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return data


def _dumps(data) -> str:
    # 10**400 as a JSON number, as a hostile file would write it.
    return json.dumps(data, allow_nan=True).replace(str(10**400), "1e400")


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A valid profile, its plan, a run report and a check folder."""
    root = tmp_path_factory.mktemp("fuzz")
    profile = make_profile_dict(n_layers=4, sizes=(1, 2))
    (root / "profile.json").write_text(json.dumps(profile))
    result = runner.invoke(app, ["plan", str(root / "profile.json"), "--stages", "2", "--global-batch", "4",
                                 "--schedule", "1f1b", "-o", str(root / "plan.json"), "-q"])
    assert result.exit_code == 0, result.stderr
    plan = json.loads((root / "plan.json").read_text())
    from pipeplan.formats.io import load_plan
    from pipeplan.run import build_report

    loaded = load_plan(root / "plan.json")
    results = [{"rank": r, "stages": [s.index for s in loaded.stages if s.rank == r], "step_ms": [9.0] * 3,
                "pipeline_ms": [8.0] * 3, "compute_ms": [{"forward": 2.0, "backward": 4.0, "weight": 0.0}] * 3,
                "losses": [1.0] * 3, "peak_memory_bytes": None} for r in range(2)]
    report = build_report(loaded, results, profile_path=str(root / "profile.json"))
    return {"root": root, "profile": profile, "plan": plan, "report": json.loads(json.dumps(report))}


ALLOWED = {0, 2, 3}


def _check_result(result, command: str, verdict_ok: bool = False) -> int:
    code = result.exit_code
    allowed = ALLOWED | ({1} if verdict_ok else set())
    where = f"{command}: exit {code}\nstdout: {result.stdout[-1500:]}\nstderr: {result.stderr[-1500:]}"
    assert code in allowed, where
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, where
    assert result.exception is None or isinstance(result.exception, SystemExit), (where, repr(result.exception))
    if code == 1:
        # check's regression verdict: a report on stdout, nothing on stderr.
        assert result.stderr == "" and "FAIL" in result.stdout, where
    elif code != 0:
        assert len(result.stderr.strip().splitlines()) == 1, where
    else:
        assert "Warning" not in result.stderr, where
    return code


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def _write(folder: Path, name: str, data) -> Path:
    path = folder / name
    path.write_text(data if isinstance(data, str) else _dumps(data))
    return path


def _run_profile_commands(folder: Path, path: Path, outcomes: list) -> None:
    outcomes.append(_check_result(_invoke("validate", path), "validate"))
    code = _check_result(_invoke("plan", path, "--stages", 2, "-o", folder / "out.json", "-q"), "plan")
    outcomes.append(code)
    if code != 0:
        assert not (folder / "out.json").exists(), "a failed plan left a file"
    else:
        (folder / "out.json").unlink()


def _run_plan_commands(valid, folder: Path, path: Path, outcomes: list) -> None:
    outcomes.append(_check_result(_invoke("validate", path), "validate"))
    outcomes.append(_check_result(_invoke("show", path), "show"))
    for fmt in ("torch", "torchtitan", "deepspeed"):
        outcomes.append(_check_result(_invoke("export", path, "--format", fmt), f"export {fmt}"))
    report = _write(folder, "report.json", valid["report"])
    outcomes.append(_check_result(_invoke("calibrate", path, report, "-o", folder / "cal.json",
                                          "--profile", valid["root"] / "profile.json"), "calibrate"))


def _run_check(valid, folder: Path, profile, baseline, outcomes: list) -> None:
    profiles = folder / "profiles"
    (profiles / "baselines").mkdir(parents=True, exist_ok=True)
    _write(profiles, "model.json", profile)
    _write(profiles / "baselines", "model.plan.json", baseline)
    outcomes.append(_check_result(_invoke("check", profiles, "--baseline", profiles / "baselines"), "check",
                                  verdict_ok=True))


def _mutations(document_key: str):
    @st.composite
    def draw(draw_, valid):
        document = valid[document_key]
        paths = list(_paths(document))
        path = draw_(st.sampled_from(paths))
        return path, _mutated(document, path, draw_(REPLACEMENTS))
    return draw


def test_mutated_profiles(valid, tmp_path):
    outcomes: list[int] = []

    @settings(FUZZ, max_examples=60)
    @given(case=_mutations("profile")(valid))
    def run(case):
        path, data = case
        _run_profile_commands(tmp_path, _write(tmp_path, "profile.json", data), outcomes)

    run()
    assert 2 in outcomes and 0 in outcomes, sorted(set(outcomes))


def test_mutated_plans(valid, tmp_path):
    outcomes: list[int] = []

    @settings(FUZZ, max_examples=40)
    @given(case=_mutations("plan")(valid))
    def run(case):
        path, data = case
        _run_plan_commands(valid, tmp_path, _write(tmp_path, "plan.json", data), outcomes)

    run()
    assert 2 in outcomes and 0 in outcomes, sorted(set(outcomes))


def test_mutated_reports(valid, tmp_path):
    outcomes: list[int] = []
    plan = _write(tmp_path, "plan.json", valid["plan"])

    @settings(FUZZ, max_examples=40)
    @given(case=_mutations("report")(valid))
    def run(case):
        path, data = case
        report = _write(tmp_path, "report.json", data)
        outcomes.append(_check_result(_invoke("validate", report), "validate report"))
        outcomes.append(_check_result(_invoke("calibrate", plan, report, "-o", tmp_path / "cal.json",
                                              "--profile", valid["root"] / "profile.json"), "calibrate"))

    run()
    assert 2 in outcomes and 0 in outcomes, sorted(set(outcomes))


def test_mutated_check_folders(valid, tmp_path):
    outcomes: list[int] = []

    @settings(FUZZ, max_examples=30)
    @given(which=st.sampled_from(["profile", "plan"]), case=st.data())
    def run(which, case):
        path, data = case.draw(_mutations(which)(valid))
        profile = data if which == "profile" else valid["profile"]
        baseline = data if which == "plan" else valid["plan"]
        _run_check(valid, tmp_path, profile, baseline, outcomes)

    run()
    assert 2 in outcomes and (0 in outcomes or 1 in outcomes), sorted(set(outcomes))


def _schema(kind: str) -> dict:
    return json.loads((REPO / "docs" / "schemas" / f"{kind}.schema.json").read_text())


def from_schema(schema: dict, root: dict | None = None):
    """Documents that follow a JSON Schema (the keywords pydantic's schemas use).

    Field by field the values keep to the schema's types and ranges; the rules a schema cannot
    state (layer names unique, stages that cover the ranks) are mostly broken, which is what a
    fuzz test wants. hypothesis-jsonschema would do this, but its current release does not run
    on this hypothesis.
    """
    root = schema if root is None else root
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return from_schema(root["$defs"][name], root)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, root) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: from_schema(v, root) for k, v in props.items() if k in required},
            optional={k: from_schema(v, root) for k, v in props.items() if k not in required})
    if kind == "array":
        if "prefixItems" in schema:
            return st.tuples(*[from_schema(s, root) for s in schema["prefixItems"]]).map(list)
        low = schema.get("minItems", 0)
        return st.lists(from_schema(schema.get("items", {}), root), min_size=low,
                        max_size=max(low, min(schema.get("maxItems", 4), 4)))
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -(2**31) - 1) + 1)
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**31 + 1) - 1)
        return st.one_of(st.integers(low, min(high, low + 16)), st.integers(low, high))
    if kind == "number":
        return st.floats(min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
                         max_value=schema.get("maximum", schema.get("exclusiveMaximum")),
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
                         allow_nan=False, allow_infinity=False)
    if kind == "string":
        low = schema.get("minLength", 0)
        return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", 12), 12)))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return st.one_of(st.none(), st.integers(), st.text(max_size=5), st.just({}))


def test_documents_from_the_published_schemas(valid, tmp_path):
    outcomes: list[int] = []

    @settings(FUZZ, max_examples=25)
    @given(kind=st.sampled_from(["profile", "plan", "report"]), data=st.data())
    def run(kind, data):
        document = data.draw(from_schema(_schema(kind)))
        path = _write(tmp_path, f"{kind}.json", document)
        if kind == "profile":
            _run_profile_commands(tmp_path, path, outcomes)
        elif kind == "plan":
            _run_plan_commands(valid, tmp_path, path, outcomes)
        else:
            outcomes.append(_check_result(_invoke("validate", path), "validate report"))
            outcomes.append(_check_result(_invoke("calibrate", _write(tmp_path, "p.json", valid["plan"]), path,
                                                  "-o", tmp_path / "cal.json", "--profile",
                                                  valid["root"] / "profile.json"), "calibrate"))

    run()
    assert 2 in outcomes, sorted(set(outcomes))


@pytest.mark.parametrize("text", ["[" * 50_000, '{"schema_version": 1, "layers": NaN}', "\x00\xff", ""])
def test_raw_bytes_that_are_not_a_format(tmp_path, text):
    path = tmp_path / "x.json"
    path.write_text(text, encoding="utf-8", errors="surrogateescape") if "\xff" not in text else \
        path.write_bytes(b"\x00\xff\xfe")
    for command in (("validate", path), ("plan", path, "--stages", 2), ("show", path),
                    ("export", path, "--format", "torch")):
        _check_result(_invoke(*command), command[0])


def test_subprocess_smoke(tmp_path, valid):
    data = copy.deepcopy(valid["profile"])
    data["layers"][1]["costs"][0]["backward_ms"] = float("nan")
    data["layers"][2]["name"] = "\u202eevil"
    path = _write(tmp_path, "bad.json", data)
    done = subprocess.run([sys.executable, "-m", "pipeplan.cli", "plan", str(path), "--stages", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "bad.json" in done.stderr and "backward_ms" in done.stderr
