"""Tracing a model into pipeline stages with torch's tracer (the ``traced`` stage builder).

:func:`traced_split` splits a model at given units with
:func:`torch.distributed.pipelining.pipeline` (``torch.export`` underneath); :class:`Routing`
says which values of the split graph enter and leave each stage, and
:func:`traced_stage_class` wraps a split stage so that it takes and returns them.
:func:`check_builders` runs the split at profile time, so the profile records which builder
``run`` can use (:mod:`pipeplan.run.stages` builds the stages from here). It lives in the
profile layer because ``pipeplan profile`` needs it and ``run`` sits above profiling.
Needs torch (imported inside the functions: the profile package loads without it).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pipeplan.errors import BadInputError
from pipeplan.profile.hf import is_hf_model

__all__ = ["Routing", "traced_stage_class", "traced_split", "check_builders", "active_dropout"]


class Routing:
    """Which values of the split graph enter and leave each stage."""

    def __init__(self, split_gm: Any) -> None:
        import torch.fx

        nodes = list(split_gm.graph.nodes)
        self.placeholders = [n.target for n in nodes if n.op == "placeholder"]
        calls = [n for n in nodes if n.op == "call_module"]
        self.submods = [n.target for n in calls]
        stage_of: dict[str, int] = {n: -1 for n in self.placeholders}
        self.call_args: list[list[str]] = []
        self.results: list[list[tuple[str, Optional[int]]]] = []
        for i, call in enumerate(calls):
            if call.kwargs:
                raise BadInputError(f"the traced stage {call.target} takes keyword arguments; cannot route them")
            self.call_args.append([self._key(a) for a in call.args])
            getitems = [u for u in call.users if u.op == "call_function" and u.args and u.args[0] is call]
            if getitems and len(getitems) == len(call.users):
                self.results.append([(u.name, int(u.args[1])) for u in getitems])
            else:
                self.results.append([(call.name, None)])
            for key, _ in self.results[-1]:
                stage_of[key] = i
        output = next(n for n in nodes if n.op == "output")
        flat = torch.fx.node.map_arg(output.args[0], lambda n: n)
        self.outputs = [self._key(n) for n in _flatten(flat) if isinstance(n, torch.fx.Node)]
        last = len(calls) - 1
        users: dict[str, list[int]] = {}
        for i, args in enumerate(self.call_args):
            for key in args:
                users.setdefault(key, []).append(i)
        for key in self.outputs:
            users.setdefault(key, []).append(last + 1)
        self.inputs: list[list[str]] = []
        self.live_out: list[list[str]] = []
        order = {key: n for n, key in enumerate(stage_of)}
        for i in range(len(calls)):
            ins = [k for k, s in stage_of.items() if s < i and max(users.get(k, [-1])) >= i]
            outs = [k for k, s in stage_of.items() if s <= i and max(users.get(k, [-1])) > i]
            if i == last:
                outs = list(self.outputs)
            self.inputs.append(sorted(ins, key=order.get))
            self.live_out.append(outs if i == last else sorted(outs, key=order.get))

    @staticmethod
    def _key(node: Any) -> str:
        return node.name if hasattr(node, "name") else str(node)


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flatten(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flatten(v)]
    return [value]


def _as_leaf_if_constant(value: Any) -> Any:
    """A floating output that needs no gradient (a rotary table, a mask) as a leaf that does.

    ``PipelineStage`` marks every floating tensor it receives as requiring a gradient and sends
    that gradient back; the sender must then hold an output that takes one.
    """
    import torch

    if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad \
            and torch.is_grad_enabled():
        return value.detach().requires_grad_(True)
    return value


def traced_stage_class() -> type:
    import torch

    class _TracedStage(torch.nn.Module):
        """One submodule of the traced model, with the values that cross its boundaries routed.

        ``forward(*values)`` takes the stage's live-in values (the first stage: the model's
        inputs, positional or by keyword) and returns its live-out values (the last stage: the
        model's flattened outputs, a tuple).
        """

        def __init__(self, submod: Any, routing: Routing, index: int) -> None:
            super().__init__()
            self.submod = submod
            self.index = index
            self.first = index == 0
            self.last = index == len(routing.submods) - 1
            self.placeholders = list(routing.placeholders)
            self.input_keys = list(routing.inputs[index])
            self.call_args = list(routing.call_args[index])
            self.results = list(routing.results[index])
            self.output_keys = list(routing.live_out[index])

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if self.first:
                env = dict(zip(self.placeholders, args))
                env.update(kwargs)
                missing = [k for k in self.input_keys if k not in env]
                if missing:
                    raise RuntimeError(f"the first stage needs the model inputs {missing}; the batch lacks them")
            else:
                if len(args) != len(self.input_keys):
                    raise RuntimeError(f"stage {self.index} expects {len(self.input_keys)} inputs, got {len(args)}")
                env = dict(zip(self.input_keys, args))
            out = self.submod(*(env[k] for k in self.call_args))
            for key, item in self.results:
                env[key] = out if item is None else out[item]
            # A copy of each computed output: torch's split backward detaches a stage's outputs in
            # place, which a view refuses, and (torch 2.13) fails ("backward through the graph a
            # second time") when an output also feeds another output inside the stage, as T5's
            # encoder states feed every decoder block; gloo sends only contiguous tensors (T5's
            # position bias is a permuted view). The profiler's split timing copies them too.
            values = tuple(v.clone(memory_format=torch.contiguous_format)
                           if isinstance(v, torch.Tensor)
                           and (v.grad_fn is not None or v._is_view() or not v.is_contiguous()) else v
                           for v in (env[k] for k in self.output_keys))
            if not self.last:
                values = tuple(_as_leaf_if_constant(v) for v in values)
            else:
                # The schedule concatenates the last stage's outputs over micro-batches; a scalar
                # (the model's own loss) cannot be concatenated, a 1-element vector can.
                values = tuple(v.unsqueeze(0).clone() if isinstance(v, torch.Tensor) and v.dim() == 0 else v
                               for v in values)
            return values if self.last or len(values) != 1 else values[0]

    return _TracedStage


def traced_split(model: Any, example_inputs: Any, stage_first_units: Sequence[str]) -> tuple[Any, Routing]:
    """Trace ``model`` on one micro-batch and split it before each of ``stage_first_units``.

    Returns
    -------
    (pipe, routing)
        torch's ``Pipe`` and the values crossing each boundary.

    Raises
    ------
    BadInputError
        When torch cannot trace the model, or the split makes a different number of stages
        (a split point that is not called at the top of the forward).
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    from pipeplan.profile.loading import split_inputs

    args, kwargs = split_inputs(example_inputs)
    spec = {name: SplitPoint.BEGINNING for name in stage_first_units}
    try:
        pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None, split_spec=spec)
    except Exception as exc:  # noqa: BLE001 - torch.export's failures on a user's model
        raise BadInputError(
            f"torch's tracer (torch.distributed.pipelining.pipeline) cannot split the model at "
            f"{', '.join(stage_first_units)}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    if pipe.num_stages != len(stage_first_units) + 1:
        raise BadInputError(
            f"torch's tracer split the model into {pipe.num_stages} stages, the plan has "
            f"{len(stage_first_units) + 1}: a stage's first unit ({', '.join(stage_first_units)}) "
            f"is not a module the forward calls once at the top of its code"
        )
    return pipe, Routing(pipe.split_gm)


def check_builders(model_name: str, net: Any, order: Sequence[str], graph: Any, example_inputs: Any) -> dict[str, Any]:
    """Which stage builders can run this model at any split between its units (profile time).

    ``units`` needs a torch.fx graph with every unit's arguments known; ``traced`` needs
    torch's tracer to split the model before every unit but the first (every boundary a plan
    may choose). Recorded in the profile's ``measurement.stage_builders``; ``plan`` refuses a
    profile where neither works (:func:`pipeplan.plan.runnable.runnable_problem`).
    """
    from pipeplan.profile.measure import exception_line

    units_ok = (":" not in model_name) or (graph.method == "torch.fx"
                                             and all(graph.args.get(u) is not None for u in order))
    record: dict[str, Any] = {"units": bool(units_ok and not is_hf_model(model_name))}
    if record["units"]:
        record["run_uses"] = "units"
        return record
    try:
        traced_split(net, example_inputs, list(order[1:]))
        record["traced"] = True
        record["run_uses"] = "traced"
    except BadInputError as exc:
        record["traced"] = False
        record["traced_error"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - anything torch raises while tracing
        record["traced"] = False
        record["traced_error"] = exception_line(exc)
    for p in net.parameters():
        p.grad = None
    return record


def active_dropout(model: Any) -> list[str]:
    """Names of the model's dropout modules that draw masks (``p > 0``, in training mode): a
    pipelined step and one process draw different masks, so ``run --verify`` refuses them
    (:mod:`pipeplan.run.verify`); the profile records them."""
    import torch

    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0 and module.training]
