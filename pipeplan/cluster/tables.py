"""Rich tables of cluster specs for the terminal (``pipeplan cluster``)."""

from __future__ import annotations

from rich.table import Table

from pipeplan.formats.cluster import ClusterSpec

__all__ = ["cluster_table"]


def _bandwidth(value: float) -> str:
    return f"{value / 1e9:g} GB/s"


def cluster_table(specs: list[ClusterSpec], title: str = "cluster presets") -> Table:
    """One row per spec: GPU, node size, memory cap, links (per GPU, per direction)."""
    from pipeplan.cluster.presets import memory_cap_bytes

    table = Table(title=title)
    for column in ("name", "gpu", "gpus/node", "memory cap", "intra-node", "latency", "network/GPU",
                   "latency", "efficiency"):
        table.add_column(column, justify="left" if column in ("name", "gpu") else "right")
    for spec in specs:
        table.add_row(
            spec.name, spec.gpu, str(spec.gpus_per_node), f"{memory_cap_bytes(spec) / 1e9:g} GB",
            _bandwidth(spec.intra_node.bandwidth_bytes_per_s), f"{spec.intra_node.latency_us:g} us",
            _bandwidth(spec.inter_node.bandwidth_bytes_per_s), f"{spec.inter_node.latency_us:g} us",
            f"{spec.intra_node.efficiency:g} / {spec.inter_node.efficiency:g}",
        )
    return table
