"""One rank: ``python -m pipeplan.run.worker CONFIG.json`` (started by torchrun).

The launcher (:mod:`pipeplan.run.launch`) writes one JSON config and starts one process per
rank under torchrun: ``d x p`` of them for a plan with ``d`` data-parallel replicas of a
``p``-rank pipeline, numbered in Megatron's order (:mod:`pipeplan.run.gradsync`). Each process:

1. joins the process group (gloo on CPU, NCCL on CUDA) with a bounded ``timeout``, so that a
   hung peer ends the job instead of waiting gloo's default 30 minutes; with ``d > 1`` it
   makes each replica's pipeline group and each pipeline rank's data group;
2. builds only the units of its own stages, by the plan's layer names
   (:func:`pipeplan.profile.units.build_stage`), and wraps each in a ``PipelineStage`` (talking in
   its replica's pipeline group);
3. runs the torch schedule class the plan names, with the plan's micro-batch size and count,
   for ``steps`` iterations with an optimizer, on synthetic batches (or the model's own batch
   factory); with ``d > 1`` each replica takes its 1/d share of the global batch, and after the
   backward the gradients are averaged over the data group
   (:class:`pipeplan.run.gradsync.DataParallelGrads`), so every replica steps as one process
   on the whole global batch would;
4. times every step (after a barrier, so all ranks start together), the compute actions
   (forward, backward, weight-gradient chunks), and the peak memory;
4b. re-times each of its stages alone (forward and whole backward of one micro-batch, outside the
   schedule) after about every fifth step from the first timed one, and after the last, so that
   the report can tell how much faster or slower the machine runs the same work now than when
   it was profiled;
5. gathers every rank's numbers on every rank and writes them to ``out_dir/ranks.json`` (the
   first local process of each node writes it).

A rank that raises writes ``out_dir/error-rank<R>.json`` (its rank, the exception and the
traceback) before it exits non-zero; torchrun then ends the other ranks and the launcher turns
the file into a one-line message.

The config is passed as a single positional path, never as options: torchrun accepts
abbreviations of its own options, so a script option such as ``--run`` is taken for
``--run-path``.

A rank that succeeds leaves with the others: a barrier, ``destroy_process_group``, then
``os._exit(0)`` without interpreter shutdown (:func:`_leave`); the torch modules that would keep
the default group alive past ``destroy_process_group`` are imported before it is made.

Test hooks: ``PIPEPLAN_RUN_EXIT_REPORT=1`` makes every rank that succeeds write
``out_dir/exit-rank<R>.json`` with the names of its threads still alive after
``destroy_process_group`` (none of gloo's should be). ``PIPEPLAN_RUN_FAULT=<rank>:<kind>`` makes
that rank fail on purpose at its first step: ``raise`` (an exception), ``exit`` (``os._exit(3)``,
a crash without a Python traceback), ``abort`` (SIGABRT, as a C++ ``std::terminate`` does), or
``hang`` (sleeps until the others time out); ``all:untie`` skips the tied-weight gradient sync on
every rank and ``all:nosync`` the data-parallel one (``--verify`` must then fail); ``hang-sync``
hangs after the first pipelined step, before the gradient all-reduce, where its replicas wait
for it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from pipeplan.run.gradsync import plan_data_parallel
from pipeplan.run.lifetime import die_with_parent
from pipeplan.run.timing import (ComputeTimer, capture_inputs, measure_link, read_status_bytes, reset_peak_rss,
                                  time_alone, time_transfers)
from pipeplan.formats.plan import Plan
from pipeplan.facts.schedules import SPLIT_BACKWARD_SCHEDULES, TORCH_SCHEDULE_CLASS
from pipeplan.profile.loading import load_bundle, make_microbatch
from pipeplan.run.gradsync import DataParallelGrads, ReplicaGroups, TiedGrads, replica_share
from pipeplan.run.stages import build_rank_stages, stage_builder
from pipeplan.run.optimizers import build_optimizer, optimizer_state_bytes

__all__ = ["main", "run_rank", "measure_link", "RESULT_FILE",
           "error_file"]

#: The file, in ``out_dir``, with every rank's results (a JSON list, by rank).
RESULT_FILE = "ranks.json"


def error_file(out_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` records why it failed."""
    return Path(out_dir) / f"error-rank{rank}.json"


def _fault(rank: int) -> Optional[str]:
    spec = os.environ.get("PIPEPLAN_RUN_FAULT", "")
    if not spec or ":" not in spec:
        return None
    who, kind = spec.split(":", 1)
    return kind if who.strip() in (str(rank), "all") else None


def _import_before_init(plans: list) -> None:
    """Import the torch modules the rank will use that take ``group=group.WORLD`` as a default.

    A default argument is evaluated at import: imported after ``init_process_group``, these
    functions keep a reference to the default group for the life of the process, so that
    ``destroy_process_group`` cannot free it. Its gloo threads then run until interpreter
    shutdown, which destroys the group while its peers are exiting too (see :func:`main`).
    ``torch.distributed.pipelining`` imports ``torch.distributed.nn.functional`` (10 such
    functions); ``ZeroRedundancyOptimizer``'s module has one more. Imported before, the defaults
    hold None.
    """
    import importlib

    importlib.import_module("torch.distributed.pipelining")
    if any(p.parallelism is not None and p.parallelism.zero_stage >= 1 for p in plans):
        importlib.import_module("torch.distributed.optim")


def _threads_alive() -> list[str]:
    """Names of this process's threads other than the calling one (``/proc``; [] elsewhere)."""
    names = []
    try:
        tasks = sorted(os.listdir("/proc/self/task"))
    except OSError:
        return names
    for task in tasks:
        if int(task) == threading.get_native_id():
            continue
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:
            continue
    return names


def _leave(code: int) -> None:
    """End the rank now: flush its output and skip interpreter shutdown.

    Interpreter shutdown would destroy whatever torch objects are still alive (process groups,
    their gloo worker and socket threads) from its final garbage collection, at the moment the
    other ranks are exiting and closing their sockets too; a C++ thread that needs the GIL then
    (for instance to run a collective's completion callback) is killed by the finalizing
    interpreter, and the process aborts (SIGABRT, "terminate called without an active
    exception"). Every result is on disk by now.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to save
            pass
    os._exit(code)


def run_rank(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Run this process's pipeline rank of each plan in turn; return its measurements.

    Parameters
    ----------
    config : dict
        Written by :func:`pipeplan.run.launch.worker_config`: ``plans`` (plans as dicts, all
        with the same number of ranks, run one after the other in one process group), ``model``,
        ``model_options``, ``unit_patterns``, ``seq_len``, ``dtype``, ``steps``, ``threads``,
        ``seed``, ``lr``, ``device``, ``timeout_s``, ``out_dir``, ``dump_grads``; optionally
        ``plan_models``, per plan the model keys where the plans are of different models.

    Returns
    -------
    list of dict
        Per plan, this rank's numbers: per-step wall times, compute times, losses (last stage),
        memory.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    threads = config.get("threads")
    if threads:
        torch.set_num_threads(int(threads))

    device_name = config.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_name == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # As the profiler does: otherwise every micro-batch faults its activations in afresh.
        from pipeplan.profile.allocator import keep_freed_memory

        keep_freed_memory()
    timeout = timedelta(seconds=float(config.get("timeout_s") or 60))
    init_kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if device.type == "cuda":
        init_kwargs["device_id"] = device
    plans = [Plan.model_validate(p) for p in config["plans"]]
    _import_before_init(plans)
    dist.init_process_group(**init_kwargs)

    largest = max(s.send_bytes for plan in plans for s in plan.stages)
    # Rank 0's pipeline neighbour: rank d in Megatron's order (rank 1 without data parallelism).
    peer = plan_data_parallel(plans[0])
    link = measure_link(rank, world_size, device, largest, peer=peer) if config.get("measure_link", True) else None
    results = []
    for index, plan in enumerate(plans):
        # Plans of different models carry their own model, options, sequence length and dtype.
        own = {**config, **config["plan_models"][index]} if config.get("plan_models") else config
        result = _run_one(index, plan, own, rank, world_size, device, backend)
        result["link"] = link
        results.append(result)
    return results


def _run_one(plan_index: int, plan: Any, config: dict[str, Any], rank: int, world_size: int, device: Any,
             backend: str) -> dict[str, Any]:
    """Build this rank's stages of ``plan``, run its steps, return the measurements."""
    # Function length (about 250 lines): one rank's run of one plan, in the order torch needs it
    # (process groups, stages, schedule, optimizer, the timed steps, verify, the result); every step
    # reads the same live torch objects, and the steps that stand alone are already helpers
    # (run/timing.py, gradsync.py, verify.py, optimizers.py).
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    from pipeplan.profile.loading import split_inputs
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    num_ranks = 1 + max(stage.rank for stage in plan.stages)
    data = plan_data_parallel(plan)
    if world_size != num_ranks * data:
        raise RuntimeError(
            f"the plan has {data} replica(s) of {num_ranks} pipeline ranks but torchrun started {world_size} "
            f"processes; start d x p = {data * num_ranks}"
        )
    # Collective: every rank makes every replica's groups, in the same order, before any stage.
    from datetime import timedelta

    timeout = timedelta(seconds=float(config.get("timeout_s") or 60))  # as init_process_group's
    groups = ReplicaGroups(data, num_ranks, rank, timeout=timeout)
    stages_here = sorted((s for s in plan.stages if s.rank == groups.pipeline_rank), key=lambda s: s.index)
    num_stages = len(plan.stages)
    fault = _fault(rank)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak_reset = reset_peak_rss()
    baseline_rss_bytes = read_status_bytes("VmRSS")

    model = config["model"]
    options = dict(config.get("model_options") or {})
    seed = int(config.get("seed", 0))
    dtype = config.get("dtype") or "fp32"
    m = plan.num_microbatches  # per replica
    batch_size = plan.microbatch_size * m  # this replica's share of the global batch
    seq_len = config.get("seq_len")
    # Batches: only the ranks holding the first stage (inputs) or the last (targets) need them,
    # but every rank loads the factory (built-ins: without weights; the traced builder traces
    # the whole model on one micro-batch on every rank).
    bundle = load_bundle(model, seed=seed, device=device, dtype=dtype,
                         **({"materialise": []} if ":" not in model else {}), **options)

    def global_batch_of(step: int) -> tuple[Any, Any]:
        # The same global batch on every rank; each replica takes its share (replica_share).
        if bundle.config.get("family") is None:
            torch.manual_seed(seed + 1 + step)
        return make_microbatch(bundle, batch_size * data, seq_len, seed=seed + 1 + step, device=device, dtype=dtype)

    def batch_of(step: int) -> tuple[Any, Any]:
        return replica_share(*global_batch_of(step), groups.data_rank, data)

    example = None
    whole = bundle if ":" in model else None  # user and hf: models: the whole model, built
    builder = stage_builder(model, [s.layers for s in plan.stages], seed=seed, device=device, dtype=dtype,
                            unit_patterns=config.get("unit_patterns"), bundle=whole, **options)
    global_inputs, global_target = global_batch_of(0)
    first_inputs, first_target_batch = replica_share(global_inputs, global_target, groups.data_rank, data)
    reference = None
    if config.get("verify"):
        from pipeplan.run.verify import reference_step, refuse_dropout

        refuse_dropout(model, whole)

        # Before the stages are built from the same model: the reference leaves the weights as
        # they were and clears its gradients.
        ref_bundle = whole or load_bundle(model, seed=seed, device=device, dtype=dtype, **options)
        # One process on the whole global batch, cut into the d x m micro-batches the replicas run.
        reference = reference_step(ref_bundle, global_inputs, global_target, m * data)
        del ref_bundle
    del global_inputs, global_target
    if builder == "traced" or whole is not None:
        from pipeplan.run.verify import microbatches

        # The traced builder traces on it; the units builder reads off it how a user model's
        # units pass tuples between stages.
        example = microbatches(first_inputs, first_target_batch, m)[0][0]
    built = build_rank_stages(model, [s.layers for s in plan.stages], [s.index for s in stages_here],
                              example_inputs=example, seed=seed, device=device, dtype=dtype,
                              unit_patterns=config.get("unit_patterns"), builder=builder,
                              bundle=whole if builder == "traced" else None,
                              split_backward_schedule=plan.schedule if plan.schedule in SPLIT_BACKWARD_SCHEDULES
                              else None, **options)
    modules = built.modules
    whole_model_param_bytes, whole_model_released = None, None
    if whole is not None:
        import dataclasses
        import gc
        import weakref

        if built.builder == "traced":
            whole_model_param_bytes = sum(t.numel() * t.element_size() for t in whole.model.parameters())
        # The stages share the parameters they hold with the whole model (traced) or have their
        # own (units); the rest of it is dead weight from here on: released, this rank keeps the
        # memory its stages need (the whole model's bytes, times 1 - 1/p, on every rank).
        released = weakref.ref(whole.model)
        bundle = dataclasses.replace(bundle, model=None)
        whole = None
        gc.collect()
        whole_model_released = released() is None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            # The peak the plan predicts is the stages' training, not the trace of the whole model.
            torch.cuda.reset_peak_memory_stats(device)
    tied = TiedGrads(built.tied, groups.stage_ranks({s.index: s.rank for s in plan.stages}), modules,
                     built.param_names, rank, timeout=timeout)
    pipeline_stages = []
    for i, (module, stage) in enumerate(zip(modules, stages_here)):
        static = built.static_args[i] if built.static_args else None
        extra = {} if static is None else {"input_args": static[0], "output_args": static[1]}
        pipeline_stages.append(PipelineStage(module, stage.index, num_stages, device, group=groups.pipeline_group,
                                             **extra))
    captured = [capture_inputs(module) for module in modules]
    timer = ComputeTimer(device)
    time_transfers(torch_schedules, timer)
    for ps in pipeline_stages:
        ps.forward_one_chunk = timer.wrap("forward", ps.forward_one_chunk)
        ps.backward_one_chunk = timer.wrap("backward", ps.backward_one_chunk)
        ps.backward_weight_one_chunk = timer.wrap("weight", ps.backward_weight_one_chunk)

    loss = built.loss
    loss_ms = [0.0]
    first_target: dict[str, Any] = {}

    def timed_loss(output: Any, target: Any) -> Any:
        if "target" not in first_target and torch.is_tensor(target):
            first_target["target"] = target.detach().clone()
        started = time.perf_counter()
        value = loss(output, target)
        loss_ms[0] += (time.perf_counter() - started) * 1000.0
        return value

    class_name = TORCH_SCHEDULE_CLASS[plan.schedule]
    schedule_class = getattr(torch_schedules, class_name)
    if plan.schedule in ("gpipe", "1f1b"):
        if len(pipeline_stages) != 1:
            raise RuntimeError(
                f"schedule {plan.schedule} runs one stage per rank; rank {rank} has "
                f"{len(pipeline_stages)} stages in the plan"
            )
        schedule = schedule_class(pipeline_stages[0], m, loss_fn=timed_loss)
    else:
        schedule = schedule_class(pipeline_stages, m, loss_fn=timed_loss)

    params = [p for module in modules for p in module.parameters()]
    replica_grads = DataParallelGrads(params, groups.data_group, data)
    zero_stage = plan.parallelism.zero_stage if plan.parallelism is not None else 0
    optimizer = build_optimizer(params, plan.settings.optimizer, float(config.get("lr", 1e-3)),
                                shard_group=groups.data_group if zero_stage >= 1 else None)

    has_first = any(s.index == 0 for s in stages_here)
    has_last = any(s.index == num_stages - 1 for s in stages_here)

    step_ms, pipeline_ms, sync_ms, compute, losses = [], [], [], [], []
    verified: Optional[list[dict[str, Any]]] = None
    alone: list[dict[str, Any]] = []
    alone_repeats = int(config.get("alone_repeats", 2))

    def time_stages_alone(step: int) -> None:
        for box, module, stage in zip(captured, modules, stages_here):
            last = stage.index == num_stages - 1
            if last and "target" not in first_target:
                continue
            times = time_alone(module, box, input_grads=stage.index > 0,
                                loss=loss if last else None, target=first_target.get("target"),
                                device=device, repeats=alone_repeats)
            if times is not None:
                alone.append({"stage": stage.index, "step": step, **times})

    steps = int(config["steps"])
    alone_steps = {steps - 1, *range(min(1, steps - 1), steps, max(1, steps // 5))}
    for step in range(steps):
        inputs: Any = ()
        target = None
        if has_first or has_last:
            inputs, target = (first_inputs, first_target_batch) if step == 0 else batch_of(step)
        if target is None:
            # The schedule's loss call wants a target per micro-batch; a model with its own loss
            # (or none) ignores it.
            target = torch.zeros(batch_size, device=device)
        if fault not in (None, "untie", "nosync", "hang-sync") and step == 0:
            if fault == "raise":
                raise RuntimeError(f"fault injected on rank {rank} (PIPEPLAN_RUN_FAULT)")
            if fault == "exit":
                os._exit(3)
            if fault == "abort":
                os.abort()
            if fault == "hang":
                time.sleep(3600)
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step_losses: list = []
        kwargs: dict[str, Any] = {}
        if has_last:
            kwargs = {"target": target, "losses": step_losses}
        if has_first:
            args, keywords = split_inputs(inputs)
            schedule.step(*args, **keywords, **kwargs)
        else:
            schedule.step(**kwargs)
        if fault != "untie":
            tied.sync()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        pipeline_done = time.perf_counter()
        if fault == "hang-sync":
            time.sleep(3600)  # its data-parallel peers wait in the gradient all-reduce
        if fault != "nosync":
            replica_grads.sync()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        synced = time.perf_counter()
        step_loss = _global_loss(step_losses, groups.data_group, data) if has_last else None
        if step == 0 and reference is not None:
            from pipeplan.run.verify import compare_rank

            verified = compare_rank(modules, stages_here, built.param_names, reference,
                                    [step_loss] if step_loss is not None else [], num_stages)
            if data > 1:
                for record in verified:
                    record["data_rank"] = groups.data_rank
        if step == 0 and config.get("dump_grads"):
            grads = {mapping.get(name, name): p.grad.detach().cpu().clone()
                     for module, mapping in zip(modules, built.param_names)
                     for name, p in module.named_parameters() if p.grad is not None}
            torch.save(grads, Path(config["out_dir"]) / f"grads-plan{plan_index}-rank{rank}.pt")
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            for p in params:
                p.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        finished = time.perf_counter()
        # Spread through the run, since a shared machine's speed moves within seconds; not
        # after the warm-up step, which leaves the process unsettled (timings 30-50% slow).
        if step in alone_steps:
            time_stages_alone(step)
        step_ms.append((finished - started) * 1000.0)
        pipeline_ms.append((pipeline_done - started) * 1000.0)
        sync_ms.append((synced - pipeline_done) * 1000.0)
        times = timer.take()
        times["loss"] = loss_ms[0]
        loss_ms[0] = 0.0
        compute.append(times)
        if step_loss is not None:
            losses.append(float(step_loss))

    if device.type == "cuda":
        peak_bytes = int(torch.cuda.max_memory_allocated(device))
        memory_method = "torch.cuda.max_memory_allocated after the stages were built"
    else:
        hwm = read_status_bytes("VmHWM")
        peak_bytes = (hwm - baseline_rss_bytes) if (hwm and baseline_rss_bytes and peak_reset) else None
        memory_method = "peak RSS (VmHWM) minus RSS before the stages were built"
    return {
        "rank": rank,
        "pipeline_rank": groups.pipeline_rank,
        "data_rank": groups.data_rank,
        "data_parallel": data,
        "host": os.uname().nodename,
        "local_rank": local_rank,
        "stages": [s.index for s in stages_here],
        "device": str(device),
        "backend": backend,
        "threads": torch.get_num_threads(),
        "step_ms": step_ms,
        "pipeline_ms": pipeline_ms,
        "data_parallel_sync_ms": sync_ms,
        "compute_ms": compute,
        "losses": losses,
        "peak_memory_bytes": peak_bytes,
        "memory_method": memory_method,
        "baseline_rss_bytes": baseline_rss_bytes,
        "param_count": sum(p.numel() for p in params),
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "alone": alone,
        "stage_builder": built.builder,
        # The traced builder builds and traces the whole model on every rank (then releases it).
        "whole_model_param_bytes": whole_model_param_bytes,
        "whole_model_released": whole_model_released,
        "tied_weights": built.tied,
        "verify": verified,
    }


def _global_loss(step_losses: list, data_group: Any, data: int) -> Any:
    """The step's loss over the global batch: the mean of this replica's micro-batch losses,
    averaged over the last stage's replicas (all of which call this, in the same step)."""
    import torch
    import torch.distributed as dist

    loss = torch.stack([x.detach().float() for x in step_losses]).mean()
    if data_group is not None and data > 1:
        dist.all_reduce(loss, group=data_group)
        loss = loss / data
    return loss


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of one rank: returns 2 on a usage error; otherwise the process ends here, by
    :func:`_leave` (exit status 0 on success, 1 after recording a failure)."""
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()  # SIGKILL when torchrun dies, however (pipeplan.run.lifetime)
    if len(argv) != 1:
        print("usage: python -m pipeplan.run.worker CONFIG.json (started by pipeplan run)", file=sys.stderr)
        return 2
    config = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    rank = int(os.environ.get("RANK", "-1"))
    out_dir = Path(config["out_dir"])
    try:
        result = run_rank(config)
        import torch.distributed as dist

        gathered: list = [None] * dist.get_world_size()  # per rank, a list over plans
        dist.all_gather_object(gathered, result)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            from pipeplan.formats.io import write_text_atomic

            write_text_atomic(out_dir / RESULT_FILE, json.dumps(gathered, indent=1) + "\n")
        # Leave together: after the barrier no rank sends again, so each may close its sockets.
        dist.barrier()
        dist.destroy_process_group()
        if os.environ.get("PIPEPLAN_RUN_EXIT_REPORT"):
            from pipeplan.formats.io import write_text_atomic

            write_text_atomic(out_dir / f"exit-rank{rank}.json",
                              json.dumps({"rank": rank, "threads_after_destroy": _threads_alive()}) + "\n")
        _leave(0)
        return 0  # not reached
    except BaseException as exc:  # noqa: BLE001 - record any failure for the launcher, then exit
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        record = {
            "rank": rank,
            "host": os.uname().nodename,
            "time": time.time(),
            "type": type(exc).__name__,
            "message": first,
            "traceback": traceback.format_exc(),
        }
        try:
            from pipeplan.formats.io import write_text_atomic

            write_text_atomic(error_file(out_dir, rank), json.dumps(record, indent=1) + "\n")
        except Exception:  # noqa: BLE001 - the record is best-effort (the writer raises BadInputError)
            pass
        print(f"pipeplan run: rank {rank} failed: {type(exc).__name__}: {first}", file=sys.stderr, flush=True)
        # Skip interpreter teardown: a process group with pending peers can block in its destructor.
        _leave(1)
        return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
