"""The Python API behind each CLI command: one function per command, files in, files out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeplan.errors import BadInputError
from pipeplan.facts.precision import PRECISIONS
from pipeplan.formats.profile import PRECISION_NAMES
from pipeplan.formats.io import file_sha256, load_json, load_plan, load_profile, write_json_atomic
from pipeplan.formats.plan import Plan, PlanSettings
from pipeplan.cluster.search import plan_cluster
from pipeplan.requests import ClusterRequest, PipelineRequest, Request, request_of
from pipeplan.plan.given import plan_split
from pipeplan.plan.offload import check_cpu_offload, with_offload_note
from pipeplan.plan.recompute import check_full_method, with_module_parts, with_selective_modules
from pipeplan.plan.search import make_plan, with_profile_defaults
from pipeplan.formats.limits import check_microbatch_count, check_option_range
from pipeplan.importers import import_pipedream
from pipeplan.plan.baselines import compare_baselines
from pipeplan.formats.io import load_report
from pipeplan.analytic import analytic_profile_to_file
from pipeplan.profile.api import profile_to_file
from pipeplan.profile.hf import read_config

__all__ = ["PipelineRequest", "ClusterRequest", "import_profile", "make_profile", "plan_any", "plan_profile", "plan_split", "compare_splits", "validate_file", "ComparisonRow"]


def import_profile(source: str, path: str | Path, batch_size: int, output: str | Path, model: str | None = None):
    """``pipeplan import``: convert another tool's profile and write it atomically."""
    if source != "pipedream":
        raise BadInputError(f"import: unknown source {source!r}; supported: pipedream")

    profile = import_pipedream(path, batch_size, model=model)
    write_json_atomic(output, profile)
    return profile


def make_profile(model: str, output: str | Path, *, analytic: bool = False, microbatch_sizes="1,2,4",
                 seq_len: int | None = None, dtype: str | None = None, gpu: str | None = None,
                 gpu_spec: str | Path | None = None, tensor_parallel="1", sequence_parallel: bool = True,
                 flash_attention: bool = True, options: dict | None = None, config: str | Path | None = None,
                 units=None, progress: bool = False, precision: str | None = None, **measure):
    """``pipeplan profile``: measure a torch model into a profile, or (``analytic``) estimate one
    from a model config on a GPU spec, and write it atomically.

    ``measure`` are :func:`pipeplan.profile.api.profile_model`'s timing options (``device``,
    ``repeats``, ``warmup``, ``threads``, ``seed``, ``split_backward``). The GPU and
    tensor-parallel options belong to the estimate; ``config`` (a transformers ``config.json``) to
    ``hf:`` models.

    Raises
    ------
    BadInputError
        An option of the other kind, a bad model or config, sizes that do not parse.
    """
    # Sizes bounded before any work: a million layers would build for hours (docs/formats.md).
    for option, value in (("--layers", (options or {}).get("layers")), ("--hidden", (options or {}).get("hidden")),
                          ("--heads", (options or {}).get("heads")), ("--vocab", (options or {}).get("vocab")),
                          ("--seq-len", seq_len)):
        check_option_range(option, value)
    if dtype in PRECISION_NAMES:
        raise BadInputError(f"--dtype: {dtype!r} is a precision, not a dtype: give --precision {dtype} (how the "
                            f"GEMMs run: {', '.join(PRECISIONS)}; with --analytic) and --dtype bf16 (the parameters "
                            f"and activations)")
    if analytic:
        return analytic_profile_to_file(
            model, output, gpu=gpu, gpu_spec=gpu_spec, microbatch_sizes=microbatch_sizes,
            tensor_parallel=tensor_parallel, seq_len=seq_len, dtype=dtype or "bf16",
            sequence_parallel=sequence_parallel, flash_attention=flash_attention, precision=precision or "bf16")
    if gpu or gpu_spec or str(tensor_parallel) != "1":
        raise BadInputError("--gpu, --gpu-spec and --tensor-parallel-degrees: only with --analytic")
    if precision not in (None, "bf16"):
        raise BadInputError("--precision: only with --analytic (a measured profile runs its model as it is)")
    options = dict(options or {})
    if config is not None:
        options["config"] = read_config(model, str(config))
    return profile_to_file(model, str(output), microbatch_sizes=microbatch_sizes,
                           seq_len=128 if seq_len is None else seq_len, dtype=dtype or "fp32", units=units or None,
                           options=options, progress=progress, **measure)


def plan_any(profile, request: Request | PlanSettings, *, profile_sha256: str, record_time: bool = False) -> Plan:
    """The plan a request asks for: a cluster plan (:class:`ClusterRequest`), a given split
    (``layers_per_stage``) or the pipeline planner's; what ``plan`` and ``check`` call.

    ``request`` may be a plan file's record of one (:class:`PlanSettings`, as ``check``
    re-plans): it is read as a request first (:func:`pipeplan.requests.request_of`), so the API
    refuses what the CLI refuses.

    Raises
    ------
    BadInputError
        A request that breaks its rules (e.g. a ZeRO stage or data-parallel degree without
        ``num_gpus``), naming the fields.
    """
    request = request_of(request)
    _check_batch(profile, request)
    settings = request.settings()
    check_full_method(settings)
    if settings.cpu_offload_layers is not None:
        # Megatron's CPU activation offload: its rules here, its memory and time in each layout the
        # cluster search costs (pipeplan.plan.offload.offload_view).
        settings = check_cpu_offload(settings, profile)
        plan = _plan_any(profile, request_of(settings), settings, profile_sha256, record_time)
        return with_offload_note(plan, profile, settings)
    if settings.recompute_modules is not None:
        # The selective mode then means these modules; the plan's stages list them as parts
        # (pipeplan.plan.recompute).
        plan = _plan_any(with_selective_modules(profile, settings.recompute_modules), request, settings,
                         profile_sha256, record_time)
        return with_module_parts(plan, profile)
    return _plan_any(profile, request, settings, profile_sha256, record_time)


def _plan_any(profile, request, settings, profile_sha256: str, record_time: bool) -> Plan:
    if isinstance(request, ClusterRequest):
        return plan_cluster(profile, settings, profile_sha256=profile_sha256, record_time=record_time)
    if request.layers_per_stage is not None:
        plan = plan_split(profile, settings, request.layers_per_stage, profile_sha256=profile_sha256)
        return plan.model_copy(update={"schema_version": 2})  # layers_per_stage is a version-2 field
    return make_plan(profile, settings, profile_sha256=profile_sha256, record_time=record_time)


def _check_batch(profile, request) -> None:
    """A given global batch within the micro-batch count limit per replica (the fixed
    ``data_parallel``, or with ``num_gpus`` the most replicas a layout may have), or exit 2 saying
    what would fit."""
    if request.global_batch is not None:
        replicas = (request.data_parallel or request.num_gpus) if isinstance(request, ClusterRequest) else 1
        check_microbatch_count(request.global_batch, profile.microbatch_sizes, request.microbatch_size,
                               replicas=replicas)


def plan_profile(profile_path: str | Path, request: Request | PlanSettings, output: str | Path | None = None,
                 record_time: bool = False) -> Plan:
    """``pipeplan plan``: plan a profile file and write the plan atomically.

    The request models have the CLI's defaults (one source: ``tests/test_layers.py`` checks
    it), so this makes the plan ``pipeplan plan`` makes from the same options, byte for byte.

    Examples
    --------
    >>> plan = plan_profile("profiles/gpt2-tiny-cpu.json", PipelineRequest(stages=2, schedule="1f1b"))
    >>> plan.schedule, len(plan.stages)
    ('1f1b', 2)
    """
    profile = load_profile(profile_path)
    plan = plan_any(profile, request, profile_sha256=file_sha256(profile_path), record_time=record_time)
    if output is not None:
        write_json_atomic(output, plan)
    return plan


@dataclass(frozen=True)
class ComparisonRow:
    """One split in ``pipeplan compare``."""

    name: str
    """``optimal`` or a baseline's name."""
    description: str
    stage_layers: tuple[int, ...]
    """Layers per stage."""
    bottleneck_ms: float
    iteration_ms: float
    samples_per_second: float
    peak_memory_bytes: int
    """The largest stage's predicted peak."""
    fits: bool
    """Whether every stage is within the memory cap."""
    global_batch: int
    """Samples per iteration the row was planned at (the profile's default where none was given)."""


def compare_splits(profile_path: str | Path, request: PipelineRequest | PlanSettings) -> list[ComparisonRow]:
    """``pipeplan compare``: the optimal plan beside the splits users make by hand.

    Every row is a plan costed and simulated by the planner's own machinery
    (:func:`pipeplan.plan.baselines.compare_baselines`), at the optimal plan's micro-batch
    size and schedule, so the rows differ only in the split.
    """
    profile = load_profile(profile_path)
    request = request_of(request)
    if not isinstance(request, PipelineRequest):
        raise BadInputError("compare: compares pipeline splits; give --stages, not --gpus")
    _check_batch(profile, request)
    settings = with_profile_defaults(profile, request.settings())
    optimal, baselines = compare_baselines(profile, settings, file_sha256(profile_path))
    cap = settings.memory_cap_bytes

    def row(name, description, costed):
        peaks = [r.peak_memory_bytes for r in costed.ranks] or [s.peak_memory_bytes for s in costed.stages]
        return ComparisonRow(
            name=name,
            description=description,
            stage_layers=tuple(len(s.layers) for s in costed.stages),
            bottleneck_ms=max(s.forward_ms + s.backward_ms + s.transfer_ms for s in costed.stages),
            iteration_ms=costed.predicted.iteration_ms,
            samples_per_second=costed.predicted.samples_per_second,
            peak_memory_bytes=int(max(peaks)),
            fits=cap is None or max(peaks) <= cap,
            global_batch=settings.global_batch,
        )

    rows = []
    if optimal is not None:
        proven = ", proven" if optimal.solver.optimal else ""
        rows.append(row("optimal", f"pipeplan ({optimal.solver.method}{proven})", optimal))
    rows.extend(row(name, description, plan) for name, description, plan in baselines)
    return rows


def validate_file(path: str | Path) -> str:
    """``pipeplan validate``: check a profile, plan or run report; returns a one-line summary.

    Raises
    ------
    BadInputError
        With one line per problem.
    """
    data = load_json(path)
    if isinstance(data, dict) and (str(data.get("schema", "")).startswith("pipeplan-run-report")
                                   or ("ranks" in data and "measured" in data)):
        report = load_report(path)
        return (f"{path}: valid run report: {report.schedule}, {len(report.ranks)} ranks, "
                f"{report.num_microbatches} x {report.microbatch_size}")
    if isinstance(data, dict) and "stages" in data and "predicted" in data:
        plan = load_plan(path)
        return (f"{path}: valid plan of {plan.profile.model}: {len(plan.stages)} stages, "
                f"{plan.schedule}, {plan.num_microbatches} x {plan.microbatch_size}")
    profile = load_profile(path)
    edges = "chain" if profile.edges is None else f"{len(profile.edges)} edges"
    degrees = profile.tensor_parallel_degrees
    return (f"{path}: valid profile of {profile.model}: {len(profile.layers)} layers, {edges}, "
            f"micro-batch sizes {profile.microbatch_sizes}"
            + (f", tensor-parallel degrees {degrees}" if degrees != [1] else ""))
