"""The cluster spec format: the GPUs, how many share a node, and the links between them.

Read from a TOML file (``pipeplan plan --cluster my.toml``) or named by a preset
(``--cluster dgx-h100``; :mod:`pipeplan.cluster.presets`). See docs/cluster-model.md.

A file looks like::

    name = "my-cluster"
    gpu = "h100-sxm"              # a GPU model by name (pipeplan gpus)
    gpus_per_node = 8
    memory_cap = "80GB"           # or memory_cap_bytes = 80e9; default: the GPU's memory
    base = "dgx-h100"             # optional: start from a preset, override what follows

    [intra_node]                  # the link between GPUs of one node
    bandwidth = "450GB/s"         # per GPU, one direction (or bandwidth_bytes_per_s)
    latency_us = 3.4              # per step of a ring
    call_latency_us = 8.4         # optional: per collective call (NCCL's base latency)

    [inter_node]                  # the network, per GPU
    bandwidth = "50GB/s"
    latency_us = 14.0

Every bandwidth is what one GPU can send in one direction at once; the collective formulas
(:mod:`pipeplan.cluster.collectives`) are written in those terms.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeplan.errors import BadInputError, format_validation_error
from pipeplan.facts.gpus import GPUS
from pipeplan.quantities import parse_bandwidth, parse_bytes

__all__ = ["Link", "ClusterSpec", "load_cluster_file", "cluster_from_dict"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _parse_quantities(data: Any, fields: dict[str, tuple[str, str]]) -> Any:
    """Turn ``bandwidth = "450GB/s"`` into ``bandwidth_bytes_per_s``, and so on.

    ``fields`` maps the short key to (the unit-named field, its kind: "bandwidth" or "bytes").
    A value that does not parse is left for pydantic to reject with the field named.
    """
    if not isinstance(data, dict):
        return data

    out = dict(data)
    for short, (long, kind) in fields.items():
        if short not in out:
            continue
        if long in out:
            raise ValueError(f"give {short} or {long}, not both")
        value = out.pop(short)
        if isinstance(value, str):
            try:
                value = parse_bandwidth(value, short) if kind == "bandwidth" else parse_bytes(value, short)
            except BadInputError as exc:
                raise ValueError(str(exc)) from None
        out[long] = value
    return out


class Link(_Strict):
    """One kind of link: NVLink/NVSwitch or PCIe inside a node, or the network between nodes."""

    bandwidth_bytes_per_s: float = Field(
        gt=0, allow_inf_nan=False,
        description="What one GPU can send in one direction at once, bytes per second (the "
                    "data sheet's figure; see efficiency).")
    latency_us: float = Field(
        ge=0, allow_inf_nan=False,
        description="Time of one step of a ring (one hop), microseconds; NCCL's tuning model "
                    "calls it the hardware latency.")
    call_latency_us: float = Field(
        default=0.0, ge=0, allow_inf_nan=False,
        description="Fixed cost of each collective call, microseconds (NCCL's base latency: 8.4 us for "
                    "Ring/Simple in the presets); 0 in a file that does not give it.")
    efficiency: float = Field(
        default=0.8, gt=0, le=1,
        description="Share of bandwidth_bytes_per_s that collectives achieve (NCCL's bus "
                    "bandwidth over the data sheet's); docs/cluster-model.md.")

    @model_validator(mode="before")
    @classmethod
    def _quantities(cls, data: Any) -> Any:
        return _parse_quantities(data, {"bandwidth": ("bandwidth_bytes_per_s", "bandwidth")})

    @property
    def achieved_bytes_per_s(self) -> float:
        """The bandwidth the collective formulas use: ``bandwidth x efficiency``."""
        return self.bandwidth_bytes_per_s * self.efficiency


class ClusterSpec(_Strict):
    """A homogeneous cluster: nodes of ``gpus_per_node`` GPUs of one model."""

    name: str = Field(min_length=1, description="A name for tables and plans.")
    gpu: str = Field(min_length=1, description="The GPU model, by name (pipeplan gpus), e.g. 'h100-sxm'.")
    gpus_per_node: int = Field(gt=0, description="GPUs that share the intra-node link.")
    memory_cap_bytes: Optional[int] = Field(
        default=None, gt=0,
        description="Usable memory per GPU; null: the GPU model's memory. The reserve "
                    "(reserve_bytes) comes out of it.")
    intra_node: Link = Field(description="The link between GPUs of one node.")
    inter_node: Link = Field(description="The network between nodes, per GPU (rail-optimised: "
                                         "each GPU has its own NIC share).")
    reserve_bytes: int = Field(
        default=2 * 2**30, ge=0,
        description="Per GPU, memory pipeplan never plans: the CUDA context, NCCL's buffers, "
                    "kernel workspace (docs/cluster-model.md).")
    fragmentation: float = Field(
        default=0.05, ge=0, lt=1,
        description="Share of the planned memory added for the allocator's fragmentation.")

    @model_validator(mode="before")
    @classmethod
    def _quantities(cls, data: Any) -> Any:
        return _parse_quantities(data, {"memory_cap": ("memory_cap_bytes", "bytes"),
                                        "reserve": ("reserve_bytes", "bytes")})

    def cap_bytes(self) -> int:
        """The memory cap per GPU: the spec's, else its GPU model's (the GPU table, ``pipeplan gpus``).

        Raises
        ------
        BadInputError
            If neither is known: the file must give ``memory_cap``.
        """
        if self.memory_cap_bytes is not None:
            return self.memory_cap_bytes
        if self.gpu in GPUS:
            return GPUS[self.gpu].memory_bytes
        raise BadInputError(
            f"cluster {self.name!r}: gpu: {self.gpu!r} is not in the GPU table (pipeplan gpus); give memory_cap "
            f"(known GPUs: {', '.join(GPUS)})")

    def node_of(self, gpu: int) -> int:
        """The node that global rank ``gpu`` lies on (ranks fill nodes in order)."""
        return gpu // self.gpus_per_node


def cluster_from_dict(data: dict, where: str = "cluster", bases: Optional[Mapping[str, ClusterSpec]] = None) -> ClusterSpec:
    """Build a spec from a parsed TOML table, resolving ``base = "<preset>"`` first.

    ``bases`` are the specs a ``base`` may name (the cluster presets,
    :data:`pipeplan.cluster.presets.PRESETS`, which this layer does not import); without them
    a ``base`` is refused.

    Raises
    ------
    BadInputError
        Naming ``where``, the field and the problem, one line each.

    Examples
    --------
    >>> spec = cluster_from_dict({"name": "two-gpu", "gpu": "l4", "gpus_per_node": 2, "memory_cap": "24GB",
    ...                           "intra_node": {"bandwidth": "32GB/s", "latency_us": 5.7},
    ...                           "inter_node": {"bandwidth": "1.5GB/s", "latency_us": 14}})
    >>> spec.intra_node.bandwidth_bytes_per_s, spec.memory_cap_bytes
    (32000000000.0, 24000000000)
    """
    data = dict(data)
    base_name = data.pop("base", None)
    if base_name is not None:
        bases = bases or {}
        if base_name not in bases:
            raise BadInputError(f"{where}: base: {base_name!r} is not a preset; one of {', '.join(bases)}")
        merged = bases[base_name].model_dump(exclude_none=True)
        for key, value in data.items():
            if key in ("intra_node", "inter_node") and isinstance(value, dict):
                link = {k: v for k, v in merged[key].items() if not (k == "bandwidth_bytes_per_s" and "bandwidth" in value)}
                link.update(value)
                merged[key] = link
            elif key in ("memory_cap", "reserve"):
                merged.pop(f"{key}_bytes", None)
                merged[key] = value
            else:
                merged[key] = value
        data = merged
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as exc:
        raise BadInputError(format_validation_error(where, exc)) from None


def load_cluster_file(path: str | Path, bases: Optional[Mapping[str, ClusterSpec]] = None) -> ClusterSpec:
    """Read and check a cluster TOML file (``bases``: as :func:`cluster_from_dict`'s).

    Raises
    ------
    BadInputError
        If the file is missing, not TOML, or a field is missing, negative or unknown.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInputError(f"{path}: cannot read: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadInputError(f"{path}: not valid TOML: {exc}") from None
    return cluster_from_dict(data, str(path), bases)
