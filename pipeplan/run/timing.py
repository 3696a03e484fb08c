"""Measuring one rank: compute timers, transfer timers, stages timed alone, memory, the link.

Used by the worker (:mod:`pipeplan.run.worker`) inside each rank's process; every function
imports torch lazily. The numbers they make are turned into the run report by
:mod:`pipeplan.run.report`.

- :class:`ComputeTimer` sums the wall (and CPU) time of a stage's compute calls per step;
  :func:`time_transfers` adds the schedule's transfer calls to it.
- :func:`capture_inputs` keeps one real micro-batch of a stage's inputs, and :func:`time_alone`
  re-times the stage alone on it (the machine's drift since profiling).
- :func:`read_status_bytes` and :func:`reset_peak_rss`: resident memory on Linux (CPU peak).
- :func:`measure_link`: point-to-point latency and bandwidth between two ranks.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

__all__ = ["ComputeTimer", "time_transfers", "capture_inputs", "time_alone", "read_status_bytes",
           "reset_peak_rss", "measure_link"]


def read_status_bytes(field: str) -> Optional[int]:
    """``VmRSS`` / ``VmHWM`` of this process from ``/proc/self/status``, in bytes (Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``); Linux >= 4.0."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class ComputeTimer:
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


def time_transfers(module: Any, timer: ComputeTimer) -> None:
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


def _wall_timed(timer: ComputeTimer, kind: str, func: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            timer.ms[kind] += (time.perf_counter() - started) * 1000.0

    return timed


def capture_inputs(module: Any) -> dict[str, Any]:
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


def time_alone(module: Any, inputs: dict[str, Any], *, input_grads: bool, loss: Any, target: Any,
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


def measure_link(rank: int, world_size: int, device: Any, large_bytes: int, repeats: int = 30,
                 peer: int = 1) -> Optional[dict]:
    """Point-to-point latency and bandwidth between ranks 0 and ``peer``, by ping-pong.

    One-way time is taken as ``latency + bytes / bandwidth``: half the fastest round trip of a
    4-byte tensor gives the latency, that of a ``large_bytes`` tensor (at least 4 MiB) the
    bandwidth. The fastest, not the median: on a shared machine a round trip also waits for
    both processes to be scheduled, which is not the link's cost. Every rank joins the barriers; only
    ranks 0 and ``peer`` exchange (with data parallelism, ``peer`` is rank 0's pipeline neighbour).

    Returns
    -------
    dict or None
        ``latency_ms``, ``bandwidth_bytes_per_s``, ``large_bytes``, ``large_one_way_ms`` (on every
        rank, broadcast from rank 0), or None with one rank (or ``peer`` outside the world).
    """
    import torch
    import torch.distributed as dist

    if world_size < 2 or not 0 < peer < world_size:
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
                dist.send(tensor, peer)
                dist.recv(tensor, peer)
            elif rank == peer:
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
            "method": f"ping-pong between ranks 0 and {peer} before the plans: fastest of {repeats} round trips / 2"}
