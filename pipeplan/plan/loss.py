"""The loss the launcher computes, as the profile's working memory of its head.

An analytic profile's head (and multi-token-prediction block) gives its loss's working memory
per implementation (``loss_working_bytes``, :mod:`pipeplan.facts.loss`) and, as
``working_bytes``, the default form's (:data:`pipeplan.facts.loss.DEFAULT_LOSS`, Megatron-core's
vocabulary-parallel cross-entropy). A plan for a launcher costs that launcher's loss
(:attr:`pipeplan.launchers.record.LauncherFacts.loss`: torchtitan's ``F.cross_entropy(pred.float())``
is ``torch-eager``); a plan without one costs the default. An entry without
``loss_working_bytes`` (measured, imported) keeps its own ``working_bytes``.
"""

from __future__ import annotations

from typing import Optional

from pipeplan.launchers.registry import LAUNCHERS
from pipeplan.facts.loss import DEFAULT_LOSS

__all__ = ["launcher_loss", "with_launcher_loss"]


def launcher_loss(launcher: Optional[str]) -> str:
    """The loss form a plan for ``launcher`` costs (the default without one).

    Examples
    --------
    >>> launcher_loss("torchtitan"), launcher_loss("megatron"), launcher_loss(None)
    ('torch-eager', 'vocab-parallel', 'vocab-parallel')
    """
    return DEFAULT_LOSS if launcher is None else LAUNCHERS[launcher].loss


def with_launcher_loss(profile, launcher: Optional[str]):
    """``profile`` with each entry's ``working_bytes`` its ``loss_working_bytes`` of the
    launcher's loss (unchanged where it gives none, or where they agree already)."""
    form = launcher_loss(launcher)
    if not any(c.loss_working_bytes and c.loss_working_bytes.get(form, c.working_bytes) != c.working_bytes
               for layer in profile.layers for c in layer.costs):
        return profile
    layers = []
    for layer in profile.layers:
        costs = [c.model_copy(update={"working_bytes": c.loss_working_bytes[form]})
                 if c.loss_working_bytes and form in c.loss_working_bytes else c for c in layer.costs]
        layers.append(layer.model_copy(update={"costs": costs}))
    return profile.model_copy(update={"layers": layers})
