"""GPU specifications: peak dense FLOP/s per precision, HBM bandwidth and capacity, NVLink.

Every figure of a shipped spec is the vendor's data sheet figure (source in the comment beside
it, and per figure in ``GpuSpec.sources``). Peak FLOP/s are **dense** (the data sheets' headline
tensor figures are often "with sparsity", twice as high). ``peak_flops`` is keyed by precision:
``fp64``, ``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8`` (per-tensor scaled FP8), ``mxfp8``
(FP8 with one E8M0 scale per 32 values, run natively by Blackwell's tensor cores) and ``nvfp4``
(FP4 E2M1 with an FP8 scale per 16 values, Blackwell); a GPU lists a precision only where its
hardware runs it and a source gives the figure (Hopper has neither ``mxfp8`` nor ``nvfp4``).
``link_bytes_per_s`` is one direction of the GPU's NVLink (or PCIe) link (NVLink's "900 GB/s"
is both directions together: 450 GB/s each way), which is what a ring collective runs at. HBM
capacities are binary (an "80 GB" HBM part holds 80 GiB). ``sm_count`` is the number of
streaming multiprocessors (AMD: compute units), from the architecture whitepaper or data sheet
(``_SM_COUNTS``, each with its source): how many GEMM tiles run at once.

``--gpu-spec my.toml`` reads any other GPU (:func:`pipeplan.formats.gpu.load_gpu_spec`)::

    name = "my-gpu"
    memory = "80GiB"
    hbm_bandwidth = "3.35TB/s"
    link_bandwidth = "450GB/s"
    sm_count = 132                   # optional: SMs (the GEMM model's wave quantisation)
    source = "where the figures come from"
    [peak_flops]
    bf16 = 989.4e12
    fp16 = 989.4e12
    fp32 = 67e12
    [sources]                        # optional: where each figure comes from
    "peak_flops.bf16" = "data sheet, dense"
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeplan.errors import BadInputError

__all__ = ["GpuSpec", "GPUS", "PRECISIONS", "get_gpu", "gpu_rows", "HOST_LINK_BYTES_PER_S", "HOST_LINK_SOURCES"]

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
    peak_flops: dict[str, float] = Field(
        description="Dense peak FLOP/s per precision: fp64, fp32, tf32, bf16, fp16, fp8, mxfp8, nvfp4 (module "
                    "docstring); a precision the GPU does not run is absent.")
    sm_count: Optional[int] = Field(
        default=None, gt=0, le=10000,
        description="Streaming multiprocessors (AMD: compute units): how many GEMM tiles run at once (the "
                    "efficiency model's wave quantisation; absent: not modelled).")
    source: str = Field(default="", description="Where the figures come from.")
    sources: dict[str, str] = Field(
        default_factory=dict, exclude=True,
        description="Where each figure comes from, keyed by field (memory_bytes, hbm_bytes_per_s, "
                    "link_bytes_per_s) or peak_flops.<precision>. Not dumped: a profile records the "
                    "figures, this says where they come from.")

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
        """Peak dense FLOP/s for a precision (a key of ``peak_flops``); BadInputError naming the GPU
        and the precisions it lists if not listed.

        Examples
        --------
        >>> GPUS["b200"].flops_for("nvfp4") / 1e15
        9.0
        """
        if dtype not in self.peak_flops:
            raise BadInputError(
                f"--dtype: {self.name} has no peak for {dtype}; it lists {', '.join(sorted(self.peak_flops))}"
            )
        return self.peak_flops[dtype]


def _spec(name, description, memory_gib, hbm, link, flops, source, sources=None) -> GpuSpec:
    sm_count, sm_source = _SM_COUNTS[name]
    return GpuSpec(name=name, description=description, memory_bytes=int(memory_gib * _GIB),
                   hbm_bytes_per_s=hbm, link_bytes_per_s=link, peak_flops=flops, source=source,
                   sm_count=sm_count, sources={**(sources or {}), "sm_count": sm_source})


_HOPPER_PAPER = "NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 1: H100 SXM5, 132 SMs"
#: SMs per shipped GPU, with the source of each (the efficiency model's wave quantisation).
_SM_COUNTS = {
    "h100-sxm": (132, _HOPPER_PAPER),
    "h200": (132, f"{_HOPPER_PAPER} (the H200 is the same GH100 configuration with HBM3e)"),
    "gh200": (132, f"{_HOPPER_PAPER} (NVIDIA Grace Hopper Superchip Architecture whitepaper: the H100 GPU of GH200)"),
    "b200": (148, "CUDA's multiProcessorCount on a B200: 148 (the full GB100 pair has 160; NVIDIA Blackwell "
                  "architecture technical brief)"),
    "gb200": (148, "the B200's 148 SMs (GB200's GPUs are the same Blackwell configuration at a higher clock)"),
    "b300": (160, "NVIDIA technical blog, 'Inside NVIDIA Blackwell Ultra' (2025): 160 SMs"),
    "gb300": (160, "NVIDIA technical blog, 'Inside NVIDIA Blackwell Ultra' (2025): 160 SMs"),
    "a100-40gb": (108, "NVIDIA A100 Tensor Core GPU Architecture whitepaper: A100 has 108 SMs"),
    "a100-80gb": (108, "NVIDIA A100 Tensor Core GPU Architecture whitepaper: A100 has 108 SMs"),
    "l4": (58, "NVIDIA Ada GPU Architecture whitepaper, appendix: L4 (AD104), 58 SMs"),
    "mi300x": (304, "AMD Instinct MI300X data sheet: 304 GPU compute units"),
}


# Hopper's dense peaks (H100 SXM data sheet; the H200 and GH200 data sheets give the same).
_HOPPER = {"fp64": 34e12, "fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12}
# A100 SXM's dense peaks (both memory sizes).
_AMPERE = {"fp64": 19.5e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}

_H100_SHEET = "NVIDIA H100 Tensor Core GPU data sheet, H100 SXM column (dense = half the sparsity figures)"
_H200_SHEET = "NVIDIA H200 Tensor Core GPU data sheet, H200 SXM column"
_B200_SHEET = "NVIDIA DGX B200 / HGX B200 data sheets, per GPU = 8-GPU figure / 8 (dense = half the sparsity figures)"
_B300_SHEET = ("NVIDIA HGX B300 data sheet, per GPU = 8-GPU figure / 8 (FP4 given with and without sparsity; "
               "the rest with sparsity: dense is half)")
_GB200_SHEET = ("NVIDIA GB200 NVL72 product page spec table, per GPU = the 72-GPU rack's figure / 72 (with "
                "sparsity: dense is half)")
_GB300_SHEET = ("NVIDIA GB300 NVL72 product page spec table, per GPU = the 72-GPU rack's figure / 72 (FP4 given "
                "with and without sparsity; the rest with sparsity: dense is half)")
_SYSTEMS = "NVIDIA's system pages as gathered in pipeplan's data/modern-runs/systems.json"
# MXFP8 has no line of its own on any data sheet: Blackwell's fifth-generation tensor cores apply
# the E8M0 block scales inside the MMA (Transformer Engine's MXFP8 recipe: "native hardware
# acceleration on Blackwell GPUs (SM 10.0+)"), so it runs at the sheets' FP8/FP6 rate.
_MXFP8 = "= the data sheet's FP8/FP6 figure: Blackwell's tensor cores scale MX blocks natively (Transformer Engine docs)"


def _sourced(sheet: str, flops: dict[str, float], **fields: str) -> dict[str, str]:
    """Every figure's source: ``sheet`` for each peak (MXFP8: the FP8 figure, :data:`_MXFP8`), and the
    given fields' own."""
    out = {f"peak_flops.{key}": (f"{sheet}; {_MXFP8}" if key == "mxfp8" else sheet) for key in flops}
    out.update(fields)
    return out


# Blackwell B200's dense peaks, per GPU (HGX B200: FP4 144 PF sparse | 72 PF dense; FP8/FP6 72 PF*,
# FP16/BF16 36 PF*, TF32 18 PF*, FP32 600 TF, FP64 296 TF per 8 GPUs; * with sparsity).
_B200 = {"fp64": 37e12, "fp32": 75e12, "tf32": 1.1e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15,
         "mxfp8": 4.5e15, "nvfp4": 9e15}
# Blackwell Ultra B300, per GPU (HGX B300: FP4 144 PF sparse | 108 PF dense; FP8/FP6 72 PF*, FP16/BF16
# 36 PF*, TF32 18 PF*, FP32 600 TF, FP64 10 TF per 8 GPUs): B200's rates but FP4 x 1.5, FP64 cut.
_B300 = {"fp64": 1.25e12, "fp32": 75e12, "tf32": 1.125e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15,
         "mxfp8": 4.5e15, "nvfp4": 13.5e15}
# The GB200 superchip's Blackwell, per GPU (GB200 NVL72 rack: FP4 1,440 PF*, FP8/FP6 720 PF*, FP16/BF16
# 360 PF*, TF32 180 PF*, FP32 5,760 TF, FP64 2,880 TF over 72 GPUs): clocked above B200 (1.2 kW).
_GB200 = {"fp64": 40e12, "fp32": 80e12, "tf32": 1.25e15, "bf16": 2.5e15, "fp16": 2.5e15, "fp8": 5e15,
          "mxfp8": 5e15, "nvfp4": 10e15}
# The GB300 superchip's Blackwell Ultra, per GPU (GB300 NVL72 rack: FP4 1,440 PF sparse | 1,080 PF dense,
# FP8/FP6 720 PF*, FP16/BF16 360 PF*, TF32 180 PF*, FP32 6 PF, FP64 100 TF over 72 GPUs).
_GB300 = {"fp64": 100e12 / 72, "fp32": 6e15 / 72, "tf32": 1.25e15, "bf16": 2.5e15, "fp16": 2.5e15, "fp8": 5e15,
          "mxfp8": 5e15, "nvfp4": 15e15}

GPUS: dict[str, GpuSpec] = {s.name: s for s in (
    # NVIDIA H100 Tensor Core GPU data sheet (H100 SXM column): FP64 34 TF, FP32 67 TF, TF32 989 TF*,
    # BF16/FP16 1,979 TF*, FP8 3,958 TF* (* with sparsity: dense is half), 80 GB HBM3 at 3.35 TB/s,
    # NVLink 900 GB/s. No MXFP8 or NVFP4: Hopper's tensor cores have no block-scaled formats.
    _spec("h100-sxm", "NVIDIA H100 SXM5 80GB", 80, 3.35e12, 450e9,
          _HOPPER,
          "NVIDIA H100 Tensor Core GPU data sheet, SXM column (dense = half the sparsity figures)",
          _sourced(_H100_SHEET, _HOPPER, memory_bytes=f"{_H100_SHEET}: 80 GB HBM3",
                   hbm_bytes_per_s=f"{_H100_SHEET}: 3.35 TB/s",
                   link_bytes_per_s=f"{_H100_SHEET}: NVLink 900 GB/s (both directions) / 2")),
    # NVIDIA H200 Tensor Core GPU data sheet (H200 SXM): same Hopper compute as H100 SXM,
    # 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    _spec("h200", "NVIDIA H200 SXM 141GB", 141, 4.8e12, 450e9,
          _HOPPER,
          "NVIDIA H200 Tensor Core GPU data sheet, SXM column",
          _sourced(_H200_SHEET + " (the H100 SXM compute)", _HOPPER, memory_bytes=f"{_H200_SHEET}: 141 GB HBM3e",
                   hbm_bytes_per_s=f"{_H200_SHEET}: 4.8 TB/s",
                   link_bytes_per_s=f"{_H200_SHEET}: NVLink 900 GB/s (both directions) / 2")),
    # NVIDIA GH200 Grace Hopper Superchip data sheet (96 GB HBM3 version): H100 compute, 96 GB HBM3 at
    # 4 TB/s; GPU-to-GPU NVLink 900 GB/s (NVLink Switch systems).
    _spec("gh200", "NVIDIA GH200 Grace Hopper (96GB HBM3)", 96, 4.0e12, 450e9,
          _HOPPER,
          "NVIDIA GH200 Grace Hopper Superchip data sheet (96 GB HBM3)"),
    # NVIDIA DGX B200 / HGX B200 data sheet, per GPU: FP4 18 PF* (9 PF dense), FP8 9 PF* and FP16/BF16
    # 4.5 PF* (* sparse; dense half), TF32 2.2 PF*, FP32 75 TF, 180 GB HBM3e (1,440 GB per 8 GPUs) at
    # 8 TB/s (64 TB/s per 8), fifth-generation NVLink 1.8 TB/s.
    _spec("b200", "NVIDIA B200 (HGX/DGX B200)", 180, 8.0e12, 900e9,
          _B200,
          "NVIDIA DGX B200 and HGX B200 data sheets, per GPU (dense = half the sparsity figures)",
          _sourced(_B200_SHEET, _B200,
                   memory_bytes="NVIDIA DGX B200 User Guide: 1,440 GB total GPU memory / 8 = 180 GB HBM3e",
                   hbm_bytes_per_s=f"{_B200_SHEET}: 64 TB/s / 8 = 8 TB/s",
                   link_bytes_per_s="NVIDIA DGX B200 User Guide: 14.4 TB/s NVLink aggregate / 8 = 1.8 TB/s "
                                    "(both directions) / 2")),
    # NVIDIA HGX B300 data sheet, per GPU (module constants above): 288 GB HBM3e (2.3 TB per 8) at 8 TB/s,
    # NVLink 5 at 1.8 TB/s (14.4 TB/s per 8).
    _spec("b300", "NVIDIA B300 (Blackwell Ultra, HGX/DGX B300)", 288, 8.0e12, 900e9,
          _B300,
          "NVIDIA HGX B300 data sheet, per GPU (dense; FP4 dense given, the rest = half the sparsity figures)",
          _sourced(_B300_SHEET, _B300,
                   memory_bytes=f"{_SYSTEMS}, DGX-B300 (secondary: restatements of NVIDIA's DGX/HGX B300 data "
                                f"sheet): 288 GB HBM3e per GPU, 2.3 TB per 8",
                   hbm_bytes_per_s=f"{_B300_SHEET}: 8 TB/s per GPU",
                   link_bytes_per_s=f"{_SYSTEMS}, DGX-B300: NVLink 5, 1.8 TB/s bidirectional per GPU / 2")),
    # The GB200 NVL72's Blackwell GPUs (module constants above): ~186 GB HBM3e (13.4 TB per 72) at 8 TB/s
    # (576 TB/s per 72), NVLink 5 at 1.8 TB/s (130 TB/s per 72).
    _spec("gb200", "NVIDIA GB200 Grace Blackwell superchip's GPU (GB200 NVL72)", 186, 8.0e12, 900e9,
          _GB200,
          "NVIDIA GB200 NVL72 spec table, per GPU (rack / 72; dense = half the sparsity figures)",
          _sourced(_GB200_SHEET, _GB200,
                   memory_bytes=f"{_SYSTEMS}, DGX-GB200 (secondary): about 13.4 TB HBM3e per 72-GPU rack, "
                                f"~186 GB per GPU",
                   hbm_bytes_per_s=f"{_GB200_SHEET}: 576 TB/s / 72 = 8 TB/s",
                   link_bytes_per_s="NVIDIA DGX GB200 User Guide, Networking: 1.8 TB/s bidirectional per GPU "
                                    "with NVLink 5.0, / 2")),
    # The GB300 NVL72's Blackwell Ultra GPUs (module constants above): ~279 GB HBM3e (20 TB per 72) at
    # 8 TB/s (576 TB/s per 72), NVLink 5 at 1.8 TB/s (130 TB/s per 72).
    _spec("gb300", "NVIDIA GB300 Grace Blackwell Ultra superchip's GPU (GB300 NVL72)", 279, 8.0e12, 900e9,
          _GB300,
          "NVIDIA GB300 NVL72 spec table, per GPU (rack / 72; dense; FP4 dense given, the rest = half the "
          "sparsity figures)",
          _sourced(_GB300_SHEET, _GB300,
                   memory_bytes=f"{_SYSTEMS}, DGX-GB300 (secondary): 20 TB HBM3e per rack, 279 GB per GPU "
                                f"(others say 288 GB)",
                   hbm_bytes_per_s=f"{_GB300_SHEET}: 576 TB/s / 72 = 8 TB/s",
                   link_bytes_per_s="NVIDIA Enterprise Reference Architecture, NVL72 AI factory: 130 TB/s "
                                    "over 72 GPUs = 1.8 TB/s (both directions) / 2")),
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


#: The GPU's link to its host CPU's memory, one direction, bytes/s: what CPU activation offload
#: copies over (pipeplan.plan.offload). Grace superchips: NVLink-C2C, 900 GB/s both directions
#: (NVIDIA GH200 / GB200 NVL72 data sheets), 450 GB/s each way; x86 systems: PCIe Gen5 x16 (32 GT/s
#: x 16 lanes, 128b/130b: 63 GB/s each way; the DGX H100/H200/B200 user guides: PCIe Gen5 to the
#: CPUs), A100 and L4 PCIe Gen4 x16 (31.5 GB/s each way).
HOST_LINK_BYTES_PER_S = {"gh200": 450e9, "gb200": 450e9, "gb300": 450e9, "h100-sxm": 63e9, "h200": 63e9,
                         "b200": 63e9, "b300": 63e9, "mi300x": 63e9, "a100-40gb": 31.5e9, "a100-80gb": 31.5e9,
                         "l4": 31.5e9}
HOST_LINK_SOURCES = {
    "NVLink-C2C": "NVIDIA GH200 Grace Hopper and GB200 NVL72 data sheets: NVLink-C2C 900 GB/s (both directions)",
    "PCIe Gen5 x16": "PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b = 63 GB/s per direction",
    "PCIe Gen4 x16": "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s per direction",
}


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
         "nvfp4_tflops": s.peak_flops.get("nvfp4", 0) / 1e12,
         "hbm_tb_per_s": s.hbm_bytes_per_s / 1e12, "link_gb_per_s": s.link_bytes_per_s / 1e9, "source": s.source}
        for s in GPUS.values()
    ]
