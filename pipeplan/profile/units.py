"""Splitting a model into units, finding the edges between them, and building one stage.

A *unit* is a module of the model, named by its dotted path, that a plan places on one
stage. The *unit graph* says, for each unit, where each positional argument of its call comes
from (a model input or another unit's output); its edges are the producer -> consumer pairs.
It is found by tracing the model's forward with ``torch.fx``, the units kept as leaves, so a
skip connection (a unit's output used by a unit other than the next) appears as an edge. When
fx cannot trace a model, :func:`pipeplan.profile.capture.capture` finds the edges from the
autograd graph of one real forward instead.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn

from pipeplan.errors import BadInputError
from pipeplan.profile.loading import load_bundle

__all__ = [
    "UnitGraph",
    "default_units",
    "select_units",
    "bundle_units",
    "trace_units",
    "RepeatedUnit",
    "repeat_error",
    "repeated_call",
    "chain_graph",
    "UnitChain",
    "build_stage",
    "build_stage_from_profile",
    "model_spec",
    "tied_parameter_names",
]

#: A value in the unit graph: ``("input", i)`` is the model's i-th positional input,
#: ``("unit", name)`` a unit's output.
Source = tuple[str, Any]


@dataclass
class UnitGraph:
    """How the units of a model are wired.

    Notes
    -----
    ``args`` is None for a unit whose arguments are not all direct model inputs or unit
    outputs (an operation sits between units, outside every unit): its edges are known, but a
    stage cannot be rebuilt from units alone there.
    """

    units: list[str]
    """Unit names in execution order (a topological order)."""
    args: dict[str, Optional[list[Source]]]
    """Per unit, the source of each positional argument, or None (see Notes)."""
    edges: list[tuple[str, str]]
    """Producer -> consumer pairs between units, in execution order of the consumer."""
    output: Optional[Source]
    """The source of the model's output, when it is directly a unit's output."""
    method: str = "torch.fx"
    """How the graph was found: ``torch.fx``, ``autograd`` or ``chain`` (assumed)."""
    unused: list[str] = field(default_factory=list)
    """Units the forward never calls (left out of ``units``)."""
    repeated: list[str] = field(default_factory=list)
    """Units without parameters that the forward calls more than once (T5's ``dropout``, called
    after the embedding and after the last block), left out of ``units``: their calls are code
    between units, which runs in the stage that needs it."""

    def is_chain(self) -> bool:
        """True when every edge joins neighbours in ``units`` and each neighbour pair is joined."""
        chain = list(zip(self.units, self.units[1:]))
        return sorted(self.edges) == sorted(chain)


def _expand(model: nn.Module, prefix: str) -> list[str]:
    names = []
    for child_name, child in model.named_children():
        full = f"{prefix}{child_name}"
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            names.extend(_expand(child, full + "."))
        else:
            names.append(full)
    return names


def default_units(model: nn.Module) -> list[str]:
    """The children of the top-level module, with ``ModuleList``/``ModuleDict`` items expanded.

    A top-level ``nn.Sequential`` gives its items. Registration order, not execution order;
    :func:`trace_units` orders them.

    Raises
    ------
    BadInputError
        If the model has no child modules.

    Examples
    --------
    >>> import torch
    >>> default_units(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    ['0', '1']
    """
    names = _expand(model, "")
    if not names:
        raise BadInputError(
            f"the model ({type(model).__name__}) has no child modules to split into units; "
            f"give it submodules (e.g. an nn.Sequential of layers)"
        )
    return names


def select_units(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Units named by dotted names or globs, with the rest of the model as coarser units.

    A module matching a pattern is a unit. A module that does not match but holds matching
    modules is split into its children; every other module is a unit of its own, so that
    the units together cover the whole model (``'encoder.layer.*'`` on a BERT gives
    ``embeddings``, ``encoder.layer.0`` ... and ``pooler``).

    Parameters
    ----------
    model : torch.nn.Module
    patterns : sequence of str
        Dotted module names or ``fnmatch`` globs (``'blocks.*'``). Comma-separated strings
        are split.

    Raises
    ------
    BadInputError
        If a pattern matches no module.

    Examples
    --------
    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
    >>> select_units(m, ["1.*"])
    ['0', '1.0', '1.1']
    """
    flat = [p.strip() for pattern in patterns for p in str(pattern).split(",") if p.strip()]
    names = [name for name, _ in model.named_modules() if name]
    matched: set[str] = set()
    for pattern in flat:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            shown = ", ".join(default_units(model)[:8])
            raise BadInputError(
                f"--units: {pattern!r} matches no module of {type(model).__name__}; "
                f"its top-level units are {shown}{', ...' if len(default_units(model)) > 8 else ''} "
                f"(use dotted names or globs like 'blocks.*')"
            )
        matched.update(hits)

    def walk(module: nn.Module, prefix: str) -> list[str]:
        out = []
        for child_name, child in module.named_children():
            full = f"{prefix}{child_name}"
            container = isinstance(child, (nn.ModuleList, nn.ModuleDict))
            if full in matched and not container:
                out.append(full)
            elif any(m.startswith(full + ".") for m in matched):
                out.extend(walk(child, full + "."))
            elif container:  # never called itself: its items are the units
                out.extend(_expand(child, full + "."))
            else:
                out.append(full)
        return out

    return walk(model, "")


class _UnitTracer(torch.fx.Tracer):
    def __init__(self, units: set[str]) -> None:
        super().__init__()
        self.units = units

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.units or super().is_leaf_module(m, module_qualified_name)


def bundle_units(bundle, unit_patterns=None) -> list[str]:
    """The units of a loaded model bundle: ``unit_patterns``, else the bundle's own, else the default.

    Parameters
    ----------
    bundle : ModelBundle
        From :func:`pipeplan.profile.loading.load_bundle`.
    unit_patterns : list of str, optional
        The user's ``--units`` patterns; they win over the bundle's.

    Returns
    -------
    list of str
        Unit names in model order (:func:`select_units` or :func:`default_units`).
    """
    patterns = unit_patterns or bundle.units
    return select_units(bundle.model, list(patterns)) if patterns else default_units(bundle.model)


def trace_units(model: nn.Module, units: Sequence[str]) -> UnitGraph:
    """Trace ``model`` with ``torch.fx``, the units as leaves, into a :class:`UnitGraph`.

    Works on a model whose parameters are on the ``meta`` device (nothing is computed).

    A unit without parameters that is called more than once is left out (``repeated``) and
    traced through, as code between units.

    Raises
    ------
    BadInputError
        If a unit with parameters is called more than once per forward.
    RuntimeError
        Any tracing failure of torch.fx (the caller falls back to the autograd graph).

    Notes
    -----
    Time linear in the number of traced operations, times one more trace per repeated unit.
    """
    repeated: list[str] = []
    while True:
        try:
            graph = _trace_once(model, [u for u in units if u not in repeated])
        except RepeatedUnit as again:
            repeated.append(again.name)
            continue
        graph.repeated = repeated
        graph.unused = [u for u in graph.unused if u not in repeated]
        return graph


class RepeatedUnit(Exception):
    """Raised while a graph is found: the unit ``name``, which holds no parameters, ran twice.

    The finders (:func:`trace_units`, :func:`pipeplan.profile.capture.capture`) catch it and
    look again without that unit; it never reaches a user.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def repeat_error(name: str) -> BadInputError:
    """The error for a unit with parameters that runs more than once in one forward."""
    return BadInputError(
        f"unit {name!r} ran more than once in one forward and holds parameters (shared weights); "
        f"a unit must run once per micro-batch: choose units that contain every call (--units)"
    )


def repeated_call(model: nn.Module, name: str) -> Exception:
    """What to raise when unit ``name`` runs a second time: :class:`RepeatedUnit` for a module
    without parameters, else :func:`repeat_error`."""
    if next(model.get_submodule(name).parameters(), None) is not None:
        return repeat_error(name)
    return RepeatedUnit(name)


def _trace_once(model: nn.Module, units: Sequence[str]) -> UnitGraph:
    unit_set = set(units)
    graph = _UnitTracer(unit_set).trace(model)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    producer: dict[Any, str] = {}
    order: list[str] = []
    args: dict[str, Optional[list[Source]]] = {}
    edges: list[tuple[str, str]] = []

    def upstream(node: Any) -> set[str]:
        found, stack, seen = set(), [node], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in producer:
                found.add(producer[n])
                continue
            stack.extend(n.all_input_nodes)
        return found

    def direct(value: Any) -> Optional[Source]:
        if isinstance(value, torch.fx.Node):
            if value in producer:
                return ("unit", producer[value])
            if value in index:
                return ("input", index[value])
        return None

    for node in graph.nodes:
        if node.op != "call_module" or node.target not in unit_set:
            continue
        name = node.target
        if name in args:
            raise repeated_call(model, name)
        sources = [direct(a) for a in node.args]
        args[name] = sources if all(s is not None for s in sources) and not node.kwargs else None
        for src in sorted(set().union(*(upstream(n) for n in node.all_input_nodes)) if node.all_input_nodes else set(),
                          key=order.index):
            edges.append((src, name))
        producer[node] = name
        order.append(name)
    output_nodes = [n for n in graph.nodes if n.op == "output"]
    output = None
    if output_nodes and len(output_nodes[0].args) == 1:
        output = direct(output_nodes[0].args[0])
    return UnitGraph(units=order, args=args, edges=edges, output=output, method="torch.fx",
                     unused=[u for u in units if u not in args])


def chain_graph(units: Sequence[str], method: str = "chain") -> UnitGraph:
    """The graph of a plain chain: each unit takes the previous unit's output."""
    units = list(units)
    args: dict[str, Optional[list[Source]]] = {}
    for i, name in enumerate(units):
        args[name] = [("input", 0)] if i == 0 else [("unit", units[i - 1])]
    return UnitGraph(units=units, args=args, edges=list(zip(units, units[1:])),
                     output=("unit", units[-1]) if units else None, method=method)


class UnitChain(nn.Module):
    """A pipeline stage: some units of a model, run in order, wired by the unit graph.

    The stage's positional inputs are the values live at its first unit (produced before it
    and used by it or later), in producer order; its outputs are the values live after its
    last unit, in the same order (one tensor when there is one). A skip connection that
    crosses the stage is passed through. Parameter names equal the full model's
    (``blocks.3.attn.c_attn.weight``), so states and gradients compare by name.
    """

    def __init__(self, model: nn.Module, graph: UnitGraph, stage_units: Sequence[str]) -> None:
        super().__init__()
        stage_units = list(stage_units)
        missing = [u for u in stage_units if u not in graph.units]
        if missing:
            raise BadInputError(
                f"unit {missing[0]!r} is not a unit of the model; its units are {', '.join(graph.units)}"
            )
        positions = [graph.units.index(u) for u in stage_units]
        if positions != list(range(positions[0], positions[0] + len(positions))):
            raise BadInputError(
                f"stage units {stage_units} are not consecutive in the model's unit order"
            )
        for u in stage_units:
            if graph.args.get(u) is None:
                raise BadInputError(
                    f"unit {u!r} takes values computed outside every unit, so a stage cannot be "
                    f"built from units alone; choose coarser units (--units) that contain that code"
                )
        first, last = positions[0], positions[-1]
        self._units = stage_units
        self._args = {u: list(graph.args[u]) for u in stage_units}
        rank = {("unit", u): i for i, u in enumerate(graph.units)}

        def pos(src: Source) -> int:
            return -1 if src[0] == "input" else rank[src]

        consumers: dict[Source, list[int]] = {}
        for i, u in enumerate(graph.units):
            for src in graph.args.get(u) or []:
                consumers.setdefault(tuple(src), []).append(i)
        if graph.output is not None:
            consumers.setdefault(tuple(graph.output), []).append(len(graph.units))
        live_in = sorted({s for s, users in consumers.items() if pos(s) < first and max(users) >= first},
                         key=lambda s: (pos(s), str(s[1])))
        live_out = sorted({s for s, users in consumers.items() if pos(s) <= last and max(users) > last},
                          key=lambda s: (pos(s), str(s[1])))
        self.inputs: list[Source] = live_in
        """Values the stage takes, in order."""
        self.outputs: list[Source] = live_out
        """Values the stage returns, in order."""
        for name in stage_units:
            parent = self
            parts = name.split(".")
            for part in parts[:-1]:
                if not hasattr(parent, part) or not isinstance(getattr(parent, part), nn.Module):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(parts[-1], model.get_submodule(name))

    @property
    def unit_names(self) -> list[str]:
        """The stage's units, in order."""
        return list(self._units)

    def forward(self, *args: Any) -> Any:
        if len(args) != len(self.inputs):
            raise RuntimeError(f"stage expects {len(self.inputs)} inputs {self.inputs}, got {len(args)}")
        env: dict[Source, Any] = dict(zip(self.inputs, args))
        for name in self._units:
            unit = self.get_submodule(name)
            env[("unit", name)] = unit(*(env[tuple(s)] for s in self._args[name]))
        outs = tuple(env[s] for s in self.outputs)
        return outs[0] if len(outs) == 1 else outs


def build_stage(model: str, units: Sequence[str], *, seed: int = 0, device: Any = "cpu",
                dtype: Any = "fp32", unit_patterns: Optional[Sequence[str]] = None,
                **options: Any) -> UnitChain:
    """Build only the given units of a model, as one pipeline stage.

    Parameters
    ----------
    model : str
        Built-in name (``gpt2-tiny``) or ``module:callable``.
    units : sequence of str
        The stage's unit names, consecutive in the model's unit order (a plan stage's layers).
    seed : int
        Built-ins: weights are drawn per unit from the seed and the unit name, so every rank
        gets the weights the full model has. User models: ``torch.manual_seed(seed)`` is set
        before the callable runs, and the whole model is built, then all but the stage dropped.
    device, dtype
        Where the stage lives and its floating dtype.
    unit_patterns : sequence of str, optional
        The ``--units`` the profile was made with, if any.
    **options
        Size options of the model (``layers``, ``hidden``, ...), as given to ``profile``.

    Returns
    -------
    UnitChain
        ``forward(*inputs)`` maps the values live before the stage to those live after it.

    Raises
    ------
    BadInputError
        Unknown model or unit, or units that are not consecutive.

    Examples
    --------
    >>> import torch
    >>> stage = build_stage("gpt2-tiny", ["blocks.0", "blocks.1"], layers=2)
    >>> stage(torch.zeros(1, 8, 128)).shape
    torch.Size([1, 8, 128])
    """
    bundle = load_bundle(model, seed=seed, device=device, dtype=dtype, materialise=list(units), **options)
    names = bundle_units(bundle, unit_patterns)
    try:
        graph = trace_units(bundle.model, names)
    except BadInputError:
        raise
    except Exception:  # noqa: BLE001 - fx fails on many real models; a chain is the usual shape
        graph = chain_graph(names)
    return UnitChain(bundle.model, graph, units).to(device)


def model_spec(profile: Any) -> tuple[str, dict[str, Any], Optional[list[str]]]:
    """``(model, options, unit_patterns)`` that rebuild the model a measured profile came from.

    Examples
    --------
    >>> from pipeplan.formats.profile import Profile
    >>> p = Profile.model_validate({"schema_version": 1, "model": "gpt2-tiny", "source": "measured",
    ...     "device": {"name": "cpu"}, "dtype": "fp32", "measurement": {"model_options": {"layers": 2}},
    ...     "layers": [{"name": "embed", "param_bytes": 0, "costs": [{"microbatch_size": 1,
    ...     "forward_ms": 1, "backward_ms": 1, "activation_bytes": 0, "output_bytes": 0}]}]})
    >>> model_spec(p)
    ('gpt2-tiny', {'layers': 2}, None)
    """
    measurement = profile.measurement or {}
    return profile.model, dict(measurement.get("model_options") or {}), measurement.get("units_option")


def build_stage_from_profile(profile: Any, units: Sequence[str], *, seed: int = 0, device: Any = "cpu",
                             dtype: Optional[str] = None) -> UnitChain:
    """:func:`build_stage` for the model a measured profile describes (name, size options, units).

    ``dtype`` defaults to the profile's. This is what a pipeline rank calls with its plan
    stage's layer names.
    """
    model, options, patterns = model_spec(profile)
    return build_stage(model, units, seed=seed, device=device, dtype=dtype or profile.dtype,
                       unit_patterns=patterns, **options)


def tied_parameter_names(model: Any) -> dict[str, list[str]]:
    """Names of each parameter the model holds under more than one name (tied weights).

    Returns
    -------
    dict
        The canonical name (``named_parameters()``'s) -> every name of that tensor.

    Examples
    --------
    >>> import torch
    >>> m = torch.nn.Module(); m.a = torch.nn.Linear(2, 2, bias=False); m.b = torch.nn.Linear(2, 2, bias=False)
    >>> m.b.weight = m.a.weight
    >>> tied_parameter_names(m)
    {'a.weight': ['a.weight', 'b.weight']}
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {group[0]: group for group in names.values() if len(group) > 1}
