"""Timing of one unit, and of the whole model for the check.

Each unit is measured alone: its inputs are captured from one real forward of the whole
model (:func:`pipeplan.profile.capture.capture`), then it is rerun on detached copies of them,
and its backward is driven by a fixed random output gradient (or by the loss, for the last
unit); its memory is counted as it runs (:mod:`pipeplan.profile.memory`). Module backward hooks
are not used: they miss time (an embedding's weight gradient, modules without parameters).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from pipeplan.profile.memory import saved_activation_bytes, tensor_bytes

__all__ = [
    "exception_line",
    "UnitMeasurement",
    "measure_unit",
    "measure_whole_model",
    "UnitTimer",
    "WholeModelTimer",
    "timing_rounds",
    "spread",
]


def spread(samples: list[float]) -> float:
    """Coefficient of variation (population standard deviation over mean); 0 for one sample.

    Examples
    --------
    >>> spread([1.0, 1.0])
    0.0
    >>> round(spread([1.0, 3.0]), 3)
    0.5
    """
    if len(samples) < 2:
        return 0.0
    mean = statistics.fmean(samples)
    return statistics.pstdev(samples) / mean if mean > 0 else 0.0


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)), result
    begin = time.perf_counter()
    result = fn()
    return (time.perf_counter() - begin) * 1e3, result


def exception_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception, never empty.

    torch often starts a message with a newline (``stage_backward_input`` does), and the real
    cause sits in ``__cause__``: the first non-blank line of the exception, else of its causes,
    else the type alone.

    Examples
    --------
    >>> try:
    ...     try:
    ...         raise ValueError("Can't detach views in-place.")
    ...     except ValueError as inner:
    ...         raise RuntimeError("") from inner
    ... except RuntimeError as exc:
    ...     exception_line(exc)
    "RuntimeError: ValueError: Can't detach views in-place."
    """
    def first(e: BaseException) -> str:
        return next((line.strip() for line in str(e).splitlines() if line.strip()), "")

    text = first(exc)
    cause = exc.__cause__ or exc.__context__
    cause_text = ""
    while cause is not None and not cause_text:
        cause_text = f"{type(cause).__name__}: {first(cause)}" if first(cause) else ""
        cause = cause.__cause__ or cause.__context__
    if not text:
        text, cause_text = cause_text, ""
    head = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"{head} (cause: {cause_text})" if cause_text else head


@dataclass
class UnitMeasurement:
    """One unit at one micro-batch size."""

    forward_ms: float
    """Median forward time (loss included for the last unit when a loss is given)."""
    backward_ms: float
    """Median time of the whole backward (input and weight gradients)."""
    backward_input_ms: Optional[float]
    """Median time of the input-gradient pass (B) of a split backward; None if not split."""
    backward_weight_ms: Optional[float]
    """Median time of the weight-gradient pass (W) that follows it; None if not split. Timed as
    torch's zero-bubble schedules run the two passes, so B + W exceeds ``backward_ms`` by what
    splitting costs."""
    activation_bytes: int
    """Bytes saved by autograd for backward (unique storages, parameters excluded)."""
    output_bytes: int
    """Bytes of the unit's output."""
    forward_spread: float
    """Coefficient of variation of the forward samples."""
    backward_spread: float
    """Coefficient of variation of the backward samples."""
    remeasured: bool = False
    """True if a high spread made it take a second round of repeats."""
    split_fallback: Optional[str] = None
    """Why torch's split backward could not time this unit (B and W are then estimated)."""
    forward_samples: list[float] = field(default_factory=list, repr=False)
    backward_samples: list[float] = field(default_factory=list, repr=False)


def _fresh(call: tuple[tuple[Any, ...], dict[str, Any]],
           copy: bool = False) -> tuple[tuple[Any, ...], dict[str, Any], list]:
    """The call's inputs as fresh leaves that require grad (and the leaves); with ``copy``, the
    unit gets a copy of each leaf instead, which it may change in place."""
    leaves: list[torch.Tensor] = []

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach()
        if t.is_floating_point() or t.is_complex():
            t.requires_grad_(True)
            leaves.append(t)
            return t.clone() if copy else t
        return t

    args, kwargs = tree_map(leaf, call)
    return args, kwargs, leaves


def _changes_leaf_in_place(exc: BaseException) -> bool:
    """True for autograd's refusal of an in-place change to a leaf (or a view of one)."""
    return "leaf Variable that requires grad is being used in an in-place operation" in str(exc)


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _split_backward(outputs: list[torch.Tensor], grads: Optional[list[torch.Tensor]], inputs: list[torch.Tensor],
                    params: list[torch.Tensor], device: torch.device) -> tuple[float, float]:
    """Times of the input-gradient pass and the weight-gradient pass, run the way torch's
    zero-bubble schedules run them (``stage_backward_input``, later ``stage_backward_weight``).

    Splitting is not free: the input pass keeps the graph and the intermediate gradients the
    weight pass needs, and the weight pass walks the graph again; together they took 1.16-1.21x
    a whole backward of two GPT-2 blocks on the development CPU. Where torch lacks those
    (private) functions, the weight pass is an ordinary backward after ``autograd.grad`` for
    the inputs kept the graph.
    """
    try:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    except ImportError:
        t_bi, _ = _timed(lambda: torch.autograd.grad(outputs, inputs, grads, allow_unused=True,
                                                     retain_graph=True), device)
        t_bw, _ = _timed(lambda: torch.autograd.backward(outputs, grads, inputs=params), device)
        return t_bi, t_bw
    # stage_backward_input detaches the outputs in place afterwards, which a view (a Linear on a
    # 3-D input) refuses; a clone is not a view, and its backward passes the gradient through.
    outputs = [o.clone() for o in outputs]
    t_bi, (_, groups) = _timed(lambda: stage_backward_input(outputs, grads, inputs, iter(params)), device)
    t_bw, _ = _timed(lambda: stage_backward_weight(iter(params), groups), device)
    return t_bi, t_bw


class UnitTimer:
    """Repeated timing of one unit; :meth:`sample` takes one forward+backward.

    Callers interleave the samples of all units (round-robin) so that a burst of load from
    another process spreads over every unit instead of inflating a few: see
    :func:`pipeplan.profile.api.profile_model`. :func:`measure_unit` is the one-unit loop.

    Parameters
    ----------
    module : torch.nn.Module
        The unit.
    call : (args, kwargs)
        Its captured inputs; floating tensors become fresh leaves that require grad.
    device : torch.device
        CUDA events time CUDA; a wall clock times the CPU (CPU ops are synchronous).
    exclude : set
        Storage keys of parameters and buffers (see :func:`parameter_storages`).
    loss : callable, optional
        ``loss(output) -> scalar``: measured as part of the unit (the last unit); otherwise
        backward is driven by a fixed random gradient of the output's shape.
    split_backward : bool
        Also time the input-gradient-only backward when :meth:`sample` asks for it.
    """

    def __init__(self, module: nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]], *,
                 device: torch.device, exclude: set, loss: Optional[Callable[[Any], torch.Tensor]] = None,
                 split_backward: bool = True) -> None:
        self.module, self.call, self.device, self.loss = module, call, device, loss
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.split_backward = split_backward
        self.copy_inputs = False
        args, kwargs, leaves = _fresh(call)
        try:
            with saved_activation_bytes(exclude=exclude) as saved:
                raw, out = self._forward(args, kwargs)
        except RuntimeError as exc:
            if not _changes_leaf_in_place(exc):
                raise
            # A unit that changes its input in place (torchvision's nn.ReLU(inplace=True) as a
            # unit of its own) refuses a leaf; in a model its input is an earlier op's output.
            # So it gets a copy of the leaf, as a pipeline stage gives it (pipeplan/run/stages.py).
            self.copy_inputs = True
            args, kwargs, leaves = _fresh(call, copy=True)
            with saved_activation_bytes(exclude=exclude) as saved:
                raw, out = self._forward(args, kwargs)
        self.output_bytes = tensor_bytes(raw)
        outs = _grad_outputs(out)
        self.grads = None if loss is not None else [torch.randn_like(t) for t in outs]
        if outs:
            torch.autograd.backward(outs, self.grads)
        del raw, out, outs
        self.activation_bytes = saved.bytes
        self.has_inputs = bool(leaves)
        self.split = split_backward and bool(leaves) and bool(self.params)
        self.forward_samples: list[float] = []
        self.backward_samples: list[float] = []
        self.input_backward_samples: list[float] = []
        self.weight_backward_samples: list[float] = []
        self.remeasured = False
        self.split_fallback: Optional[str] = None

    def _forward(self, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        raw = self.module(*args, **kwargs)
        return raw, (self.loss(raw) if self.loss is not None else raw)

    def sample(self, record: bool = True, input_pass: bool = False) -> None:
        """One timed forward and backward; with ``input_pass`` also an input-gradient-only pass."""
        a, kw, _ = _fresh(self.call, self.copy_inputs)
        t_f, (_, o) = _timed(lambda: self._forward(a, kw), self.device)
        o_list = _grad_outputs(o)
        t_b = 0.0
        if o_list:
            t_b, _ = _timed(lambda: torch.autograd.backward(o_list, self.grads), self.device)
        del o, o_list
        if record:
            self.forward_samples.append(t_f)
            self.backward_samples.append(t_b)
        if input_pass and self.split:
            a, kw, ins = _fresh(self.call, self.copy_inputs)
            t_f2, (_, o) = _timed(lambda: self._forward(a, kw), self.device)
            o_list = _grad_outputs(o)
            try:
                t_bi, t_bw = _split_backward(o_list, self.grads, ins, self.params, self.device)
            except (RuntimeError, ValueError, TypeError) as exc:
                # torch's split backward refuses some units (a view detached in place, a graph
                # walked twice): fall back to the whole backward, with an estimated split.
                self.split = False
                self.split_fallback = exception_line(exc)
                for p in self.params:
                    p.grad = None
                return
            finally:
                del o, o_list
            if record:
                self.forward_samples.append(t_f2)
                self.input_backward_samples.append(t_bi)
                self.weight_backward_samples.append(t_bw)

    def noisy(self, limit: float = 0.15, floor_ms: float = 1.0) -> bool:
        """True for a unit over ``floor_ms`` whose forward or backward spread exceeds ``limit``."""
        fwd, bwd = self.forward_samples, self.backward_samples
        return (statistics.median(fwd) + statistics.median(bwd) > floor_ms
                and max(spread(fwd), spread(bwd)) > limit)

    def result(self) -> UnitMeasurement:
        """Medians and spreads of the samples so far (gradients are cleared)."""
        for p in self.params:
            p.grad = None
        fwd, bwd = self.forward_samples, self.backward_samples
        backward_ms = statistics.median(bwd)
        backward_input_ms: Optional[float]
        backward_weight_ms: Optional[float]
        if self.split and self.input_backward_samples:
            backward_input_ms = statistics.median(self.input_backward_samples)
            backward_weight_ms = statistics.median(self.weight_backward_samples)
        elif self.split_fallback is not None:
            # Input and weight gradients of a matmul cost the same; splitting's own cost unknown.
            backward_input_ms = backward_weight_ms = backward_ms / 2
        elif not self.split_backward or self.split:
            backward_input_ms = backward_weight_ms = None
        elif not self.has_inputs:
            # Integer inputs (token ids): all of backward is weight gradients.
            backward_input_ms, backward_weight_ms = 0.0, backward_ms
        else:
            # No weights: all of backward is the input gradient.
            backward_input_ms, backward_weight_ms = backward_ms, 0.0
        return UnitMeasurement(
            forward_ms=statistics.median(fwd),
            backward_ms=backward_ms,
            backward_input_ms=backward_input_ms,
            backward_weight_ms=backward_weight_ms,
            activation_bytes=self.activation_bytes,
            output_bytes=self.output_bytes,
            forward_spread=spread(fwd),
            backward_spread=spread(bwd),
            remeasured=self.remeasured,
            split_fallback=self.split_fallback,
            forward_samples=list(fwd),
            backward_samples=list(bwd),
        )


def timing_rounds(warmup: int, repeats: int) -> list[tuple[bool, bool]]:
    """``(record, input_pass)`` per round: warm-ups unrecorded (the last one also warms the
    input-gradient pass), then the repeats, with the input-gradient pass on every other one.

    The input-gradient pass costs a second forward; half the repeats are enough for its
    median and keep a 12-block GPT-2 profile to a few minutes.

    Examples
    --------
    >>> timing_rounds(1, 3)
    [(False, True), (True, True), (True, False), (True, True)]
    """
    rounds = [(False, i == warmup - 1) for i in range(warmup)]
    return rounds + [(True, i % 2 == 0) for i in range(repeats)]


def measure_unit(
    module: nn.Module,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    device: torch.device,
    repeats: int,
    warmup: int,
    exclude: set,
    loss: Optional[Callable[[Any], torch.Tensor]] = None,
    split_backward: bool = True,
    remeasure_spread: float = 0.15,
) -> UnitMeasurement:
    """Time one unit's forward and backward and count its memory (see :class:`UnitTimer`).

    A unit over 1 ms whose forward or backward spread exceeds ``remeasure_spread`` gets one
    more round of ``repeats``.

    Notes
    -----
    Costs about ``(warmup + repeats) * (1 forward + 1 backward) + repeats / 2 * (1 forward +
    1/2 backward)`` of the unit.
    """
    timer = UnitTimer(module, call, device=device, exclude=exclude, loss=loss, split_backward=split_backward)
    for record, input_pass in timing_rounds(warmup, repeats):
        timer.sample(record, input_pass)
    if timer.noisy(remeasure_spread):
        for _, input_pass in timing_rounds(0, repeats):
            timer.sample(True, input_pass)
        timer.remeasured = True
    return timer.result()


class WholeModelTimer:
    """Repeated full forward (+ loss) and backward of the model on one micro-batch."""

    def __init__(self, model: nn.Module, inputs: Any, *, device: torch.device,
                 loss: Optional[Callable[[Any], torch.Tensor]] = None) -> None:
        self.model, self.device, self.loss = model, device, loss
        # A dict batch is keyword inputs.
        self.inputs, self.kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})
        self.grads: Optional[list[torch.Tensor]] = None
        self.samples: dict[str, list[float]] = {"forward_ms": [], "backward_ms": [], "step_ms": []}

    def sample(self, record: bool = True) -> None:
        """One timed step."""
        model, inputs, kwargs, loss = self.model, self.inputs, self.kwargs, self.loss
        t_f, out = _timed(lambda: loss(model(*inputs, **kwargs)) if loss is not None else model(*inputs, **kwargs),
                          self.device)
        outs = _grad_outputs(out)
        if self.grads is None and loss is None:
            generator = torch.Generator(device=outs[0].device if outs else "cpu").manual_seed(0)
            self.grads = [torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype) for t in outs]
        t_b = 0.0
        if outs:
            t_b, _ = _timed(lambda: torch.autograd.backward(outs, self.grads), self.device)
        del out, outs
        if record:
            self.samples["forward_ms"].append(t_f)
            self.samples["backward_ms"].append(t_b)
            self.samples["step_ms"].append(t_f + t_b)

    def result(self) -> dict[str, Any]:
        """Medians: ``forward_ms``, ``backward_ms``, ``step_ms`` (median of per-step sums), and
        ``step_spread``; gradients are cleared."""
        for p in self.model.parameters():
            p.grad = None
        return {
            "forward_ms": statistics.median(self.samples["forward_ms"]),
            "backward_ms": statistics.median(self.samples["backward_ms"]),
            "step_ms": statistics.median(self.samples["step_ms"]),
            "step_spread": spread(self.samples["step_ms"]),
            "samples": {k: list(v) for k, v in self.samples.items()},
        }


def measure_whole_model(
    model: nn.Module,
    inputs: tuple[Any, ...],
    *,
    device: torch.device,
    repeats: int,
    warmup: int,
    loss: Optional[Callable[[Any], torch.Tensor]] = None,
) -> dict[str, Any]:
    """Median forward, backward and step time of the full model on one micro-batch.

    Returns
    -------
    dict
        ``forward_ms``, ``backward_ms``, ``step_ms`` (medians; step is the median of the
        per-repeat sums), ``step_spread`` and the ``samples``.
    """
    timer = WholeModelTimer(model, inputs, device=device, loss=loss)
    for i in range(warmup + repeats):
        timer.sample(record=i >= warmup)
    return timer.result()


