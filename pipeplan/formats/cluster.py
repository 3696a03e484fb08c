"""The cluster spec format: the GPUs, how many share a node and an NVLink domain, and the links.

Read from a TOML file (``pipeplan plan --cluster my.toml``) or named by a preset
(``--cluster dgx-h100``; :mod:`pipeplan.cluster.presets`). See docs/cluster-model.md.

A file looks like::

    name = "my-cluster"
    gpu = "h100-sxm"              # a GPU model by name (pipeplan gpus)
    gpus_per_node = 8
    gpus_per_nvlink_domain = 8    # optional: GPUs on one NVLink fabric (NVL72: 72); default gpus_per_node
    memory_cap = "80GB"           # or memory_cap_bytes = 80e9; default: the GPU's memory
    base = "dgx-h100"             # optional: start from a preset, override what follows

    [intra_node]                  # the link between GPUs of one node (of one NVLink domain)
    bandwidth = "450GB/s"         # per GPU, one direction (or bandwidth_bytes_per_s)
    latency_us = 3.4              # per step of a ring
    call_latency_us = 8.4         # optional: per collective call (NCCL's base latency)

    [inter_node]                  # the network, per GPU
    bandwidth = "50GB/s"
    latency_us = 14.0

Every bandwidth is what one GPU can send in one direction at once; the collective formulas
(:mod:`pipeplan.cluster.collectives`) are written in those terms.

``intra_node`` is the fast link: between the GPUs of one node, or of one NVLink domain where
``gpus_per_nvlink_domain`` spans several nodes (a GB200 NVL72 rack's 18 trays of 4 GPUs share
one NVLink switch fabric); ``inter_node`` is the network between domains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeplan.errors import BadInputError, format_validation_error
from pipeplan.facts.gpus import GPUS
# Byte counts take 80e9 (a whole float, as the module docstring shows); a GPU count takes only 8.
from pipeplan.formats.limits import (Bytes, Efficiency, LatencyUs, LinkBandwidth, Name, NodeGpus, PositiveBytes,
                                     PositiveCount, Share)
from pipeplan.formats.reading import load_toml
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

    bandwidth_bytes_per_s: LinkBandwidth = Field(
        description="What one GPU can send in one direction at once, bytes per second (the "
                    "data sheet's figure; see efficiency).")
    latency_us: LatencyUs = Field(
        description="Time of one step of a ring (one hop), microseconds; NCCL's tuning model "
                    "calls it the hardware latency.")
    call_latency_us: LatencyUs = Field(
        default=0.0,
        description="Fixed cost of each collective call, microseconds (NCCL's base latency: 8.4 us for "
                    "Ring/Simple in the presets); 0 in a file that does not give it.")
    efficiency: Efficiency = Field(
        default=0.8,
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
    """A homogeneous cluster: nodes of ``gpus_per_node`` GPUs of one model, ``gpus_per_nvlink_domain``
    of them on one NVLink fabric (by default a node)."""

    name: Name = Field(description="A name for tables and plans (plain text).")
    gpu: Name = Field(description="The GPU model, by name (pipeplan gpus), e.g. 'h100-sxm'.")
    gpus_per_node: NodeGpus = Field(description="GPUs of one node (one host, one launcher process group): "
                                                "what a job's GPU count comes in whole multiples of.")
    gpus_per_nvlink_domain: Optional[NodeGpus] = Field(
        default=None,
        description="GPUs that share the fast link (intra_node), across nodes where an NVLink switch fabric "
                    "joins them (GB200 NVL72: 72, over 18 nodes of 4); a multiple of gpus_per_node. Null: "
                    "gpus_per_node (the domain is the node). docs/cluster-model.md, NVLink domains.")
    memory_cap_bytes: Optional[PositiveBytes] = Field(
        default=None,
        description="Usable memory per GPU; null: the GPU model's memory. What a real job holds beside the "
                    "plan (the CUDA context, workspaces, NCCL buffers, fragmentation) comes out of it.")
    intra_node: Link = Field(description="The link between GPUs of one NVLink domain (of one node unless "
                                         "gpus_per_nvlink_domain spans nodes).")
    inter_node: Link = Field(description="The network between domains, per GPU (rail-optimised: "
                                         "each GPU has its own NIC share).")
    # What a real job holds beside the plan: each null field takes the documented figure
    # (pipeplan.facts.job_memory); a file written for the old single reserve still loads.
    reserve_bytes: Optional[Bytes] = Field(
        default=None,
        description="Per GPU, a fixed part pipeplan never plans, replacing the documented terms (the CUDA "
                    "context, the cuBLAS workspaces, the NCCL buffers of the layout's communicators); null: "
                    "those terms (docs/cluster-model.md, Memory a real job sees).")
    fragmentation: Optional[Share] = Field(
        default=None,
        description="Share of the planned memory added for the caching allocator's fragmentation; null: the "
                    "launcher's (pipeplan.facts.job_memory).")
    cuda_context_bytes: Optional[Bytes] = Field(
        default=None, description="Per GPU, the CUDA context (driver state and loaded kernels); null: the "
                                  "documented figure (pipeplan.facts.job_memory).")
    nccl_channels: Optional[PositiveCount] = Field(
        default=None, description="Channels NCCL opens per collective communicator (NCCL_MIN/MAX_NCHANNELS); "
                                  "null: the documented figure (8).")

    @model_validator(mode="before")
    @classmethod
    def _quantities(cls, data: Any) -> Any:
        return _parse_quantities(data, {"memory_cap": ("memory_cap_bytes", "bytes"),
                                        "reserve": ("reserve_bytes", "bytes"),
                                        "cuda_context": ("cuda_context_bytes", "bytes")})

    @model_validator(mode="after")
    def _whole_nodes(self) -> "ClusterSpec":
        domain = self.gpus_per_nvlink_domain
        if domain is not None and domain % self.gpus_per_node:
            # A node's GPUs share its NVLink switches, so a domain is whole nodes.
            raise ValueError(f"gpus_per_nvlink_domain: {domain} is not a multiple of gpus_per_node "
                             f"{self.gpus_per_node} (an NVLink domain is whole nodes)")
        return self

    @property
    def nvlink_domain_gpus(self) -> int:
        """GPUs of one NVLink domain: ``gpus_per_nvlink_domain``, else ``gpus_per_node``."""
        return self.gpus_per_nvlink_domain or self.gpus_per_node

    def domain_gpus_for(self, num_gpus: int) -> int:
        """GPUs of a job of ``num_gpus`` that share one NVLink domain: the layout's fast group.

        A job no larger than a domain runs in one (at least a node). A larger one is cut into equal
        segments of whole nodes, each inside one domain: the most nodes, up to a domain's, that divide
        the job's nodes (what Megatron Bridge asks Slurm for on NVL72: 16 trays of 4, 64 GPUs, for
        128 or 256 GPUs; docs/cluster-model.md). Where the domain is the node this is ``gpus_per_node``.

        Examples
        --------
        >>> spec = ClusterSpec(name="nvl72", gpu="gb200", gpus_per_node=4, gpus_per_nvlink_domain=72,
        ...                    intra_node={"bandwidth": "900GB/s", "latency_us": 3.4},
        ...                    inter_node={"bandwidth": "50GB/s", "latency_us": 14})
        >>> [spec.domain_gpus_for(n) for n in (2, 8, 64, 72, 128, 144, 256)]
        [4, 8, 64, 72, 64, 72, 64]
        """
        G, domain = self.gpus_per_node, self.nvlink_domain_gpus
        if num_gpus <= domain:
            return max(num_gpus, G)
        nodes, most = num_gpus // G, domain // G
        return G * max(k for k in range(1, most + 1) if nodes % k == 0)

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
        if not isinstance(base_name, str):
            raise BadInputError(f"{where}: base: expected a preset's name (a string), found {type(base_name).__name__}")
        if base_name not in bases:
            raise BadInputError(f"{where}: base: {base_name!r} is not a preset; one of {', '.join(bases)}")
        merged = bases[base_name].model_dump(exclude_none=True)
        for key, value in data.items():
            if key in ("intra_node", "inter_node") and isinstance(value, dict):
                link = {k: v for k, v in merged[key].items() if not (k == "bandwidth_bytes_per_s" and "bandwidth" in value)}
                link.update(value)
                merged[key] = link
            elif key in ("memory_cap", "reserve", "cuda_context"):
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
    return cluster_from_dict(load_toml(path), str(path), bases)
