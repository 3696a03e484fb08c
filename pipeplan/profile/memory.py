"""Memory measurement of a unit: the bytes autograd saves for backward, and tensor sizes.

Activation bytes count unique storages saved by autograd (``saved_tensors_hooks``), leaving
out parameters and buffers: the per-unit sum then equals the whole model's (docs/profiling.md).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["tensor_bytes", "parameter_storages", "saved_activation_bytes", "is_out_of_memory"]


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a (nested) value: what a stage would send of it."""
    leaves, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _storage_key(t: torch.Tensor) -> Optional[tuple[Any, int]]:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if storage.nbytes() == 0:
        return None
    return (str(t.device), storage.data_ptr())


def parameter_storages(model: nn.Module) -> set[tuple[Any, int]]:
    """Storage keys of every parameter and buffer (they are not activations)."""
    keys = set()
    for t in [*model.parameters(), *model.buffers()]:
        key = _storage_key(t)
        if key is not None:
            keys.add(key)
    return keys


class saved_activation_bytes:
    """Context manager counting bytes autograd saves for backward, by unique storage.

    Storages of ``exclude`` (parameters, buffers) are left out. A view saves its whole
    storage, which is what stays in memory.

    Examples
    --------
    >>> import torch
    >>> lin = torch.nn.Linear(4, 3, bias=False)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> with saved_activation_bytes(exclude=parameter_storages(lin)) as saved:
    ...     y = lin(x)
    >>> saved.bytes   # only x: 2 * 4 * 4 bytes
    32
    """

    def __init__(self, exclude: Optional[set] = None) -> None:
        self.exclude = exclude or set()
        self.storages: dict[tuple[Any, int], int] = {}
        self._hooks: Any = None

    @property
    def bytes(self) -> int:
        """Total bytes of the unique storages saved."""
        return sum(self.storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in self.exclude:
            self.storages[key] = t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> "saved_activation_bytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for CUDA/CPU out-of-memory errors."""
    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or isinstance(exc, MemoryError):
        return True
    return "out of memory" in str(exc).lower()
