"""JSON Schemas of the formats, generated from the pydantic models (published in docs/schemas/)."""

from __future__ import annotations

import json

from pipeplan.errors import BadInputError
from pipeplan.formats.plan import Plan
from pipeplan.formats.profile import Profile
from pipeplan.formats.report import RunReport
from pipeplan.formats.runs import RunsFile

__all__ = ["json_schema_text"]


def json_schema_text(kind: str) -> str:
    """The JSON Schema of ``profile``, ``plan``, ``report`` (a run report) or ``runs`` (launcher runs
    for ``calibrate --runs``) as stable, indented text."""
    models = {"profile": Profile, "plan": Plan, "report": RunReport, "runs": RunsFile}
    if kind not in models:
        raise BadInputError(f"schema: {kind!r} is not one of {', '.join(models)}")
    schema = models[kind].model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    version = {"profile": 2, "plan": 2, "report": 1, "runs": 1}[kind]
    schema["$id"] = f"https://pipeplan.dev/schemas/{kind}-v{version}.json"
    return json.dumps(schema, indent=2) + "\n"
