"""One forward of the whole model with hooks on its units: their inputs, order and wiring.

Each unit is later measured alone on the inputs captured here (:mod:`pipeplan.profile.measure`).
The wiring comes from the autograd graph, so it also sees through operations between units; it
is the fallback when torch.fx cannot trace the model (:func:`pipeplan.profile.units.trace_units`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from pipeplan.profile.memory import tensor_bytes
from pipeplan.profile.units import RepeatedUnit, Source, UnitGraph, repeated_call

__all__ = ["Capture", "capture"]


@dataclass
class Capture:
    """What one forward of the whole model showed about its units."""

    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]]
    """Per unit, its detached positional and keyword inputs."""
    order: list[str]
    """Units in the order they ran."""
    graph: UnitGraph
    """The unit graph seen at run time (edges from the autograd graph)."""
    output_bytes: dict[str, int]
    """Bytes of each unit's output."""


def _detach(value: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value)


def capture(model: nn.Module, units: list[str], inputs: Any) -> Capture:
    """Run the model once and record each unit's inputs, call order and wiring.

    The wiring comes from the autograd graph: walking back from a unit's inputs to the
    nearest outputs of other units gives its producers, so it also sees through operations
    between units. It is the fallback when torch.fx cannot trace the model.

    A unit without parameters that runs more than once (T5's ``dropout``) is left out of the
    units (``graph.repeated``) and the forward run again without it: its calls are code between
    units.

    Raises
    ------
    BadInputError
        If a unit with parameters runs more than once per forward.
    """
    repeated: list[str] = []
    while True:
        try:
            seen = _capture_once(model, [u for u in units if u not in repeated], inputs)
        except RepeatedUnit as again:
            repeated.append(again.name)
            continue
        seen.graph.repeated = list(repeated)
        seen.graph.unused = [u for u in seen.graph.unused if u not in repeated]
        return seen


def _capture_once(model: nn.Module, units: list[str], inputs: Any) -> Capture:
    calls: dict[str, tuple[Any, Any]] = {}
    order: list[str] = []
    out_bytes: dict[str, int] = {}
    owner_of_fn: dict[Any, str] = {}
    owner_of_tensor: dict[int, str] = {}
    args_src: dict[str, Optional[list[Source]]] = {}
    edges: list[tuple[str, str]] = []
    # Keyword inputs (a dict batch) are sources named by their keyword.
    input_ids = {id(t): i for i, t in (inputs.items() if isinstance(inputs, dict) else enumerate(inputs))}
    keep_alive: list[Any] = []

    def producers(value: Any) -> set[str]:
        found, stack, seen = set(), [], set()
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                if id(t) in owner_of_tensor:
                    found.add(owner_of_tensor[id(t)])
                elif t.grad_fn is not None:
                    stack.append(t.grad_fn)
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if fn in owner_of_fn:
                found.add(owner_of_fn[fn])
                continue
            stack.extend(next_fn for next_fn, _ in fn.next_functions)
        return found

    def pre_hook(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name in calls:
                raise repeated_call(model, name)
            calls[name] = (args, kwargs)
            order.append(name)
            sources: list[Source] = []
            for a in args:
                if isinstance(a, torch.Tensor) and id(a) in owner_of_tensor:
                    sources.append(("unit", owner_of_tensor[id(a)]))
                elif isinstance(a, torch.Tensor) and id(a) in input_ids:
                    sources.append(("input", input_ids[id(a)]))
                else:
                    sources = None  # type: ignore[assignment]
                    break
            args_src[name] = sources if sources is not None and not kwargs else None
            for src in sorted(producers((args, kwargs)), key=order.index):
                edges.append((src, name))
        return hook

    def post_hook(name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            out_bytes[name] = tensor_bytes(output)
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor):
                    owner_of_tensor[id(t)] = name
                    keep_alive.append(t)
                    if t.grad_fn is not None:
                        owner_of_fn[t.grad_fn] = name
        return hook

    handles = []
    try:
        for name in units:
            module = model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(pre_hook(name), with_kwargs=True))
            handles.append(module.register_forward_hook(post_hook(name)))
        output = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    finally:
        for h in handles:
            h.remove()
    out_source: Optional[Source] = None
    if isinstance(output, torch.Tensor) and id(output) in owner_of_tensor:
        out_source = ("unit", owner_of_tensor[id(output)])
    graph = UnitGraph(units=list(order), args=args_src, edges=edges, output=out_source, method="autograd",
                      unused=[u for u in units if u not in calls])
    detached = {name: _detach(call) for name, call in calls.items()}
    return Capture(calls=detached, order=list(order), graph=graph, output_bytes=out_bytes)
