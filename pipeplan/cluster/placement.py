"""Which GPU runs what: ranks of a data x tensor x pipeline layout, as Megatron orders them.

Megatron-LM numbers ranks with tensor parallelism innermost, then data, then pipeline
(``megatron.core.parallel_state``, order ``tp-dp-pp`` with context and expert parallelism 1):

    rank = t + T x (d + D x p)        for tensor rank t < T, data rank d < D, pipeline rank p < P

and fills nodes in rank order (``gpus_per_node`` consecutive ranks per node). So a tensor
group is ``T`` consecutive GPUs, inside one node whenever ``T`` divides the node; a pipeline
rank's ``T x D`` GPUs are consecutive; neighbouring pipeline ranks are ``T x D`` GPUs apart,
on the same node only when ``T x D`` is smaller than a node.

What sets a group's bandwidth is not the node but the NVLink domain: ``gpus_per_domain``
consecutive ranks (a node, unless an NVLink switch fabric joins several: a GB200 NVL72 job's
64 GPUs over 16 trays of 4). Ranks of one domain talk over NVLink (the cluster's ``intra_node``
link) even on two nodes; ranks of two domains over the network. :meth:`Layout.span` and
:meth:`Layout.pipeline_link` ask "same domain"; :meth:`Layout.node` stays the host, for show.
Because tensor, then context (here 1), then expert ranks are innermost, they fill a domain
before any group reaches the network.

Examples
--------
>>> layout = Layout(data=2, tensor=4, pipeline=2, gpus_per_node=8)
>>> layout.stage_gpus(1)
(8, 9, 10, 11, 12, 13, 14, 15)
>>> layout.tensor_group(pipeline_rank=0, data_rank=1)
(4, 5, 6, 7)
>>> layout.data_group(pipeline_rank=1, tensor_rank=0)
(8, 12)
>>> layout.pipeline_link(0, 1)
'inter'
>>> nvl = Layout(data=2, tensor=8, pipeline=4, gpus_per_node=4, gpus_per_domain=64)  # GB200 NVL72
>>> nvl.tensor_span(), nvl.pipeline_link(0, 1)   # t=8 over 2 trays, all in one NVLink domain
(GroupSpan(ranks_per_node=8, nodes=1), 'intra')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from pipeplan.errors import BadInputError

__all__ = ["Layout", "GroupSpan", "cluster_layout"]

LinkKind = Literal["intra", "inter", "local"]


@dataclass(frozen=True)
class GroupSpan:
    """The shape of a communication group on the NVLink domains (nodes, where a domain is a node).

    The fields keep their names from when the domain was always the node: ``ranks_per_node`` is
    the group's ranks per domain, ``nodes`` the domains it touches."""

    ranks_per_node: int
    """GPUs of the group in each NVLink domain it touches (the same in every one)."""
    nodes: int
    """NVLink domains (nodes, where a domain is a node) the group touches."""

    @property
    def size(self) -> int:
        return self.ranks_per_node * self.nodes

    @property
    def link(self) -> LinkKind:
        """``local`` (one GPU), ``intra`` (one NVLink domain) or ``inter`` (spans domains)."""
        if self.size == 1:
            return "local"
        return "intra" if self.nodes == 1 else "inter"


@dataclass(frozen=True)
class Layout:
    """A data x tensor x pipeline layout on nodes of ``gpus_per_node`` GPUs, ``gpus_per_domain``
    consecutive ones sharing an NVLink domain (None: the node).

    Raises
    ------
    BadInputError
        If a degree is not positive, the tensor degree does not divide a domain (tensor
        parallelism stays on NVLink), the domain is not whole nodes, or the GPUs are not
        whole nodes (whole domains, where there are several).
    """

    data: int
    tensor: int
    pipeline: int
    gpus_per_node: int
    gpus_per_domain: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("data", "tensor", "pipeline", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise BadInputError(f"{name}: {getattr(self, name)} must be at least 1")
        domain = self.domain_size
        if domain < 1 or domain % self.gpus_per_node:
            raise BadInputError(f"gpus_per_domain: {domain} is not a positive multiple of the "
                                f"{self.gpus_per_node} GPUs of a node")
        if domain % self.tensor:
            where = "node" if domain == self.gpus_per_node else "NVLink domain"
            raise BadInputError(
                f"tensor parallel {self.tensor} does not divide the {domain} GPUs of a "
                f"{where}; tensor parallelism runs inside a {where}, so use a divisor of {domain}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise BadInputError(
                f"{self.num_gpus} GPUs are not whole nodes of {self.gpus_per_node}")
        if self.num_gpus > domain and self.num_gpus % domain:
            raise BadInputError(f"{self.num_gpus} GPUs are not whole NVLink domains of {domain}")

    @property
    def domain_size(self) -> int:
        """GPUs of one NVLink domain: ``gpus_per_domain``, else a node's."""
        return self.gpus_per_node if self.gpus_per_domain is None else self.gpus_per_domain

    @property
    def num_gpus(self) -> int:
        return self.data * self.tensor * self.pipeline

    def rank(self, pipeline_rank: int, data_rank: int, tensor_rank: int) -> int:
        """The global rank (GPU) of one coordinate (module docstring)."""
        return tensor_rank + self.tensor * (data_rank + self.data * pipeline_rank)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pipeline_rank, data_rank, tensor_rank)`` of a global rank.

        Examples
        --------
        >>> Layout(2, 4, 2, 8).coordinates(13)
        (1, 1, 1)
        """
        tensor_rank = rank % self.tensor
        data_rank = (rank // self.tensor) % self.data
        return rank // (self.tensor * self.data), data_rank, tensor_rank

    def node(self, rank: int) -> int:
        """The host (node) that runs ``rank``."""
        return rank // self.gpus_per_node

    def domain(self, rank: int) -> int:
        """The NVLink domain of ``rank``: what decides whether two ranks talk over NVLink."""
        return rank // self.domain_size

    def stage_gpus(self, pipeline_rank: int) -> tuple[int, ...]:
        """The GPUs that run pipeline rank ``pipeline_rank`` (every replica and tensor shard)."""
        first = self.rank(pipeline_rank, 0, 0)
        return tuple(range(first, first + self.tensor * self.data))

    def tensor_group(self, pipeline_rank: int, data_rank: int) -> tuple[int, ...]:
        return tuple(self.rank(pipeline_rank, data_rank, t) for t in range(self.tensor))

    def data_group(self, pipeline_rank: int, tensor_rank: int) -> tuple[int, ...]:
        return tuple(self.rank(pipeline_rank, d, tensor_rank) for d in range(self.data))

    def pipeline_group(self, data_rank: int, tensor_rank: int) -> tuple[int, ...]:
        return tuple(self.rank(p, data_rank, tensor_rank) for p in range(self.pipeline))

    def span(self, ranks) -> GroupSpan:
        """The group's shape on the NVLink domains.

        Raises
        ------
        ValueError
            If the group has different counts in different domains (no layout here makes one).
        """
        counts: dict[int, int] = {}
        for rank in ranks:
            counts[self.domain(rank)] = counts.get(self.domain(rank), 0) + 1
        per_node = set(counts.values())
        if len(per_node) != 1:
            raise ValueError(f"group {tuple(ranks)} is uneven over nodes: {counts}")
        return GroupSpan(ranks_per_node=per_node.pop(), nodes=len(counts))

    def tensor_span(self) -> GroupSpan:
        """Every tensor group's shape (all alike: consecutive GPUs inside a domain)."""
        return self.span(self.tensor_group(0, 0))

    def data_span(self) -> GroupSpan:
        """Every data-parallel group's shape (all alike in this ordering)."""
        return self.span(self.data_group(0, 0))

    def expert_group(self, expert: int, expert_tensor: int = 1) -> tuple[int, ...]:
        """The first pipeline rank's first expert-parallel group: Megatron-core numbers the expert
        layers' ranks expert-tensor innermost, then expert, then expert-data, inside each
        pipeline rank's ``t x d`` GPUs (``RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp)``), so the
        group is ``expert`` GPUs ``expert_tensor`` apart.

        Examples
        --------
        >>> Layout(data=8, tensor=2, pipeline=1, gpus_per_node=8).expert_group(4)
        (0, 1, 2, 3)
        >>> Layout(data=8, tensor=2, pipeline=1, gpus_per_node=8).expert_group(4, expert_tensor=2)
        (0, 2, 4, 6)
        """
        return tuple(i * expert_tensor for i in range(expert))

    def expert_data_group(self, expert: int, expert_tensor: int = 1) -> tuple[int, ...]:
        """The first expert-data-parallel group: the ``t x d / (E x ETP)`` GPUs that hold the same
        experts, ``E x ETP`` apart (their gradients are summed over it)."""
        stride = expert * expert_tensor
        return tuple(j * stride for j in range(self.tensor * self.data // stride))

    def loose_span(self, ranks) -> GroupSpan:
        """The group's shape, its fewest ranks in any domain it touches where they differ (a group
        of a pipeline rank whose GPUs are not whole domains): the network's share is then not
        underestimated."""
        counts: dict[int, int] = {}
        for rank in ranks:
            counts[self.domain(rank)] = counts.get(self.domain(rank), 0) + 1
        return GroupSpan(ranks_per_node=min(counts.values()), nodes=len(counts))

    def pipeline_link(self, src_pipeline_rank: int, dst_pipeline_rank: int) -> LinkKind:
        """The link a pipeline transfer between two pipeline ranks crosses.

        Every replica and tensor shard sends at once, each GPU to its peer ``T x D`` GPUs away;
        the transfer is on the network if any of those pairs is in two NVLink domains (the slowest
        pair gates the step), on NVLink otherwise, across nodes too where a domain spans them.
        ``local`` when the two pipeline ranks are the same (the V placement).

        Examples
        --------
        >>> Layout(data=1, tensor=2, pipeline=4, gpus_per_node=8).pipeline_link(1, 2)
        'intra'
        >>> Layout(data=1, tensor=2, pipeline=8, gpus_per_node=8).pipeline_link(3, 4)
        'inter'
        """
        if src_pipeline_rank == dst_pipeline_rank:
            return "local"
        for src, dst in zip(self.stage_gpus(src_pipeline_rank), self.stage_gpus(dst_pipeline_rank)):
            if self.domain(src) != self.domain(dst):
                return "inter"
        return "intra"

    def describe_stage(self, pipeline_rank: int) -> str:
        """``GPUs 8-15 (node 1)``: for ``show``."""
        gpus = self.stage_gpus(pipeline_rank)
        nodes = sorted({self.node(g) for g in gpus})
        gpu_text = f"GPU {gpus[0]}" if len(gpus) == 1 else f"GPUs {gpus[0]}-{gpus[-1]}"
        node_text = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"
        return f"{gpu_text} ({node_text})"


def cluster_layout(cluster, data: int, tensor: int, pipeline: int) -> Layout:
    """The layout of ``data x tensor x pipeline`` GPUs on ``cluster``: its nodes, and its NVLink
    domain segments for a job of that size (:meth:`pipeplan.formats.cluster.ClusterSpec.domain_gpus_for`).

    Examples
    --------
    >>> from pipeplan.cluster.presets import PRESETS
    >>> cluster_layout(PRESETS["gb200-nvl72"], 16, 8, 1).domain_size   # 128 GPUs: two 64-GPU segments
    64
    >>> cluster_layout(PRESETS["dgx-h100"], 16, 8, 1).domain_size
    8
    """
    num_gpus = data * tensor * pipeline
    domain = cluster.domain_gpus_for(num_gpus)
    return Layout(data, tensor, pipeline, cluster.gpus_per_node,
                  None if domain == cluster.gpus_per_node else domain)
