"""One pipeline rank: ``python -m pipeplan.run.worker CONFIG.json`` (started by torchrun).

The launcher (:mod:`pipeplan.run.launch`) writes one JSON config and starts one process per
pipeline rank under torchrun. Each process:

1. joins the process group (gloo on CPU, NCCL on CUDA) with a bounded ``timeout``, so that a
   hung peer ends the job instead of waiting gloo's default 30 minutes;
2. builds only the units of its own stages, by the plan's layer names
   (:func:`pipeplan.profile.build_stage`), and wraps each in a ``PipelineStage``;
3. runs the torch schedule class the plan names, with the plan's micro-batch size and count,
   for ``steps`` iterations with an optimizer, on synthetic batches (or the model's own batch
   factory);
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

Test hook: the environment variable ``PIPEPLAN_RUN_FAULT=<rank>:<kind>`` makes that rank fail on
purpose at its first step: ``raise`` (an exception), ``exit`` (``os._exit(3)``, a crash without
a Python traceback), or ``hang`` (sleeps until the others time out); ``all:untie`` skips the
tied-weight gradient sync on every rank (``--verify`` must then fail).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

__all__ = ["main", "run_rank", "measure_link", "RESULT_FILE", "error_file"]

#: The file, in ``out_dir``, with every rank's results (a JSON list, by rank).
RESULT_FILE = "ranks.json"


def error_file(out_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` records why it failed."""
    return Path(out_dir) / f"error-rank{rank}.json"


def _read_status_bytes(field: str) -> Optional[int]:
    """``VmRSS`` / ``VmHWM`` of this process from ``/proc/self/status``, in bytes (Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``); Linux >= 4.0."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class _Timer:
    """Sums the wall time of a stage's compute calls, per kind, for the current step."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.device = device
        self.torch = torch
        self.ms = {"forward": 0.0, "backward": 0.0, "weight": 0.0, "wait": 0.0, "post": 0.0}
        # CPU time of this thread inside the same calls: on CPU with one torch thread, the share
        # cpu / wall tells whether the rank had its core (1.0) or shared it with other work.
        self.cpu_ms = 0.0
        self._pending: list[tuple[str, Any, Any]] = []

    def wrap(self, kind: str, func: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                start = self.torch.cuda.Event(enable_timing=True)
                end = self.torch.cuda.Event(enable_timing=True)
                start.record()
                out = func(*args, **kwargs)
                end.record()
                self._pending.append((kind, start, end))
                return out
            started, cpu_started = time.perf_counter(), time.thread_time()
            out = func(*args, **kwargs)
            self.ms[kind] += (time.perf_counter() - started) * 1000.0
            self.cpu_ms += (time.thread_time() - cpu_started) * 1000.0
            return out

        return timed

    def take(self) -> dict[str, float]:
        """This step's totals (after the step: CUDA events are read here), then reset."""
        if self._pending:
            self.torch.cuda.synchronize(self.device)
            for kind, start, end in self._pending:
                self.ms[kind] += start.elapsed_time(end)
            self._pending.clear()
        out = dict(self.ms)
        if not self.cuda:
            out["cpu"] = self.cpu_ms
        self.ms = {k: 0.0 for k in self.ms}
        self.cpu_ms = 0.0
        return out


def _time_transfers(module: Any, timer: _Timer) -> None:
    """Time the schedule's transfer calls: posting them (``_batch_p2p``) and waiting on them
    (``_wait_batch_p2p``), so that idle time splits into waiting for peers and the schedule's own
    work. torch 2.13 calls both by their module-level names; where they are missing (another
    torch), nothing is timed."""
    for name, kind in (("_batch_p2p", "post"), ("_wait_batch_p2p", "wait")):
        func = getattr(module, name, None)
        if func is None:
            continue
        func = getattr(func, "__wrapped_by_pipeplan__", func)
        timed = _wall_timed(timer, kind, func)
        timed.__wrapped_by_pipeplan__ = func
        setattr(module, name, timed)


def _wall_timed(timer: _Timer, kind: str, func: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            timer.ms[kind] += (time.perf_counter() - started) * 1000.0

    return timed


def _capture_inputs(module: Any) -> dict[str, Any]:
    """Keep a copy of the inputs of the stage module's second call (a real micro-batch).

    Not the first: a stage that infers its shapes (``PipelineStage`` without example inputs)
    first runs its module on ``torch.empty`` tensors made from metadata, whose values are
    garbage (NaN, denormals, out-of-range ids) and would make the stage's timing alone
    meaningless. The second call is always a real micro-batch (at the latest, the next step's).
    """
    import torch

    box: dict[str, Any] = {}
    calls = [0]

    def hook(_module: Any, args: tuple, kwargs: dict) -> None:
        if calls[0] >= 2 or any(torch.is_tensor(a) and a.is_meta for a in (*args, *kwargs.values())):
            return
        calls[0] += 1
        copy = (lambda a: a.detach().clone() if torch.is_tensor(a) else a)
        box["args"] = tuple(copy(a) for a in args)
        box["kwargs"] = {k: copy(a) for k, a in kwargs.items()}

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return box


def _time_alone(module: Any, inputs: dict[str, Any], *, input_grads: bool, loss: Any, target: Any,
                device: Any, repeats: int) -> Optional[dict[str, float]]:
    """Median forward and whole-backward time of one micro-batch through ``module``, alone.

    The profiler times each unit the same way (a random output gradient drives the backward; the
    last stage's forward includes the loss), so measured / predicted here is how the machine's
    speed moved between profiling and this run, free of the schedule's bubbles and transfers.
    The gradients it makes are dropped.
    """
    import torch

    if "args" not in inputs or repeats <= 0:
        return None

    def prepare(a: Any) -> Any:
        if torch.is_tensor(a) and input_grads and a.is_floating_point():
            return a.detach().requires_grad_(True)
        return a

    args = tuple(prepare(a) for a in inputs["args"])
    kwargs = {k: prepare(a) for k, a in inputs["kwargs"].items()}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    forward_ms, backward_ms, grads = [], [], None
    # One untimed pass first: the first call after a pipelined step is slower (caches,
    # allocator), as the profiler's warm-up rounds know.
    for repeat in range(repeats + 1):
        sync()
        started = time.perf_counter()
        out = module(*args, **kwargs)
        value = loss(out, target) if loss is not None else out
        sync()
        forwarded = time.perf_counter()
        outs = [t for t in (value if isinstance(value, (tuple, list)) else [value])
                if torch.is_tensor(t) and t.requires_grad]
        if loss is None and grads is None:
            generator = torch.Generator(device=outs[0].device).manual_seed(0) if outs else None
            grads = [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=generator) for t in outs]
        torch.autograd.backward(outs, None if loss is not None else grads)
        sync()
        finished = time.perf_counter()
        if repeat > 0:
            forward_ms.append((forwarded - started) * 1000.0)
            backward_ms.append((finished - forwarded) * 1000.0)
    for p in module.parameters():
        p.grad = None
    return {"forward_ms": statistics.median(forward_ms), "backward_ms": statistics.median(backward_ms)}


def _fault(rank: int) -> Optional[str]:
    spec = os.environ.get("PIPEPLAN_RUN_FAULT", "")
    if not spec or ":" not in spec:
        return None
    who, kind = spec.split(":", 1)
    return kind if who.strip() in (str(rank), "all") else None


def run_rank(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Run this process's pipeline rank of each plan in turn; return its measurements.

    Parameters
    ----------
    config : dict
        Written by :func:`pipeplan.run.launch.worker_config`: ``plans`` (plans as dicts, all
        with the same number of ranks, run one after the other in one process group), ``model``,
        ``model_options``, ``unit_patterns``, ``seq_len``, ``dtype``, ``steps``, ``threads``,
        ``seed``, ``lr``, ``device``, ``timeout_s``, ``out_dir``, ``dump_grads``.

    Returns
    -------
    list of dict
        Per plan, this rank's numbers: per-step wall times, compute times, losses (last stage),
        memory.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from pipeplan.formats.plan import Plan

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
    dist.init_process_group(**init_kwargs)

    plans = [Plan.model_validate(p) for p in config["plans"]]
    largest = max(s.send_bytes for plan in plans for s in plan.stages)
    link = measure_link(rank, world_size, device, largest) if config.get("measure_link", True) else None
    results = []
    for index, plan in enumerate(plans):
        result = _run_one(index, plan, config, rank, world_size, device, backend)
        result["link"] = link
        results.append(result)
    return results


def measure_link(rank: int, world_size: int, device: Any, large_bytes: int, repeats: int = 30) -> Optional[dict]:
    """Point-to-point latency and bandwidth between ranks 0 and 1, by ping-pong.

    One-way time is taken as ``latency + bytes / bandwidth``: half the fastest round trip of a
    4-byte tensor gives the latency, that of a ``large_bytes`` tensor (at least 4 MiB) the
    bandwidth. The fastest, not the median: on a shared machine a round trip also waits for
    both processes to be scheduled, which is not the link's cost. Every rank joins the barriers; only ranks 0 and 1 exchange.

    Returns
    -------
    dict or None
        ``latency_ms``, ``bandwidth_bytes_per_s``, ``large_bytes``, ``large_one_way_ms`` (on every
        rank, broadcast from rank 0), or None with one rank.
    """
    import torch
    import torch.distributed as dist

    if world_size < 2:
        return None
    # At least 4 MiB: smaller messages take about the latency alone, leaving the bandwidth noise.
    large_bytes = max(int(large_bytes), 4 * 2**20)
    one_way, typical = [], []
    for size in (4, large_bytes):
        tensor = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        times = []
        dist.barrier()
        for i in range(repeats + 2):
            started = time.perf_counter()
            if rank == 0:
                dist.send(tensor, 1)
                dist.recv(tensor, 1)
            elif rank == 1:
                dist.recv(tensor, 0)
                dist.send(tensor, 0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:  # the first exchanges set up the connection
                times.append((time.perf_counter() - started) * 1000.0 / 2)
        one_way.append(min(times) if rank == 0 else 0.0)
        typical.append(sorted(times)[len(times) // 2] if rank == 0 else 0.0)
    values = torch.tensor(one_way + typical, dtype=torch.float64, device=device)
    dist.broadcast(values, 0)
    latency_ms, large_ms, median_latency_ms, median_large_ms = (float(v) for v in values.cpu())
    per_byte_ms = max(large_ms - latency_ms, 1e-9) / large_bytes
    return {"latency_ms": round(latency_ms, 4), "bandwidth_bytes_per_s": round(1000.0 / per_byte_ms, 1),
            "large_bytes": large_bytes, "large_one_way_ms": round(large_ms, 4),
            # The median includes waiting for the peer to be scheduled: on a shared machine,
            # that (not the link) is what a transfer on the critical path costs.
            "median_latency_ms": round(median_latency_ms, 4), "median_large_one_way_ms": round(median_large_ms, 4),
            "method": "ping-pong between ranks 0 and 1 before the plans: fastest of 30 round trips / 2"}


def _run_one(plan_index: int, plan: Any, config: dict[str, Any], rank: int, world_size: int, device: Any,
             backend: str) -> dict[str, Any]:
    """Build this rank's stages of ``plan``, run its steps, return the measurements."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    from pipeplan.plan.schedules import SPLIT_BACKWARD_SCHEDULES, TORCH_SCHEDULE_CLASS
    from pipeplan.profile import load_bundle, make_microbatch
    from pipeplan.profile.loading import split_inputs
    from pipeplan.run.stages import TiedGrads, build_rank_stages, stage_builder

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    num_ranks = 1 + max(stage.rank for stage in plan.stages)
    if world_size != num_ranks:
        raise RuntimeError(
            f"the plan has {num_ranks} ranks but torchrun started {world_size} processes; "
            f"start one process per pipeline rank"
        )
    stages_here = sorted((s for s in plan.stages if s.rank == rank), key=lambda s: s.index)
    num_stages = len(plan.stages)
    fault = _fault(rank)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak_reset = _reset_peak_rss()
    baseline_rss_bytes = _read_status_bytes("VmRSS")

    model = config["model"]
    options = dict(config.get("model_options") or {})
    seed = int(config.get("seed", 0))
    dtype = config.get("dtype") or "fp32"
    m = plan.num_microbatches
    batch_size = plan.microbatch_size * m
    seq_len = config.get("seq_len")
    # Batches: only the ranks holding the first stage (inputs) or the last (targets) need them,
    # but every rank loads the factory (built-ins: without weights; the traced builder traces
    # the whole model on one micro-batch on every rank).
    bundle = load_bundle(model, seed=seed, device=device, dtype=dtype,
                         **({"materialise": []} if ":" not in model else {}), **options)

    def batch_of(step: int) -> tuple[Any, Any]:
        if bundle.config.get("family") is None:
            torch.manual_seed(seed + 1 + step)
        return make_microbatch(bundle, batch_size, seq_len, seed=seed + 1 + step, device=device, dtype=dtype)

    example = None
    whole = bundle if ":" in model else None  # user and hf: models: the whole model, built
    builder = stage_builder(model, [s.layers for s in plan.stages], seed=seed, device=device, dtype=dtype,
                            unit_patterns=config.get("unit_patterns"), bundle=whole, **options)
    first_inputs, first_target_batch = batch_of(0)
    reference = None
    if config.get("verify"):
        from pipeplan.run.verify import reference_step

        # Before the stages are built from the same model: the reference leaves the weights as
        # they were and clears its gradients.
        ref_bundle = whole or load_bundle(model, seed=seed, device=device, dtype=dtype, **options)
        reference = reference_step(ref_bundle, first_inputs, first_target_batch, m)
        del ref_bundle
    if builder == "traced":
        from pipeplan.run.verify import microbatches

        example = microbatches(first_inputs, first_target_batch, m)[0][0]
    built = build_rank_stages(model, [s.layers for s in plan.stages], [s.index for s in stages_here],
                              example_inputs=example, seed=seed, device=device, dtype=dtype,
                              unit_patterns=config.get("unit_patterns"), builder=builder,
                              bundle=whole if builder == "traced" else None,
                              split_backward_schedule=plan.schedule if plan.schedule in SPLIT_BACKWARD_SCHEDULES
                              else None, **options)
    modules = built.modules
    tied = TiedGrads(built.tied, {s.index: s.rank for s in plan.stages}, modules, built.param_names, rank)
    pipeline_stages = []
    for i, (module, stage) in enumerate(zip(modules, stages_here)):
        static = built.static_args[i] if built.static_args else None
        extra = {} if static is None else {"input_args": static[0], "output_args": static[1]}
        pipeline_stages.append(PipelineStage(module, stage.index, num_stages, device, **extra))
    captured = [_capture_inputs(module) for module in modules]
    timer = _Timer(device)
    _time_transfers(torch_schedules, timer)
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
    optimizer_name = plan.settings.optimizer
    lr = float(config.get("lr", 1e-3))
    if optimizer_name == "adam":
        optimizer = torch.optim.Adam(params, lr=lr)
    elif optimizer_name == "sgd":
        optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
    else:
        optimizer = None

    has_first = any(s.index == 0 for s in stages_here)
    has_last = any(s.index == num_stages - 1 for s in stages_here)

    step_ms, pipeline_ms, compute, losses = [], [], [], []
    verified: Optional[list[dict[str, Any]]] = None
    alone: list[dict[str, Any]] = []
    alone_repeats = int(config.get("alone_repeats", 2))

    def time_stages_alone(step: int) -> None:
        for box, module, stage in zip(captured, modules, stages_here):
            last = stage.index == num_stages - 1
            if last and "target" not in first_target:
                continue
            times = _time_alone(module, box, input_grads=stage.index > 0,
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
        if fault not in (None, "untie") and step == 0:
            if fault == "raise":
                raise RuntimeError(f"fault injected on rank {rank} (PIPEPLAN_RUN_FAULT)")
            if fault == "exit":
                os._exit(3)
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
        if step == 0 and reference is not None:
            from pipeplan.run.verify import compare_rank

            verified = compare_rank(modules, stages_here, built.param_names, reference, step_losses, num_stages)
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
        times = timer.take()
        times["loss"] = loss_ms[0]
        loss_ms[0] = 0.0
        compute.append(times)
        if has_last:
            losses.append(float(torch.stack([x.detach().float() for x in step_losses]).mean()))

    if device.type == "cuda":
        peak_bytes = int(torch.cuda.max_memory_allocated(device))
        memory_method = "torch.cuda.max_memory_allocated"
    else:
        hwm = _read_status_bytes("VmHWM")
        peak_bytes = (hwm - baseline_rss_bytes) if (hwm and baseline_rss_bytes and peak_reset) else None
        memory_method = "peak RSS (VmHWM) minus RSS before the stages were built"
    return {
        "rank": rank,
        "host": os.uname().nodename,
        "local_rank": local_rank,
        "stages": [s.index for s in stages_here],
        "device": str(device),
        "backend": backend,
        "threads": torch.get_num_threads(),
        "step_ms": step_ms,
        "pipeline_ms": pipeline_ms,
        "compute_ms": compute,
        "losses": losses,
        "peak_memory_bytes": peak_bytes,
        "memory_method": memory_method,
        "baseline_rss_bytes": baseline_rss_bytes,
        "param_count": sum(p.numel() for p in params),
        "alone": alone,
        "stage_builder": built.builder,
        "tied_weights": built.tied,
        "verify": verified,
    }


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of one rank; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
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
        dist.barrier()
        dist.destroy_process_group()
        return 0
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
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
