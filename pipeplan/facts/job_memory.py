"""Memory a real training job holds per GPU beside what pipeplan plans: the documented figures.

Each figure has its source beside it; docs/cluster-model.md, "Memory a real job sees", gives the
formulas that turn them into a plan's reserve (:mod:`pipeplan.cluster.memory`).

- **CUDA context**: the driver's per-process state and the loaded kernels' code. PyTorch's own
  measurement (pytorch/pytorch#86509, the PR that made ``CUDA_MODULE_LOADING=LAZY`` PyTorch's
  default): 666,632,192 bytes with every module loaded eagerly, 287,047,680 bytes lazily. A
  training job runs a large share of its kernels (GEMMs, attention, NCCL, fused optimizers), so
  the eager figure is taken: a job that runs every kernel it links pays it, and lazy loading only
  defers it (CUDA Programming Guide, "Lazy Loading": on by default on Linux since CUDA 12.2). No
  per-GPU-type measurement was found; the same figure stands for every GPU until one is measured
  (``cuda_context`` in the cluster spec overrides it).
- **cuBLAS / cuBLASLt workspaces**, one each per (handle, stream); PyTorch's defaults
  (aten/src/ATen/cuda/CublasHandlePool.cpp, ``CUBLAS_WORKSPACE_CONFIG``): ``:4096:8`` (8 x 4 MiB =
  32 MiB) on compute capability 9.0 and later, ``:4096:2:16:8`` (2 x 4 MiB + 8 x 16 KiB) before;
  cuBLASLt (``CUBLASLT_WORKSPACE_SIZE``, pytorch/pytorch#120925, following the cuBLAS guide's
  recommendation): 32 MiB from 9.0, 4 MiB on Ampere with at least 24 GiB, 1 MiB otherwise. One
  compute stream is counted (the launchers' GEMMs run on the default stream).
- **NCCL communicator buffers**: ``NCCL_BUFFSIZE`` (NCCL's environment-variable docs: default
  4 MiB, the Simple protocol's buffer per channel per peer connection). Channels: the number NCCL
  opens depends on the topology; the NCCL log in NVIDIA/nccl#1189 (two 2-GPU nodes) shows "8 coll
  channels, ... 2 p2p channels per peer", the figures taken here (NVSwitch nodes may open up to 32,
  NCCL's ``NCCL_MAX_NCHANNELS``: ``nccl_channels`` in the cluster spec overrides it).
- **The caching allocator's fragmentation**: the share of the allocated bytes the allocator holds
  but cannot hand out (the PyTorch CUDA semantics docs, "Memory management";
  ``expandable_segments`` reduces it). No launcher-specific measurement was found; pipeplan keeps
  5% for every launcher (the figure it always used, an assumption, not a measurement), in a table
  per launcher so that a measured figure replaces one row, not a constant.
"""

from __future__ import annotations

__all__ = ["CUDA_CONTEXT_BYTES", "NCCL_BUFFSIZE_BYTES", "NCCL_COLL_CHANNELS", "NCCL_P2P_CHANNELS_PER_PEER",
           "FRAGMENTATION_SHARE", "COMPUTE_CAPABILITY", "cublas_workspace_bytes", "fragmentation_share",
           "SOURCES"]

_MIB = 2**20

#: The CUDA context with PyTorch's kernels loaded (pytorch/pytorch#86509: eager module loading).
CUDA_CONTEXT_BYTES = 666_632_192

#: NCCL_BUFFSIZE's default (NCCL docs, Environment Variables: 4194304).
NCCL_BUFFSIZE_BYTES = 4 * _MIB

#: Channels of a collective communicator, and of a point-to-point connection per peer (NCCL's
#: log in NVIDIA/nccl#1189: "8 coll channels ... 2 p2p channels per peer").
NCCL_COLL_CHANNELS = 8
NCCL_P2P_CHANNELS_PER_PEER = 2

#: The caching allocator's fragmentation per launcher (module docstring: 5% for each, assumed).
FRAGMENTATION_SHARE = {None: 0.05, "megatron": 0.05, "deepspeed": 0.05, "torchtitan": 0.05}

#: Compute capability (major, minor) of the shipped GPUs (NVIDIA's CUDA GPUs table); it picks
#: PyTorch's cuBLAS workspace sizes. MI300X runs hipBLASLt, whose default PyTorch leaves at 1 MiB.
COMPUTE_CAPABILITY = {"h100-sxm": (9, 0), "h200": (9, 0), "gh200": (9, 0), "b200": (10, 0), "b300": (10, 3),
                      "gb200": (10, 0), "gb300": (10, 3), "a100-40gb": (8, 0), "a100-80gb": (8, 0),
                      "l4": (8, 9), "mi300x": None}

SOURCES = {
    "cuda_context": "pytorch/pytorch#86509: 666,632,192 bytes with eager module loading (287,047,680 lazily)",
    "cublas_workspace": "PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp and CUDABlas.cpp (pytorch/pytorch#120925)",
    "nccl_buffers": "NCCL docs, NCCL_BUFFSIZE (4 MiB); NVIDIA/nccl#1189's log: 8 coll channels, 2 p2p channels per peer",
    "fragmentation": "assumed 5% (pipeplan's figure before; no launcher-specific measurement found)",
}


def cublas_workspace_bytes(gpu: str, memory_bytes: int) -> int:
    """PyTorch's cuBLAS plus cuBLASLt workspace for one stream on ``gpu``.

    A GPU not in :data:`COMPUTE_CAPABILITY` (a ``--gpu-spec`` file) gets the largest (Hopper's).

    Examples
    --------
    >>> cublas_workspace_bytes("h100-sxm", 80 * 2**30) // 2**20          # 32 + 32 MiB
    64
    >>> cublas_workspace_bytes("a100-80gb", 80 * 2**30) / 2**20          # 8 MiB + 128 KiB + 4 MiB
    12.125
    """
    capability = COMPUTE_CAPABILITY.get(gpu, (9, 0))
    if capability is None:  # ROCm: hipBLAS's own, and hipBLASLt at PyTorch's 1 MiB
        return 2 * 4 * _MIB + 8 * 16 * 1024 + _MIB
    if capability >= (9, 0):
        return 8 * 4 * _MIB + 32 * _MIB
    lt = 4 * _MIB if capability[0] == 8 and memory_bytes >= 24 * 2**30 else _MIB
    return 2 * 4 * _MIB + 8 * 16 * 1024 + lt


def fragmentation_share(launcher) -> float:
    """The allocator's fragmentation share under ``launcher`` (:data:`FRAGMENTATION_SHARE`)."""
    return FRAGMENTATION_SHARE.get(launcher, FRAGMENTATION_SHARE[None])
