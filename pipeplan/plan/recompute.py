"""Recomputation as the launchers run it: Megatron's selective modules and uniform recompute sets.

The planner's ``selective`` recompute mode keeps, per layer, ``selective_activation_bytes`` and
costs ``selective_recompute_ms`` (:mod:`pipeplan.plan.costmodel`). By default these are the
profile's own fields: the attention core (Megatron's default ``--recompute-modules core_attn``).
With ``--recompute-modules`` (``PlanSettings.recompute_modules``) the mode means the named
modules instead: :func:`with_selective_modules` rewrites every cost entry's selective fields from
its ``selective_modules`` (what each module's recompute frees and costs)::

    selective_activation_bytes = activation_bytes - sum(saved_bytes of the chosen modules)
    selective_recompute_ms     = sum(recompute_ms of the chosen modules)

so every solver, the cluster's selective view and ``show`` cost the chosen set unchanged. The
working memory of the recompute follows from the same fields (the largest layer's freed bytes,
:attr:`pipeplan.plan.costmodel.CostModel.selective_working_bytes`).

Megatron-LM applies one recomputation to every pipeline rank (``TransformerConfig`` has one
``recompute_granularity``, ``recompute_method`` and ``recompute_num_layers``), so a plan for it
recomputes alike on every stage: :func:`uniform_recompute_sets`. See docs/cost-model.md,
"Recomputation as the launchers run it".
"""

from __future__ import annotations

from pipeplan.errors import BadInputError
from pipeplan.formats.plan import RecomputePart
from pipeplan.formats.profile import RECOMPUTE_MODULES
from pipeplan.launchers.registry import LAUNCHERS

__all__ = ["full_mode", "block_layers", "check_full_method", "parse_recompute_modules", "check_recompute_modules", "with_selective_modules",
           "megatron_runs", "recomputed_layers", "recompute_order", "recompute_prefix", "uniform_recompute", "uniform_recompute_sets", "selective_module_parts", "with_module_parts"]

#: Modules whose recompute contains another's: Megatron's ``moe`` checkpoints the whole MoE layer,
#: its activation and shared experts included, so naming both would count their bytes twice.
_CONTAINS = {"moe": ("moe_act", "shared_experts")}


def check_recompute_modules(modules, where: str = "--recompute-modules") -> tuple[str, ...]:
    """The modules in Megatron's order, each once, or a one-line :class:`BadInputError`.

    Examples
    --------
    >>> check_recompute_modules(["moe_act", "layernorm"])
    ('moe_act', 'layernorm')
    """
    names = list(modules)
    unknown = [m for m in names if m not in RECOMPUTE_MODULES]
    if unknown or not names:
        raise BadInputError(f"{where}: {', '.join(unknown) or 'nothing given'} is not one of "
                            f"{', '.join(RECOMPUTE_MODULES)} (Megatron-core's recompute_modules)")
    if len(set(names)) != len(names):
        raise BadInputError(f"{where}: a module is named twice ({', '.join(names)})")
    for whole, parts in _CONTAINS.items():
        inside = [m for m in parts if m in names]
        if whole in names and inside:
            raise BadInputError(f"{where}: {whole} already recomputes {', '.join(inside)} (the whole MoE "
                                f"layer); name one or the other")
    return tuple(m for m in RECOMPUTE_MODULES if m in names)


def parse_recompute_modules(text: str) -> list[str]:
    """``--recompute-modules layernorm,moe_act`` as a list (checked)."""
    return list(check_recompute_modules([part.strip() for part in text.split(",") if part.strip()]))


def _entry_with(cost, modules):
    given = cost.selective_modules or {}
    # min: a hand-written profile's modules may overlap; a layer cannot free more than it keeps.
    freed = min(cost.activation_bytes, sum(given[m].saved_bytes for m in modules if m in given))
    time = sum(given[m].recompute_ms for m in modules if m in given)
    return cost.model_copy(update={"selective_activation_bytes": cost.activation_bytes - freed,
                                   "selective_recompute_ms": round(float(time), 6)})


def with_selective_modules(profile, modules):
    """``profile`` with every entry's selective fields costing ``modules`` (module docstring).

    Entries without ``selective_modules`` (a unit with none of the modules: the embedding, the
    head) free nothing.

    Raises
    ------
    BadInputError
        If no entry gives ``selective_modules`` (measured and imported profiles do not), or a
        module is offered by no layer (as Megatron refuses ``moe_act`` on a dense model).
    """
    modules = check_recompute_modules(modules)
    offered = {m for layer in profile.layers for c in layer.costs for m in (c.selective_modules or {})}
    if not offered:
        raise BadInputError("--recompute-modules: the profile gives no selective_modules (analytic profiles do: "
                            "pipeplan profile --analytic); leave it out to recompute the attention core")
    missing = [m for m in modules if m not in offered]
    if missing:
        raise BadInputError(f"--recompute-modules: no layer of the profile has {', '.join(missing)} "
                            f"(it offers {', '.join(m for m in RECOMPUTE_MODULES if m in offered)})")
    layers = [layer.model_copy(update={"costs": [_entry_with(c, modules) for c in layer.costs]})
              for layer in profile.layers]
    return profile.model_copy(update={"layers": layers})


def check_full_method(settings) -> None:
    """Megatron's ``--recompute-method`` / ``--recompute-num-layers`` as the planner costs them,
    or a one-line :class:`BadInputError`: only for ``--launcher megatron``; ``uniform`` only with
    1 layer per group (larger groups keep one input per group and rebuild the group at once:
    not costed yet)."""
    method, n = settings.recompute_method, settings.recompute_num_layers
    if method is None and n is None:
        return
    if settings.launcher != "megatron":
        raise BadInputError("--recompute-method, --recompute-num-layers: Megatron-LM's flags; give --launcher megatron")
    if method is None:
        raise BadInputError("--recompute-num-layers: give --recompute-method block or uniform with it")
    if method == "uniform" and (n or 1) != 1:
        raise BadInputError(f"--recompute-num-layers: uniform groups of {n} layers are not costed yet (each group "
                            f"keeps one input and is rebuilt at once); use 1, or --recompute-method block")
    if method == "block" and n is None:
        raise BadInputError("--recompute-method block: give --recompute-num-layers N (blocks recomputed per stage)")
    if method == "block" and settings.solver == "ilp":
        raise BadInputError("--recompute-method block: costed by the chain DP only; leave --solver at auto or dp")


def block_layers(settings) -> int:
    """N of ``--recompute-method block`` (0 otherwise): the layer graph's ``recompute_block_layers``."""
    return int(settings.recompute_num_layers or 0) if getattr(settings, "recompute_method", None) == "block" else 0


def full_mode(settings) -> str:
    """The recompute mode that full recomputation is under these settings: ``block`` for
    Megatron's ``--recompute-method block``, else ``full`` (uniform, one layer at a time)."""
    return "block" if block_layers(settings) else "full"


def megatron_runs(settings, virtual_stages: int, recompute) -> bool:
    """Whether Megatron runs the recompute set as costed: its block method counts the first N
    blocks of each model chunk, and on one pipeline rank Megatron builds one chunk however many
    stages the plan puts there, so block on ``p = 1`` with ``v > 1`` is not what it runs."""
    return not ("block" in recompute and settings.stages == 1 and virtual_stages > 1)


def recompute_order(in_flight: tuple[int, ...]) -> list[int]:
    """Stages ranked for recomputation: most micro-batches in flight first, then earliest."""
    return sorted(range(len(in_flight)), key=lambda s: (-in_flight[s], s))


def recompute_prefix(order: list[int], k: int, num_stages: int, mode: str = "full") -> tuple[str, ...]:
    """The first ``k`` stages of ``order`` recompute (``mode``: full or selective), the others not at all."""
    chosen = set(order[:k])
    return tuple(mode if s in chosen else "none" for s in range(num_stages))


def recomputed_layers(stage, settings, profile) -> frozenset:
    """The names of a plan stage's layers whose forward the cluster's parts count twice: none
    without recomputation, the first N transformer blocks for Megatron's block method, else every
    layer (selective stages too, as the cluster's parts always counted them: an overestimate of
    their collectives and expert parts, kept so that plans stay what they were)."""
    if not stage.recompute:
        return frozenset()
    n = block_layers(settings) if stage.recompute_granularity != "selective" else 0
    if not n:
        return frozenset(stage.layers)
    kinds = {layer.name: layer.kind for layer in profile.layers}
    named = any(kinds.values())
    return frozenset([name for name in stage.layers if not named or kinds.get(name) == "block"][:n])


def uniform_recompute(launcher) -> bool:
    """Whether the launcher applies one recomputation to every pipeline stage (Megatron-LM: one
    ``recompute_granularity`` for the model; torchtitan: one ``[activation_checkpoint]`` for every
    block of every model part), so the planner may not mix them per stage."""
    return launcher is not None and LAUNCHERS[launcher].uniform_recompute


def uniform_recompute_sets(num_stages: int, selective_known: bool, full: str = "full") -> list[tuple[str, ...]]:
    """The recompute sets a uniform launcher runs: none, selective (where the profile gives
    it) and full (``full``: its mode, :func:`full_mode`), each on every stage.

    Examples
    --------
    >>> uniform_recompute_sets(2, True)
    [('none', 'none'), ('selective', 'selective'), ('full', 'full')]
    """
    modes = ("none", "selective", full) if selective_known else ("none", full)
    return [(mode,) * num_stages for mode in modes]


def selective_module_parts(profile, microbatch_size: int, modules) -> dict[str, tuple[float, float]]:
    """Per chosen module, its ``(saved_bytes, recompute_ms)`` summed over the profile's layers at
    ``microbatch_size`` (degree 1): what ``show`` lists as the recompute's parts."""
    out = {m: (0.0, 0.0) for m in check_recompute_modules(modules)}
    for layer in profile.layers:
        given = layer.cost_at(microbatch_size).selective_modules or {}
        for m in out:
            if m in given:
                saved, ms = out[m]
                out[m] = (saved + given[m].saved_bytes, ms + given[m].recompute_ms)
    return out


def with_module_parts(plan, profile):
    """``plan`` with each selective stage's ``recompute_modules``: per module of
    ``plan.settings.recompute_modules``, its recompute time and freed bytes summed over the
    stage's layers (the profile's entries at the plan's micro-batch size and tensor-parallel
    degree). They add up to the stage's recomputation: ``activation_bytes - sum(saved_bytes)``
    is what the stage keeps, ``sum(recompute_ms)`` what its backward repeats. Unchanged without
    ``recompute_modules``."""
    modules = plan.settings.recompute_modules
    if not modules:
        return plan
    modules = check_recompute_modules(modules)
    degree = plan.parallelism.tensor if plan.parallelism is not None else 1
    layers = {layer.name: layer for layer in profile.layers}
    stages = []
    for stage in plan.stages:
        if stage.recompute_granularity == "selective":
            parts = {m: [0.0, 0] for m in modules}
            for name in stage.layers:
                given = layers[name].cost_at(plan.microbatch_size, degree).selective_modules or {}
                for m in modules:
                    if m in given:
                        parts[m][0] += given[m].recompute_ms
                        parts[m][1] += given[m].saved_bytes
            # A cluster plan's selective view keeps the selective bytes as activation_bytes too;
            # the stage then states what it would keep without them, so that the parts add up.
            whole = (stage.selective_activation_bytes or 0) + sum(saved for _, saved in parts.values())
            stage = stage.model_copy(update={"activation_bytes": max(stage.activation_bytes, whole), "recompute_modules": {
                m: RecomputePart(recompute_ms=round(ms, 6), saved_bytes=int(saved)) for m, (ms, saved) in parts.items()}})
        stages.append(stage)
    return type(plan).model_validate({**plan.model_dump(), "stages": [s.model_dump() for s in stages],
                                      "schema_version": 2})  # validated whole: a plan that passes runs
