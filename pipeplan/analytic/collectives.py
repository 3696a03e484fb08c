"""The tensor-parallel collectives of each unit per micro-batch (Megatron's split).

Payloads are the full (unsharded) buffer of each collective, ``X = s b h`` elements for the
hidden states. Per block (Shoeybi et al. 2019, figure 3; Korthikanti et al. 2022, section 4.2.2):

- tensor parallelism alone: forward all-reduces after the attention output projection and after
  the MLP's down projection (2 X); backward all-reduces the input gradients of the two
  column-parallel GEMMs (2 X);
- with sequence parallelism: forward all-gathers before QKV and the MLP and reduce-scatters
  after them (2 AG + 2 RS of X, the same bytes on a ring as 2 all-reduces); backward
  reduce-scatters the gathered inputs' gradients, all-gathers the output gradients and
  all-gathers each column-parallel GEMM's input again for its weight gradient (4 AG + 2 RS).

The vocabulary-parallel embedding all-reduces (reduce-scatters, with sequence parallelism) its
output; the head's cross-entropy all-reduces three fp32 values per token (the max, the sum of
exponentials, the target's logit) and its input gradient is all-reduced (reduce-scattered, after
an all-gather of the input in forward). With sequence parallelism an all-reduce is counted as a
reduce-scatter plus an all-gather (2 payloads, 2 calls), so one entry has one collective kind.
A multi-token prediction depth (DeepSeek-V3) does what its parts do: an embedding's lookup, a
block and the head's loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.analytic.configs import ModelConfig
from pipeplan.analytic.flops import Shape

__all__ = ["Collectives", "unit_collectives"]


@dataclass(frozen=True)
class Collectives:
    """One unit's tensor-parallel traffic per micro-batch (zero at degree 1)."""

    kind: str
    """``all_reduce`` or ``reduce_scatter_all_gather``."""
    forward_bytes: int
    backward_bytes: int
    forward_count: int
    backward_count: int


def unit_collectives(cfg: ModelConfig, kind: str, shape: Shape) -> Collectives:
    """The collectives of one unit at ``shape`` (see the module docstring for the rules)."""
    sp = shape.sequence_parallel
    name = "reduce_scatter_all_gather" if sp else "all_reduce"
    if shape.tensor_parallel == 1:
        return Collectives(name, 0, 0, 0, 0)
    hidden = shape.dtype_bytes * shape.tokens * cfg.hidden_size
    if kind == "block":
        fwd, bwd = ((4, 4), (6, 6)) if sp else ((2, 2), (2, 2))
        return Collectives(name, fwd[0] * hidden, bwd[0] * hidden, fwd[1], bwd[1])
    if kind == "embedding":
        return Collectives(name, hidden, hidden if sp else 0, 1, 1 if sp else 0)
    if kind == "mtp":
        parts = [unit_collectives(cfg, part, shape) for part in ("embedding", "block", "head")]
        return Collectives(name, *(sum(getattr(p, f) for p in parts)
                                   for f in ("forward_bytes", "backward_bytes", "forward_count", "backward_count")))
    if kind == "head":
        loss = 3 * 4 * shape.tokens
        if sp:
            return Collectives(name, hidden + 2 * loss, 2 * hidden, 1 + 6, 2)
        return Collectives(name, loss, hidden, 3, 1)
    return Collectives(name, 0, 0, 0, 0)
