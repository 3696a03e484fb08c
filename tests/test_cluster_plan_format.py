"""The plan format's version 2 (cluster plans): old plans still read, new fields round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeplan.cluster.presets import PRESETS
from pipeplan.errors import BadInputError
from pipeplan.formats.io import dump_model, load_plan
from pipeplan.formats.plan import Parallelism, Plan

BASELINES = Path(__file__).resolve().parents[1] / "profiles" / "baselines"


def test_version_1_plans_read_unchanged():
    for path in sorted(BASELINES.glob("*.plan.json")):
        plan = load_plan(path)
        assert plan.schema_version == 1 and plan.parallelism is None
        assert dump_model(plan) == path.read_text(), path  # same bytes back


def test_version_2_fields_round_trip(tmp_path):
    data = json.loads(next(iter(sorted(BASELINES.glob("*.plan.json")))).read_text())
    data["schema_version"] = 2
    data["settings"].update(num_gpus=16, cluster=PRESETS["dgx-a100"].model_dump(), zero_stage=1)
    pipeline = len({stage["rank"] for stage in data["stages"]})
    data["parallelism"] = Parallelism(num_gpus=4 * pipeline, data=2, tensor=2, pipeline=pipeline,
                                      gpus_per_node=8, zero_stage=1).model_dump()
    data["predicted"].update(tensor_parallel_ms=1.0, data_parallel_ms=2.0, optimizer_ms=3.0)
    path = tmp_path / "v2.plan.json"
    path.write_text(json.dumps(data))
    plan = load_plan(path)
    assert plan.settings.cluster == PRESETS["dgx-a100"]
    assert Plan.model_validate_json(dump_model(plan)) == plan


def test_unknown_plan_version_is_refused(tmp_path):
    data = json.loads(next(iter(sorted(BASELINES.glob("*.plan.json")))).read_text())
    data["schema_version"] = 3
    path = tmp_path / "v3.plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BadInputError, match="schema_version: 3 is not supported; this pipeplan reads 1 and 2"):
        load_plan(path)
