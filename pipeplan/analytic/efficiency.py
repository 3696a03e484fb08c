"""Time from work: the efficiency model (how close each kind of kernel gets to the GPU's peaks).

Each part of a unit (:mod:`pipeplan.analytic.flops`) takes

    part_ms = max(flops / (peak_flops x efficiency[kind]), bytes / (hbm_bytes_per_s x memory)) + kernel_latency

so a GEMM is compute-bound or memory-bound by its arithmetic intensity (the roofline model:
Williams, Waterman, Patterson 2009), and the fixed latency makes achieved FLOP/s grow with the
GEMM's size: ``achieved = flops / (flops / (peak x e) + latency)`` reaches half of ``peak x e``
at ``flops = peak x e x latency`` (about 3 GFLOP on an H100 with the defaults).

The defaults (:data:`DEFAULT_EFFICIENCY`) and their sources:

- ``gemm = 0.75``: large 16-bit cuBLAS GEMMs reach 70-80% of the dense tensor-core peak on
  A100 and H100 (NVIDIA, "Matrix Multiplication Background User's Guide", Deep Learning
  Performance documentation; Megatron-LM reaches 52% of peak end to end on A100 with the
  communication and the bubble included: Narayanan et al. 2021, table 1);
- ``attention = 0.5``: FlashAttention-2 reaches 50-73% of peak forward and less backward on
  A100 (Dao 2023, section 4.1), about 35% on H100;
- ``memory = 0.8``: elementwise kernels stream at about 80% of the data sheet's HBM bandwidth;
- ``kernel_latency_us = 4``: launch and tail of one kernel.

These are assumptions, not measurements of your GPU: ``pipeplan calibrate`` fits them to a
measured profile of the same model (:func:`fit_efficiency`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeplan.analytic.flops import Part

__all__ = ["EfficiencyModel", "DEFAULT_EFFICIENCY", "part_ms", "parts_ms"]


class EfficiencyModel(BaseModel):
    """Achieved fractions of the GPU's peaks, per kind of part."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gemm: float = Field(default=0.75, gt=0, le=1, description="Fraction of peak FLOP/s a large GEMM reaches.")
    attention: float = Field(default=0.5, gt=0, le=1, description="Fraction of peak FLOP/s the attention core reaches.")
    memory: float = Field(default=0.8, gt=0, le=1, description="Fraction of peak HBM bandwidth streaming kernels reach.")
    kernel_latency_us: float = Field(default=4.0, ge=0, description="Fixed time per kernel (launch, tail).")
    source: str = Field(default="pipeplan default (docs/analytic.md, 'Efficiency')", description="Where the figures come from.")


DEFAULT_EFFICIENCY = EfficiencyModel()


def part_ms(part: Part, peak_flops: float, hbm_bytes_per_s: float, model: EfficiencyModel,
            quantized_peak_flops: float | None = None) -> float:
    """One part's time in milliseconds (see the module docstring); a quantized GEMM
    (``--precision``) runs at ``quantized_peak_flops`` with the same GEMM efficiency."""
    compute_s = 0.0
    if part.flops:
        fraction = model.attention if part.kind == "attention" else model.gemm
        peak = quantized_peak_flops if part.quantized and quantized_peak_flops else peak_flops
        compute_s = part.flops / (peak * fraction)
    memory_s = part.bytes / (hbm_bytes_per_s * model.memory)
    return 1e3 * max(compute_s, memory_s) + model.kernel_latency_us / 1e3


def parts_ms(parts: list[Part], peak_flops: float, hbm_bytes_per_s: float, model: EfficiencyModel,
             quantized_peak_flops: float | None = None) -> float:
    """The sum of :func:`part_ms` over ``parts``."""
    return sum(part_ms(p, peak_flops, hbm_bytes_per_s, model, quantized_peak_flops) for p in parts)
