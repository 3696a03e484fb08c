"""The ``units`` stage builder's stages as ``PipelineStage`` runs them (see :mod:`pipeplan.run.stages`).

A :class:`~pipeplan.profile.units.UnitChain` holds a stage's units wired by the unit graph. What
crosses a stage boundary must suit ``PipelineStage`` and gloo, which a user model's units need
not:

- gloo sends only contiguous tensors: a non-contiguous view (a U-Net's cropped skip) failed on
  the receiving rank (``input tensor has to be contiguous``); outputs are made contiguous;
- ``PipelineStage`` sends a flat tuple of tensors: a unit that returns a tuple (U-Net blocks
  that pass ``(features, *skips)`` on) reached the next stage as several inputs where its units
  take one value; outputs are flattened and the next stage regroups them;
- a dict batch reaches the first stage as keywords (``UnitChain`` takes positional inputs);
- torch's shape inference runs a stage on tensors made from metadata, whose integers are
  garbage (a later stage embedding ``decoder_input_ids`` indexed out of range): for user models
  each stage gets static example inputs and outputs, from one forward of the whole model (which
  every rank builds for a user model anyway);
- a stage whose first unit changes its input in place (``nn.ReLU(inplace=True)``) gets a copy
  of the received leaf, which autograd refuses to change.

The built-ins' units take and return one tensor each; for them only the contiguity applies.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Iterator, Sequence

__all__ = ["as_units_stages"]


def as_units_stages(modules: Sequence[Any], stage_indices: Sequence[int], num_stages: int, model: Any,
                    example_inputs: Any) -> list[tuple[Any, Any]]:
    """Turn this rank's built ``UnitChain`` stages into units stages, in place.

    Parameters
    ----------
    modules : list of UnitChain
        This rank's stages, in the order of ``stage_indices``.
    stage_indices, num_stages
        Which stages they are, of how many.
    model : torch.nn.Module or None
        The whole user model (built on every rank), or None (a built-in).
    example_inputs : tuple or dict or None
        One micro-batch.

    Returns
    -------
    list of (input_args, output_args)
        Per module, static example arguments for ``PipelineStage``; empty without a user model
        and an example (shapes are then inferred, as for the built-ins).
    """
    import torch
    from torch.utils._pytree import tree_flatten

    user = model is not None and example_inputs is not None
    values = _unit_boundary_values(model, modules, example_inputs) if user else {}
    specs = {src: tree_flatten(v)[1] for src, v in values.items() if not isinstance(v, torch.Tensor)}
    cls = _units_stage_class()
    names = _forward_parameter_names(model) if model is not None else []
    for module, index in zip(modules, stage_indices):
        _as_units_stage(module, cls, specs, first=index == 0, last=index == num_stages - 1, input_names=names)
    return [_units_static_args(m, values, example_inputs) for m in modules] if user else []


@contextmanager
def _eval_mode(module: Any) -> Iterator[None]:
    """Shapes without side effects: batch norm's running statistics stay as built."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@lru_cache(maxsize=1)
def _units_stage_class() -> type:
    """:class:`~pipeplan.profile.units.UnitChain` with flat, contiguous stage boundaries."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from pipeplan.profile.units import UnitChain

    class _UnitsStage(UnitChain):
        """A stage of the ``units`` builder as ``PipelineStage`` runs it (see the module doc).

        Every output but the last stage's is flattened (a unit's tuple becomes its tensors) and
        made contiguous; the next stage regroups what it receives into the values its units take
        (``boundary_specs``). The first stage takes the model's inputs as the schedule passes
        them (positional, or by keyword for a dict batch) and keeps those it uses.
        """

        boundary_specs: dict[Any, Any]
        copy_inputs: bool = False
        first: bool
        last: bool
        input_names: list[str]

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if self.first:
                if kwargs or len(args) != len(self.inputs):
                    by_index = dict(enumerate(args))
                    by_index.update({self.input_names.index(k): v for k, v in kwargs.items()
                                     if k in self.input_names})
                    args = tuple(by_index[src[1]] for src in self.inputs)
            else:
                if self.copy_inputs:
                    # A first unit that changes its input in place (nn.ReLU(inplace=True)) would
                    # change the received leaf, which autograd refuses: it gets a copy.
                    args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)
                if self.boundary_specs:
                    args = self._regroup(args)
            out = UnitChain.forward(self, *args)
            if self.last:
                return out
            values = out if len(self.outputs) > 1 else (out,)
            flat_out = [leaf for value in values for leaf in tree_flatten(value)[0]]
            flat_out = [v.contiguous() if isinstance(v, torch.Tensor) and not v.is_contiguous() else v
                        for v in flat_out]
            return flat_out[0] if len(flat_out) == 1 else tuple(flat_out)

        def _regroup(self, args: tuple) -> tuple:
            """The received flat tensors as the values the stage's units take."""
            flat, grouped = list(args), []
            for src in self.inputs:
                spec = self.boundary_specs.get(tuple(src))
                if spec is None:
                    grouped.append(flat.pop(0))
                else:
                    grouped.append(tree_unflatten([flat.pop(0) for _ in range(spec.num_leaves)], spec))
            return tuple(grouped)

    return _UnitsStage


def _as_units_stage(module: Any, cls: type, specs: dict[Any, Any], *, first: bool, last: bool,
                    input_names: list[str]) -> None:
    """Turn a built :class:`UnitChain` into ``cls`` in place (its parameters keep their names)."""
    module.__class__ = cls
    module.boundary_specs = {src: specs[src] for src in module.inputs if src in specs}
    module.first, module.last, module.input_names = first, last, list(input_names)


def _forward_parameter_names(model: Any) -> list[str]:
    """The model's forward parameters in order: torch.fx numbers the model inputs so."""
    import inspect

    return list(inspect.signature(model.forward).parameters)


def _unit_boundary_values(model: Any, modules: Sequence[Any], example_inputs: Any) -> dict[Any, Any]:
    """The value of every source a stage of ``modules`` takes, on the example micro-batch.

    One forward of the whole model (a user model: every rank has it), no gradients, with a
    hook on each unit whose output a stage takes from an earlier one; model inputs by position
    (the forward's parameter order, as torch.fx numbers them).
    """
    import torch

    from pipeplan.profile.loading import call_model, split_inputs

    args, kwargs = split_inputs(example_inputs)
    names = _forward_parameter_names(model)
    values: dict[Any, Any] = {("input", i): v for i, v in enumerate(args)}
    values.update({("input", names.index(k)): v for k, v in kwargs.items() if k in names})
    wanted = {src[1] for m in modules for src in m.inputs if src[0] == "unit"}
    hooks = []
    for name in wanted:
        def record(_module: Any, _args: Any, output: Any, name: str = name) -> None:
            values[("unit", name)] = output
        hooks.append(model.get_submodule(name).register_forward_hook(record))
    try:
        with torch.no_grad(), _eval_mode(model):
            call_model(model, example_inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return values


def _units_static_args(module: Any, values: dict[Any, Any], example_inputs: Any) -> tuple[Any, Any]:
    """``(input_args, output_args)`` of one ``units`` stage for ``PipelineStage``, from the example."""
    import torch
    from torch.utils._pytree import tree_flatten

    from pipeplan.profile.loading import split_inputs
    from pipeplan.profile.measure import _changes_leaf_in_place

    def example(value: Any) -> Any:
        value = value.detach().clone(memory_format=torch.contiguous_format)
        return value.requires_grad_(True) if value.is_floating_point() else value

    with _eval_mode(module):
        if module.first:
            args, kwargs = split_inputs(example_inputs)
            inputs = tuple(example(v) for v in args)
            out = module(*inputs, **kwargs)
        else:
            inputs = tuple(example(leaf) for src in module.inputs for leaf in tree_flatten(values[tuple(src)])[0])
            try:
                out = module(*inputs)
            except RuntimeError as exc:
                if not _changes_leaf_in_place(exc):
                    raise
                module.copy_inputs = True
                inputs = tuple(example(v) for v in inputs)
                out = module(*inputs)
    outputs = tuple(example(v) for v in tree_flatten(out)[0] if isinstance(v, torch.Tensor))
    for p in module.parameters():
        p.grad = None
    return inputs, outputs
