"""The optimizer a rank steps with: the plan's ``--optimizer`` over the rank's parameters (ZeRO
1's sharded state where the plan's data-parallel group shards it), and the bytes of its state
(the run report puts them beside the plan's). Needs torch (imported inside the functions)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["build_optimizer", "optimizer_state_bytes"]


def build_optimizer(params: list, name: str, lr: float, *, shard_group: Any = None) -> Any:
    """The plan's optimizer over ``params``: ``adam`` and ``adam-fp32-grads`` (the same update; the
    names differ in the memory they count), ``sgd`` with momentum 0.9, or None for ``none``.

    With ``shard_group`` (ZeRO 1 over the data group), torch's ``ZeroRedundancyOptimizer``: each
    replica keeps the optimizer state of its share of the parameters, updates them, and
    broadcasts them to the others; the update is the same as unsharded.
    """
    import torch

    if name in ("adam", "adam-fp32-grads"):
        optimizer_class, options = torch.optim.Adam, {"lr": lr}
    elif name == "sgd":
        optimizer_class, options = torch.optim.SGD, {"lr": lr, "momentum": 0.9}
    else:
        return None
    if shard_group is None:
        return optimizer_class(params, **options)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=shard_group, **options)


def optimizer_state_bytes(optimizer: Any) -> Optional[int]:
    """Bytes of the tensors this rank's optimizer keeps (its share, under ZeRO 1), or None."""
    import torch

    if optimizer is None:
        return None
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps its share's optimizer
    return sum(value.numel() * value.element_size() for state in local.state.values()
               for value in state.values() if torch.is_tensor(value))
