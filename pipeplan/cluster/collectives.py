"""Time of the collectives that tensor and data parallelism run, on a cluster's links.

The alpha-beta model of NCCL's own tuner (``src/graph/tuning.cc``): a collective call costs a
fixed latency (``Link.call_latency_us``, NCCL's base latency), then some steps over ``n`` ranks,
each costing the link's per-hop latency, and moves some bytes per rank at the link's achieved
bandwidth. For a buffer of ``S`` bytes (the whole, unsharded tensor):

=================  ==========================  =====================================
collective         steps (ring)                bytes each rank sends (ring)
=================  ==========================  =====================================
all-reduce         ``2 (n - 1)``               ``2 (n - 1) / n x S``
reduce-scatter     ``n - 1``                   ``(n - 1) / n x S``
all-gather         ``n - 1``                   ``(n - 1) / n x S``
=================  ==========================  =====================================

All-reduce can also run as NCCL's double binary tree: ``2 ceil(log2 n)`` steps, about ``2 S``
per rank at full bandwidth; the faster of the two is taken (NCCL's tuner picks per size).

A group that spans NVLink domains runs hierarchically (inside each domain first, then one rank of
each domain's share over the network, each GPU on its own NIC): with ``k`` ranks per domain on ``N``
domains,

    all-reduce     = RS_intra(S, k) + AR_inter(S / k, N) + AG_intra(S, k)
    reduce-scatter = RS_intra(S, k) + RS_inter(S / k, N)
    all-gather     = AG_inter(S / k, N) + AG_intra(S, k)

Tensor parallelism's collectives (:func:`tensor_parallel_ms`) and a pipeline stage's
point-to-point send (:func:`send_ms`) are timed by the same model.

"Intra" is the cluster's fast link (``ClusterSpec.intra_node``) and holds for every rank of one
NVLink domain: a node, or several where an NVLink switch fabric joins them (GB200 NVL72); the
groups' shapes come from :meth:`pipeplan.cluster.placement.Layout.span`, which counts domains.

See docs/cluster-model.md for the sources and the limits (no NVLS/SHARP, no congestion).
"""

from __future__ import annotations

import math
from typing import Literal

from pipeplan.formats.cluster import Link

__all__ = ["COLLECTIVES", "ring_ms", "tree_all_reduce_ms", "flat_collective_ms", "collective_ms",
           "tensor_parallel_ms", "send_ms", "all_to_all_ms"]

Collective = Literal["all-reduce", "reduce-scatter", "all-gather"]

#: The collectives this module times.
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")

#: Ring steps and the share of S each rank sends, per collective, as functions of n.
_RING = {
    "all-reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "reduce-scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "all-gather": (lambda n: n - 1, lambda n: (n - 1) / n),
}


def _check(kind: str, size_bytes: float, ranks: int) -> None:
    if kind not in _RING:
        raise ValueError(f"collective {kind!r} is not one of {', '.join(COLLECTIVES)}")
    if ranks < 1:
        raise ValueError(f"ranks: {ranks} must be at least 1")
    if size_bytes < 0:
        raise ValueError(f"size_bytes: {size_bytes} must be >= 0")


def ring_ms(kind: Collective, size_bytes: float, ranks: int, link: Link) -> float:
    """A ring collective of ``size_bytes`` over ``ranks`` ranks on one kind of link.

    Parameters
    ----------
    kind : {"all-reduce", "reduce-scatter", "all-gather"}
    size_bytes : float
        The whole buffer: the input of a reduce-scatter, the output of an all-gather.
    ranks : int
        Ranks in the group; one rank (or zero bytes) costs nothing.
    link : Link
        The link every step of the ring crosses.

    Returns
    -------
    float
        Milliseconds.

    Examples
    --------
    >>> nvlink = Link(bandwidth_bytes_per_s=100e9, latency_us=0, efficiency=1)
    >>> ring_ms("all-reduce", 1e9, 4, nvlink)   # 2 x 3/4 x 1 GB at 100 GB/s
    15.0
    >>> ring_ms("all-gather", 1e9, 4, nvlink)
    7.5
    >>> ring_ms("all-reduce", 1e9, 1, nvlink)
    0.0
    """
    _check(kind, size_bytes, ranks)
    if ranks == 1 or size_bytes == 0:
        return 0.0
    steps, share = _RING[kind]
    return ((link.call_latency_us + steps(ranks) * link.latency_us) / 1e3
            + share(ranks) * size_bytes / link.achieved_bytes_per_s * 1e3)


def tree_all_reduce_ms(size_bytes: float, ranks: int, link: Link) -> float:
    """NCCL's double-binary-tree all-reduce: ``2 ceil(log2 n)`` hops, ``2 S`` per rank.

    Faster than the ring for small buffers on many ranks (fewer latency steps), slower for
    large ones (``2 S`` against the ring's ``2 (n-1)/n S``).

    Examples
    --------
    >>> net = Link(bandwidth_bytes_per_s=10e9, latency_us=10, efficiency=1)
    >>> round(tree_all_reduce_ms(1000, 64, net), 4)   # 12 hops of 10 us, 2 kB at 10 GB/s
    0.1202
    >>> round(ring_ms("all-reduce", 1000, 64, net), 4)  # 126 hops
    1.2602
    """
    _check("all-reduce", size_bytes, ranks)
    if ranks == 1 or size_bytes == 0:
        return 0.0
    steps = 2 * math.ceil(math.log2(ranks))
    return (link.call_latency_us + steps * link.latency_us) / 1e3 + 2 * size_bytes / link.achieved_bytes_per_s * 1e3


def flat_collective_ms(kind: Collective, size_bytes: float, ranks: int, link: Link) -> float:
    """The faster of ring and tree (tree for all-reduce only), on one kind of link.

    Examples
    --------
    >>> link = Link(bandwidth_bytes_per_s=10e9, latency_us=10, efficiency=1)
    >>> flat_collective_ms("all-reduce", 1000, 64, link) == tree_all_reduce_ms(1000, 64, link)
    True
    >>> flat_collective_ms("all-reduce", 1e9, 64, link) == ring_ms("all-reduce", 1e9, 64, link)
    True
    """
    ring = ring_ms(kind, size_bytes, ranks, link)
    if kind != "all-reduce":
        return ring
    return min(ring, tree_all_reduce_ms(size_bytes, ranks, link))


def collective_ms(kind: Collective, size_bytes: float, ranks_per_node: int, nodes: int,
                  intra: Link, inter: Link) -> float:
    """A collective over a group of ``ranks_per_node`` GPUs in each of ``nodes`` NVLink domains (nodes,
    where the domain is the node).

    One domain: flat on the intra-node (NVLink) link. One rank per domain: flat on the network.
    Otherwise hierarchical (module docstring): the in-domain parts move the whole buffer,
    the network part only each GPU's ``1 / ranks_per_node`` share, every GPU on its own NIC.

    Parameters
    ----------
    kind : {"all-reduce", "reduce-scatter", "all-gather"}
    size_bytes : float
        The whole buffer (module docstring).
    ranks_per_node, nodes : int
        The group's shape (:meth:`pipeplan.cluster.placement.Layout.span`).
    intra, inter : Link
        The cluster's intra-node link and network.

    Returns
    -------
    float
        Milliseconds.

    Examples
    --------
    >>> nv = Link(bandwidth_bytes_per_s=400e9, latency_us=0, efficiency=1)
    >>> ib = Link(bandwidth_bytes_per_s=50e9, latency_us=0, efficiency=1)
    >>> collective_ms("all-reduce", 8e9, 8, 1, nv, ib)   # one node: 2 x 7/8 x 8 GB at 400 GB/s
    35.0
    >>> # 2 nodes of 8: RS + AG inside (2 x 17.5 ms) + all-reduce of 1 GB over 2 NICs (20 ms)
    >>> collective_ms("all-reduce", 8e9, 8, 2, nv, ib)
    55.0
    """
    _check(kind, size_bytes, ranks_per_node * nodes)
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"group shape {ranks_per_node} x {nodes} must be positive")
    if nodes == 1:
        return flat_collective_ms(kind, size_bytes, ranks_per_node, intra)
    if ranks_per_node == 1:
        return flat_collective_ms(kind, size_bytes, nodes, inter)
    share = size_bytes / ranks_per_node
    if kind == "all-reduce":
        return (ring_ms("reduce-scatter", size_bytes, ranks_per_node, intra)
                + flat_collective_ms("all-reduce", share, nodes, inter)
                + ring_ms("all-gather", size_bytes, ranks_per_node, intra))
    return ring_ms(kind, size_bytes, ranks_per_node, intra) + ring_ms(kind, share, nodes, inter)


def tensor_parallel_ms(collective: str, payload_bytes: float, count: int, ranks: int, link: Link) -> float:
    """A layer's tensor-parallel collectives in one pass (forward or backward), as a profile
    records them (schema version 2: kind, summed payload, number of calls).

    ``all_reduce``: each call is a ring all-reduce, so ``count x 2 (t - 1)`` latency steps and
    ``2 (t - 1) / t`` of the summed payload sent per rank. ``reduce_scatter_all_gather``
    (sequence parallelism): each call is a reduce-scatter or an all-gather, ``count x (t - 1)``
    steps and ``(t - 1) / t`` of the payload. Equal to summing :func:`ring_ms` over the calls.

    Parameters
    ----------
    collective : {"all_reduce", "reduce_scatter_all_gather"}
    payload_bytes : float
        The sum of every call's whole buffer.
    count : int
        Calls (latency is paid per call).
    ranks : int
        ``t``.
    link : Link
        The intra-node (NVLink) link: tensor groups stay in an NVLink domain, a node unless the
        domain spans nodes (:class:`~pipeplan.cluster.placement.Layout`).

    Examples
    --------
    >>> nv = Link(bandwidth_bytes_per_s=300e9, latency_us=0, efficiency=1)
    >>> tensor_parallel_ms("all_reduce", 2 * 48e6, 2, 8, nv) == 2 * ring_ms("all-reduce", 48e6, 8, nv)
    True
    """
    if collective not in ("all_reduce", "reduce_scatter_all_gather"):
        raise ValueError(f"collective {collective!r} is not all_reduce or reduce_scatter_all_gather")
    if count < 0 or payload_bytes < 0 or ranks < 1:
        raise ValueError("count and payload_bytes must be >= 0, ranks >= 1")
    if ranks == 1 or (payload_bytes == 0 and count == 0):
        return 0.0
    factor = 2 if collective == "all_reduce" else 1
    return (count * (link.call_latency_us + factor * (ranks - 1) * link.latency_us) / 1e3
            + factor * (ranks - 1) / ranks * payload_bytes / link.achieved_bytes_per_s * 1e3)


def send_ms(size_bytes: float, link: Link) -> float:
    """One point-to-point send of ``size_bytes`` (a pipeline transfer): one hop plus the bytes.

    Examples
    --------
    >>> send_ms(50e6, Link(bandwidth_bytes_per_s=25e9, latency_us=14, efficiency=1))
    2.014
    """
    if size_bytes < 0:
        raise ValueError(f"size_bytes: {size_bytes} must be >= 0")
    if size_bytes == 0:
        return 0.0
    return link.latency_us / 1e3 + size_bytes / link.achieved_bytes_per_s * 1e3


def all_to_all_ms(size_bytes: float, ranks: int, ranks_per_node: int, intra: Link, inter: Link) -> float:
    """One all-to-all of an expert-parallel group: each of its ``n`` ranks holds ``size_bytes``
    and sends ``1 / n`` of them to every rank (the token dispatch or combine of balanced routing:
    Megatron-core's ``MoEAlltoAllTokenDispatcher``, DeepSpeed-MoE).

    NCCL runs it as one group of point-to-point sends and receives to every peer at once
    (``ncclGroupStart``, a send and a receive per peer), so it pays one call's fixed latency and
    one hop's latency of the slowest link it uses, and moves the bytes on both links at once:
    the ``(k - 1) / n`` share for the other ``k - 1`` ranks of its NVLink domain (node) over the
    intra-node link, the ``(n - k) / n`` share for the other domains over the network (each GPU on
    its own NIC)::

        all_to_all = call_latency + hop_latency + max((k - 1) / n x S / B_intra, (n - k) / n x S / B_inter)

    Parameters
    ----------
    size_bytes : float
        Bytes one rank sends in all, its own share included (``S``).
    ranks : int
        ``n``, the group's size.
    ranks_per_node : int
        ``k``, the group's ranks in the sender's NVLink domain (itself included); ``n`` in one.
    intra, inter : Link
        The cluster's intra-node link and network.

    Returns
    -------
    float
        Milliseconds; 0 for one rank or no bytes.

    Examples
    --------
    >>> nv = Link(bandwidth_bytes_per_s=400e9, latency_us=0, efficiency=1)
    >>> ib = Link(bandwidth_bytes_per_s=50e9, latency_us=0, efficiency=1)
    >>> all_to_all_ms(8e9, 8, 8, nv, ib)      # 7/8 x 8 GB at 400 GB/s
    17.5
    >>> all_to_all_ms(8e9, 16, 8, nv, ib)     # 8/16 x 8 GB at 50 GB/s on the NIC
    80.0
    """
    if size_bytes < 0:
        raise ValueError(f"size_bytes: {size_bytes} must be >= 0")
    if not 1 <= ranks_per_node <= ranks:
        raise ValueError(f"ranks_per_node {ranks_per_node} must be between 1 and ranks {ranks}")
    n, k = ranks, ranks_per_node
    if n == 1 or size_bytes == 0:
        return 0.0
    slowest = inter if n > k else intra
    latency_ms = (slowest.call_latency_us + slowest.latency_us) / 1e3
    intra_ms = (k - 1) / n * size_bytes / intra.achieved_bytes_per_s * 1e3
    inter_ms = (n - k) / n * size_bytes / inter.achieved_bytes_per_s * 1e3
    return latency_ms + max(intra_ms, inter_ms)
