"""What each ``--optimizer`` keeps per parameter, and what its step reads and writes.

Training state per parameter, in bytes, split into the three parts ZeRO shards one by one
(``w`` = the training dtype's bytes, 2 for bf16/fp16, 4 for fp32):

    adam             w + w + (4 master + 8 moments)  = 16 (fp32: 4 + 4 + 8 = 16)
                     the ZeRO paper's K = 12 and DeepSpeed's accounting
    adam-fp32-grads  w + 4 + (4 master + 8 moments)  = 18 (fp32: 16)
                     Megatron-LM's mixed precision: fp32 main gradients
    sgd              w + w + (4 master + 4 momentum) = 12 (fp32: 4 + 4 + 4 = 12)
    none             w + w                           = 2 w: no optimizer state

``adam`` is pipeplan's default and what plans of schema version 1 assumed (16 bytes);
``adam-fp32-grads`` is Megatron's default for bf16 (``--accumulate-allreduce-grads-in-fp32``):
18 bytes, of which its distributed optimizer shards the 12 of the optimizer state, giving
Megatron's documented ``6 + 12 / d`` (Megatron Core user guide, "Distributed Optimizer").

The optimizer step is memory-bound. Per parameter of the rank's shard it touches (Megatron-LM's
``MixedPrecisionOptimizer.step``, which DeepSpeed and torchtitan's defaults match in kind):

- clipping by the global gradient norm (``--clip-grad 1.0``, Megatron's default): the gradient
  read once for the norm and read and written once to scale it (3 x gradient bytes);
- the update: the state read and written, the gradient read (2 x state + gradient);
- the training-dtype copy of the weights: the fp32 master read, the copy written (4 + w); in
  fp32 training the update steps the weights in place instead (read and written, 2 w);
- with fp16 loss scaling (:func:`optimizer_step_ms`'s ``loss_scaling``): unscaling the gradients
  and checking them for inf/nan, read and written once (2 x gradient bytes).

A quantized ``--precision`` (:mod:`pipeplan.facts.precision`, ``q`` bytes per quantized element)
adds Transformer Engine's quantized weight copies, a part of their own
(:attr:`TrainingState.quantized_weight_bytes`):

    bf16 weights (default)    weights w, copies 2 q (row-wise and column-wise, kept across
                              micro-batches); the step re-casts them: + (w + 2 q)
    --fp8-param-gather        weights q (the row-wise copy is the parameter), copies q (the
                              column-wise one); the step writes q instead of w and the
                              transpose: + 2 q

so fp8 adds 2 bytes per parameter to ``adam``'s 16 without the gather (18), none with it (1 + 1 for the 2).
They are counted on every parameter (the embedding and the output head, which stay bf16 and keep
no copies, are counted as if they did: an overestimate of ``2 q`` per parameter of theirs without
the gather, none with it). ZeRO 3 shards them as the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from pipeplan.facts.precision import precision_or_default

__all__ = ["precision_of", "OPTIMIZERS", "TrainingState", "training_state", "optimizer_step_ms",
           "ZERO_STAGES", "StateMemory", "state_memory", "state_bytes_per_param_byte"]

def precision_of(settings) -> tuple[Optional[str], bool]:
    """``(precision, quantized_params)`` of plan settings (``PlanSettings.precision`` and
    ``fp8_param_gather``), the two arguments :func:`training_state` takes after the dtype."""
    return getattr(settings, "precision", None), bool(getattr(settings, "fp8_param_gather", None))


#: The ``--optimizer`` values.
OPTIMIZERS = ("adam", "adam-fp32-grads", "sgd", "none")


@dataclass(frozen=True)
class TrainingState:
    """Bytes per parameter of each part of the training state."""

    weight_bytes: float
    """The weights in the training dtype (what the forward reads; ZeRO 3 shards them)."""
    gradient_bytes: float
    """The gradients that data parallelism reduces (ZeRO 2 shards them)."""
    optimizer_bytes: float
    """fp32 master weights (16-bit training) and the optimizer's moments (ZeRO 1 shards them)."""
    step_bytes: float
    """Bytes the optimizer step reads and writes per parameter of its shard."""
    quantized_weight_bytes: float = 0
    """A quantized ``--precision``'s weight copies (Transformer Engine's; module docstring)."""

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes + self.quantized_weight_bytes


def training_state(optimizer: str, dtype_bytes: int, precision: Optional[str] = None,
                   quantized_params: bool = False) -> TrainingState:
    """Bytes per parameter of ``optimizer`` training in a dtype of ``dtype_bytes``.

    Parameters
    ----------
    optimizer : {"adam", "adam-fp32-grads", "sgd", "none"}
    dtype_bytes : int
        2 for bf16/fp16, 4 for fp32.
    precision : str, optional
        The profile's ``--precision`` (None or ``bf16``: no quantized copies).
    quantized_params : bool
        ``--fp8-param-gather``: the weights are kept quantized (module docstring).

    Raises
    ------
    ValueError
        For an unknown optimizer.

    Examples
    --------
    >>> training_state("adam", 2).total_bytes
    16
    >>> training_state("adam-fp32-grads", 2).total_bytes   # Megatron's 18
    18
    >>> training_state("adam", 4).total_bytes
    16
    >>> training_state("sgd", 2).total_bytes
    12
    >>> training_state("none", 2).total_bytes
    4
    >>> fp8 = training_state("adam", 2, "fp8")               # + fp8 copy and its transpose
    >>> fp8.quantized_weight_bytes, fp8.total_bytes, fp8.step_bytes - 38
    (2.0, 18.0, 4.0)
    >>> gather = training_state("adam", 2, "fp8", quantized_params=True)   # --fp8-param-gather
    >>> gather.weight_bytes, gather.quantized_weight_bytes, gather.total_bytes, gather.step_bytes - 38
    (1.0, 1.0, 16.0, 1.0)
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    w = dtype_bytes
    master = 4 if w < 4 else 0  # 16-bit training keeps an fp32 copy; fp32 training steps the weights
    if optimizer == "none":
        return TrainingState(w, w, 0, 0)
    grad = 4 if optimizer == "adam-fp32-grads" else w
    moments = 8 if optimizer.startswith("adam") else 4
    state = master + moments
    # Module docstring: clipping (3 grad), the update (2 state + grad), the weight copy.
    step = 3 * grad + 2 * state + grad + (4 + w if master else 2 * w)
    recipe = precision_or_default(precision)
    if not recipe.quantized:
        return TrainingState(w, grad, state, step)
    q = recipe.operand_bytes
    if quantized_params:
        # The step writes the q-byte parameter instead of the w-byte copy, then its transpose.
        return TrainingState(q, grad, state, step - w + q + 2 * q, quantized_weight_bytes=q)
    return TrainingState(w, grad, state, step + w + 2 * q, quantized_weight_bytes=2 * q)


def optimizer_step_ms(shard_params: float, state: TrainingState, hbm_bytes_per_s: float,
                      hbm_efficiency: float = 0.8, loss_scaling: bool = False) -> float:
    """Time of the optimizer step over a rank's shard: bytes touched / achieved HBM bandwidth.

    Parameters
    ----------
    shard_params : float
        Parameters this GPU steps: its tensor shard of its stages, divided by ``d`` under
        ZeRO 1-3 (each data-parallel rank steps its own share).
    state : TrainingState
    hbm_bytes_per_s : float
        The GPU's memory bandwidth (data sheet).
    hbm_efficiency : float
        Achieved share of it by the fused (multi-tensor) optimizer kernels.
    loss_scaling : bool
        fp16 training: the gradients are unscaled and checked for inf/nan first.

    Examples
    --------
    >>> s = training_state("adam", 2)
    >>> s.step_bytes            # clip 3 x 2 + update 2 x 12 + 2 + copy 4 + 2
    38
    >>> optimizer_step_ms(1e9, s, 2e12, hbm_efficiency=1.0)   # 38 GB at 2 TB/s
    19.0
    >>> megatron = training_state("adam-fp32-grads", 2)
    >>> megatron.step_bytes + 2 * megatron.gradient_bytes     # fp16: Megatron's step, 54 bytes
    54
    """
    if shard_params < 0:
        raise ValueError(f"shard_params: {shard_params} must be >= 0")
    if hbm_bytes_per_s <= 0 or not 0 < hbm_efficiency <= 1:
        raise ValueError("hbm_bytes_per_s must be > 0 and hbm_efficiency in (0, 1]")
    touched = state.step_bytes + (2 * state.gradient_bytes if loss_scaling else 0)
    return shard_params * touched / (hbm_bytes_per_s * hbm_efficiency) * 1e3


#: The ZeRO stages pipeplan plans.
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class StateMemory:
    """One GPU's training state, by part, in bytes."""

    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    quantized_weight_bytes: int = 0
    """A quantized ``--precision``'s weight copies (sharded as the weights)."""

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes + self.quantized_weight_bytes


def state_memory(params: float, state: TrainingState, zero_stage: int, data_parallel: int) -> StateMemory:
    """The training state one GPU holds for ``params`` parameters under ZeRO ``zero_stage``.

    Parameters
    ----------
    params : float
        Parameters of the GPU's stages, its tensor shard (a profile at degree ``t`` gives them).
    state : TrainingState
        Bytes per parameter of each part.
    zero_stage : {0, 1, 2, 3}
    data_parallel : int
        ``d``; a sharded part is ``ceil(bytes / d)`` (the last rank's padding is not counted).

    Raises
    ------
    ValueError
        For a stage outside 0-3 or ``d < 1``.

    Examples
    --------
    >>> megatron = training_state("adam-fp32-grads", 2)
    >>> m = state_memory(1e9, megatron, zero_stage=1, data_parallel=4)   # 6 + 12 / 4 bytes
    >>> m.total_bytes / 1e9
    9.0
    >>> state_memory(1e9, megatron, 0, 4).total_bytes / 1e9
    18.0
    >>> state_memory(1e9, megatron, 3, 4).total_bytes / 1e9
    4.5
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage: {zero_stage} is not one of 0, 1, 2, 3")
    if data_parallel < 1:
        raise ValueError(f"data_parallel: {data_parallel} must be at least 1")

    def part(bytes_per_param: float, sharded: bool) -> int:
        whole = params * bytes_per_param
        return math.ceil(whole / data_parallel) if sharded else math.ceil(whole)

    return StateMemory(
        weight_bytes=part(state.weight_bytes, zero_stage >= 3),
        gradient_bytes=part(state.gradient_bytes, zero_stage >= 2),
        optimizer_bytes=part(state.optimizer_bytes, zero_stage >= 1),
        quantized_weight_bytes=part(state.quantized_weight_bytes, zero_stage >= 3) if state.quantized_weight_bytes else 0,
    )


def state_bytes_per_param_byte(optimizer: str, dtype_bytes: int, zero_stage: int = 0,
                               data_parallel: int = 1, precision: Optional[str] = None,
                               quantized_params: bool = False) -> float:
    """Training state one GPU holds per byte of its parameters: the cost model's static factor.

    With ``zero_stage = 0`` it is the pipeline planner's long-standing factor (16 bytes per
    parameter over the dtype's bytes for ``adam``); ZeRO divides each sharded part by ``d``.

    Examples
    --------
    >>> state_bytes_per_param_byte("adam", 2)
    8.0
    >>> state_bytes_per_param_byte("adam-fp32-grads", 2, zero_stage=1, data_parallel=4)   # (6 + 3) / 2
    4.5
    >>> state_bytes_per_param_byte("none", 4)
    2.0
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage: {zero_stage} is not one of 0, 1, 2, 3")
    state = training_state(optimizer, dtype_bytes, precision, quantized_params)
    d = float(data_parallel)
    per_param = (state.weight_bytes / (d if zero_stage >= 3 else 1.0)
                 + state.gradient_bytes / (d if zero_stage >= 2 else 1.0)
                 + state.optimizer_bytes / (d if zero_stage >= 1 else 1.0))
    if state.quantized_weight_bytes:
        per_param += state.quantized_weight_bytes / (d if zero_stage >= 3 else 1.0)
    return per_param / float(dtype_bytes)
