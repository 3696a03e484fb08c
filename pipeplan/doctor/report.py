"""doctor's report: plain text, markdown (a pull-request comment), JSON, and JUnit XML for CI."""

from __future__ import annotations

import json
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from pipeplan.doctor.findings import Diagnosis, parts_text
from pipeplan.quantities import format_bytes
from pipeplan.formats.io import write_text_atomic

__all__ = ["render", "write_junit", "as_dict"]

_ORDER = {"error": 0, "warning": 1, "info": 2}


def _stage_rows(result: Diagnosis) -> list[tuple[str, ...]]:
    rows = []
    plan = result.plan
    for i, stage in enumerate(result.layout.stages):
        names = result.stage_layers[i] if i < len(result.stage_layers) else list(stage.units)
        span = f"{names[0]} .. {names[-1]}" if len(names) > 1 else (names[0] if names else "(empty)")
        peak = ""
        ms = ""
        if plan is not None:
            ps = plan.stages[i]
            ms = f"{ps.forward_ms + ps.backward_ms:.4g}"
            if result.cluster_cost is not None:  # per GPU, the reserve included
                peak = format_bytes(next(r.total_bytes for r in result.cluster_cost.memory if r.rank == ps.rank))
            else:
                peak = format_bytes(next(r.peak_memory_bytes for r in plan.ranks if r.rank == ps.rank))
        rows.append((str(stage.index), str(stage.rank), str(stage.vstage), str(len(names)), span, ms, peak))
    return rows


def _summary(result: Diagnosis) -> list[str]:
    c = result.config
    # One pipeline rank runs no pipeline schedule: say so, not "1 ranks x 1 virtual stages, 1f1b".
    pipeline = ("no pipeline (p = 1)" if c.pipeline_degree == 1 else
                f"{c.pipeline_degree} pipeline ranks x {c.virtual_stages} virtual stages, {c.schedule}")
    batches = "micro-batches" if c.pipeline_degree > 1 else "batches (gradient accumulation)"
    lines = [f"{c.path}: {c.launcher}, {pipeline}, tensor {c.tensor_degree}, data {c.data_degree or '?'}, "
             f"{c.num_microbatches if c.num_microbatches is not None else '?'} {batches} of {c.microbatch_size} "
             f"per replica, recompute {c.recompute}"]
    if result.plan is not None and result.plan.parallelism is not None:
        par, plan = result.plan.parallelism, result.plan
        lines.append(f"on {plan.settings.cluster.name}: {par.num_gpus} GPUs as d={par.data} x t={par.tensor} x "
                     + (f"C={par.context} x " if par.context else "") + f"p={par.pipeline}, ZeRO {par.zero_stage}"
                     # What the config runs (its --sequence-parallel), not the profile's costing.
                     + (", sequence parallel" if c.sequence_parallel and par.tensor > 1 else "")
                     + f", optimizer {plan.settings.optimizer}, cap {format_bytes(result.cluster_cost.cap_bytes)} per GPU")
        lines.append(f"predicted: {parts_text(plan)}; {plan.predicted.samples_per_second:.6g} samples/s")
    elif result.plan is not None:
        pr = result.plan.predicted
        lines.append(f"predicted: {pr.iteration_ms:.6g} ms per iteration = compute {pr.compute_ms:.6g} + bubble "
                     f"{pr.bubble_ms:.6g} + transfer {pr.transfer_ms:.6g}"
                     + (f" + overhead {pr.overhead_ms:.6g}" if pr.overhead_ms else "")
                     + f" ms; {pr.samples_per_second:.6g} samples/s per replica")
    if result.best is not None:
        b = result.best
        shape = (f"{b.schedule}, v = {b.virtual_stages}, {b.num_microbatches} micro-batches" if b.settings.stages > 1
                 else f"no pipeline, {b.num_microbatches} batches")
        lines.append(f"best plan ({c.launcher} can run it): {shape} of {b.microbatch_size}, layers per stage "
                     f"{[len(s.layers) for s in sorted(b.stages, key=lambda s: s.index)]}, predicted "
                     f"{b.predicted.iteration_ms:.6g} ms"
                     + (f" (ZeRO {b.parallelism.zero_stage})" if b.parallelism is not None else ""))
    if result.best_any is not None:
        b, par = result.best_any, result.best_any.parallelism
        shape = (f"{b.schedule}, v = {b.virtual_stages}, {b.num_microbatches} micro-batches" if par.pipeline > 1
                 else f"no pipeline, {b.num_microbatches} batches")
        lines.append(f"best plan for the same {par.num_gpus} GPUs: d={par.data} x t={par.tensor} x "
                     + (f"C={par.context} x " if par.context else "") + f"p={par.pipeline}, "
                     f"ZeRO {par.zero_stage}, {shape} of {b.microbatch_size} per replica, predicted "
                     f"{b.predicted.iteration_ms:.6g} ms")
    return lines


_MEMORY_HEADER = ("rank", "weights", "gradients", "optimizer", "activations", "reserve", "total", "cap")


def _memory_header(result: Diagnosis) -> tuple[str, ...]:
    """The memory table's columns: an "experts" part for a mixture-of-experts layout."""
    cost = result.cluster_cost
    if cost is None:
        return _MEMORY_HEADER
    quantized = ("quantized copies",) if any(r.quantized_weight_bytes for r in cost.memory) else ()
    experts = ("experts",) if any(r.expert_bytes for r in cost.memory) else ()
    working = ("of it working",) if any(r.working_bytes for r in cost.memory) else ()
    return (*_MEMORY_HEADER[:2], *quantized, *_MEMORY_HEADER[2:4], *experts, *_MEMORY_HEADER[4:5], *working,
            *_MEMORY_HEADER[5:])


def _memory_rows(result: Diagnosis) -> list[tuple[str, ...]]:
    """Memory per GPU of each pipeline rank, by part (with --cluster)."""
    cost = result.cluster_cost
    if cost is None:
        return []
    moe = any(r.expert_bytes for r in cost.memory)
    quantized = any(r.quantized_weight_bytes for r in cost.memory)
    working = any(r.working_bytes for r in cost.memory)  # the loss's, part of the activations
    return [(str(r.rank), format_bytes(r.weight_bytes),
             *((format_bytes(r.quantized_weight_bytes),) if quantized else ()),
             format_bytes(r.gradient_bytes), format_bytes(r.optimizer_bytes),
             *((format_bytes(r.expert_bytes),) if moe else ()),
             format_bytes(r.activation_bytes), *((format_bytes(r.working_bytes) if r.working_bytes else "-",) if working else ()),
             format_bytes(r.reserve_bytes), format_bytes(r.total_bytes),
             format_bytes(cost.cap_bytes) + (" OVER" if r.total_bytes > cost.cap_bytes else ""))
            for r in cost.memory]


def _reserve_lines(result: Diagnosis) -> list[str]:
    """The reserve by part (with --cluster): the fullest rank's, as cluster.memory.job_memory gives it."""
    cost = result.cluster_cost
    jobs = [r for r in (cost.memory if cost is not None else ()) if getattr(r, "job", None) is not None]
    if not jobs:
        return []
    r = max(jobs, key=lambda r: r.total_bytes)
    job = r.job
    if job.fixed_override_bytes is not None:
        fixed = f"the cluster spec's reserve {format_bytes(job.fixed_override_bytes)}"
    else:
        fixed = (f"CUDA context {format_bytes(job.cuda_context_bytes)} + cuBLAS workspaces "
                 f"{format_bytes(job.cublas_workspace_bytes)} + NCCL buffers {format_bytes(job.nccl_buffer_bytes)}")
    return [f"reserve of rank {r.rank}: {fixed} + allocator fragmentation {format_bytes(job.fragmentation_bytes)} "
            f"(docs/cluster-model.md, Memory a real job sees)"]


def _table(header, rows) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    return ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()] + \
        ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


def _findings(result: Diagnosis):
    return sorted(result.findings, key=lambda f: _ORDER.get(f.severity, 3))


def as_dict(result: Diagnosis) -> dict:
    """The report as plain data (``--format json``)."""
    def plan_data(plan):
        if plan is None:
            return None
        return {"schedule": plan.schedule, "virtual_stages": plan.virtual_stages,
                "microbatch_size": plan.microbatch_size, "num_microbatches": plan.num_microbatches,
                "layers_per_stage": [len(s.layers) for s in sorted(plan.stages, key=lambda s: s.index)],
                "predicted": plan.predicted.model_dump(),
                "rank_peak_memory_bytes": [r.peak_memory_bytes for r in plan.ranks],
                "parallelism": plan.parallelism.model_dump() if plan.parallelism is not None else None}

    c = result.config
    return {
        "config": {"launcher": c.launcher, "path": c.path, "pipeline_degree": c.pipeline_degree,
                   "virtual_stages": c.virtual_stages, "schedule": c.schedule, "tensor_degree": c.tensor_degree,
                   "data_degree": c.data_degree, "microbatch_size": c.microbatch_size,
                   "num_microbatches": c.num_microbatches, "recompute": c.recompute, "zero_stage": c.zero_stage,
                   "sequence_parallel": c.sequence_parallel,
                   **({"precision": c.precision} if c.precision else {})},
        "layout": [{"index": s.index, "rank": s.rank, "vstage": s.vstage, "units": list(s.units)}
                   for s in result.layout.stages],
        "findings": [f.__dict__ for f in _findings(result)],
        "plan": plan_data(result.plan),
        "best": plan_data(result.best),
        "best_for_same_gpus": plan_data(result.best_any),
        "memory_per_rank": None if result.cluster_cost is None else [
            {"rank": r.rank, "weight_bytes": r.weight_bytes, "gradient_bytes": r.gradient_bytes,
             "optimizer_bytes": r.optimizer_bytes, "activation_bytes": r.activation_bytes,
             **({"expert_bytes": r.expert_bytes} if r.expert_bytes else {}),
             **({"quantized_weight_bytes": r.quantized_weight_bytes} if r.quantized_weight_bytes else {}),
             **({"working_bytes": r.working_bytes} if r.working_bytes else {}),
             "reserve_bytes": r.reserve_bytes, "total_bytes": r.total_bytes,
             **({"reserve_parts": dict(vars(r.job))} if getattr(r, "job", None) is not None else {})}
            for r in result.cluster_cost.memory],
        "memory_cap_bytes": None if result.cluster_cost is None else result.cluster_cost.cap_bytes,
        "speedup": result.speedup,
        "notes": result.notes,
        "exit_code": result.exit_code,
    }


def render(result: Diagnosis, output_format: str = "table") -> str:
    """The report in ``table`` (plain text), ``markdown`` or ``json``."""
    if output_format == "json":
        return json.dumps(as_dict(result), indent=2) + "\n"
    findings = _findings(result)
    header = ("stage", "rank", "vstage", "layers", "span", "ms/mb", "rank peak")
    rows = _stage_rows(result)
    if output_format == "markdown":
        out = [f"### pipeplan doctor: `{result.config.path}`", ""]
        out += [f"- {line}" for line in _summary(result)]
        out += ["", "| severity | finding | setting | message | fix |", "|---|---|---|---|---|"]
        for f in findings:
            out.append(f"| {f.severity} | {f.code} | `{f.setting}` | {f.message} | {f.fix} |")
        out += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        memory = _memory_rows(result)
        if memory:
            header = _memory_header(result)
            out += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            out += ["| " + " | ".join(r) + " |" for r in memory]
            out += [""] + _reserve_lines(result)
        out += [""] + [f"> note: {n}" for n in result.notes]
        return "\n".join(out).rstrip() + "\n"
    out = list(_summary(result))
    out.append("")
    out += _table(header, rows)
    memory = _memory_rows(result)
    if memory:
        out += ["", "memory per GPU:"] + _table(_memory_header(result), memory) + _reserve_lines(result)
    out.append("")
    for f in findings:
        out.append(f"{f.severity}: [{f.code}] {f.message}")
        if f.setting:
            out.append(f"    setting: {f.setting}")
        if f.fix:
            out.append(f"    fix: {f.fix}")
    out += [f"note: {n}" for n in result.notes]
    errors = sum(f.severity == "error" for f in findings)
    warnings = sum(f.severity == "warning" for f in findings)
    out.append(f"{errors} error(s), {warnings} warning(s)")
    return "\n".join(out) + "\n"


def write_junit(result: Diagnosis, path: str | Path) -> None:
    """Write :func:`junit_text` to ``path`` atomically."""
    write_text_atomic(path, junit_text(result), option="--junit")


def junit_text(result: Diagnosis) -> str:
    """One test case per finding; errors fail, the rest pass (warnings as system-out)."""
    findings = _findings(result)
    name = quoteattr(f"pipeplan doctor {result.config.path}")
    failures = sum(f.severity == "error" for f in findings)
    lines = ['<?xml version="1.0" encoding="utf-8"?>',
             f'<testsuite name={name} tests="{max(1, len(findings))}" failures="{failures}">']
    if not findings:
        lines.append(f'  <testcase classname="doctor" name={quoteattr(result.config.path)}/>')
    for f in findings:
        case = quoteattr(f"{f.code}: {f.setting}")
        if f.severity == "error":
            lines.append(f'  <testcase classname="doctor.{f.code}" name={case}>'
                         f'<failure message={quoteattr(f.message)}>{escape(f.fix)}</failure></testcase>')
        else:
            lines.append(f'  <testcase classname="doctor.{f.code}" name={case}>'
                         f'<system-out>{escape(f.severity + ": " + f.message)}</system-out></testcase>')
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"
