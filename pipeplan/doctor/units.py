"""Which profile layers each launcher unit is: by role (``kind``) for Megatron and torchtitan, by
position for DeepSpeed.

A profile's layers carry their role in ``kind`` (embedding, block, norm, head, other). Megatron
names units ``embedding``, ``decoder.<i>``, ``loss``; torchtitan's decoder models name modules
``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``; DeepSpeed's PipelineModule indexes its
layer list. Layers of kind ``other`` (a parameter-free rotary embedding) ride with the layer
before them.
"""

from __future__ import annotations

from pipeplan.errors import BadInputError
from pipeplan.launchers.registry import LAUNCHERS

__all__ = ["unit_positions", "stage_positions", "TORCHTITAN_ROLE_NAMES"]

#: torchtitan's module name for each single-layer role.
TORCHTITAN_ROLE_NAMES = {"embedding": "tok_embeddings", "norm": "norm", "head": "output"}


def _roles(profile, launcher: str) -> dict[str, list[int]]:
    kinds = [layer.kind for layer in profile.layers]
    if any(k is None for k in kinds):
        missing = [layer.name for layer in profile.layers if layer.kind is None][:4]
        raise BadInputError(
            f"--profile: layers {missing} have no 'kind'; doctor maps {launcher}'s units to profile layers by "
            f"role: give each layer kind embedding, block, norm, head or other"
        )
    roles: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        roles.setdefault(kind, []).append(i)
    return roles


def unit_positions(launcher: str, profile, num_layers: int | None) -> tuple[list[str], dict[str, list[int]]]:
    """The model's units in order, and the profile positions each stands for.

    Raises
    ------
    BadInputError
        Layers without ``kind`` (Megatron, torchtitan), or a block count that differs from the
        config's layer count.
    """
    if launcher == "deepspeed":
        names = [str(i) for i in range(len(profile.layers))]
        return names, {name: [i] for i, name in enumerate(names)}
    roles = _roles(profile, launcher)
    blocks = roles.get("block", [])
    if num_layers is not None and len(blocks) != num_layers:
        setting = LAUNCHERS[launcher].settings.layers
        raise BadInputError(
            f"--profile: {profile.model!r} has {len(blocks)} blocks but the config's {setting} is {num_layers}; "
            f"give the profile of the model the config trains"
        )
    if launcher == "megatron":
        units = ["embedding"] + [f"decoder.{i}" for i in range(len(blocks))] + ["loss"]
        mapping = {"embedding": roles.get("embedding", []), "loss": roles.get("norm", []) + roles.get("head", [])}
        mapping.update({f"decoder.{i}": [pos] for i, pos in enumerate(blocks)})
        return units, mapping
    names = {layer.name for layer in profile.layers}
    torchtitan_named = "tok_embeddings" in names and all(f"layers.{i}" in names for i in range(len(blocks)))
    if torchtitan_named:
        units = [layer.name for layer in profile.layers if layer.kind != "other"]
        index = {layer.name: i for i, layer in enumerate(profile.layers)}
        return units, {u: [index[u]] for u in units}
    mapping = {}
    for role, name in TORCHTITAN_ROLE_NAMES.items():
        if len(roles.get(role, [])) > 1:
            raise BadInputError(f"--profile: {len(roles[role])} layers of kind {role!r}; torchtitan's model has "
                                f"one {name}")
        mapping[name] = roles.get(role, [])
    mapping.update({f"layers.{i}": [pos] for i, pos in enumerate(blocks)})
    units = ["tok_embeddings"] + [f"layers.{i}" for i in range(len(blocks))] + ["norm", "output"]
    return units, mapping


def stage_positions(profile, stage_units: list[tuple[str, ...]], mapping: dict[str, list[int]]) -> list[list[int]]:
    """Profile positions of each stage; ``other`` layers join the stage of the layer before them."""
    owner: dict[int, int] = {}
    for s, units in enumerate(stage_units):
        for unit in units:
            for pos in mapping.get(unit, []):
                owner.setdefault(pos, s)
    stages: list[list[int]] = [[] for _ in stage_units]
    previous = None
    for pos, layer in enumerate(profile.layers):
        if pos in owner:
            previous = owner[pos]
            stages[owner[pos]].append(pos)
        elif layer.kind == "other":
            target = previous if previous is not None else next(iter(sorted(owner.values())), None)
            if target is not None:
                stages[target].append(pos)
    return [sorted(s) for s in stages]
