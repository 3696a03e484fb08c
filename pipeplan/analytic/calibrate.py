"""Fit the efficiency model to a measured profile of the same model on the same GPU.

``pipeplan calibrate ANALYTIC.json --measured MEASURED.json -o calibrated.json`` rebuilds the
analytic profile (its config, GPU and options are recorded in it) with the
:class:`EfficiencyModel` that best explains the measured per-unit forward and backward times.

The fit minimises the mean squared log ratio of predicted to measured time over every unit,
micro-batch size and pass (forward, whole backward), by coordinate descent (golden-section search
on each of the four parameters in turn, 30 rounds): each evaluation is a vectorised sum over the
parts, so a fit takes milliseconds. Units are matched by name, or else by role and order
(embedding, blocks, norm, head) when the measured model names its modules otherwise. The GEMMs'
shape factors (``gemm_k_overhead``) and the host's time per kernel (``host_us_per_kernel``) are
kept at the starting model's values (each pass is still the GPU's or the host's time, whichever
is longer, as :func:`pipeplan.analytic.efficiency.pass_ms` times it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Union

import numpy as np

from pipeplan.analytic.configs import ModelConfig
from pipeplan.analytic.efficiency import EfficiencyModel, gemm_shape_factor
from pipeplan.analytic.flops import Shape, unit_work
from pipeplan.facts.gpus import GpuSpec
from pipeplan.facts.precision import get_precision
from pipeplan.errors import BadInputError
from pipeplan.formats.profile import Profile
from pipeplan.analytic.api import DTYPE_BYTES, analytic_profile, model_units
from pipeplan.analytic.families import parse_family
from pipeplan.formats.io import load_profile, write_json_atomic

__all__ = ["fit_efficiency", "calibrate_analytic_files", "rebuild_options"]

_ROUNDS = 30
_BOUNDS = {"gemm": (1e-3, 1.0), "attention": (1e-3, 1.0), "memory": (1e-3, 1.0), "kernel_latency_us": (0.0, 2000.0)}


def _pairs(analytic_units: list[tuple[str, str, int]], measured: Profile, where: str):
    by_name = {layer.name: layer for layer in measured.layers}
    if all(name in by_name for name, _, _ in analytic_units):
        return [(unit, by_name[unit[0]]) for unit in analytic_units]
    kinds = [kind for _, kind, _ in analytic_units]
    measured_kinds = [layer.kind for layer in measured.layers]
    if kinds != measured_kinds:
        raise BadInputError(
            f"{where}: its units match neither by name nor by role and order ({len(measured.layers)} units, "
            f"roles {measured_kinds[:3]}...) the analytic model's ({len(kinds)} units); profile the same model"
        )
    return list(zip(analytic_units, measured.layers))


def _design(cfg: ModelConfig, pairs, measured: Profile, flash: bool, dtype_bytes: int, quantized_bytes=None,
            sm_count=None, start: EfficiencyModel = EfficiencyModel()):
    """Parts of every (unit, size, pass) beside its measured time (``quantized_bytes``: the
    profile's precision, pipeplan.facts.precision). A measured backward is the sum of two passes
    (B and W), each the GPU's or the host's time, whichever is longer (efficiency.pass_ms); each
    GEMM's shape factor is taken at ``start``'s ``gemm_k_overhead`` (not fitted)."""
    rows, flops, moved, kinds, targets, quantized, shapes = [], [], [], [], [], [], []
    pass_target, pass_launches = [], []
    for b in measured.microbatch_sizes:
        shape = Shape(measured.sequence_length or 1, b, 1, False, flash, dtype_bytes, quantized_bytes)
        for (_, kind, index), layer in pairs:
            work = unit_work(cfg, kind, index, shape)
            cost = layer.cost_at(b)
            for passes, measured_ms in (([work.forward], cost.forward_ms),
                                        ([work.backward_input, work.backward_weight], cost.backward_ms)):
                if measured_ms <= 0 or not any(passes):
                    continue
                entry = len(targets)
                targets.append(measured_ms)
                for parts in passes:
                    pass_target.append(entry)
                    pass_launches.append(sum(part.launches for part in parts))
                    for part in parts:
                        rows.append(len(pass_target) - 1)
                        flops.append(part.flops)
                        moved.append(part.bytes)
                        kinds.append(part.kind)
                        quantized.append(part.quantized)
                        shapes.append(gemm_shape_factor(part, sm_count, start.gemm_k_overhead)
                                      if part.kind == "gemm" else 1.0)
    if not targets:
        raise BadInputError("--measured: no positive times to fit")
    return (np.array(rows), np.array(flops, dtype=float) * np.array(shapes), np.array(moved, dtype=float),
            np.array([k == "attention" for k in kinds]), np.array(targets, dtype=float), np.array(quantized, dtype=bool),
            np.array(pass_target), np.array(pass_launches, dtype=float) * start.host_us_per_kernel / 1e3)


def _loss(params: dict[str, float], design, peak, bandwidth: float) -> float:
    # ``peak``: one peak, or per part (a quantized precision's GEMMs at theirs).
    rows, flops, moved, attention, targets, _, pass_target, host = design
    efficiency = np.where(attention, params["attention"], params["gemm"])
    seconds = np.maximum(flops / (peak * efficiency), moved / (bandwidth * params["memory"]))
    gpu = np.bincount(rows, weights=1e3 * seconds + params["kernel_latency_us"] / 1e3, minlength=len(pass_target))
    predicted = np.bincount(pass_target, weights=np.maximum(gpu, host), minlength=len(targets))
    return float(np.mean(np.log(predicted / targets) ** 2))


def _golden(f, lo: float, hi: float, steps: int = 40) -> float:
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit_efficiency(cfg: ModelConfig, gpu: GpuSpec, measured: Profile, *, flash_attention: bool = True,
                   start: EfficiencyModel = EfficiencyModel(), where: str = "--measured",
                   precision: str = "bf16") -> tuple[EfficiencyModel, dict[str, Any]]:
    """The efficiency model that best explains ``measured`` (degree-1 times), and the fit's errors.

    Returns
    -------
    (EfficiencyModel, dict)
        The fitted model (``source`` says what it was fitted to) and ``{"entries", "rms_log_error_before",
        "rms_log_error_after", "median_ratio_before", "median_ratio_after"}``.
    """
    if measured.dtype not in DTYPE_BYTES:
        raise BadInputError(f"{where}: dtype {measured.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    recipe = get_precision(precision)
    if recipe.quantized and recipe.peak not in gpu.peak_flops:
        raise BadInputError(f"--precision: {gpu.name} has no peak for {recipe.peak}")
    peak, bandwidth = gpu.flops_for(measured.dtype), gpu.hbm_bytes_per_s
    design = _design(cfg, _pairs(model_units(cfg), measured, where), measured, flash_attention, DTYPE_BYTES[measured.dtype],
                     recipe.operand_bytes, gpu.sm_count, start)
    if recipe.quantized:
        peak = np.where(design[5], gpu.peak_flops[recipe.peak], peak)
    params = {k: getattr(start, k) for k in _BOUNDS}
    before = _loss(params, design, peak, bandwidth)
    for _ in range(_ROUNDS):
        for key, (lo, hi) in _BOUNDS.items():
            if key == "kernel_latency_us":
                params[key] = _golden(lambda v: _loss({**params, key: v}, design, peak, bandwidth), lo, hi)
            else:
                params[key] = math.exp(_golden(lambda v: _loss({**params, key: math.exp(v)}, design, peak, bandwidth),
                                               math.log(lo), math.log(hi)))
    after = _loss(params, design, peak, bandwidth)
    fitted = start.model_copy(update=dict(
        **{k: (round(v, 4) if k != "kernel_latency_us" else round(v, 2)) for k, v in params.items()},
        source=f"fitted by pipeplan calibrate to {measured.model} measured on {measured.device.name} "
               f"({len(design[4])} unit times)"))
    return fitted, {"entries": int(len(design[4])), "rms_log_error_before": math.sqrt(before),
                    "rms_log_error_after": math.sqrt(_loss({k: getattr(fitted, k) for k in _BOUNDS}, design, peak, bandwidth)),
                    "fit_rms_log_error": math.sqrt(after)}


def rebuild_options(profile: Profile, where: str) -> tuple[ModelConfig, GpuSpec, dict[str, Any]]:
    """The config, GPU and options an analytic profile was built with (from its ``measurement``)."""
    record = profile.measurement or {}
    if profile.source != "analytic" or "config" not in record or "gpu" not in record:
        raise BadInputError(f"{where}: not a profile written by `pipeplan profile --analytic` (no measurement.config/gpu)")
    cfg = parse_family(dict(record["config"]), profile.model, f"{where}: measurement.config")
    gpu = GpuSpec.model_validate(record["gpu"])
    options = dict(seq_len=profile.sequence_length, dtype=profile.dtype, microbatch_sizes=profile.microbatch_sizes,
                   tensor_parallel=profile.tensor_parallel_degrees,
                   sequence_parallel=bool(record.get("sequence_parallel", True)),
                   flash_attention=bool(record.get("flash_attention", True)),
                   precision=profile.precision or "bf16")
    return cfg, gpu, options


def calibrate_analytic_files(analytic_path: Union[str, Path], measured_path: Union[str, Path],
                             output: Union[str, Path]) -> tuple[Profile, dict[str, Any]]:
    """Fit to ``measured_path`` and write the analytic profile rebuilt with the fitted efficiency."""
    analytic = load_profile(analytic_path)
    measured = load_profile(measured_path)
    cfg, gpu, options = rebuild_options(analytic, str(analytic_path))
    fitted, report = fit_efficiency(cfg, gpu, measured, flash_attention=options["flash_attention"],
                                    where=str(measured_path), precision=options["precision"])
    rebuilt = analytic_profile(cfg, gpu, efficiency=fitted, **options)
    write_json_atomic(output, rebuilt)
    return rebuilt, {**report, "efficiency": fitted.model_dump()}
