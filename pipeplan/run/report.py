"""The run report: what each rank measured, beside what the plan predicted.

A report is a JSON object (written by ``pipeplan run --report``)::

    {"schema": "pipeplan-run-report/1", "schedule": ..., "microbatch_size": ..., "num_microbatches": ...,
     "num_ranks": d x p, "data_parallel": d, "pipeline_ranks": p,
     "measured": {"iteration_ms": ..., "iteration_ms_steps": [...], "samples_per_second": ...},
     "predicted": {"iteration_ms": ..., "simulated_iteration_ms": ...},
     "ratio": measured / predicted iteration,
     "ranks": [{"rank", "stages", "step_ms", "pipeline_ms", "busy_ms", "forward_ms", "backward_ms",
                "weight_ms", "loss_ms", "idle_ms", "peak_memory_bytes", "predicted_busy_ms",
                "busy_ratio", "predicted_peak_memory_bytes", "memory_ratio", ...}],
     "loss": [one value per step], "run": {...how it ran...}, "notes": [...]}

Definitions (all times are medians over the steps after the first, a warm-up):

- ``pipeline_ms``: wall time of ``schedule.step()`` on the rank, from a barrier that starts every
  rank together; the iteration time is the largest over ranks, per step, of ``pipeline_ms`` plus
  ``data_parallel_sync_ms``.
- Data parallelism (``data_parallel`` d > 1): ``ranks`` holds every process, with its
  ``pipeline_rank`` (the plan's ``rank``) and ``data_rank``; predictions per rank are the plan's
  for its pipeline rank. ``data_parallel_sync_ms`` (per rank; ``measured``: the largest over
  ranks) is the gradient all-reduce over the replicas after the backward, which includes waiting
  for the slowest replica; ``predicted.data_parallel_ms`` is the plan's term for it.
  ``num_microbatches`` is per replica and ``samples_per_second`` counts the global batch
  (``d x m x b``). The replayed and adjusted predictions scale each pipeline rank by its
  slowest replica. ``loss`` is the loss over the global batch.
- ``step_ms``: the same plus the gradient sync and the optimizer step.
- ``busy_ms``: time inside the rank's compute calls: forward, backward (input and, where not
  split, weight gradients), weight-gradient and loss; ``idle_ms = pipeline_ms - busy_ms``
  (bubble, waiting for transfers, the schedule's own overhead).
- ``wait_ms``, ``post_ms``, ``overhead_ms``: the idle time split into waiting on transfers
  (torch's ``_wait_batch_p2p``: the bubble, and peers that are late), posting them
  (``_batch_p2p``), and the rest of ``schedule.step()`` outside compute and transfers (the
  schedule's own work: splitting the batch, bookkeeping, gradient scaling).
- ``actions`` and ``overhead_per_action_ms``: the rank's compute actions per iteration (the
  schedule's action list) and ``(post_ms + overhead_ms) / actions``, the schedule's own time per
  action; the report's ``measured.action_overhead_ms`` pools the ranks. ``pipeplan calibrate``
  writes it into the profile, and a plan made from that profile counts it
  (``settings.action_overhead_ms``, ``pipeplan plan --action-overhead-ms``).
- ``cpu_share`` (CPU only): CPU time over wall time inside the compute calls; below 1 the rank
  shared its core with other work and its times are inflated by that much.
- ``busy_cpu_ms`` (CPU only): the CPU time of the compute calls (forward, backward, weight; not
  the loss), which other work on the machine does not inflate; ``busy_cpu_ratio`` compares it
  with the predicted busy time.
- ``link``: point-to-point latency and bandwidth between ranks 0 and 1, measured by ping-pong
  before the plans run; with a profile, ``predicted.simulated_with_link_iteration_ms`` is the
  simulation with every cross-rank transfer costing ``median latency + bytes / bandwidth``.
- ``gap``: on the rank that finished last, how much of ``measured - predicted`` iteration is
  compute (``busy_ms - predicted_busy_ms``: the profile's per-layer times) and how much idle
  (``idle_ms - predicted_idle_ms``: bubble, transfers, the schedule's own work).
- ``predicted.replayed_iteration_ms`` and ``replayed_ratio``: the plan's schedule simulated again
  with every rank's stage costs scaled so that its busy time is what the rank measured. The
  replay has the measured compute and the model's everything else, so ``measured / replayed``
  is the error of the non-compute terms (transfers, the schedule's own work, waiting on a late
  peer beyond what the compute explains) and ``replayed / predicted`` that of the compute.
- ``alone_ms`` (per rank): the rank's stages re-timed alone, forward and whole backward of one
  micro-batch each, outside the schedule (the median of timings spread through the run, after
  about every fifth step from the first timed one and after the last: ``alone_steps_ms``, whose
  first and last are ``alone_before_ms`` and ``alone_after_ms``), beside
  ``predicted_alone_ms``, the same from the plan (the profile's per-layer times).
  ``alone_ratio`` is how much slower (above 1) the machine ran the same work during the run than
  when it was profiled: a shared or throttled machine drifts, and no cost model can foresee it.
  The report's ``alone_ratio`` pools the ranks.
- ``predicted.adjusted_iteration_ms`` and ``adjusted_ratio``: the plan's schedule simulated again
  with every rank's stage costs scaled by its ``alone_ratio``; ``measured / adjusted`` is the
  error of the cost model with the machine's drift since profiling taken out. ``ratio`` is
  about ``alone_ratio x adjusted_ratio``.
- ``peak_memory_bytes``: CUDA, ``max_memory_allocated``; CPU, the growth of the resident set
  from before the stages were built to its peak (it includes the allocator's slack).
"""

from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

from pipeplan.quantities import format_bytes
from pipeplan.plan.actions import rank_actions
from pipeplan.plan import plan_simulation, plan_stage_costs
from pipeplan.plan.simulate import simulate
from pipeplan.run.plans import simulate_plan

__all__ = ["build_report", "report_table", "SCHEMA"]

SCHEMA = "pipeplan-run-report/1"


def _median(values: Sequence[float]) -> Optional[float]:
    return float(statistics.median(values)) if values else None


def _r(value: Optional[float], digits: int = 4) -> Optional[float]:
    return None if value is None else round(float(value), digits)


def _ratio(measured: Optional[float], predicted: Optional[float]) -> Optional[float]:
    if measured is None or not predicted:
        return None
    return round(measured / predicted, 4)


def build_report(plan: Any, results: Sequence[dict[str, Any]], *, profile: Any = None,
                 profile_path: Optional[str] = None, run: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Combine every rank's measurements with the plan's predictions.

    Parameters
    ----------
    plan : Plan
    results : sequence of dict
        One per rank, as :func:`pipeplan.run.worker.run_rank` returns them.
    profile : Profile, optional
        Adds the simulator's prediction from the profile's per-layer costs
        (``predicted.simulated_iteration_ms``, per rank ``simulated_busy_ms``).
    profile_path : str, optional
        Recorded for ``pipeplan calibrate``.
    run : dict, optional
        How the run was made (model, steps, threads, load average), copied in.

    Returns
    -------
    dict
        See the module docstring.

    Examples
    --------
    >>> from pipeplan.formats.plan import Plan
    >>> plan = Plan.model_validate({"schema_version": 1, "profile": {"model": "m", "sha256": "0"},
    ...     "settings": {"stages": 1, "global_batch": 2}, "schedule": "gpipe", "microbatch_size": 1,
    ...     "num_microbatches": 2, "predicted": {"iteration_ms": 10, "bubble_fraction": 0,
    ...     "samples_per_second": 200, "bottleneck_stage": 0}, "solver": {"method": "dp-chain",
    ...     "optimal": True, "seconds": 0}, "stages": [{"index": 0, "rank": 0, "forward_ms": 2,
    ...     "backward_ms": 3, "send_bytes": 0, "peak_memory_bytes": 0, "layers": ["a"]}]})
    >>> rank = {"rank": 0, "stages": [0], "step_ms": [30, 12, 13], "pipeline_ms": [29, 11, 12],
    ...         "compute_ms": [{"forward": 5, "backward": 6, "weight": 0, "loss": 0}] * 3,
    ...         "losses": [2.0, 1.5, 1.2], "peak_memory_bytes": None}
    >>> report = build_report(plan, [rank])
    >>> report["measured"]["iteration_ms"], report["ratio"], report["loss"]
    (11.5, 1.15, [2.0, 1.5, 1.2])
    """
    results = sorted(results, key=lambda r: r["rank"])
    data = int(results[0].get("data_parallel", 1))
    steps = len(results[0]["pipeline_ms"])
    timed = range(1, steps) if steps > 1 else range(steps)

    def sync(r: dict[str, Any], i: int) -> float:
        return (r.get("data_parallel_sync_ms") or [0.0] * steps)[i]

    # The iteration includes the data-parallel gradient sync, as the plan's does.
    iteration_steps = [max(r["pipeline_ms"][i] + sync(r, i) for r in results) for i in range(steps)]
    iteration_ms = _median([iteration_steps[i] for i in timed])

    predicted_rank = {summary.rank: summary for summary in plan.ranks}

    actions_per_rank = [len(actions) for actions in rank_actions(
        plan.schedule, plan.settings.stages, plan.num_microbatches, plan.virtual_stages)]
    stage_by_index = {s.index: s for s in plan.stages}
    simulation = None
    if profile is not None:
        simulation = simulate_plan(plan, profile)

    ranks = [_rank_row(r, plan, timed, steps, data, simulation, predicted_rank, stage_by_index, actions_per_rank)
             for r in results]

    losses = next((r["losses"] for r in results if r.get("losses") and
                   (len(plan.stages) - 1) in r["stages"]), [])
    predicted: dict[str, Any] = {
        "iteration_ms": plan.predicted.iteration_ms,
        "bubble_fraction": plan.predicted.bubble_fraction,
        "samples_per_second": plan.predicted.samples_per_second,
    }
    if plan.settings.action_overhead_ms:
        predicted["action_overhead_ms"] = plan.settings.action_overhead_ms
    link = next((r.get("link") for r in results if r.get("link")), None)
    if simulation is not None:
        predicted["simulated_iteration_ms"] = _r(simulation.iteration_ms)
        predicted["simulated_bubble_fraction"] = _r(simulation.bubble_fraction)
        if link is not None:
            # The median latency: a transfer on the critical path also waits for the peer to be
            # woken, which the fastest round trip hides.
            with_link = simulate_plan(plan, profile, bandwidth_bytes_per_s=link["bandwidth_bytes_per_s"],
                                      latency_ms=link.get("median_latency_ms", link["latency_ms"]))
            predicted["simulated_with_link_iteration_ms"] = _r(with_link.iteration_ms)
    batch = plan.microbatch_size * plan.num_microbatches * data  # the global batch
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "model": (run or {}).get("model", plan.profile.model),
        "schedule": plan.schedule,
        "virtual_stages": plan.virtual_stages,
        "num_ranks": len(results),
        "data_parallel": data,
        "pipeline_ranks": plan.settings.stages,
        "microbatch_size": plan.microbatch_size,
        "num_microbatches": plan.num_microbatches,
        "measured": {
            "iteration_ms": _r(iteration_ms),
            "iteration_ms_steps": [_r(x, 3) for x in iteration_steps],
            "warmup_iteration_ms": _r(iteration_steps[0]),
            "samples_per_second": _r(batch * 1000.0 / iteration_ms) if iteration_ms else None,
            "timed_steps": len(timed),
        },
        "predicted": predicted,
        "ratio": _ratio(iteration_ms, plan.predicted.iteration_ms),
        "ranks": ranks,
        "loss": [_r(x, 6) for x in losses],
        "link": link,
        "run": dict(run or {}),
        "notes": [],
    }
    if data > 1:
        report["measured"]["data_parallel_sync_ms"] = _r(_median([max(sync(r, i) for r in results) for i in timed]))
        if plan.predicted.data_parallel_ms is not None:
            predicted["data_parallel_ms"] = plan.predicted.data_parallel_ms
    if all(row.get("overhead_per_action_ms") is not None for row in ranks):
        report["measured"]["action_overhead_ms"] = _r(
            sum(row["post_ms"] + row["overhead_ms"] for row in ranks) / sum(row["actions"] for row in ranks))

    _add_ratios(report, plan, ranks, iteration_ms, simulation)
    _add_notes(report, ranks, results)
    if profile_path is not None:
        report["profile_path"] = profile_path
    return report


def _rank_row(r: dict[str, Any], plan: Any, timed: range, steps: int, data: int, simulation: Any,
              predicted_rank: dict, stage_by_index: dict, actions_per_rank: list) -> dict[str, Any]:
    """One rank's row of the report: its measured parts (medians over the timed steps) beside
    the plan's (and the simulator's) prediction for that rank."""

    def sync(i: int) -> float:
        return (r.get("data_parallel_sync_ms") or [0.0] * steps)[i]

    pipeline_rank = r.get("pipeline_rank", r["rank"])
    compute = [r["compute_ms"][i] for i in timed]
    forward = _median([c["forward"] for c in compute])
    backward = _median([c["backward"] for c in compute])
    weight = _median([c["weight"] for c in compute])
    loss = _median([c.get("loss", 0.0) for c in compute])
    busy = _median([c["forward"] + c["backward"] + c["weight"] + c.get("loss", 0.0) for c in compute])
    pipeline = _median([r["pipeline_ms"][i] for i in timed])
    wait = _median([c.get("wait", 0.0) for c in compute]) if compute and "wait" in compute[0] else None
    post = _median([c.get("post", 0.0) for c in compute]) if compute and "post" in compute[0] else None
    overhead = None
    if wait is not None and post is not None:
        overhead = _median([r["pipeline_ms"][i] - (c["forward"] + c["backward"] + c["weight"] + c.get("loss", 0.0))
                            - c["wait"] - c["post"] for i, c in zip(timed, compute)])
    compute_walls = [c["forward"] + c["backward"] + c["weight"] for c in compute]
    cpu_share = busy_cpu = None
    if compute and all("cpu" in c for c in compute) and sum(compute_walls) > 0:
        cpu_share = sum(c["cpu"] for c in compute) / sum(compute_walls)
        busy_cpu = _median([c["cpu"] for c in compute])
    summary = predicted_rank.get(pipeline_rank)
    stages = [stage_by_index[i] for i in r["stages"]]
    if summary is not None:
        predicted_busy = summary.busy_ms
        # Measured idle time holds the schedule's own work too.
        predicted_idle = summary.idle_ms + (summary.overhead_ms or 0.0)
        predicted_peak = summary.peak_memory_bytes
    else:
        predicted_busy = plan.num_microbatches * sum(s.forward_ms + s.backward_ms for s in stages)
        predicted_idle = max(0.0, plan.predicted.iteration_ms - predicted_busy)
        predicted_peak = sum(s.peak_memory_bytes for s in stages)
    row = {
        "rank": r["rank"],
        "pipeline_rank": pipeline_rank,
        "data_rank": r.get("data_rank", 0),
        "stages": r["stages"],
        "layers": [layer for s in stages for layer in s.layers],
        "step_ms": _r(_median([r["step_ms"][i] for i in timed])),
        "pipeline_ms": _r(pipeline),
        "busy_ms": _r(busy),
        "forward_ms": _r(forward),
        "backward_ms": _r(backward),
        "weight_ms": _r(weight),
        "loss_ms": _r(loss),
        # Per step, then the median: like the parts below, so that they compare.
        "idle_ms": _r(_median([r["pipeline_ms"][i] - (c["forward"] + c["backward"] + c["weight"]
                                                    + c.get("loss", 0.0)) for i, c in zip(timed, compute)])),
        "predicted_idle_ms": _r(predicted_idle),
        "wait_ms": _r(wait),
        "post_ms": _r(post),
        "overhead_ms": _r(overhead),
        "actions": actions_per_rank[pipeline_rank] if pipeline_rank < len(actions_per_rank) else None,
        "predicted_busy_ms": _r(predicted_busy),
        "predicted_forward_ms": _r(plan.num_microbatches * sum(s.forward_ms for s in stages)),
        "predicted_backward_ms": _r(plan.num_microbatches * sum(s.backward_ms for s in stages)),
        "busy_ratio": _ratio(busy, predicted_busy),
        "peak_memory_bytes": r.get("peak_memory_bytes"),
        "predicted_peak_memory_bytes": predicted_peak,
        "memory_ratio": _ratio(r.get("peak_memory_bytes"), predicted_peak),
        "memory_method": r.get("memory_method"),
        "optimizer": r.get("optimizer"),
        "optimizer_state_bytes": r.get("optimizer_state_bytes"),
        "cpu_share": _r(cpu_share, 3),
        "busy_cpu_ms": _r(busy_cpu),
        "busy_cpu_ratio": _ratio(busy_cpu, predicted_busy),
        "device": r.get("device"),
        "backend": r.get("backend"),
        "host": r.get("host"),
        "threads": r.get("threads"),
        "pipeline_ms_steps": [_r(x, 3) for x in r["pipeline_ms"]],
    }
    if data > 1:
        row["data_parallel_sync_ms"] = _r(_median([sync(i) for i in timed]))
    if overhead is not None and row["actions"]:
        row["overhead_per_action_ms"] = _r((post + overhead) / row["actions"])
    row.update(_alone(r.get("alone") or [], stages))
    if simulation is not None:
        row["simulated_busy_ms"] = _r(simulation.rank_busy_ms[pipeline_rank])
        row["simulated_busy_ratio"] = _ratio(busy, simulation.rank_busy_ms[pipeline_rank])
    return row


def _add_ratios(report: dict[str, Any], plan: Any, ranks: list, iteration_ms: float, simulation: Any) -> None:
    """The measured iteration against each prediction (replayed with the ranks' measured compute,
    adjusted for the machine's drift, simulated from the profile) and where the gap comes from."""
    predicted = report["predicted"]
    planned_busy_ms = plan_simulation(plan).rank_busy_ms
    if all(row["busy_ms"] is not None and planned_busy_ms[row["pipeline_rank"]] > 0 for row in ranks):
        replayed_ms = _scaled_iteration_ms(
            plan, _slowest_replica([(row["pipeline_rank"], row["busy_ms"] / planned_busy_ms[row["pipeline_rank"]])
                                    for row in ranks]))
        predicted["replayed_iteration_ms"] = _r(replayed_ms)
        report["replayed_ratio"] = _ratio(iteration_ms, replayed_ms)
    if all(row.get("alone_ms") and row.get("alone_ratio") is not None for row in ranks):
        report["alone_ratio"] = _ratio(sum(row["alone_ms"] for row in ranks),
                                       sum(row["predicted_alone_ms"] for row in ranks))
        adjusted_ms = _scaled_iteration_ms(
            plan, _slowest_replica([(row["pipeline_rank"], row["alone_ratio"]) for row in ranks]))
        predicted["adjusted_iteration_ms"] = _r(adjusted_ms)
        report["adjusted_ratio"] = _ratio(iteration_ms, adjusted_ms)
    if simulation is not None:
        report["simulated_ratio"] = _ratio(iteration_ms, simulation.iteration_ms)
        if "simulated_with_link_iteration_ms" in predicted:
            report["simulated_with_link_ratio"] = _ratio(iteration_ms, predicted["simulated_with_link_iteration_ms"])
    # Where the gap comes from, on the rank that finished last: its compute (the profile's
    # per-layer times) or its idle time (bubble, transfers, the schedule's own work).
    last = max(ranks, key=lambda row: row["pipeline_ms"] or 0.0)
    if last["busy_ms"] is not None and last["idle_ms"] is not None:
        report["gap"] = {
            "rank": last["rank"],
            "iteration_ms": _r(iteration_ms - plan.predicted.iteration_ms) if iteration_ms is not None else None,
            "compute_ms": _r(last["busy_ms"] - last["predicted_busy_ms"]),
            "idle_ms": _r(last["idle_ms"] - last["predicted_idle_ms"]),
        }


def _add_notes(report: dict[str, Any], ranks: list, results: Sequence[dict[str, Any]]) -> None:
    """What a reader must know before reading the ratios: shared cores, the traced builder's
    whole-model memory, the machine's drift since profiling."""
    shares = [row["cpu_share"] for row in ranks if row.get("cpu_share") is not None]
    if shares and min(shares) < 0.9:
        report["notes"].append(
            f"the ranks' compute got {min(shares):.0%}-{max(shares):.0%} of a core (CPU time / wall time "
            f"inside forward and backward): other work shared the cores, so measured times are inflated; "
            f"rerun on a quiet machine before reading the ratio as an error of the cost model"
        )
    whole = max((r.get("whole_model_param_bytes") or 0 for r in results
                 if str(r.get("memory_method", "")).startswith("peak RSS")), default=0)
    if whole:
        verify = " and --verify's one-process reference step" if any(r.get("verify") for r in results) else ""
        released = ("; released after the build" if all(r.get("whole_model_released") for r in results)
                    else "; NOT released after the build (something still holds the model)")
        report["notes"].append(
            f"measured peak memory (RSS) includes what the traced stage builder needs on every rank: the "
            f"whole model, built and traced there ({format_bytes(whole)} of parameters){verify}{released}; a "
            f"memory ratio above 1 is mostly that, not the plan's stages (benchmarks/gpu_check.sh measures "
            f"each stage alone)"
        )
    drift = report.get("alone_ratio")
    if drift is not None and abs(drift - 1.0) > 0.15:
        report["notes"].append(
            f"the stages re-timed alone during the run took {drift:.2f}x their profiled time: the machine "
            f"runs the same work {'slower' if drift > 1 else 'faster'} than when it was profiled, so the ratio "
            f"measures that drift as much as the cost model (adjusted ratio {report.get('adjusted_ratio')}); "
            f"re-profile, or pipeplan calibrate from this report"
        )


def _alone(timings: Sequence[dict[str, Any]], stages: Sequence[Any]) -> dict[str, Any]:
    """A rank's stages re-timed alone, against the plan's per-micro-batch stage times."""
    if not timings:
        return {}
    by_step: dict[int, dict[int, float]] = {}
    for t in timings:
        by_step.setdefault(t["step"], {})[t["stage"]] = t["forward_ms"] + t["backward_ms"]
    wanted = {s.index for s in stages}
    totals = [sum(times.values()) for _, times in sorted(by_step.items()) if set(times) == wanted]
    if not totals:
        return {}
    predicted_ms = sum(s.forward_ms + s.backward_ms for s in stages)
    alone_ms = statistics.median(totals)
    return {
        "alone_ms": _r(alone_ms),
        "alone_steps_ms": [_r(x, 3) for x in totals],
        "alone_before_ms": _r(totals[0]),
        "alone_after_ms": _r(totals[-1]),
        "predicted_alone_ms": _r(predicted_ms),
        "alone_ratio": _ratio(alone_ms, predicted_ms),
    }


def _slowest_replica(factors: Sequence[tuple[int, float]]) -> dict[int, float]:
    """Per pipeline rank, the largest factor over its replicas (the slowest one bounds the iteration).

    Examples
    --------
    >>> _slowest_replica([(0, 1.1), (0, 1.3), (1, 0.9)])
    {0: 1.3, 1: 0.9}
    """
    out: dict[int, float] = {}
    for pipeline_rank, factor in factors:
        out[pipeline_rank] = max(factor, out.get(pipeline_rank, factor))
    return out


def _scaled_iteration_ms(plan: Any, factors: dict[int, float]) -> float:
    """The plan's schedule simulated again with each rank's compute times multiplied by its factor."""
    from dataclasses import replace

    rank_of = {s.index: s.rank for s in plan.stages}
    scaled = []
    for index, cost in enumerate(plan_stage_costs(plan)):
        k = factors[rank_of[index]]
        scaled.append(replace(cost, forward_ms=cost.forward_ms * k, backward_input_ms=cost.backward_input_ms * k,
                              backward_weight_ms=cost.backward_weight_ms * k,
                              full_backward_ms=cost.backward_ms * k))
    return simulate(scaled, plan.schedule, plan.settings.stages, plan.num_microbatches,
                    plan.virtual_stages).iteration_ms


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def _x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def report_table(report: dict[str, Any]) -> Any:
    """A rich table: one row per rank, measured beside predicted, then the iteration."""
    from rich.table import Table

    measured, predicted = report["measured"], report["predicted"]
    data = report.get("data_parallel") or 1
    replicas = f"{data} replicas of " if data > 1 else ""
    ranks = (report.get("pipeline_ranks") or report["num_ranks"] // data) if data > 1 else report["num_ranks"]
    title = (f"{report['model']}: {report['schedule']}, {replicas}{ranks} ranks x "
             f"{report['virtual_stages']} stages, {report['num_microbatches']} micro-batches of "
             f"{report['microbatch_size']}{' per replica' if data > 1 else ''}")
    table = Table(title=title)
    for column in ("rank", "stages", "step ms", "busy ms", "predicted busy", "busy ratio",
                   "idle ms", "core share", "peak memory", "predicted memory"):
        table.add_column(column, justify="left" if column == "stages" else "right")
    for row in report["ranks"]:
        peak = row.get("peak_memory_bytes")
        table.add_row(
            str(row["rank"]),
            ",".join(map(str, row["stages"])),
            _ms(row["pipeline_ms"]),
            _ms(row["busy_ms"]),
            _ms(row["predicted_busy_ms"]),
            _x(row["busy_ratio"]),
            _ms(row["idle_ms"]),
            "-" if row.get("cpu_share") is None else f"{row['cpu_share']:.0%}",
            "-" if peak is None else format_bytes(peak),
            format_bytes(row["predicted_peak_memory_bytes"]),
        )
    simulated = predicted.get("simulated_iteration_ms")
    table.add_row(
        "all", "", _ms(measured["iteration_ms"]), "", _ms(predicted["iteration_ms"]),
        _x(report["ratio"]), "", "", "", "", end_section=True,
    )
    loss = report.get("loss") or []
    run = report.get("run", {})
    parts = [
        f"iteration {_ms(measured['iteration_ms'])} ms measured vs {_ms(predicted['iteration_ms'])} ms "
        f"predicted (ratio {_x(report['ratio'])})",
    ]
    if simulated is not None:
        parts.append(f"simulated from the profile {_ms(simulated)} ms (ratio {_x(report.get('simulated_ratio'))})")
    link = report.get("link")
    if link:
        parts.append(f"measured link {link.get('median_latency_ms', link['latency_ms']):.2f} ms + "
                     f"{link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
        if predicted.get("simulated_with_link_iteration_ms") is not None:
            parts.append(f"simulated with that link {_ms(predicted['simulated_with_link_iteration_ms'])} ms "
                         f"(ratio {_x(report.get('simulated_with_link_ratio'))})")
    if measured.get("data_parallel_sync_ms") is not None:
        planned = predicted.get("data_parallel_ms")
        parts.append(f"gradient sync over {data} replicas {_ms(measured['data_parallel_sync_ms'])} ms, waiting for the "
                     f"slowest included" + (f" (planned {planned:.1f})" if planned is not None else ""))
    if predicted.get("replayed_iteration_ms") is not None:
        parts.append(f"replayed with the measured compute {_ms(predicted['replayed_iteration_ms'])} ms "
                     f"(ratio {_x(report.get('replayed_ratio'))}: the non-compute terms)")
    if measured.get("action_overhead_ms") is not None:
        planned = predicted.get("action_overhead_ms")
        parts.append(f"the schedule's own work {measured['action_overhead_ms']:.2f} ms per action"
                     + (f" (planned {planned:.2f})" if planned else " (not in the plan: pipeplan calibrate adds it)"))
    if predicted.get("adjusted_iteration_ms") is not None:
        parts.append(f"the stages re-timed alone ran {_x(report.get('alone_ratio'))}x their profiled time; "
                     f"the prediction scaled by that {_ms(predicted['adjusted_iteration_ms'])} ms "
                     f"(ratio {_x(report.get('adjusted_ratio'))}: the cost model without the machine's drift)")
    gap = report.get("gap")
    if gap and gap.get("iteration_ms") is not None:
        parts.append(f"gap {gap['iteration_ms']:+.1f} ms on rank {gap['rank']}: compute {gap['compute_ms']:+.1f}, "
                     f"idle {gap['idle_ms']:+.1f}")
    parts.append(f"median of {measured['timed_steps']} steps after a {_ms(measured['warmup_iteration_ms'])} ms warm-up")
    if loss:
        parts.append(f"loss {loss[0]:.4f} -> {loss[-1]:.4f}")
    if run.get("load_average_before") is not None:
        parts.append(f"load average {run['load_average_before']} -> {run.get('load_average_after')}")
    table.caption = "; ".join(parts)
    return table
