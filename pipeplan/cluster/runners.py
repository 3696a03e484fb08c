"""Which runners-up a cluster plan plans in full, and the ``--compare`` layouts' trials.

The branch and bound proves the winner without planning most layouts: a layout whose lower
bound is above the best found is cut, so its row could say only "at least this". After the
search, a few layouts chosen to answer the questions a user asks of a plan (what would the largest
tensor degree cost, or pure data parallelism, or no pipeline at all) are planned exactly, each
by a branch and bound among its own trials (:func:`pipeplan.cluster.search._exact_best`): its
row then holds the time planning that layout alone (``--data-parallel d --tensor-parallel t
--stages p``) gives. The choice depends only on the trials and their bounds, so the same inputs
give the same rows. docs/cluster-model.md ("Runners-up and --compare").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from pipeplan.cluster.experts import expert_choices
from pipeplan.cluster.profile_view import head_counts, tensor_degrees
from pipeplan.cluster.space import candidates, parallel_degrees
from pipeplan.errors import BadInputError
from pipeplan.launchers.registry import launcher_zero_stages
from pipeplan.requests import parse_compare

__all__ = ["informative_layouts", "kind_label", "Compare", "compare_search"]


def _layouts(trials, best) -> dict:
    """The trials of each layout ``(d, t, p, E)`` but the winner's."""
    by_key: dict = {}
    for trial in trials:
        if trial.key != best.key:
            by_key.setdefault(trial.key, []).append(trial)
    return by_key


def informative_layouts(trials, best, limit: int) -> list[tuple[str, list]]:
    """Up to ``limit`` layouts other than the winner's, each with why it is listed, and its trials.

    In this order, each the layout of its kind that the search's seed estimate ranks first (a
    planned trial's is its time; layouts whose every trial is over the memory last): the largest
    tensor degree; pure data parallelism (t = p = 1, where the rules allow it); each other tensor
    degree but the winner's, largest first; no pipeline (p = 1); then the best estimates left.
    One layout is listed once.

    Examples
    --------
    >>> from types import SimpleNamespace as N
    >>> def trial(d, t, p, ms):
    ...     return N(key=(d, t, p, 1), tensor=t, pipeline=p, status="pruned", lower_bound_ms=ms,
    ...              extras={"estimate_ms": ms})
    >>> trials = [trial(4, 4, 1, 10.0), trial(16, 1, 1, 30.0), trial(4, 2, 2, 12.0), trial(2, 8, 1, 40.0),
    ...           trial(8, 2, 1, 11.0), trial(2, 4, 2, 9.0)]
    >>> [(label, group[0].key[:3]) for label, group, _ in informative_layouts(trials, trials[0], 4)]
    [('t=8 (the largest t)', (2, 8, 1)), ('pure data parallel', (16, 1, 1)), ('t=2', (8, 2, 1)), ('next best estimate', (2, 4, 2))]
    """
    by_key = _layouts(trials, best)

    def rank(key):
        open_ = [t.parts.iteration_ms if t.status == "planned" else t.extras.get("estimate_ms", t.lower_bound_ms)
                 for t in by_key[key] if t.status in ("new", "pruned", "planned")]
        return (0, min(open_), key) if open_ else (1, 0.0, key)

    ranked = sorted(by_key, key=rank)
    tensors = sorted({key[1] for key in ranked}, reverse=True)
    kinds = [(f"t={tensors[0]} (the largest t)", lambda k: k[1] == tensors[0])] if tensors else []
    kinds += [("pure data parallel", lambda k: k[1] == 1 and k[2] == 1)]
    # The winner answers for its own tensor degree.
    kinds += [(f"t={t}", lambda k, t=t: k[1] == t) for t in tensors[1:] if t != best.tensor]
    kinds += [("p=1 (no pipeline)", lambda k: k[2] == 1)]
    chosen: dict = {}
    for label, wanted in kinds:
        key = next((k for k in ranked if wanted(k) and k not in chosen), None)
        if key is not None and len(chosen) < limit:
            chosen[key] = (label, [by_key[k] for k in ranked if wanted(k) and k != key])
    for key in ranked:
        if len(chosen) >= limit:
            break
        chosen.setdefault(key, ("next best estimate", []))
    return [(label, by_key[key], rivals) for key, (label, rivals) in chosen.items()]


def kind_label(label: str, found, rivals) -> str:
    """``label`` with whether the row is proven the best of its kind: every other layout of the
    kind planned slower or bounded at or above its time (after the runners-up were planned), or
    how many are not ruled out (their bound below its time); ``label`` as it is for a row of a
    kind of one layout, or with no plan.

    Examples
    --------
    >>> from types import SimpleNamespace as N
    >>> found = N(status="planned", parts=N(iteration_ms=10.0))
    >>> kind_label("t=8", found, [[N(status="pruned", lower_bound_ms=9.0)], [N(status="infeasible")]])
    't=8; 1 more of its kind not ruled out'
    >>> kind_label("t=8", found, [[N(status="pruned", lower_bound_ms=11.0)]])
    't=8; proven best of its kind'
    """
    if found is None or not rivals:
        return label
    ms = found.parts.iteration_ms
    open_ = sum(1 for group in rivals if any(
        (t.parts.iteration_ms if t.status == "planned" else t.lower_bound_ms) < ms
        for t in group if t.status in ("planned", "pruned", "new")))
    if not open_:
        return f"{label}; proven best of its kind"
    return f"{label}; {open_} more of its kind not ruled out"


@dataclass
class Compare:
    """One ``--compare`` layout: its text, the search that plans it and its trials."""

    text: str
    search: object
    """The cluster search (a copy with the micro-batch size fixed where ``mbs`` is given)."""
    trials: list
    fresh: bool
    """Whether the trials are its own (bounds still to compute), not the search's."""
    unbounded: Optional[dict] = None
    """Its own per-layout pipeline optima when its settings differ from the search's (``mbs``)."""


def _rule_text(message: str) -> str:
    """A layout rule's message in the keys of ``--compare``."""
    for option, key in (("--data-parallel", "d"), ("--tensor-parallel", "t"), ("--stages", "p"),
                        ("--microbatch-size", "mbs"), ("--expert-parallel", "e")):
        message = message.replace(option + ":", key + ":").replace(option, key)
    return message


def compare_search(search, text: str, layout_trials: Callable) -> Compare:
    """The trials a ``--compare`` layout plans: the search's own of that layout where they are the
    same (no ``zero``, ``mbs`` or ``e`` that they leave out), else its own.

    Raises
    ------
    BadInputError
        A layout the rules refuse (tensor degree within a node and dividing the heads, the
        profile's tensor degrees, at most one stage per unit, ``d x b`` dividing the batch, a
        fixed option of the plan it contradicts), naming ``--compare`` and the rule.
    """
    layout = parse_compare(text)
    where = f"--compare {text!r}"
    d, t, p = layout["d"], layout["t"], layout["p"]
    profile, settings, cluster = search.profile, search.settings, search.cluster
    mbs, zero, expert = layout.get("mbs"), layout.get("zero"), layout.get("e")
    if mbs is not None and mbs not in profile.microbatch_sizes:
        raise BadInputError(f"{where}: mbs={mbs} is not a profiled micro-batch size ({profile.microbatch_sizes})")
    if mbs is not None and settings.microbatch_size not in (None, mbs):
        raise BadInputError(f"{where}: mbs={mbs} but --microbatch-size {settings.microbatch_size} fixes it")
    if zero is not None and settings.zero_stage not in (None, zero):
        raise BadInputError(f"{where}: zero={zero} but --zero {settings.zero_stage} fixes it")
    runs = launcher_zero_stages(settings.launcher, d, p)
    if zero is not None and settings.launcher is not None and zero not in runs:
        raise BadInputError(f"{where}: zero={zero}: --launcher {settings.launcher} runs ZeRO "
                            f"{' or '.join(map(str, runs))} here")
    if expert not in (None, 1) and getattr(profile, "experts", None) is None:
        raise BadInputError(f"{where}: e={expert}: the profile has no experts (a dense model plans e=1)")
    if expert is not None and expert not in expert_choices(
            profile, settings.model_copy(update={"expert_parallel": expert}), d, t):
        raise BadInputError(f"{where}: e={expert} does not divide d={d} and the number of experts")
    try:
        degrees = parallel_degrees(settings.num_gpus, cluster.gpus_per_node, len(profile.layers), head_counts(profile),
                                   tensor_degrees(profile), data=d, tensor=t, pipeline=p, context=search.context)
        candidates(degrees, settings.global_batch, [mbs] if mbs is not None else search.sizes_all)
    except BadInputError as error:
        raise BadInputError(f"{where}: {_rule_text(str(error))}") from None
    if mbs is None:
        own = [trial for trial in search.trials if trial.key[:3] == (d, t, p)
               and (zero is None or trial.zero_stage == zero) and (expert is None or trial.expert == expert)]
        if own:
            return Compare(text, search, own, fresh=False)
        return Compare(text, search, layout_trials(search, d, t, p, len(search.trials), expert, zero), fresh=True)
    sub = dataclasses.replace(search, settings=settings.model_copy(update={"microbatch_size": mbs}),
                              sizes_all=[mbs], trials=[], compares=[])
    return Compare(text, sub, layout_trials(sub, d, t, p, 0, expert, zero), fresh=True, unbounded={})
