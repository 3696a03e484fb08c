"""GPU specifications: peak dense FLOP/s per dtype, HBM bandwidth and capacity, intra-node link.

Every figure of a shipped spec is the vendor's data sheet figure (source in the comment beside
it). Peak FLOP/s are **dense** (the data sheets' headline tensor figures are often "with
sparsity", twice as high). ``link_bytes_per_s`` is one direction of the GPU's intra-node link
(NVLink's "900 GB/s" is both directions together: 450 GB/s each way), which is what a ring
collective runs at. HBM capacities are binary (an "80 GB" HBM part holds 80 GiB).

``--gpu-spec my.toml`` reads any other GPU (:func:`pipeplan.formats.gpu.load_gpu_spec`)::

    name = "my-gpu"
    memory = "80GiB"
    hbm_bandwidth = "3.35TB/s"
    link_bandwidth = "450GB/s"
    source = "where the figures come from"
    [peak_flops]
    bf16 = 989.4e12
    fp16 = 989.4e12
    fp32 = 67e12
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeplan.errors import BadInputError

__all__ = ["GpuSpec", "GPUS", "PRECISIONS", "get_gpu", "gpu_rows"]

_GIB = 2**30

#: The precisions ``peak_flops`` may name, widest first.
PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4")


class GpuSpec(BaseModel):
    """One GPU's figures, in bytes, bytes per second and FLOP per second."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Short name used on the command line, e.g. h100-sxm.")
    description: str = Field(default="", description="The product's full name.")
    memory_bytes: int = Field(gt=0, description="HBM capacity.")
    hbm_bytes_per_s: float = Field(gt=0, description="Peak HBM bandwidth.")
    link_bytes_per_s: float = Field(gt=0, description="Intra-node link bandwidth per direction.")
    peak_flops: dict[str, float] = Field(description="Dense peak FLOP/s per dtype (fp32, tf32, bf16, fp16, fp8).")
    source: str = Field(default="", description="Where the figures come from.")

    @field_validator("peak_flops")
    @classmethod
    def _positive(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("give at least one dtype, e.g. bf16 = 989.4e12")
        for dtype, flops in value.items():
            if dtype not in PRECISIONS:
                raise ValueError(f"{dtype!r} is not one of {', '.join(PRECISIONS)}")
            if not flops > 0:
                raise ValueError(f"{dtype}: {flops!r} must be positive")
        return value

    def flops_for(self, dtype: str) -> float:
        """Peak dense FLOP/s for a training dtype; BadInputError naming the GPU if not listed."""
        if dtype not in self.peak_flops:
            raise BadInputError(
                f"--dtype: {self.name} has no peak for {dtype}; it lists {', '.join(sorted(self.peak_flops))}"
            )
        return self.peak_flops[dtype]


def _spec(name, description, memory_gib, hbm, link, flops, source) -> GpuSpec:
    return GpuSpec(name=name, description=description, memory_bytes=int(memory_gib * _GIB),
                   hbm_bytes_per_s=hbm, link_bytes_per_s=link, peak_flops=flops, source=source)


# Hopper's dense peaks (H100 SXM data sheet; the H200 and GH200 data sheets give the same).
_HOPPER = {"fp64": 34e12, "fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12}
# A100 SXM's dense peaks (both memory sizes).
_AMPERE = {"fp64": 19.5e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}

GPUS: dict[str, GpuSpec] = {s.name: s for s in (
    # NVIDIA H100 Tensor Core GPU data sheet (H100 SXM column): FP64 34 TF, FP32 67 TF, TF32 989 TF*,
    # BF16/FP16 1,979 TF*, FP8 3,958 TF* (* with sparsity: dense is half), 80 GB HBM3 at 3.35 TB/s,
    # NVLink 900 GB/s.
    _spec("h100-sxm", "NVIDIA H100 SXM5 80GB", 80, 3.35e12, 450e9,
          _HOPPER,
          "NVIDIA H100 Tensor Core GPU data sheet, SXM column (dense = half the sparsity figures)"),
    # NVIDIA H200 Tensor Core GPU data sheet (H200 SXM): same Hopper compute as H100 SXM,
    # 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    _spec("h200", "NVIDIA H200 SXM 141GB", 141, 4.8e12, 450e9,
          _HOPPER,
          "NVIDIA H200 Tensor Core GPU data sheet, SXM column"),
    # NVIDIA GH200 Grace Hopper Superchip data sheet (96 GB HBM3 version): H100 compute, 96 GB HBM3 at
    # 4 TB/s; GPU-to-GPU NVLink 900 GB/s (NVLink Switch systems).
    _spec("gh200", "NVIDIA GH200 Grace Hopper (96GB HBM3)", 96, 4.0e12, 450e9,
          _HOPPER,
          "NVIDIA GH200 Grace Hopper Superchip data sheet (96 GB HBM3)"),
    # NVIDIA DGX B200 / HGX B200 data sheet, per GPU: FP8 9 PF* and FP16/BF16 4.5 PF* (* sparse; dense
    # half), TF32 2.2 PF*, FP32 75 TF, 180 GB HBM3e (1,440 GB per 8 GPUs) at 8 TB/s (64 TB/s per 8),
    # fifth-generation NVLink 1.8 TB/s.
    _spec("b200", "NVIDIA B200 (HGX/DGX B200)", 180, 8.0e12, 900e9,
          {"fp64": 37e12, "fp32": 75e12, "tf32": 1.1e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15},
          "NVIDIA DGX B200 and HGX B200 data sheets, per GPU (dense = half the sparsity figures)"),
    # NVIDIA A100 Tensor Core GPU data sheet (A100 40GB SXM): FP32 19.5 TF, TF32 156 TF, BF16/FP16
    # 312 TF (dense), 1,555 GB/s HBM2, NVLink 600 GB/s.
    _spec("a100-40gb", "NVIDIA A100 SXM4 40GB", 40, 1.555e12, 300e9,
          _AMPERE,
          "NVIDIA A100 Tensor Core GPU data sheet, 40GB SXM column"),
    # The same data sheet, A100 80GB SXM: 2,039 GB/s HBM2e.
    _spec("a100-80gb", "NVIDIA A100 SXM4 80GB", 80, 2.039e12, 300e9,
          _AMPERE,
          "NVIDIA A100 Tensor Core GPU data sheet, 80GB SXM column"),
    # NVIDIA L4 Tensor Core GPU data sheet: FP32 30.3 TF, TF32 120 TF*, BF16/FP16 242 TF*, FP8 485 TF*
    # (* sparse), 24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16 (64 GB/s both ways), no NVLink.
    _spec("l4", "NVIDIA L4 24GB (PCIe)", 24, 300e9, 32e9,
          {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12, "fp8": 242.5e12},
          "NVIDIA L4 Tensor Core GPU data sheet (dense = half the sparsity figures)"),
    # AMD Instinct MI300X data sheet: FP32 163.4 TF, TF32 653.7 TF, FP16/BF16 1,307.4 TF, FP8 2,614.9 TF
    # (dense), 192 GB HBM3 at 5.3 TB/s, Infinity Fabric 896 GB/s aggregate (7 links x 128 GB/s, both ways).
    _spec("mi300x", "AMD Instinct MI300X 192GB", 192, 5.3e12, 448e9,
          {"fp64": 81.7e12, "fp32": 163.4e12, "tf32": 653.7e12, "bf16": 1307.4e12, "fp16": 1307.4e12,
           "fp8": 2614.9e12},
          "AMD Instinct MI300X accelerator data sheet"),
)}


def get_gpu(name: str) -> GpuSpec:
    """A shipped spec by name; BadInputError listing the known ones otherwise."""
    key = name.strip().lower()
    if key not in GPUS:
        raise BadInputError(f"--gpu: {name!r} is not a known GPU; known: {', '.join(GPUS)} (or give --gpu-spec FILE)")
    return GPUS[key]


def gpu_rows() -> list[dict[str, Any]]:
    """One row per shipped GPU, for ``pipeplan gpus``."""
    return [
        {"name": s.name, "description": s.description, "memory_gib": s.memory_bytes / _GIB,
         "bf16_tflops": s.peak_flops.get("bf16", 0) / 1e12, "fp8_tflops": s.peak_flops.get("fp8", 0) / 1e12,
         "hbm_tb_per_s": s.hbm_bytes_per_s / 1e12, "link_gb_per_s": s.link_bytes_per_s / 1e9, "source": s.source}
        for s in GPUS.values()
    ]
