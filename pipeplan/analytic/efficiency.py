"""Time from work: the efficiency model (how close each kind of kernel gets to the GPU's peaks).

Each part of a unit (:mod:`pipeplan.analytic.flops`) takes

    part_ms = max(flops x shape / (peak_flops x efficiency[kind]), bytes / (hbm_bytes_per_s x memory))
              + kernel_latency

so a GEMM is compute-bound or memory-bound by its arithmetic intensity (the roofline model:
Williams, Waterman, Patterson 2009), and the fixed latency makes achieved FLOP/s grow with the
GEMM's size. ``shape`` (:func:`gemm_shape_factor`, at least 1) is what a GEMM of ``m x n``
outputs per group, ``groups`` groups and reduction ``k`` loses against a large one on a GPU of
``sm_count`` SMs. Each output tile of ``tm x tn`` is one thread block's work; m and n are padded
to the tile (tile quantisation: ``pad = tiles tm tn / (groups m n)`` with
``tiles = groups ceil(m/tm) ceil(n/tn)``), and each tile's k loop pays a fixed pipeline fill of
``k0 = gemm_k_overhead`` elements of k. The library runs the tiles one of two ways and takes
the faster (NVIDIA, "Matrix Multiplication Background User's Guide", Deep Learning Performance
documentation, "Tile quantization" and "Wave quantization"; Osama et al. 2023, "Stream-K:
Work-centric Parallel Decomposition for Dense Matrix-Matrix Multiplication on the GPU", PPoPP,
as CUTLASS's and cuBLAS's stream-K kernels run it):

- data-parallel, the tiles in waves of ``sm_count`` (wave quantisation):
  ``pad x ceil(tiles / sm_count) sm_count / tiles x (1 + k0 / k)``;
- stream-K, the ``tiles x k`` iterations split evenly over the SMs, each SM paying the fill once
  per tile it touches (``tiles / sm_count + 1`` of them):
  ``pad x (1 + k0 / k + sm_count k0 / (tiles k))`` (the partial tiles' fix-up not counted).

``shape`` is the smaller, over the tiles :data:`GEMM_TILES`. Without ``sm_count`` (a
``--gpu-spec`` without one) it is ``pad x (1 + k0 / k)``.

A unit's pass is timed as the GPU's sum or the host's, whichever is longer (:func:`pass_ms`):
eager PyTorch launches each kernel from Python, and where the kernels are shorter than the host
takes to launch them, the GPU waits. ``host_ms = launches x host_us_per_kernel`` with the
launches from the parts (:attr:`pipeplan.analytic.flops.Part.launches`). Taking the maximum per
unit pass says the host cannot run ahead across a unit, which holds where the launcher
synchronises the host each layer (Megatron-core's all-to-all token dispatcher waits for the
token counts on the host each MoE layer: ``moe/token_dispatcher.py``,
``_maybe_dtoh_and_synchronize``) and is pessimistic by at most the host-bound units' excess
where it does not.

The defaults (:data:`DEFAULT_EFFICIENCY`) and their sources:

- ``gemm = 0.75``: large 16-bit cuBLAS GEMMs reach 70-80% of the dense tensor-core peak on
  A100 and H100 (NVIDIA, "Matrix Multiplication Background User's Guide", Deep Learning
  Performance documentation; Megatron-LM reaches 52% of peak end to end on A100 with the
  communication and the bubble included: Narayanan et al. 2021, table 1);
- ``gemm_k_overhead = 64``: one k block of CUTLASS's 16-bit Hopper and Blackwell tiles
  (``128 x 128 x 64``), the pipeline fill before a tile's first MMA (the warp-specialised
  kernels overlap the rest of the prologue and the epilogue with the next tile's loads);
- ``attention = 0.5``: FlashAttention-2 reaches 50-73% of peak forward and less backward on
  A100 (Dao 2023, section 4.1), about 35% on H100;
- ``memory = 0.8``: elementwise kernels stream at about 80% of the data sheet's HBM bandwidth;
- ``kernel_latency_us = 4``: launch and tail of one kernel on the GPU;
- ``host_us_per_kernel = 9.2``: the host's time to launch one kernel from eager PyTorch: the
  dispatcher's 4.3 us per autograd-recorded op (measured, ``benchmarks/bench_host_overhead.py``
  on the development CPU) plus the CUDA driver's 4.9 us per launch from compiled C
  (JuliaGPU/CUDAdrv.jl pull request 15's measurement, "mostly spent in libcuda").

These are assumptions, not measurements of your GPU: ``pipeplan calibrate`` fits them to a
measured profile of the same model (:func:`fit_efficiency`).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from pipeplan.analytic.flops import Part

__all__ = ["EfficiencyModel", "DEFAULT_EFFICIENCY", "GEMM_TILES", "gemm_shape_factor", "part_ms",
           "parts_ms", "pass_ms", "host_ms", "CUDA_LAUNCH_HOST_US", "grouped_launch_host_ms"]

#: Output tiles (rows, columns) of one thread block that cuBLAS and CUTLASS pick among for 16-bit
#: and 8-bit GEMMs on Ampere, Hopper and Blackwell (CUTLASS's default tile shapes; the brief's
#: "128x128 / 128x256"); one set for every GPU.
GEMM_TILES = ((128, 128), (128, 256), (256, 128))


class EfficiencyModel(BaseModel):
    """Achieved fractions of the GPU's peaks, per kind of part, and the fixed costs per kernel."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gemm: float = Field(default=0.75, gt=0, le=1, description="Fraction of peak FLOP/s a large GEMM reaches "
                        "(one whose tiles fill whole waves and whose k is long).")
    attention: float = Field(default=0.5, gt=0, le=1, description="Fraction of peak FLOP/s the attention core reaches.")
    memory: float = Field(default=0.8, gt=0, le=1, description="Fraction of peak HBM bandwidth streaming kernels reach.")
    kernel_latency_us: float = Field(default=4.0, ge=0, le=2000, description="Fixed GPU time per kernel (launch, tail).")
    # The shape and host terms after the four the first calibrate fits (their order kept).
    gemm_k_overhead: float = Field(default=64.0, ge=0, le=4096, description="Fixed cost of a GEMM tile's k loop "
                                   "(pipeline fill), in elements of k.")
    host_us_per_kernel: float = Field(default=9.2, ge=0, le=2000, description="Host time to launch one kernel from "
                                      "the framework (Python dispatch and the CUDA launch).")
    source: str = Field(default="pipeplan default (docs/analytic.md, 'Efficiency')", description="Where the figures come from.")


DEFAULT_EFFICIENCY = EfficiencyModel()


def gemm_shape_factor(part: Part, sm_count: Optional[int], k_overhead: float) -> float:
    """How much longer a GEMM takes than a large one of its FLOPs (at least 1 where k_overhead
    is 0; the module docstring's ``shape``); 1 for a part without GEMM dimensions.

    Examples
    --------
    >>> from pipeplan.analytic.flops import Part
    >>> big = Part("g", "gemm", 0.0, 0.0, m=8192, n=8192, k=8192)
    >>> gemm_shape_factor(big, 128, 0.0)       # 64 x 64 tiles of 128: 32 full waves
    1.0
    >>> gemm_shape_factor(Part("g", "gemm", 0.0, 0.0, m=100, n=128, k=4096), None, 0.0)   # m padded to 128
    1.28
    """
    if not (part.m > 0 and part.n > 0 and part.k > 0):
        return 1.0
    return _shape_factor(part.m, part.n, part.k, part.groups, sm_count, k_overhead)


@functools.lru_cache(maxsize=65536)
def _shape_factor(m: float, n: float, k: float, groups: int, sm_count: Optional[int], k_overhead: float) -> float:
    # Cached: a profile asks for the same few shapes at every unit, size and degree.
    fill = k_overhead / k
    best = math.inf
    for tile_m, tile_n in GEMM_TILES:
        tiles = groups * math.ceil(m / tile_m) * math.ceil(n / tile_n)
        pad = tiles * tile_m * tile_n / (groups * m * n)
        if not sm_count:
            best = min(best, pad * (1 + fill))
            continue
        waves = math.ceil(tiles / sm_count) * sm_count / tiles
        stream_k = 1 + fill + sm_count * fill / tiles
        best = min(best, pad * waves * (1 + fill), pad * stream_k)
    return best


def part_ms(part: Part, peak_flops: float, hbm_bytes_per_s: float, model: EfficiencyModel,
            quantized_peak_flops: float | None = None, sm_count: Optional[int] = None) -> float:
    """One part's GPU time in milliseconds (see the module docstring); a quantized GEMM
    (``--precision``) runs at ``quantized_peak_flops`` with the same GEMM efficiency."""
    compute_s = 0.0
    if part.flops:
        fraction = model.attention if part.kind == "attention" else model.gemm
        peak = quantized_peak_flops if part.quantized and quantized_peak_flops else peak_flops
        compute_s = part.flops / (peak * fraction)
        if part.kind == "gemm":
            compute_s *= gemm_shape_factor(part, sm_count, model.gemm_k_overhead)
    memory_s = part.bytes / (hbm_bytes_per_s * model.memory)
    return 1e3 * max(compute_s, memory_s) + model.kernel_latency_us / 1e3


def parts_ms(parts: list[Part], peak_flops: float, hbm_bytes_per_s: float, model: EfficiencyModel,
             quantized_peak_flops: float | None = None, sm_count: Optional[int] = None) -> float:
    """The GPU's time for ``parts``: the sum of :func:`part_ms`."""
    return sum(part_ms(p, peak_flops, hbm_bytes_per_s, model, quantized_peak_flops, sm_count) for p in parts)


def host_ms(parts: list[Part], model: EfficiencyModel) -> float:
    """The host's time to launch ``parts``: ``launches x host_us_per_kernel``."""
    return sum(p.launches for p in parts) * model.host_us_per_kernel / 1e3


#: The host's time for one CUDA launch from compiled code, no Python dispatch: the CUDA driver's
#: 4.9 us of ``host_us_per_kernel`` (the same source, JuliaGPU/CUDAdrv.jl pull request 15). What
#: Transformer Engine's grouped GEMM pays per local expert beyond the first: ``GroupedLinear``
#: makes one Python call, and ``multi_stream_cublas_gemm`` (transformer_engine/common/gemm/
#: cublaslt_gemm.cu) launches one cuBLAS GEMM per expert from C++, round-robin on its 4 streams.
CUDA_LAUNCH_HOST_US = 4.9


def grouped_launch_host_ms(parts: list[Part]) -> float:
    """The host's time one more group of ``parts``' grouped GEMMs costs (those with ``groups > 1``):
    ``grouped GEMMs x CUDA_LAUNCH_HOST_US``. A routed GEMM's host launch in :func:`host_ms` is one
    Python call; TE launches one GEMM per local expert, so an expert-parallel rank holding ``n``
    experts pays ``(n - 1)`` times this on top (docs/analytic.md, "Host overhead")."""
    return sum(1 for p in parts if p.groups > 1) * CUDA_LAUNCH_HOST_US / 1e3


def pass_ms(parts: list[Part], peak_flops: float, hbm_bytes_per_s: float, model: EfficiencyModel,
            quantized_peak_flops: float | None = None, sm_count: Optional[int] = None) -> tuple[float, float]:
    """One unit pass: ``(max(gpu_ms, host_ms), host_wait_ms)``, the wait being how long of it the
    GPU idles for the host (``max(0, host_ms - gpu_ms)``)."""
    gpu = parts_ms(parts, peak_flops, hbm_bytes_per_s, model, quantized_peak_flops, sm_count)
    host = host_ms(parts, model)
    return max(gpu, host), max(0.0, host - gpu)
