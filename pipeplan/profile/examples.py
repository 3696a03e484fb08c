"""Two small user models, as a user would write them for the ``module:callable`` contract.

They exercise what real models do and the built-ins do not, and serve docs/models.md's table
(``benchmarks/models_table.py``) and the tests (``tests/test_run_hf.py``) alike::

    pipeplan profile pipeplan.profile.examples:tuples --microbatch-sizes 1 -o tuples.json
    pipeplan profile pipeplan.profile.examples:no_loss --microbatch-sizes 1 -o no_loss.json

``tuples``
    A conv net whose blocks return tuples, with a skip connection and a value computed outside
    every unit (``d1[0]``): torch.fx traces it, but a stage cannot be built from units alone,
    so ``pipeplan run`` uses the traced stage builder. No loss: the default loss trains it.
``no_loss``
    An MLP without a loss: it trains on the documented default (the mean square of the output).
"""

from __future__ import annotations

import torch
from torch import nn

from pipeplan.profile.registry import InputSpec

__all__ = ["TupleNet", "tuples", "no_loss"]


class _Down(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.conv(x))
        return y, y.mean(dim=(2, 3), keepdim=True)  # a tuple


class _Up(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor], skip: torch.Tensor) -> torch.Tensor:
        y, gate = pair
        return torch.relu(self.conv(y * gate)) + skip


class TupleNet(nn.Module):
    """A conv net on 3 x 8 x 8 images whose blocks return tuples, with a skip connection
    (``stem`` -> ``up1``) and a slice outside units; ten outputs."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, hidden, 3, padding=1)
        self.down1 = _Down(hidden)
        self.down2 = _Down(hidden)
        self.up1 = _Up(hidden)
        self.head = nn.Linear(hidden * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        d1 = self.down1(h)
        d2 = self.down2(d1[0])  # a value computed outside every unit
        return self.head(self.up1(d2, h).flatten(1))


def tuples(hidden: int = 4) -> tuple[nn.Module, list[InputSpec]]:
    """:class:`TupleNet` with ``hidden`` channels and its input spec (no loss).

    Examples
    --------
    >>> model, specs = tuples()
    >>> model(torch.zeros(2, *specs[0].shape)).shape
    torch.Size([2, 10])
    """
    return TupleNet(hidden), [InputSpec(shape=(3, 8, 8))]


def no_loss(hidden: int = 16, layers: int = 4) -> tuple[nn.Module, list[InputSpec]]:
    """An MLP of ``layers`` linear layers of width ``hidden`` and its input spec (no loss).

    Examples
    --------
    >>> model, specs = no_loss(hidden=8, layers=2)
    >>> len(model), specs[0].shape
    (2, (8,))
    """
    return nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)]), [InputSpec(shape=(hidden,))]
