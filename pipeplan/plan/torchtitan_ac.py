"""torchtitan's activation checkpointing forms as the planner costs them.

torchtitan applies one ``[activation_checkpoint]`` setting to every transformer block of every
model part (``torchtitan/distributed/activation_checkpoint.py``, ``apply_ac``: a loop over
``model.layers``), so a plan for ``--launcher torchtitan`` recomputes alike on every stage
(:func:`pipeplan.plan.recompute.uniform_recompute`), and the embedding, final norm and head are
never checkpointed. Its forms, each the planner's recompute mode it is costed as:

- ``mode = "full"``: every block is wrapped in torch's checkpoint: the ``full`` mode (each
  layer keeps its input and is rebuilt alone). pipeplan's ``full`` also rebuilds the
  embedding, the final norm and the head, which torchtitan does not: the head's forward is
  counted once more than torchtitan runs it (31 ms, 1.9% of Llama 3 8B's predicted step at s = 8192, b = 2).
- ``mode = "selective"``, ``selective_ac_option = "op"`` (``--selective-ac-option op``, the
  default under ``--launcher torchtitan``): the ``selective`` mode with every block's selective
  fields taken from its ``selective_op_sac`` (:mod:`pipeplan.analytic.op_sac`)::

      selective_activation_bytes = activation_bytes - selective_op_sac.saved_bytes
      selective_recompute_ms     = selective_op_sac.recompute_ms

  and every other unit keeping everything (``activation_bytes``, no recompute).
- ``mode = "selective"``, ``selective_ac_option = "N"`` (``--selective-ac-option N``): the
  ``selective`` mode with the N-th, 2N-th, ... block (``_apply_layer_sac``: a counter over the
  blocks, ``count % N == 0`` checkpointed) costed as full recomputation of that block::

      selective_activation_bytes = the block's input bytes (its predecessor's output_bytes)
      selective_recompute_ms     = forward_ms

  and every other unit keeping everything. The counter is torchtitan's process-wide one; the
  blocks are counted here over the whole model, which is the same on one pipeline rank and,
  with a pipeline, the same per rank where each rank's first block is the (kN+1)-th (otherwise
  a rank checkpoints the same number of its blocks, give or take one).

``memory_budget`` (the compiler's own choice) is not costed. See docs/cost-model.md,
"Recomputation as the launchers run it".
"""

from __future__ import annotations

from pipeplan.errors import BadInputError

__all__ = ["parse_selective_ac_option", "check_selective_ac_option", "selective_ac_option", "with_torchtitan_selective", "layer_sac_blocks"]


#: The most blocks between two checkpointed ones that --selective-ac-option takes (the plan
#: settings' pattern: up to six digits).
MAX_EVERY = 999_999


def parse_selective_ac_option(text: str, where: str = "--selective-ac-option") -> str:
    """torchtitan's ``selective_ac_option`` as torchtitan reads it (``"op"``, or a positive whole
    number: ``str.isdigit()``), or a one-line :class:`BadInputError`.

    Examples
    --------
    >>> parse_selective_ac_option("op"), parse_selective_ac_option("2")
    ('op', '2')
    """
    value = str(text).strip()
    if value == "op" or (value.isdigit() and 1 <= int(value) <= MAX_EVERY):
        return "op" if value == "op" else str(int(value))
    raise BadInputError(f"{where}: {text!r} is not op or a whole number of blocks 1..{MAX_EVERY} "
                        f"(torchtitan's selective_ac_option)")


def check_selective_ac_option(settings) -> None:
    """``--selective-ac-option`` only with ``--launcher torchtitan``, or a one-line
    :class:`BadInputError` (the value's form is the plan settings' pattern)."""
    if settings.launcher == "torchtitan" and settings.recompute_modules is not None:
        raise BadInputError("--recompute-modules: Megatron-core's modules; torchtitan's selective recomputation is "
                            "--selective-ac-option op or N")
    if settings.selective_ac_option is not None and settings.launcher != "torchtitan":
        raise BadInputError("--selective-ac-option: torchtitan's [activation_checkpoint] setting; give --launcher "
                            "torchtitan (or, for Megatron, --recompute-modules)")


def selective_ac_option(settings) -> str | None:
    """What selective recomputation means for the settings' launcher: torchtitan's option
    (``op`` by default), or None for the others (the profile's own selective fields)."""
    if settings.launcher != "torchtitan":
        return None
    return settings.selective_ac_option or "op"


def layer_sac_blocks(profile, every: int) -> list[int]:
    """Positions in ``profile.layers`` of the blocks torchtitan checkpoints at
    ``selective_ac_option = every``: the ``every``-th, ``2 every``-th, ... unit of kind ``block``
    (every unit where the profile names no kinds)."""
    named = any(layer.kind for layer in profile.layers)
    blocks = [i for i, layer in enumerate(profile.layers) if not named or layer.kind == "block"]
    return [i for n, i in enumerate(blocks, start=1) if n % every == 0]


def _keeps_everything(cost):
    return cost.model_copy(update={"selective_activation_bytes": cost.activation_bytes, "selective_recompute_ms": 0.0})


def _op_sac(profile):
    if not any(c.selective_op_sac is not None for layer in profile.layers for c in layer.costs):
        return None
    layers = []
    for layer in profile.layers:
        costs = []
        for c in layer.costs:
            if c.selective_op_sac is None:
                costs.append(_keeps_everything(c))
            else:
                costs.append(c.model_copy(update={
                    "selective_activation_bytes": c.activation_bytes - c.selective_op_sac.saved_bytes,
                    "selective_recompute_ms": c.selective_op_sac.recompute_ms}))
        layers.append(layer.model_copy(update={"costs": costs}))
    return profile.model_copy(update={"layers": layers})


def _layer_sac(profile, every: int):
    chosen = set(layer_sac_blocks(profile, every))
    layers = []
    for i, layer in enumerate(profile.layers):
        costs = []
        for c in layer.costs:
            if i not in chosen:
                costs.append(_keeps_everything(c))
                continue
            before = profile.layers[i - 1].cost_at(c.microbatch_size, c.degree) if i else None
            kept = before.output_bytes if before is not None else 0
            costs.append(c.model_copy(update={"selective_activation_bytes": min(kept, c.activation_bytes),
                                              "selective_recompute_ms": c.forward_ms}))
        layers.append(layer.model_copy(update={"costs": costs}))
    return profile.model_copy(update={"layers": layers})


def _without_selective(profile):
    layers = [layer.model_copy(update={"costs": [c.model_copy(update={"selective_activation_bytes": None,
                                                                      "selective_recompute_ms": None})
                                                 for c in layer.costs]}) for layer in profile.layers]
    return profile.model_copy(update={"layers": layers})


def with_torchtitan_selective(profile, settings):
    """``profile`` with its selective fields costing torchtitan's selective form (module
    docstring); unchanged for other launchers.

    A profile without ``selective_op_sac`` (measured, imported) has no per-op form: its
    selective fields are dropped, so the search plans none and full only.

    Raises
    ------
    BadInputError
        ``--recompute selective`` at ``selective_ac_option op`` on a profile without
        ``selective_op_sac``.
    """
    option = selective_ac_option(settings)
    if option is None:
        return profile
    if option != "op":
        return _layer_sac(profile, int(option))
    rewritten = _op_sac(profile)
    if rewritten is not None:
        return rewritten
    if settings.recompute == "selective":
        raise BadInputError("--recompute selective: with --launcher torchtitan that is per-op activation "
                            "checkpointing, which the profile does not cost (no selective_op_sac: analytic "
                            "profiles of dense models give it); use --selective-ac-option N, all or auto")
    return _without_selective(profile)
