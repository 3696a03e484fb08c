"""``pipeplan doctor``: read a launcher config people already have, say what is wrong, and fix it.

    launcher config --parse--> LauncherConfig + Layout (the launcher's own rounding)
                    --diagnose--> findings, the layout costed, the best plan for the same ranks
                    --fix--> the same launcher's config with the best plan, other settings kept

One module per step: ``megatron.py`` / ``torchtitan.py`` / ``deepspeed.py`` (parse and layout),
``units.py`` (launcher units to profile layers), ``evaluate.py`` (the pipeline planner),
``cluster.py`` (the cluster planner, ``--cluster``: d x t x p, ZeRO, memory per rank by part),
``diagnose.py`` and ``diagnose_cluster.py`` (findings), ``fix.py`` (rewrite the config),
``report.py`` (text, markdown, JSON, JUnit).
See docs/doctor.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeplan.launchers.config import LAUNCHERS, LauncherConfig, Layout
from pipeplan.doctor.diagnose import diagnose
from pipeplan.doctor.findings import SAME_SPEED, Diagnosis, Finding
from pydantic import ValidationError

from pipeplan.launchers.torchtitan.inputs import apply_overrides, is_registry_spec, registry_job
from pipeplan.errors import BadInputError
from pipeplan.launchers.deepspeed.reader import deepspeed_layout_of, parse_deepspeed
from pipeplan.doctor.report import junit_text, render
from pipeplan.formats.io import (check_output_target, file_sha256, load_profile, refuse_overwriting_input,
                                 write_files_atomic)
from pipeplan.formats.plan import PlanSettings
from pipeplan.quantities import parse_bandwidth, parse_bytes
from pipeplan.launchers.registry import DEFAULT_OPTIMIZER, launcher_optimizer
from pipeplan.facts.training_state import OPTIMIZERS
from pipeplan.cluster.presets import resolve_cluster
from pipeplan.doctor.fix import fix_config
from pipeplan.launchers.megatron.reader import megatron_layout_of, parse_megatron
from pipeplan.launchers.torchtitan.reader import load_toml, parse_torchtitan, torchtitan_layout_of
from pipeplan.doctor.units import unit_positions
from pipeplan.formats.reading import read_input_text

__all__ = ["LAUNCHERS", "launcher_precision", "DoctorOptions", "read_config", "doctor_file", "run_doctor_command", "Diagnosis", "Finding"]


@dataclass(frozen=True)
class DoctorOptions:
    """What the launcher file itself does not say."""

    world_size: int | None = None
    """GPUs in the job (data-parallel size = world / (t x p x cp))."""
    variables: tuple[tuple[str, str], ...] = ()
    """Megatron: values for variables the script reads but does not set."""
    num_stages: int | None = None
    """DeepSpeed: ``PipelineModule(num_stages=...)``."""
    partition_method: str | None = None
    """DeepSpeed: ``PipelineModule(partition_method=...)``."""
    parts: tuple[int, ...] | None = None
    """DeepSpeed: explicit stage boundaries."""
    activation_checkpoint_interval: int | None = None
    """DeepSpeed: ``PipelineModule(activation_checkpoint_interval=...)``."""
    tensor_degree: int = 1
    """DeepSpeed: the tensor-parallel size (its config does not carry it)."""
    ep_size: int = 1
    """DeepSpeed: DeepSpeed-MoE's ``MoE(ep_size=...)`` (its config does not carry it)."""
    cluster: str | None = None
    """A cluster preset or TOML file: cost the layout at its real d x t x p and ZeRO stage."""
    search_layouts: bool = True
    """With ``cluster``: also search every d x t x p of the same GPUs for the best plan."""
    optimizer_auto: bool = False
    """``--optimizer auto``: the launcher's own gradient dtype (Megatron's ``--grad-reduce-in-bf16``: adam)."""


def _read_torchtitan(path: str, profile, options: DoctorOptions) -> tuple[LauncherConfig, Layout]:
    """A TOML job config, or a Python registry's ``module:function``, with ``--var`` overrides."""
    overrides = [f"{name}={value}" for name, value in options.variables]
    if is_registry_spec(path):
        text, data = None, registry_job(path)
    else:
        text, data = read_input_text(path, "TOML"), None
    blocks = sum(layer.kind == "block" for layer in profile.layers)
    config = parse_torchtitan(path, text, world_size=options.world_size, data=data, overrides=overrides)
    if config.num_layers is None:
        config = parse_torchtitan(path, text, num_layers=blocks, validate_with_torchtitan=False,
                                  world_size=options.world_size, data=data, overrides=overrides)
    units, _ = unit_positions("torchtitan", profile, config.num_layers)
    job = apply_overrides(path, load_toml(path, text) if data is None else data, overrides)
    raw = job.get("parallelism", {}).get("module_fqns_per_model_part")
    return config, torchtitan_layout_of(config, units, raw)


def read_config(launcher: str, path: str | Path, profile, options: DoctorOptions = DoctorOptions()
                ) -> tuple[LauncherConfig, Layout]:
    """Parse a launcher file and build the layout the launcher would build.

    Raises
    ------
    BadInputError
        Unknown launcher, unreadable or unparseable file, or a setting of the wrong type
        (the message names the file and the setting).
    """
    if launcher not in LAUNCHERS:
        raise BadInputError(f"doctor: launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    path = str(path)
    if launcher == "torchtitan":
        return _read_torchtitan(path, profile, options)
    text = read_input_text(path, {"megatron": "launch script"}.get(launcher, "JSON"))
    if launcher == "megatron":
        config = parse_megatron(path, text, variables=dict(options.variables), world_size=options.world_size)
        return config, megatron_layout_of(config)

    config = parse_deepspeed(path, text, num_stages=options.num_stages, partition_method=options.partition_method,
                             parts=list(options.parts) if options.parts else None,
                             activation_checkpoint_interval=options.activation_checkpoint_interval,
                             world_size=options.world_size, tensor_degree=options.tensor_degree,
                             ep_size=options.ep_size)
    layers = profile.layers
    types = [" ".join(filter(None, (layer.name, layer.kind, layer.description))) for layer in layers]
    params = [layer.param_bytes // profile.dtype_bytes for layer in layers]
    return config, deepspeed_layout_of(config, [layer.name for layer in layers], params, types)


def launcher_precision(config: LauncherConfig, profile, settings, optimizer_auto: bool = False):
    """The plan settings with the config's precision recipe, and what doctor says of it.

    ``--grad-reduce-in-bf16`` (Megatron) makes ``--optimizer auto`` ``adam`` (bf16 gradients);
    ``--fp8-param-gather`` keeps the weights quantized where the profile's GEMMs are; a config whose
    GEMMs run in another precision than the profile's is said (its time and memory are the profile's).
    """
    update, findings = {}, []
    if optimizer_auto and config.gradient_reduce_dtype == "bf16" and settings.optimizer == "adam-fp32-grads":
        update["optimizer"] = "adam"
    made = getattr(profile, "precision", None)
    if config.quantized_params and made is not None:
        update["fp8_param_gather"] = True
    if config.precision != made:
        runs, has = config.precision or "bf16", made or "bf16"
        findings.append(Finding(
            "precision", "warning", f"precision {runs}",
            f"the config's GEMMs run in {runs}, the profile's in {has}: time and memory here are {has}'s",
            f"profile with --precision {runs} (pipeplan profile --analytic ... --precision {runs})"))
    return (settings.model_copy(update=update) if update else settings), findings


def launcher_overlap(config: LauncherConfig, settings):
    """The plan settings with the overlap the config runs (its flags; the launcher's defaults where
    the config says nothing), so that its cluster costing (``--cluster``; the overlap is a cluster
    setting) hides what the launcher hides."""
    update = {}
    if config.overlap is not None:
        update["overlap"] = list(config.overlap)
    if config.ddp_bucket_size is not None:
        update["ddp_bucket_size"] = config.ddp_bucket_size
    return settings.model_copy(update=update) if update else settings


def doctor_file(launcher: str, path: str | Path, profile_path: str | Path, settings, *,
                options: DoctorOptions = DoctorOptions(), fix_output: str | Path | None = None,
                output_format: str = "table", junit_path: str | Path | None = None) -> tuple[Diagnosis, str, list[Path]]:
    """What ``pipeplan doctor`` does: read, diagnose, report, and optionally fix.

    Parameters
    ----------
    launcher : {"megatron", "torchtitan", "deepspeed"}
    path : path
        The launcher's file (launch script, TOML, ds_config).
    profile_path : path
        The model's profile (layers with their ``kind``).
    settings : PlanSettings
        Memory cap, optimizer, bandwidth; ``stages`` and ``global_batch`` come from the config.
    fix_output : path, optional
        Write the same launcher's config with the best plan here.
    output_format : {"table", "markdown", "json"}
    junit_path : path, optional

    Returns
    -------
    diagnosis : Diagnosis
    text : str
        The report.
    written : list of Path

    Raises
    ------
    BadInputError
        Bad files or settings (exit 2).
    """
    inputs = [path, profile_path, options.cluster]  # a preset's name matches no file
    # Every output is checked before any work: not a device, FIFO or folder, not an input.
    for option, target in (("-o", fix_output), ("--junit", junit_path)):
        if target is not None:
            check_output_target(target, option)
            refuse_overwriting_input(target, *inputs, option=option)
    if output_format not in ("table", "markdown", "json"):
        raise BadInputError(f"--format: {output_format!r} is not one of table, markdown, json")
    profile = load_profile(profile_path)
    cluster = None
    if options.cluster is not None:
        cluster = resolve_cluster(options.cluster)
    config, layout = read_config(launcher, path, profile, options)
    settings, precision_findings = launcher_precision(config, profile, settings, options.optimizer_auto)
    settings = launcher_overlap(config, settings) if cluster is not None else settings
    result = diagnose(config, layout, profile, settings, profile_sha256=file_sha256(profile_path), cluster=cluster,
                      search_layouts=options.search_layouts)
    result.findings[:0] = precision_findings
    outputs: dict[str | Path, str] = {}
    if fix_output is not None:
        if result.best is None:
            raise BadInputError("--fix: no plan fits, so there is nothing to write (see the findings)")
        original = Path(path).read_text(encoding="utf-8")
        if result.speedup is not None and result.speedup <= SAME_SPEED:
            # The config is as fast as the best plan and its findings state no change: --fix makes none.
            outputs[fix_output] = original
        else:
            outputs.update(fix_config(config, original, result.best, profile, str(fix_output)))
    text = render(result, output_format)
    if junit_path is not None:
        outputs[junit_path] = junit_text(result)
    # The fixed config, its sidecar and the JUnit file: all written, or none.
    written = write_files_atomic(outputs, inputs, option="-o/--junit") if outputs else []
    return result, text, written


def run_doctor_command(launcher: str, config_path, profile_path, *, memory_cap: str | None = None,
                       optimizer: str = "auto", bandwidth: str = "25GB/s", world_size: int | None = None,
                       cluster: str | None = None, search_layouts: bool = True, tensor_degree: int = 1,
                       variables=(), num_stages: int | None = None, partition_method: str | None = None,
                       parts: str | None = None, checkpoint_interval: int | None = None, ep_size: int = 1,
                       fix: bool = False,
                       fix_output=None, output_format: str = "table", junit=None) -> tuple[str, list[Path], int]:
    """``pipeplan doctor`` with the command line's strings: returns (report, files written, exit code).

    Raises
    ------
    BadInputError
        Bad options or files (exit 2).
    """
    optimizer_auto = optimizer == "auto"
    if optimizer == "auto":
        # Megatron-LM keeps fp32 main gradients in 16-bit training (--accumulate-allreduce-grads-in-fp32)
        # unless the script says --grad-reduce-in-bf16 (launcher_precision).
        optimizer = launcher_optimizer(launcher) if launcher in LAUNCHERS else DEFAULT_OPTIMIZER
    if optimizer not in OPTIMIZERS:
        raise BadInputError(f"--optimizer: {optimizer!r} is not one of auto, {', '.join(OPTIMIZERS)}")
    if tensor_degree < 1:
        raise BadInputError(f"--tensor-parallel: {tensor_degree} must be at least 1")
    if fix and fix_output is None:
        raise BadInputError("--fix: give -o FILE for the fixed config")
    pairs = []
    for item in variables:
        name, sep, value = item.removeprefix("--").partition("=")
        # torchtitan's overrides are dotted (parallelism.tensor_parallel_degree=8).
        dotted = launcher == "torchtitan" and all(part.isidentifier() for part in name.split("."))
        if not sep or not (name.isidentifier() or dotted):
            raise BadInputError(f"--var: {item!r} is not NAME=VALUE")
        pairs.append((name, value))
    boundaries = None
    if parts is not None:
        try:
            boundaries = tuple(int(x) for x in parts.split(","))
        except ValueError:
            raise BadInputError(f"--parts: {parts!r} is not a comma-separated list of integers") from None
    if memory_cap:
        cap = parse_bytes(memory_cap)
    elif cluster is not None:
        cap = None  # the cluster's GPU memory
    else:
        cap = load_profile(profile_path).device.memory_bytes
    rate = parse_bandwidth(bandwidth)
    try:
        settings = PlanSettings(stages=1, global_batch=1, memory_cap_bytes=cap, optimizer=optimizer,
                                bandwidth_bytes_per_s=None if rate == float("inf") else rate)
    except ValidationError as exc:
        first = exc.errors()[0]
        option = {"memory_cap_bytes": f"--memory-cap {memory_cap}", "bandwidth_bytes_per_s": f"--bandwidth {bandwidth}"}
        where = option.get(str(first["loc"][0]) if first["loc"] else "", "doctor")
        raise BadInputError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None
    options = DoctorOptions(world_size=world_size, variables=tuple(pairs), num_stages=num_stages,
                            partition_method=partition_method, parts=boundaries,
                            activation_checkpoint_interval=checkpoint_interval, tensor_degree=tensor_degree,
                            ep_size=ep_size,
                            cluster=cluster,
                            search_layouts=search_layouts, optimizer_auto=optimizer_auto)
    result, text, written = doctor_file(launcher, config_path, profile_path, settings, options=options,
                                        fix_output=fix_output, output_format=output_format, junit_path=junit)
    return text, written, result.exit_code
