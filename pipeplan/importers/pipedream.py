"""Import PipeDream's profiler output (``graph.txt``) into a profile.

Mapping (see docs/formats.md):

- ``forward_compute_time`` / ``backward_compute_time`` (ms for the whole profiling batch) ->
  ``forward_ms`` / ``backward_ms`` at micro-batch size ``--batch-size``; ``Input*`` nodes'
  forward time is data loading and is set to zero, as PipeDream's optimizer does.
- ``activation_size`` (bytes of the node's output, summed over a list) -> ``output_bytes``, and
  also ``activation_bytes``: PipeDream records no saved-for-backward size, and a layer's output
  is what its consumer saves, so the sum over a stage matches to first order.
- ``parameter_size`` -> ``param_bytes``. Node order -> a topological order (PipeDream lists nodes
  in no order); edges are kept, so branches stay a DAG.
"""

from __future__ import annotations

from pathlib import Path

import networkx as nx
from pydantic import ValidationError

from pipeplan.errors import BadInputError
from pipeplan.errors import format_validation_error
from pipeplan.formats.io import read_input_text
from pipeplan.formats.profile import Device, Layer, LayerCost, Profile

__all__ = ["import_pipedream", "parse_pipedream", "PROFILED_BATCH"]

#: The batch each of PipeDream's published graphs was profiled at (from the data's README), the
#: ``batch_size`` :func:`import_pipedream` takes for them.
PROFILED_BATCH = {
    "alexnet": 256, "vgg16": 128, "resnet18": 256, "resnet50": 128, "resnext50": 128,
    "resnet101": 64, "resnext101": 64, "squeezenet1_0": 256, "inception_v3": 128,
    "densenet121": 64, "nasnetamobile": 128, "nasnetalarge": 16, "gnmt": 128, "gnmt_large": 128,
}

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


def _number(path, lineno: int, key: str, text: str) -> float:
    text = text.strip()
    try:
        if text.startswith("["):
            return sum(float(x) for x in text.strip("[]").split(";") if x.strip())
        value = float(text)
    except ValueError:
        raise BadInputError(f"{path}:{lineno}: {key}={text!r} is not a number") from None
    if value != value or value < 0 or value == float("inf"):
        raise BadInputError(f"{path}:{lineno}: {key}={text!r} must be a finite number >= 0")
    return value


def parse_pipedream(path: str | Path):
    """Parse a graph.txt into ``(nodes, edges)``; nodes map id -> (description, metrics)."""

    path = Path(path)
    lines = read_input_text(path, "graph.txt").splitlines()
    nodes: dict[str, tuple[str, dict[str, float]]] = {}
    edges: list[tuple[str, str]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.startswith("\t"):
            parts = [p.strip() for p in line.strip().split(" -- ")]
            if len(parts) != 2:
                raise BadInputError(f"{path}:{lineno}: an edge line must be 'src -- dst'")
            edges.append((parts[0], parts[1]))
            continue
        parts = line.split(" -- ")
        if parts and parts[-1].startswith("stage_id="):
            parts = parts[:-1]
        if len(parts) < 3:
            raise BadInputError(
                f"{path}:{lineno}: a node line must be 'id -- description -- metrics'"
            )
        node_id, description, meta = parts[0].strip(), " -- ".join(parts[1:-1]), parts[-1]
        metrics = {}
        for item in meta.split(", "):
            key, sep, value = item.partition("=")
            if not sep:
                raise BadInputError(f"{path}:{lineno}: {item!r} is not key=value")
            metrics[key.strip()] = _number(path, lineno, key.strip(), value)
        missing = [f for f in _FIELDS if f not in metrics]
        if missing:
            raise BadInputError(f"{path}:{lineno}: node {node_id} lacks {', '.join(missing)}")
        if node_id in nodes:
            raise BadInputError(f"{path}:{lineno}: node {node_id} is defined twice")
        nodes[node_id] = (description, metrics)
    if not nodes:
        raise BadInputError(f"{path}: no nodes found; is this a PipeDream graph.txt?")
    for src, dst in edges:
        for end in (src, dst):
            if end not in nodes:
                raise BadInputError(f"{path}: edge {src} -- {dst} names unknown node {end}")
    return nodes, edges


def import_pipedream(path: str | Path, batch_size: int, model: str | None = None) -> Profile:
    """Read a PipeDream graph.txt profiled at ``batch_size`` samples into a profile.

    Parameters
    ----------
    path : path-like
    batch_size : int
        The batch the file was profiled at (see the data's README); the costs are recorded
        at micro-batch size ``batch_size``.
    model : str, optional
        Model name; defaults to the file name before ``.graph.txt``.

    Returns
    -------
    Profile
        ``source`` "imported", layers in a deterministic topological order.

    Raises
    ------
    BadInputError
        Malformed lines, unknown nodes in edges, or a cycle.
    """
    if batch_size <= 0:
        raise BadInputError(f"--batch-size: {batch_size} must be positive")
    path = Path(path)
    nodes, edges = parse_pipedream(path)
    graph = nx.DiGraph()
    graph.add_nodes_from(nodes)
    graph.add_edges_from(edges)
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise BadInputError(f"{path}: the graph has a cycle through {cycle[0][0]} -> {cycle[0][1]}")

    def numeric(node_id: str):
        # The digits' value, compared as (length, text) without leading zeros: the same order as
        # int(digits) without converting (an id of 5,000 digits passed Python's limit).
        digits = "".join(ch for ch in node_id if ch.isdigit()).lstrip("0")
        return (len(digits), digits, node_id)

    order = list(nx.lexicographical_topological_sort(graph, key=numeric))
    try:
        layers = _layers(nodes, order, batch_size)
        name = model or path.name.removesuffix(".txt").removesuffix(".graph")
        # Edges in the order of their ends' positions: a dict, not order.index (quadratic:
        # 37 s at 50,000 nodes).
        position = {node_id: i for i, node_id in enumerate(order)}
        return Profile(
            schema_version=1,
            model=name,
            source="imported",
            device=Device(name="unknown GPU (PipeDream profile)"),
            dtype="fp32",
            layers=layers,
            edges=[[u, v] for u, v in sorted(graph.edges(), key=lambda e: (position[e[0]], position[e[1]]))],
            measurement={"imported_from": "pipedream graph.txt", "profile_batch_size": batch_size},
        )
    except ValidationError as exc:
        raise BadInputError(format_validation_error(path, exc)) from None
    except _NodeError as exc:
        raise BadInputError(f"{path}: node {exc.node_id}: {format_validation_error('', exc.error)[2:]}") from None


class _NodeError(Exception):
    def __init__(self, node_id: str, error: ValidationError):
        super().__init__(node_id)
        self.node_id, self.error = node_id, error


def _layers(nodes: dict, order: list[str], batch_size: int) -> list[Layer]:
    """One layer per node, in ``order``; a value out of the format's range names its node."""
    layers = []
    for node_id in order:
        try:
            description, m = nodes[node_id]
            is_input = description.startswith("Input")
            output = int(round(m["activation_size"]))
            layers.append(
                Layer(
                    name=node_id,
                    description=description,
                    param_bytes=int(round(m["parameter_size"])),
                    costs=[
                        LayerCost(
                            microbatch_size=batch_size,
                            forward_ms=0.0 if is_input else m["forward_compute_time"],
                            backward_ms=m["backward_compute_time"],
                            activation_bytes=0 if is_input else output,
                            output_bytes=output,
                        )
                    ],
                )
            )
        except ValidationError as exc:
            raise _NodeError(node_id, exc) from None
    return layers
