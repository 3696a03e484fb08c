"""Building one rank's pipeline stages of a plan, for any model ``plan`` accepts.

Two stage builders, chosen per model (:func:`stage_builder`):

``units``
    :class:`pipeplan.profile.units.UnitChain`: the stage's units, wired by the unit graph
    (torch.fx). Used for the built-ins (whose units each take the previous unit's outputs) and
    for user models that fx traces with every stage unit's arguments known. Builds only the
    stage's units.
``traced``
    torch's tracer front end, :func:`torch.distributed.pipelining.pipeline` (``torch.export``
    underneath), split at the plan's stage boundaries (``SplitPoint.BEGINNING`` at each stage's
    first unit). Everything the forward computes outside units (position ids, rotary tables,
    masks, slices such as ViT's ``[:, 0]``, the model's own loss from ``labels``) lands in the
    stage that first needs it. Used for ``hf:`` models and for user models the ``units``
    builder cannot run. Every rank builds and traces the whole model, then keeps its stages.

Each traced stage is wrapped (``traced_stage_class``: a module class made once torch is
imported), which routes the values that cross
stage boundaries: a stage takes every value made before it and used by it or later, and
returns every value made by it or before and used later (a model input such as ``labels``
travels from the first stage to the one that uses it). The wrapped modules go into ordinary
``PipelineStage`` objects (shapes inferred at the first step), which every schedule class runs;
the traced ``_PipelineStage`` fails under the V schedules on gloo (docs/running.md).

Tied weights (GPT-2's and BERT's embedding and output matrix) are copied into every stage that
uses them; :class:`pipeplan.run.gradsync.TiedGrads` sums their gradients over those stages after each step, as
Megatron does for its embedding group, so the copies stay equal and the step equals a single
process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from pipeplan.errors import BadInputError
from pipeplan.profile.tracing import Routing, check_builders, traced_split, traced_stage_class
from pipeplan.run.gradsync import TiedGrads  # re-exported: it lived here before gradsync
from pipeplan.profile.hf import is_hf_model
from pipeplan.run.unitstages import as_units_stages

__all__ = [
    "RankStages",
    "TiedGrads",
    "build_rank_stages",
    "stage_builder",
    "traced_split",
    "check_builders",
    "split_backward_problem",
]


@dataclass
class RankStages:
    """What one rank runs: its stage modules and how the last stage's loss is made."""

    modules: list[Any]
    """One module per stage of this rank, in stage order."""
    builder: str
    """``units`` or ``traced``."""
    loss: Callable[[Any, Any], Any]
    """``loss(last_stage_output, target) -> scalar``."""
    param_names: list[dict[str, str]] = field(default_factory=list)
    """Per module: its parameter name -> the full model's (canonical) parameter name."""
    tied: dict[str, list[int]] = field(default_factory=dict)
    """Canonical name of each weight used by more than one stage -> those stages' indices."""
    static_args: list[Optional[tuple[Any, Any]]] = field(default_factory=list)
    """Per module, example ``(inputs, outputs)`` for ``PipelineStage(input_args=, output_args=)``,
    or None to let the stage infer them. The traced builder gives them: torch's inference runs a
    stage on tensors made from metadata, whose integer values (``labels``) are garbage."""


def stage_builder(model: str, stage_layers: Sequence[Sequence[str]], *, seed: int = 0, device: Any = "cpu",
                  dtype: str = "fp32", unit_patterns: Optional[Sequence[str]] = None, bundle: Any = None,
                  **options: Any) -> str:
    """``units`` or ``traced``: which builder runs this model split this way (see the module doc)."""
    if is_hf_model(model):
        return "traced"
    if ":" not in model:
        return "units"
    from pipeplan.profile.loading import load_bundle
    from pipeplan.profile.units import bundle_units, trace_units

    bundle = bundle or load_bundle(model, seed=seed, device=device, dtype=dtype, **options)
    names = bundle_units(bundle, unit_patterns)
    try:
        graph = trace_units(bundle.model, names)
    except BadInputError:
        raise
    except Exception:  # noqa: BLE001 - fx fails on many real models
        return "traced"
    layers = [u for stage in stage_layers for u in stage]
    if any(graph.args.get(u) is None for u in layers) or [u for u in graph.units if u in set(layers)] != layers:
        return "traced"
    return "units"


def build_rank_stages(model: str, stage_layers: Sequence[Sequence[str]], stage_indices: Sequence[int], *,
                      example_inputs: Any = None, seed: int = 0, device: Any = "cpu", dtype: str = "fp32",
                      unit_patterns: Optional[Sequence[str]] = None, builder: Optional[str] = None,
                      bundle: Any = None, split_backward_schedule: Optional[str] = None,
                      **options: Any) -> RankStages:
    """Build the stages ``stage_indices`` of a model split into ``stage_layers``.

    Parameters
    ----------
    model : str
        Built-in, ``module:callable`` or ``hf:...``.
    stage_layers : list of list of str
        Every stage's units, in stage order (the plan's ``stages[i].layers``).
    stage_indices : list of int
        The stages this rank holds.
    example_inputs : tuple or dict, optional
        One micro-batch (the traced builder traces on it); default: the model's own factory.
    builder : {'units', 'traced'}, optional
        Default: :func:`stage_builder`.
    bundle : ModelBundle, optional
        The whole model, already built with ``seed`` (the traced builder traces it; saves a
        second build). Not used by the ``units`` builder.
    split_backward_schedule : str, optional
        The plan's schedule when it splits backward (``zb``, ``zbv``, ``dualpipev``): the traced
        builder then checks each of this rank's stages but the first (torch runs a whole
        backward there) with :func:`split_backward_problem`.

    Raises
    ------
    BadInputError
        A stage torch's split backward cannot train, naming it, the cause and the schedules
        that run it.

    Returns
    -------
    RankStages
    """
    import torch

    from pipeplan.profile.loading import default_loss, load_bundle

    builder = builder or stage_builder(model, stage_layers, seed=seed, device=device, dtype=dtype,
                                       unit_patterns=unit_patterns, **options)
    if builder == "units":
        from pipeplan.profile.units import build_stage

        modules = [build_stage(model, stage_layers[i], seed=seed, device=device, dtype=dtype,
                               unit_patterns=unit_patterns, **options) for i in stage_indices]
        bundle = load_bundle(model, seed=seed, device=device, dtype=dtype,
                             **({"materialise": []} if ":" not in model else {}), **options)
        static = as_units_stages(modules, stage_indices, len(stage_layers),
                                 bundle.model if ":" in model else None, example_inputs)
        loss = bundle.loss_fn or default_loss
        names = [{n: n for n, _ in m.named_parameters()} for m in modules]
        return RankStages(modules=modules, builder="units", loss=loss, param_names=names, static_args=static)

    bundle = bundle or load_bundle(model, seed=seed, device=device, dtype=dtype, **options)
    net = bundle.model
    if example_inputs is None:
        raise BadInputError("the traced stage builder needs one micro-batch to trace on")
    eager = None
    if bundle.loss_in_output:
        with torch.no_grad():
            from pipeplan.profile.loading import call_model

            eager = call_model(net, example_inputs)
    from pipeplan.profile.units import tied_parameter_names

    tied = tied_parameter_names(net)
    alias = {name: canonical for canonical, group in tied.items() for name in group}
    pipe, routing = _cached_split(net, example_inputs, [layers[0] for layers in stage_layers[1:]],
                                  (model, seed, str(device), dtype, repr(sorted(options.items()))))
    _check_traced_stages(pipe, stage_layers, tied, alias)
    cls = traced_stage_class()
    modules, names, static = [], [], []
    uses: dict[str, set[int]] = {}
    examples = _example_values(pipe, routing, cls, example_inputs, len(stage_layers))
    for index in range(len(stage_layers)):
        submod = pipe.get_stage_module(index)
        used = _used_parameters(submod)
        _drop_unused_tied_copies(submod, used, alias)
        mapping = {n: alias.get(n, n) for n, _ in submod.named_parameters(remove_duplicate=False)}
        for n, canonical in mapping.items():
            if canonical in tied and n in used:
                uses.setdefault(canonical, set()).add(index)
        if index in stage_indices:
            module = cls(submod, routing, index).to(device)
            if split_backward_schedule and index > 0:
                problem = split_backward_problem(module, examples[index][0], examples[index][1])
                if problem is not None:
                    units = stage_layers[index]
                    raise BadInputError(
                        f"stage {index} ({units[0]} .. {units[-1]}) cannot run under "
                        f"{split_backward_schedule}: torch's split backward (the zero-bubble "
                        f"schedules' B and W passes) cannot train it ({problem}); plan it with "
                        f"--schedule 1f1b, interleaved or gpipe (docs/models.md)"
                    )
            modules.append(module)
            names.append({f"submod.{n}": c for n, c in mapping.items()})
            static.append(examples[index])
    if bundle.loss_in_output:
        position = _loss_position(eager)
        loss = lambda output, target, _p=position: output[_p].sum()  # noqa: E731 - a new tensor, not a view
    elif bundle.loss_fn is not None:
        user_loss = bundle.loss_fn
        loss = lambda output, target: user_loss(output[0] if len(output) == 1 else output, target)  # noqa: E731
    else:
        loss = default_loss
    return RankStages(modules=modules, builder="traced", loss=loss, param_names=names,
                      tied={c: sorted(s) for c, s in sorted(uses.items()) if len(s) > 1}, static_args=static)


#: The traced splits made so far in this process, by (model, seed, device, dtype, options,
#: split points, micro-batch shapes): a torchrun job's later plans of the same model and layout
#: (``run_plans``) reuse the trace (torch.export is most of a plan's set-up on every rank).
_SPLITS: dict[tuple, tuple[Any, Routing]] = {}
_SPLITS_KEPT = 8


def _cached_split(net: Any, example_inputs: Any, stage_first_units: Sequence[str],
                  model_key: tuple) -> tuple[Any, Routing]:
    """:func:`traced_split`, traced once per process for each model, layout and micro-batch shape.

    The cache keeps an untouched copy of the split; each call gets a fresh copy of it with
    ``net``'s current parameters and buffers copied in, so a plan starts from the weights its
    own build made, exactly as if it had traced ``net`` itself.
    """
    import copy

    import torch

    from pipeplan.profile.loading import split_inputs

    args, kwargs = split_inputs(example_inputs)

    def shape(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype), value.requires_grad)
        return ("value", repr(value))

    key = model_key + (tuple(stage_first_units), tuple(shape(a) for a in args),
                       tuple((k, shape(v)) for k, v in sorted((kwargs or {}).items())))
    if key not in _SPLITS:
        pipe, routing = traced_split(net, example_inputs, stage_first_units)
        if len(_SPLITS) >= _SPLITS_KEPT:
            _SPLITS.pop(next(iter(_SPLITS)))
        _SPLITS[key] = (copy.deepcopy(pipe), routing)
        return pipe, routing
    pristine, routing = _SPLITS[key]
    pipe = copy.deepcopy(pristine)
    state = dict(net.named_parameters(remove_duplicate=False))
    state.update(net.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for index in range(pipe.num_stages):
            submod = pipe.get_stage_module(index)
            for name, tensor in [*submod.named_parameters(remove_duplicate=False),
                                 *submod.named_buffers(remove_duplicate=False)]:
                if name in state:  # else a constant the trace lifted: the same in every build
                    tensor.copy_(state[name])
    return pipe, routing


def split_backward_problem(module: Any, inputs: tuple, outputs: tuple) -> Optional[str]:
    """Why torch's split backward (B, then W) cannot train this stage, or None.

    Runs the stage once on the example ``inputs`` with torch's own ``stage_backward_input`` and
    ``stage_backward_weight`` (as the zero-bubble schedules do) and once with a plain backward,
    and compares the weight gradients. torch 2.13 groups a stage's parameters by the paths from
    its inputs; where two groups share nodes, W either fails ("Trying to backward through the
    graph a second time") or, with the graph kept, counts a path twice. T5 does that on a stage
    that holds the decoder's embedding and a decoder block but is not the first stage (the
    decoder's weight-only branch meets the encoder states in the cross-attention).
    """
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from pipeplan.profile.measure import exception_line

    params = [p for p in module.parameters() if p.requires_grad]

    def run(split: bool) -> list[Any]:
        for p in params:
            p.grad = None
        ins = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = module(*ins)
        outs = [o for o in (out if isinstance(out, tuple) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        grads = [torch.ones_like(o) for o in outs]
        if split:
            _, groups = stage_backward_input(outs, grads, [x for x in ins if x.requires_grad], iter(params))
            stage_backward_weight(iter(params), groups)
        else:
            torch.autograd.backward(outs, grads)
        return [None if p.grad is None else p.grad.clone() for p in params]

    try:
        whole = run(split=False)
        try:
            split = run(split=True)
        except RuntimeError as exc:
            return exception_line(exc).split(" (")[0]  # torch's advice on retain_graph does not apply
        for p, a, b in zip(params, whole, split):
            if (a is None) != (b is None) or (a is not None and not torch.allclose(a, b, rtol=1e-4, atol=1e-6)):
                return "its weight gradients differ from a plain backward's"
        return None
    finally:
        for p in params:
            p.grad = None


def _example_values(pipe: Any, routing: Routing, cls: type, example_inputs: Any,
                    num_stages: int) -> list[tuple[Any, Any]]:
    """Each stage's inputs and outputs on the example micro-batch, as ``PipelineStage`` wants them
    (detached; floating ones require a gradient, as received activations do)."""
    import torch

    from pipeplan.profile.loading import split_inputs

    def example(value: Any) -> Any:
        value = value.detach().clone(memory_format=torch.contiguous_format)
        return value.requires_grad_(True) if value.is_floating_point() else value

    def as_tuple(value: Any) -> tuple:
        return value if isinstance(value, tuple) else (value,)

    args, kwargs = split_inputs(example_inputs)
    out: list[tuple[Any, Any]] = []
    values: Any = None
    for index in range(num_stages):
        stage = cls(pipe.get_stage_module(index), routing, index)
        result = stage(*args, **kwargs) if index == 0 else stage(*values)
        # The first stage's positional inputs (none for keyword batches) come from the schedule.
        inputs = tuple(example(v) for v in (args if index == 0 else values))
        values = as_tuple(result)
        out.append((inputs, tuple(example(v) for v in values)))
    for p in pipe.split_gm.parameters():
        p.grad = None
    return out


def _check_traced_stages(pipe: Any, stage_layers: Sequence[Sequence[str]], tied: dict[str, list[str]],
                         alias: dict[str, str]) -> None:
    """Refuse a split whose traced stages hold other units than the plan's.

    The tracer splits before each stage's first unit, so a stage that is not a run of consecutive
    units in the forward's call order (a plan made over the layer DAG: GPT-2's ``wpe`` alone
    before ``wte``) becomes a different split; run, it would train without some weights'
    gradients and ``--verify`` would find them wrong. Checked by the units whose parameters each
    traced stage reads (tied copies count for every unit that holds them).
    """
    owner = {unit: index for index, layers in enumerate(stage_layers) for unit in layers}

    def unit_of(name: str) -> Optional[str]:
        parts = name.split(".")
        return next((u for u in (".".join(parts[:k]) for k in range(len(parts), 0, -1)) if u in owner), None)

    for index in range(len(stage_layers)):
        for name in sorted(_used_parameters(pipe.get_stage_module(index))):
            units = [u for u in map(unit_of, tied.get(alias.get(name, ""), [name])) if u is not None]
            if units and index not in {owner[u] for u in units}:
                unit = units[0]
                raise BadInputError(
                    f"plan stage {index} holds {', '.join(stage_layers[index])}, but torch's tracer put "
                    f"{name} (unit {unit}, plan stage {owner[unit]}) into it: the traced builder needs every "
                    f"stage to be a run of consecutive units in the order the forward calls them; make the "
                    f"plan again with this pipeplan (its plans of traced models follow that order)"
                )


def _drop_unused_tied_copies(submod: Any, used: set[str], alias: dict[str, str]) -> None:
    """Remove the tied-weight copies torch's split leaves in a stage whose graph never reads them.

    torch 2.13's ``pipeline()`` puts every name of a tied weight into each stage that reads any
    of them: GPT-2's first stage holds ``lm_head.weight`` beside ``transformer.wte.weight``, as a
    separate tensor. Kept, the copy would get the tied gradient sum (:class:`TiedGrads` gives
    every copy on a rank the sum) and optimizer state: four times the weight's bytes that the
    plan did not count (616 MB on GPT-2 small's first rank).
    """
    for name, _ in list(submod.named_parameters(remove_duplicate=False)):
        if name in alias and name not in used:
            owner_name, _, leaf = name.rpartition(".")
            delattr(submod.get_submodule(owner_name) if owner_name else submod, leaf)


def _used_parameters(submod: Any) -> set[str]:
    """Parameter names a traced submodule's graph reads (torch copies unused tied ones in too)."""
    used = set()
    for node in submod.graph.nodes:
        if node.op == "get_attr":
            used.add(str(node.target))
        elif node.op == "call_module":
            prefix = f"{node.target}."
            used.update(prefix + n for n, _ in submod.get_submodule(node.target).named_parameters())
    return used


def _loss_position(output: Any) -> int:
    """Where the loss sits among a model output's flattened values (``ModelOutput``: ``loss`` first)."""
    keys = list(output.keys()) if hasattr(output, "keys") else None
    if keys and "loss" in keys:
        return keys.index("loss")
    if keys is None and isinstance(output, (tuple, list)) and output and getattr(output[0], "dim", lambda: 1)() == 0:
        return 0
    raise BadInputError(
        f"the model returned no loss ({type(output).__name__}); give its batch 'labels' or a loss_fn"
    )
