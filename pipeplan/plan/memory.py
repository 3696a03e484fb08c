"""The memory model: what a stage holds at its peak.

    peak_memory_bytes = static_bytes_per_param_byte x param_bytes      (weights, grads, optimizer)
                      + in_flight x activation_bytes                  (or, recomputing: in_flight x
                                                                       input bytes + one micro-batch)

See docs/cost-model.md for the derivation and what is left out.
"""

from __future__ import annotations

__all__ = ["BYTES_PER_PARAMETER", "static_bytes_per_param_byte", "in_flight_microbatches"]

#: Bytes of training state per parameter. Adam with 16-bit weights: 2 (weights) + 2 (grads)
#: + 4 (fp32 master) + 4 + 4 (moments) = 16; in fp32 it is 4 + 4 + 4 + 4 = 16 too.
#: SGD with momentum: 12 either way (16-bit: 2 + 2 + 4 master + 4 momentum).
BYTES_PER_PARAMETER = {"adam": 16, "sgd": 12}


def static_bytes_per_param_byte(optimizer: str, dtype_bytes: int) -> float:
    """Training state per byte of parameters.

    Examples
    --------
    >>> static_bytes_per_param_byte("adam", 2)
    8.0
    >>> static_bytes_per_param_byte("adam", 4)
    4.0
    >>> static_bytes_per_param_byte("none", 2)  # weights and gradients only
    2.0
    """
    if optimizer == "none":
        return 2.0
    return BYTES_PER_PARAMETER[optimizer] / float(dtype_bytes)


def in_flight_microbatches(schedule: str, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Micro-batches whose activations each stage holds at its peak.

    GPipe runs every forward before any backward, so each stage holds all ``m``; 1F1B starts
    backwards as soon as the last stage can, so stage ``s`` of ``p`` holds ``min(m, p - s)``.

    Examples
    --------
    >>> in_flight_microbatches("1f1b", 4, 8)
    (4, 3, 2, 1)
    >>> in_flight_microbatches("gpipe", 4, 8)
    (8, 8, 8, 8)
    """
    if schedule == "gpipe":
        return (num_microbatches,) * num_stages
    return tuple(min(num_microbatches, num_stages - s) for s in range(num_stages))
