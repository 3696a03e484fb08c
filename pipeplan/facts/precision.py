"""Training precisions as recipes: which GEMMs run quantized, at which peak, and what Transformer
Engine keeps in memory for them (``--precision``; docs/analytic.md, "Precision").

``--dtype`` stays the parameters' and activations' type (bf16); ``--precision`` says how the
GEMMs of the transformer blocks run. Each recipe, and its source:

- ``bf16``: every GEMM in the training dtype (the default; today's behaviour).
- ``fp8``: FP8 with per-tensor current scaling ("FP8-CS": Transformer Engine's
  ``Float8CurrentScaling``, Megatron-LM's ``--fp8-recipe tensorwise``; the delayed-scaling
  recipe costs the same here). E4M3 forward, E5M2 gradients (``--fp8-format hybrid``). One byte
  per element; the per-tensor scales are a few bytes and are not counted.
- ``mxfp8``: MXFP8 (OCP Microscaling Formats v1.0: one E8M0 scale byte per 32 elements;
  Transformer Engine's ``MXFP8BlockScaling``, Megatron-LM's ``--fp8-recipe mxfp8``; Blackwell
  only): ``1 + 1/32`` bytes per element.
- ``nvfp4``: NVFP4 (E2M1, 4 bits, one E4M3 scale byte per 16 elements: NVIDIA, "Pretraining
  Large Language Models with NVFP4", 2025, section 2; Transformer Engine's ``NVFP4BlockScaling``,
  Megatron-LM's ``--fp4-format e2m1 --fp4-recipe nvfp4``; Blackwell only): ``0.5 + 1/16`` bytes
  per element. Not counted: the recipe's random Hadamard transforms of the weight gradient's
  inputs and the stochastic rounding of the gradients (section 4 of the paper), extra
  memory-bound passes of the casts' size.

What runs quantized: the linear layers Transformer Engine builds in Megatron-LM's transformer
blocks (query/key/value, output projection, the MLP's or the experts' up and down projections,
multi-head latent attention's projections). What does not: the attention core (Megatron-LM's
``--fp8-dot-product-attention`` is off by default), the norms, activations and residuals, the
router (Megatron-LM computes it in fp32/bf16), the embedding and the output head (Megatron-LM's
output layer is not a Transformer Engine module), the all-to-alls, the optimizer.

Memory, as Transformer Engine keeps it (per parameter of a quantized GEMM's weight):

- the bf16 weights stay (``--dtype``); TE keeps their quantized copies between micro-batches
  (``is_first_microbatch``: cast once per iteration), row-wise for the forward and column-wise
  (the transpose) for the input gradient: ``2 x operand bytes`` per parameter
  (:attr:`Precision.weight_copy_bytes`);
- with ``--fp8-param-gather`` (Megatron-LM's ``fp8_param``; torchtitan's
  ``enable_fsdp_float8_all_gather`` casts before the gather) the weights *are* the quantized
  row-wise copy (no bf16 weight: ``operand bytes``), and the column-wise copy stays; the
  distributed optimizer's fp32 master weights are unchanged, and the parameter all-gather moves
  the quantized bytes;
- the saved input of each quantized GEMM (what its weight gradient reads) is kept quantized,
  column-wise only (TE's ``Linear``/``LayerNormLinear``/``LayerNormMLP`` save the quantized input):
  :attr:`Precision.saved_bytes` per element instead of the dtype's;
- fp32 master weights and Adam moments, and the gradients, as ``--optimizer`` says
  (``adam-fp32-grads``: Megatron-LM's fp32 gradient reduce; ``adam``: ``--grad-reduce-in-bf16``).

Time: a quantized GEMM runs at the GPU's peak for the precision (``peak_flops[precision]`` in the
GPU table) times the same GEMM efficiency as bf16 -- an assumption, not a measurement: no FP8
GEMM was timed for this work (no GPU was lent to it), and ``pipeplan calibrate`` fits the one
``gemm`` figure -- and moves quantized operands; its input and output gradient are cast first (memory-bound: read
the dtype, write row-wise and column-wise quantized copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipeplan.errors import BadInputError

__all__ = ["Precision", "PRECISIONS", "get_precision", "precision_or_default", "plan_precision"]


@dataclass(frozen=True)
class Precision:
    """One ``--precision`` recipe."""

    name: str
    peak: str
    """The key of the GPU table's ``peak_flops`` its quantized GEMMs run at."""
    operand_bytes: Optional[float]
    """Bytes per element of a quantized operand, block scales included; None: not quantized."""
    megatron_flags: tuple
    """Megatron-LM's flags for it (``--fp8-format``/``--fp8-recipe`` or ``--fp4-*``)."""
    source: str

    @property
    def quantized(self) -> bool:
        return self.operand_bytes is not None

    @property
    def weight_copy_bytes(self) -> float:
        """TE's row-wise and column-wise quantized copies of one bf16 weight element."""
        return 2.0 * self.operand_bytes if self.quantized else 0.0

    @property
    def saved_bytes(self) -> Optional[float]:
        """Bytes per element of a quantized GEMM's saved input (column-wise copy only)."""
        return self.operand_bytes


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("bf16", "bf16", None, (), "the training dtype throughout"),
    Precision("fp8", "fp8", 1.0, (("--fp8-format", "hybrid"), ("--fp8-recipe", "tensorwise")),
              "Transformer Engine Float8CurrentScaling (FP8-CS), Megatron-LM --fp8-recipe tensorwise"),
    Precision("mxfp8", "mxfp8", 1.0 + 1.0 / 32, (("--fp8-format", "e4m3"), ("--fp8-recipe", "mxfp8")),
              "OCP Microscaling v1.0 (E8M0 scale per 32 elements), Transformer Engine MXFP8BlockScaling"),
    Precision("nvfp4", "nvfp4", 0.5 + 1.0 / 16, (("--fp4-format", "e2m1"), ("--fp4-recipe", "nvfp4")),
              "NVIDIA NVFP4 (E2M1, E4M3 scale per 16 elements), Transformer Engine NVFP4BlockScaling"),
)}


def get_precision(name: str) -> Precision:
    """A recipe by name; ValueError listing the known ones otherwise."""
    if name not in PRECISIONS:
        raise ValueError(f"{name!r} is not one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def precision_or_default(name: Optional[str]) -> Precision:
    """``None`` (a profile or plan without a precision: everything in the training dtype) is bf16's."""
    return PRECISIONS["bf16" if name is None else name]


def plan_precision(profile_precision: Optional[str], fp8_param_gather: Optional[bool]) -> Optional[str]:
    """The precision a plan records: its profile's (how the profile's GEMMs ran sets the quantized
    weight copies the training state holds: :func:`pipeplan.facts.training_state.training_state`).

    Raises
    ------
    BadInputError
        ``--fp8-param-gather`` with a profile whose GEMMs run in its dtype.
    """
    if fp8_param_gather and profile_precision is None:
        raise BadInputError("--fp8-param-gather: the profile's GEMMs run in its dtype; it needs a profile made "
                            "with --precision fp8, mxfp8 or nvfp4")
    return profile_precision
