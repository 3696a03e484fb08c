"""The runs file (``pipeplan-runs/1``): a user's own launcher runs, each a fixed configuration and
what one iteration measured, for ``pipeplan calibrate --runs`` (docs/analytic.md, "Calibrating
from launcher runs").

Each run states what ``pipeplan profile --analytic`` needs (the model's config, the GPU, the
sequence length, the dtype) and what ``pipeplan plan --gpus`` needs to plan exactly the layout
that ran (``layout``: the plan request's own fields, each degree and choice fixed), beside the
measured seconds per iteration, the measured peak memory per GPU where known, and where the
numbers come from (``source``). A field left out takes the default of the command that reads
it (``pipeplan profile --analytic``, ``pipeplan plan``): one source for every default.

Relative paths (a config, a GPU spec, a cluster TOML) are read from the runs file's folder.
"""

from __future__ import annotations

import copy
from typing import Any, Literal, Optional, Union, get_args, get_origin

from pydantic_core import PydanticUndefined
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from pipeplan.errors import BadInputError
from pipeplan.formats.limits import Name, PositiveBytes, PositiveCount, Text
from pipeplan.formats.plan import PlanSettings
from pipeplan.formats.profile import PRECISION_NAMES
from pipeplan.formats.reading import load_json

__all__ = ["RUNS_SCHEMA", "RunLayout", "MeasuredRun", "RunsFile", "load_runs", "LAYOUT_REQUIRED",
           "MEGATRON_SPLIT"]

#: The value of a runs file's ``schema`` field.
RUNS_SCHEMA = "pipeplan-runs/1"
#: ``layout.layers_per_stage``: Megatron-LM's split (the blocks equally over the (virtual) stages,
#: the embedding on the first, the final norm and the head on the last).
MEGATRON_SPLIT = "megatron"
#: What a run must fix: the choices the planner would otherwise search, so that the fit plans
#: the layout that ran and nothing else.
LAYOUT_REQUIRED = ("num_gpus", "data_parallel", "tensor_parallel", "stages", "virtual_stages", "schedule",
                   "microbatch_size", "global_batch", "recompute", "zero_stage")
#: Plan settings that are not a run's layout: the cluster (the run's ``cluster``), the precision
#: (the run's, a profile option), what only a search has (compare, search_stages, the solver) and
#: internal or pipeline-only fields.
_NOT_LAYOUT = ("cluster", "precision", "compare", "search_stages", "solver", "expert_data_parallel",
               "bandwidth_bytes_per_s", "layers_per_stage")


def _required_type(annotation):
    """``Optional[X]`` without the None (a field a run must give)."""
    args = [arg for arg in get_args(annotation) if arg is not type(None)]
    return args[0] if get_origin(annotation) is Union and len(args) == 1 else annotation


def _layout_fields() -> dict[str, Any]:
    """The plan settings' fields (their types and bounds), all optional but :data:`LAYOUT_REQUIRED`."""
    fields: dict[str, Any] = {}
    for name, field in PlanSettings.model_fields.items():
        if name in _NOT_LAYOUT:
            continue
        annotation, copied = field.annotation, copy.copy(field)
        if name == "optimizer":  # auto: the launcher's (as the plan request takes it)
            annotation = Literal["auto", "adam", "adam-fp32-grads", "sgd", "none"]
        description = (field.description or "").split(" Required,")[0]
        if name in LAYOUT_REQUIRED:
            copied.default, copied.description = PydanticUndefined, f"Required. {description}"
            fields[name] = (_required_type(annotation), copied)
        else:
            copied.default, copied.description = None, f"{description} Left out: `pipeplan plan`'s default."
            fields[name] = (Optional[annotation], copied)
    fields["layers_per_stage"] = (Optional[Union[list[PositiveCount], Literal["megatron"]]], Field(
        default=None, description="The split that ran: units per stage in profile order (virtual stages in "
                                  "order), or 'megatron' (Megatron-LM's: blocks equally over the stages, the "
                                  "embedding on the first, the final norm and the head on the last); left out: "
                                  "the planner's best split of the fixed layout."))
    return fields


class _LayoutBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("schedule", check_fields=False)
    @classmethod
    def _named_schedule(cls, value: str) -> str:
        if value == "auto":
            raise ValueError("give the schedule that ran (1f1b, interleaved, ...), not auto")
        return value

    @field_validator("layers_per_stage", mode="before", check_fields=False)
    @classmethod
    def _split_words(cls, value: Any) -> Any:
        if isinstance(value, str) and value != MEGATRON_SPLIT:
            raise ValueError(f"{value!r} is neither a list of units per stage (e.g. [5, 7, 7, 7]) nor "
                             f"{MEGATRON_SPLIT!r} (Megatron-LM's split)")
        return value

    @model_validator(mode="after")
    def _degrees_fill_the_gpus(self):
        used = self.data_parallel * self.tensor_parallel * self.stages * (self.context_parallel or 1)
        if used != self.num_gpus:
            context = f" x context_parallel {self.context_parallel}" if self.context_parallel else ""
            raise ValueError(f"data_parallel {self.data_parallel} x tensor_parallel {self.tensor_parallel} x stages "
                             f"{self.stages}{context} = {used} is not num_gpus {self.num_gpus}")
        return self

    @field_validator("recompute", check_fields=False)
    @classmethod
    def _named_recompute(cls, value: str) -> str:
        if value == "auto":
            raise ValueError("give the recomputation that ran (none, selective, all), not auto")
        return value


RunLayout = create_model("RunLayout", __base__=_LayoutBase, __doc__=(
    "The layout that ran, in the plan request's fields (`pipeplan plan --gpus`): every degree and "
    "choice the planner would search is fixed."), **_layout_fields())


class MeasuredRun(BaseModel):
    """One launcher run: the model, the GPU and cluster, the layout, and what it measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name = Field(description="The run's name (unique in the file; --holdout names runs).")
    source: Text = Field(min_length=1, description="Where the measurement comes from (a log, a paper's table).")
    model: Union[Name, dict[str, Any]] = Field(
        description="A HuggingFace config.json path (from the runs file's folder), a shipped config's name "
                    "(pipeplan profile --analytic takes both), or the config itself inline.")
    gpu: Optional[Name] = Field(default=None, description="A known GPU (pipeplan gpus), e.g. a100-80gb.")
    gpu_spec: Optional[Name] = Field(default=None, description="A GPU spec TOML file instead of gpu.")
    cluster: Name = Field(description="A cluster preset (pipeplan cluster) or a cluster TOML file.")
    seq_len: Optional[PositiveCount] = Field(default=None, description="Tokens per sample.")
    dtype: Optional[Literal["fp32", "tf32", "bf16", "fp16"]] = Field(
        default=None, description="Parameters' and activations' type (pipeplan profile --analytic --dtype).")
    precision: Optional[Literal[("bf16", *PRECISION_NAMES)]] = Field(
        default=None, description="How the GEMMs ran (pipeplan profile --analytic --precision).")
    flash_attention: Optional[bool] = Field(default=None, description="Flash attention (no s^2 scores kept).")
    sequence_parallel: Optional[bool] = Field(default=None, description="Megatron sequence parallelism.")
    layout: RunLayout
    measured_iteration_s: float = Field(gt=0, le=1e7, allow_inf_nan=False,
                                        description="Measured seconds per iteration (a median over steady steps).")
    measured_peak_memory_bytes: Optional[PositiveBytes] = Field(
        default=None, description="Measured peak memory per GPU (the busiest), bytes; compared, not fitted.")

    @model_validator(mode="after")
    def _one_gpu(self) -> "MeasuredRun":
        if (self.gpu is None) == (self.gpu_spec is None):
            raise ValueError("gpu, gpu_spec: give one of them (a known GPU's name, or a GPU spec TOML file)")
        return self


class RunsFile(BaseModel):
    """Launcher runs to fit the efficiency model to (``pipeplan calibrate --runs``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal["pipeplan-runs/1"] = Field(default=RUNS_SCHEMA, alias="schema",
                                                description="Format name and version.")
    description: Optional[Text] = Field(default=None, description="What the runs are, and where they come from.")
    licence: Optional[Text] = Field(default=None, description="The measurements' licence or terms of use.")
    runs: list[MeasuredRun] = Field(min_length=1, max_length=10_000)

    @field_validator("runs")
    @classmethod
    def _names_once(cls, runs: list[MeasuredRun]) -> list[MeasuredRun]:
        names = [run.name for run in runs]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"run names repeat: {', '.join(repeated)}")
        return runs


def _where(path, data: Any, loc: tuple) -> tuple[str, tuple]:
    """``file: run 'NAME' (runs[i])`` and the rest of the location, for an error inside a run."""
    if len(loc) >= 2 and loc[0] == "runs" and isinstance(loc[1], int):
        runs = data.get("runs") if isinstance(data, dict) else None
        run = runs[loc[1]] if isinstance(runs, list) and loc[1] < len(runs) else None
        name = run.get("name") if isinstance(run, dict) else None
        label = f"run {name!r} (runs[{loc[1]}])" if isinstance(name, str) else f"runs[{loc[1]}]"
        return f"{path}: {label}", loc[2:]
    return str(path), loc


def _message(path, data: Any, exc: ValidationError) -> str:
    first = exc.errors()[0]
    where, loc = _where(path, data, tuple(first["loc"]))
    # A model validator's loc ends at the run; a union's branch names (list[...], literal[...]) are noise.
    loc = tuple(part for part in loc if not (isinstance(part, str) and ("[" in part or part.startswith("function-"))))
    field = ".".join(str(part) if not isinstance(part, int) else f"[{part}]" for part in loc).replace(".[", "[")
    message = "missing field" if first["type"] == "missing" else first["msg"].removeprefix("Value error, ")
    line = f"{where}: {field}: {message}" if field else f"{where}: {message}"
    more = len(exc.errors()) - 1
    return line + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


def load_runs(path) -> RunsFile:
    """Read and check a runs file.

    Raises
    ------
    BadInputError
        One line naming the file, the run (its name and index), the field and the problem.
    """
    data = load_json(path)
    if not isinstance(data, dict):
        raise BadInputError(f"{path}: expected a JSON object (a runs file), found {type(data).__name__}")
    if "runs" not in data and ("layers" in data or "stages" in data):
        raise BadInputError(f"{path}: this is a profile or a plan, not a runs file (docs/formats.md)")
    try:
        return RunsFile.model_validate(data)
    except ValidationError as exc:
        raise BadInputError(_message(path, data, exc)) from None
