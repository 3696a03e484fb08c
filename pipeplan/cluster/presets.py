"""Cluster presets (``--cluster dgx-h100``) and resolving a name or a TOML file to a spec.

Every figure is the vendor's data-sheet number, with its source beside it; bandwidths are per
GPU and per direction (a data sheet's "900 GB/s NVLink" is both directions together, so 450 GB/s
here). What collectives achieve of them is ``Link.efficiency`` (docs/cluster-model.md). Latencies
are NCCL's own per-hop figures for its Ring/Simple protocol (``hwLat`` in NCCL's
``src/graph/tuning.cc``: NVLink 3.4 us, PCI 5.7 us, network 14.0 us). The GPUs' own figures
(memory, FLOP/s, HBM bandwidth) are the GPU table's (:mod:`pipeplan.facts.gpus`), by name.

The Blackwell systems' figures are those gathered, with NVIDIA's pages named, in the project's
modern-runs data (``systems.json``: DGX-B200, DGX-B300, DGX-GB200, DGX-GB300); the comment beside
each figure repeats its source. The NVL72 racks are nodes (compute trays) of 4 GPUs in a 72-GPU
NVLink domain (``gpus_per_nvlink_domain = 72``, the hardware); a job uses the segments of it that
:meth:`~pipeplan.formats.cluster.ClusterSpec.domain_gpus_for` gives (64 GPUs for 64, 128 or 256:
what Megatron Bridge's launcher asks Slurm for), docs/cluster-model.md.
"""

from __future__ import annotations

from pathlib import Path

from pipeplan.errors import BadInputError
from pipeplan.formats.cluster import ClusterSpec, Link, load_cluster_file

__all__ = ["PRESETS", "resolve_cluster"]

GB = 10**9

#: NCCL's per-hop latencies (Ring, Simple protocol), src/graph/tuning.cc ``hwLat``.
_NVLINK_LATENCY_US = 3.4
_PCI_LATENCY_US = 5.7
_NET_LATENCY_US = 14.0
#: NCCL's base latency per call (Ring and Tree, Simple protocol), ``baseLat`` in the same file.
_CALL_LATENCY_US = 8.4

PRESETS: dict[str, ClusterSpec] = {
    "dgx-h100": ClusterSpec(
        name="dgx-h100", gpu="h100-sxm", gpus_per_node=8,
        # H100 data sheet: NVLink 900 GB/s (both directions) through DGX H100's four NVSwitches.
        intra_node=Link(bandwidth_bytes_per_s=450 * GB, latency_us=_NVLINK_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
        # DGX H100 data sheet: 8x single-port ConnectX-7, 400 Gb/s InfiniBand: one per GPU.
        inter_node=Link(bandwidth_bytes_per_s=50 * GB, latency_us=_NET_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
    ),
    "dgx-a100": ClusterSpec(
        name="dgx-a100", gpu="a100-80gb", gpus_per_node=8,
        # A100 data sheet: NVLink 600 GB/s (both directions) through DGX A100's six NVSwitches.
        intra_node=Link(bandwidth_bytes_per_s=300 * GB, latency_us=_NVLINK_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
        # DGX A100 data sheet: 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute
        # (Selene, where Korthikanti et al. 2022 ran, is built of these nodes).
        inter_node=Link(bandwidth_bytes_per_s=25 * GB, latency_us=_NET_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
    ),
    "gh200": ClusterSpec(
        name="gh200", gpu="gh200", gpus_per_node=4,
        # Quad GH200 node (HPE Cray EX254n, as in CSCS Alps): the four Hoppers are linked all to
        # all; each has 18 NVLink-4 links of 25 GB/s per direction (H100 data sheet), 6 to each
        # peer, so a ring step between two of them runs at 150 GB/s.
        intra_node=Link(bandwidth_bytes_per_s=150 * GB, latency_us=_NVLINK_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
        # One Slingshot-11 NIC of 200 Gb/s per GH200 (CSCS Alps documentation).
        inter_node=Link(bandwidth_bytes_per_s=25 * GB, latency_us=_NET_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
    ),
    "dgx-b200": ClusterSpec(
        name="dgx-b200", gpu="b200", gpus_per_node=8,
        # DGX B200 data sheet: fifth-generation NVLink, 1.8 TB/s per GPU (both directions).
        intra_node=Link(bandwidth_bytes_per_s=900 * GB, latency_us=_NVLINK_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
        # DGX B200 data sheet: 8x single-port ConnectX-7, up to 400 Gb/s: one per GPU.
        inter_node=Link(bandwidth_bytes_per_s=50 * GB, latency_us=_NET_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
    ),
    "dgx-h200": ClusterSpec(
        name="dgx-h200", gpu="h200", gpus_per_node=8,
        # H200 data sheet: NVLink 900 GB/s (both directions), four NVSwitches as in DGX H100.
        intra_node=Link(bandwidth_bytes_per_s=450 * GB, latency_us=_NVLINK_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
        # DGX H200 data sheet: 8x single-port ConnectX-7, 400 Gb/s InfiniBand: one per GPU (as DGX H100).
        inter_node=Link(bandwidth_bytes_per_s=50 * GB, latency_us=_NET_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
    ),
    "dgx-b300": ClusterSpec(
        name="dgx-b300", gpu="b300", gpus_per_node=8,
        # systems.json DGX-B300 (secondary: restatements of NVIDIA's DGX/HGX B300 data sheet): NVLink 5,
        # 1.8 TB/s bidirectional per GPU, 14.4 TB/s per 8 GPUs.
        intra_node=Link(bandwidth_bytes_per_s=900 * GB, latency_us=_NVLINK_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
        # The same: 8 ConnectX-8 SuperNICs of 800 Gb/s, one per GPU.
        inter_node=Link(bandwidth_bytes_per_s=100 * GB, latency_us=_NET_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
    ),
    "gb200-nvl72": ClusterSpec(
        name="gb200-nvl72", gpu="gb200", gpus_per_node=4, gpus_per_nvlink_domain=72,
        # NVIDIA DGX GB200 User Guide, Hardware: 72-GPU NVL domains, 18 compute trays of 4 Blackwell GPUs,
        # 9 NVLink switch trays; Networking: 1.8 TB/s bidirectional per GPU with NVLink 5.0.
        intra_node=Link(bandwidth_bytes_per_s=900 * GB, latency_us=_NVLINK_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
        # DGX SuperPOD GB200 reference architecture: NDR 400 Gb/s InfiniBand compute fabric between
        # racks; one NIC per GPU (as in the GB300 tray: 4 HCAs per 4-GPU tray).
        inter_node=Link(bandwidth_bytes_per_s=50 * GB, latency_us=_NET_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
    ),
    "gb300-nvl72": ClusterSpec(
        name="gb300-nvl72", gpu="gb300", gpus_per_node=4, gpus_per_nvlink_domain=72,
        # NVIDIA Enterprise Reference Architecture, NVL72 AI factory: 9 NVSwitch trays joining all 72
        # Blackwell Ultra GPUs at 130 TB/s (1.8 TB/s per GPU, both directions); trays of 4 GPUs.
        intra_node=Link(bandwidth_bytes_per_s=900 * GB, latency_us=_NVLINK_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
        # The same: 4 ConnectX-8 HCAs per 4-GPU tray; 800 Gb/s each (secondary: restating NVIDIA's page).
        inter_node=Link(bandwidth_bytes_per_s=100 * GB, latency_us=_NET_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
    ),
    "pcie-l4": ClusterSpec(
        name="pcie-l4", gpu="l4", gpus_per_node=8,
        # L4 data sheet: PCIe Gen4 x16, 64 GB/s (both directions); no NVLink.
        intra_node=Link(bandwidth_bytes_per_s=32 * GB, latency_us=_PCI_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
        # Google Cloud g2-standard-96 (8 L4): 100 Gb/s network per VM, shared by 8 GPUs.
        inter_node=Link(bandwidth_bytes_per_s=100 * GB / 8 / 8, latency_us=_NET_LATENCY_US,
                        call_latency_us=_CALL_LATENCY_US),
    ),
}


def resolve_cluster(name_or_path: str | Path) -> ClusterSpec:
    """A preset by name, or a TOML file by path.

    Raises
    ------
    BadInputError
        If it is neither a preset nor a readable, valid cluster file.

    Examples
    --------
    >>> resolve_cluster("dgx-a100").gpus_per_node
    8
    """
    text = str(name_or_path)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if path.suffix.lower() == ".toml" or path.exists():
        return load_cluster_file(path, PRESETS)
    raise BadInputError(
        f"--cluster: {text!r} is neither a preset ({', '.join(PRESETS)}) nor a TOML file")
