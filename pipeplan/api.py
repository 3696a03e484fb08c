"""The Python API behind each CLI command: one function per command, files in, files out."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.facts.precision import PRECISIONS
from pipeplan.formats.profile import PRECISION_NAMES
from pipeplan.formats.io import file_sha256, load_json, load_plan, load_profile, write_json_atomic
from pipeplan.formats.plan import Plan, PlanSettings
from pipeplan.cluster.search import plan_cluster
from pipeplan.requests import ClusterRequest, PipelineRequest, Request, request_of
from pipeplan.plan.given import megatron_layers_per_stage, plan_split
from pipeplan.formats.runs import MEGATRON_SPLIT, load_runs
from pipeplan.formats.gpu import resolve_gpu
from pipeplan.cluster.presets import PRESETS, resolve_cluster
from pipeplan.analytic.api import analytic_profile
from pipeplan.analytic.efficiency import EfficiencyModel
from pipeplan.analytic.families import load_model_config, parse_family
from pipeplan.analytic.fit import fit_log_residuals, fittable_fields, from_log_space, load_efficiency, \
    parse_fit_fields, to_log_space
from pipeplan.plan.offload import check_cpu_offload, with_offload_note
from pipeplan.plan.recompute import check_full_method, with_module_parts, with_selective_modules
from pipeplan.plan.loss import with_launcher_loss
from pipeplan.plan.torchtitan_ac import check_selective_ac_option, with_torchtitan_selective
from pipeplan.plan.search import make_plan, with_profile_defaults
from pipeplan.formats.limits import check_microbatch_count, check_option_range
from pipeplan.importers import import_pipedream
from pipeplan.plan.baselines import compare_baselines
from pipeplan.formats.io import load_report
from pipeplan.analytic import analytic_profile_to_file
from pipeplan.profile.api import profile_to_file
from pipeplan.profile.hf import read_config

__all__ = ["PipelineRequest", "ClusterRequest", "import_profile", "make_profile", "plan_any", "plan_profile", "plan_split", "compare_splits", "validate_file", "ComparisonRow",
           "calibrate_runs", "RunsCalibration", "RunPrediction"]


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
                 units=None, progress: bool = False, precision: str | None = None,
                 efficiency: str | Path | None = None, **measure):
    """``pipeplan profile``: measure a torch model into a profile, or (``analytic``) estimate one
    from a model config on a GPU spec, and write it atomically.

    ``measure`` are :func:`pipeplan.profile.api.profile_model`'s timing options (``device``,
    ``repeats``, ``warmup``, ``threads``, ``seed``, ``split_backward``). The GPU and
    tensor-parallel options and ``efficiency`` (an efficiency model file, as ``calibrate --runs``
    writes) belong to the estimate; ``config`` (a transformers ``config.json``) to ``hf:`` models.

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
            sequence_parallel=sequence_parallel, flash_attention=flash_attention, precision=precision or "bf16",
            **({"efficiency": load_efficiency(efficiency)} if efficiency is not None else {}))
    if gpu or gpu_spec or str(tensor_parallel) != "1" or efficiency is not None:
        raise BadInputError("--gpu, --gpu-spec, --tensor-parallel-degrees and --efficiency: only with --analytic")
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
    check_selective_ac_option(settings)
    # torchtitan's selective form (per op, or every N-th block) as the profile's selective fields.
    profile = with_torchtitan_selective(profile, settings)
    # The launcher's loss as the head's working memory (pipeplan.plan.loss).
    profile = with_launcher_loss(profile, settings.launcher)
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
    """``pipeplan validate``: check a profile, plan, run report or runs file; returns a one-line summary.

    Raises
    ------
    BadInputError
        With one line per problem.
    """
    data = load_json(path)
    if isinstance(data, dict) and (str(data.get("schema", "")).startswith("pipeplan-runs/") or
                                   ("runs" in data and "layers" not in data and "stages" not in data)):
        runs = load_runs(path).runs
        return f"{path}: valid runs file: {len(runs)} run{'s' if len(runs) > 1 else ''} ({', '.join(r.name for r in runs)})"
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


# --- pipeplan calibrate --runs: the efficiency model fitted to a user's own launcher runs ---

#: The cap a run is planned under when the memory model says it does not fit (it ran, so its
#: time is still worth predicting; the table flags it): the largest byte count a plan takes.
_NO_CAP_BYTES = 2**53


@dataclass(frozen=True)
class RunPrediction:
    """One run of ``calibrate --runs``: measured against predicted, before and after the fit."""

    name: str
    held_out: bool
    measured_s: float
    before_s: float
    after_s: float
    measured_peak_memory_bytes: int | None
    predicted_peak_memory_bytes: int
    over_cap: bool
    """The memory model puts the run over its cap (planned without one)."""

    @property
    def error_before(self) -> float:
        return self.before_s / self.measured_s - 1

    @property
    def error_after(self) -> float:
        return self.after_s / self.measured_s - 1


@dataclass(frozen=True)
class RunsCalibration:
    """What ``calibrate --runs`` fitted, and how well (rms log errors: sqrt(mean(log(p/m)^2)))."""

    efficiency: EfficiencyModel
    fitted_terms: tuple[str, ...]
    rows: tuple[RunPrediction, ...]
    iterations: int
    evaluations: int
    fit_seconds: float
    at_bounds: tuple[str, ...] = ()
    """Fitted terms that ended on one of their bounds (the runs ask for more than the term gives)."""

    def rms_log_error(self, held_out: bool, after: bool) -> float | None:
        rows = [r for r in self.rows if r.held_out == held_out]
        if not rows:
            return None
        return math.sqrt(sum(math.log((r.after_s if after else r.before_s) / r.measured_s) ** 2
                             for r in rows) / len(rows))


@dataclass
class _Run:
    """A run made ready to predict: its profile options and its layout's request."""

    where: str
    run: object
    cfg: object
    gpu: object
    options: dict
    request: ClusterRequest
    megatron_split: bool
    over_cap: bool = False


def _relative(folder: Path, name: str) -> str:
    """A path from the runs file's folder where it names a file there, else as given."""
    candidate = folder / name
    return str(candidate) if not Path(name).is_absolute() and candidate.exists() else name


def _prepare_run(run, folder: Path, index: int, runs_path) -> _Run:
    where = f"{runs_path}: run {run.name!r} (runs[{index}])"
    try:
        cfg = (parse_family(dict(run.model), run.name, "model") if isinstance(run.model, dict)
               else load_model_config(_relative(folder, run.model)))
        gpu = resolve_gpu(run.gpu, _relative(folder, run.gpu_spec) if run.gpu_spec else None)
        cluster = resolve_cluster(run.cluster if run.cluster in PRESETS else _relative(folder, run.cluster))
    except BadInputError as exc:
        raise BadInputError(f"{where}: {exc}") from None
    layout = run.layout.model_dump(exclude_none=True)
    megatron = layout.get("layers_per_stage") == MEGATRON_SPLIT
    if megatron:
        layout.pop("layers_per_stage")
    request = ClusterRequest.make(f"{where}: layout", cluster=cluster, **layout)
    profile_options = {"seq_len": run.seq_len, "dtype": run.dtype, "precision": run.precision,
                       "flash_attention": run.flash_attention, "sequence_parallel": run.sequence_parallel}
    options = {key: value for key, value in profile_options.items() if value is not None}
    options.update(microbatch_sizes=[run.layout.microbatch_size], tensor_parallel=[run.layout.tensor_parallel])
    return _Run(where, run, cfg, gpu, options, request, megatron)


def _predict(prepared: _Run, efficiency: EfficiencyModel) -> tuple[float, int]:
    """The run's predicted seconds per iteration and peak bytes per GPU (the busiest rank's,
    with the reserve), planned at its layout with an analytic profile built with ``efficiency``."""
    try:
        profile = analytic_profile(prepared.cfg, prepared.gpu, efficiency=efficiency, **prepared.options)
        request = prepared.request
        if prepared.megatron_split:
            stages = request.stages * request.virtual_stages
            request = request.model_copy(update={"layers_per_stage": megatron_layers_per_stage(profile, stages)})
        plan = plan_any(profile, request, profile_sha256="calibrate-runs")
    except BadInputError as exc:
        raise BadInputError(f"{prepared.where}: {exc}") from None
    peak = max(rank.peak_memory_bytes for rank in plan.ranks) + (plan.reserve_bytes or 0)
    return plan.predicted.iteration_ms / 1e3, int(peak)


def _first_prediction(prepared: _Run, efficiency: EfficiencyModel) -> tuple[float, int]:
    """As :func:`_predict`; a run the memory model puts over its cap is planned without one."""
    try:
        return _predict(prepared, efficiency)
    except InfeasibleError as exc:
        prepared.over_cap = True
        prepared.request = prepared.request.model_copy(update={"memory_cap_bytes": _NO_CAP_BYTES})
        try:
            return _predict(prepared, efficiency)
        except InfeasibleError:
            raise InfeasibleError(f"{prepared.where}: {exc}") from None


def _fit_selection(runs, fit: str | None, holdout, allow_underdetermined: bool) -> tuple[list[str], set[str]]:
    terms = parse_fit_fields(fit)
    names = [run.name for run in runs]
    held = {name.strip() for item in holdout or () for name in str(item).split(",") if name.strip()}
    unknown = sorted(held - set(names))
    if unknown:
        raise BadInputError(f"--holdout: {', '.join(unknown)} is not a run of the file; its runs: {', '.join(names)}")
    fitted = len(names) - len(held)
    if fitted == 0:
        raise BadInputError("--holdout: every run is held out; leave some to fit to")
    if len(terms) > fitted and not allow_underdetermined:
        raise BadInputError(
            f"--fit: {len(terms)} free terms ({', '.join(terms)}) but {fitted} run{'s' if fitted > 1 else ''} to fit "
            f"them to: the fit would not be determined. Fit at most {fitted} (e.g. --fit {','.join(terms[:fitted])}), "
            f"add runs, or give --allow-underdetermined")
    return terms, held


def calibrate_runs(runs_path: str | Path, output: str | Path | None = None, *, fit: str | None = None,
                   holdout=(), start: str | Path | None = None,
                   allow_underdetermined: bool = False) -> RunsCalibration:
    """``pipeplan calibrate --runs``: fit the efficiency model to measured iteration times.

    Every run is planned at its layout (``plan --gpus`` with every degree and choice fixed) from
    an analytic profile rebuilt with each trial efficiency model; the terms ``fit`` names (default:
    every bounded float field of :class:`EfficiencyModel`) move to minimise the squared log error
    over the runs not in ``holdout`` (:func:`pipeplan.analytic.fit.fit_log_residuals`). The
    fitted model is written to ``output`` atomically; the terms not fitted keep ``start``'s
    values (an efficiency file; default: the defaults).

    Raises
    ------
    BadInputError
        A bad runs file (file, run, field), an unknown term or run name, more free terms than runs
        to fit (unless ``allow_underdetermined``).
    """
    runs = load_runs(runs_path).runs
    terms, held = _fit_selection(runs, fit, holdout, allow_underdetermined)
    initial = load_efficiency(start) if start is not None else EfficiencyModel()
    folder = Path(runs_path).parent
    prepared = [_prepare_run(run, folder, i, runs_path) for i, run in enumerate(runs)]
    before = [_first_prediction(p, initial) for p in prepared]
    fitting = [p for p in prepared if p.run.name not in held]
    measured = np.array([p.run.measured_iteration_s for p in fitting])
    bounds = fittable_fields()

    def model_at(u) -> EfficiencyModel:
        return initial.model_copy(update={t: from_log_space(float(v), bounds[t]) for t, v in zip(terms, u)})

    def residuals(u) -> np.ndarray:
        efficiency = model_at(u)
        return np.log(np.array([_predict(p, efficiency)[0] for p in fitting]) / measured)

    started = time.perf_counter()
    u0 = np.array([to_log_space(getattr(initial, t), bounds[t]) for t in terms])
    upper = np.array([to_log_space(bounds[t].clamp(bounds[t].upper), bounds[t]) if bounds[t].upper is not None
                      and bounds[t].lower is not None else np.inf for t in terms])
    result = fit_log_residuals(residuals, u0, upper)
    start_residuals = np.log(np.array([b[0] for p, b in zip(prepared, before) if p.run.name not in held]) / measured)
    # A fit that does not beat the start (a term started off its bound, no run sensitive to it) keeps it.
    best = model_at(result.u) if result.residuals @ result.residuals < start_residuals @ start_residuals else initial
    fitted = _rounded(best, terms, runs_path, [p.run.name for p in fitting], initial)
    seconds = time.perf_counter() - started
    rows = tuple(RunPrediction(name=p.run.name, held_out=p.run.name in held, measured_s=p.run.measured_iteration_s,
                               before_s=b[0], after_s=_predict(p, fitted)[0],
                               measured_peak_memory_bytes=p.run.measured_peak_memory_bytes,
                               predicted_peak_memory_bytes=b[1], over_cap=p.over_cap)
                 for p, b in zip(prepared, before))
    at_bounds = tuple(t for t in terms if _on_bound(getattr(fitted, t), bounds[t]))
    calibration = RunsCalibration(fitted, tuple(terms), rows, result.iterations, result.evaluations, seconds, at_bounds)
    fitted = fitted.model_copy(update={"source": f"{fitted.source}; rms log error over them "
                                                 f"{calibration.rms_log_error(False, False):.4f} -> "
                                                 f"{calibration.rms_log_error(False, True):.4f}"})
    if output is not None:
        write_json_atomic(output, fitted)
    return RunsCalibration(fitted, tuple(terms), rows, result.iterations, result.evaluations, seconds, at_bounds)


def _on_bound(value: float, bounds) -> bool:
    """Whether a fitted value sits on its upper bound or within 1e-6 (of the unit) of its lower."""
    return (bounds.upper is not None and value >= bounds.clamp(bounds.upper)) or \
        (bounds.lower is not None and value - bounds.lower <= 1e-6)


def _rounded(model: EfficiencyModel, terms, runs_path, names, initial: EfficiencyModel) -> EfficiencyModel:
    """The fitted terms at 6 significant digits (stable bytes), checked as a file of them would be,
    with where they come from."""
    rest = [name for name in fittable_fields() if name not in terms]
    source = (f"fitted by pipeplan calibrate --runs {Path(runs_path).name} ({', '.join(terms)}) to "
              f"{len(names)} run{'s' if len(names) > 1 else ''}: {', '.join(names)}"
              + (f"; {', '.join(rest)} from: {initial.source}" if rest else ""))
    bounds = fittable_fields()
    values = {t: bounds[t].clamp(float(f"{getattr(model, t):.6g}")) for t in terms}
    return EfficiencyModel.model_validate({**model.model_dump(), **values, "source": source})
