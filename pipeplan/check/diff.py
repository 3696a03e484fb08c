"""``pipeplan diff A B``: two plans, or two profiles, side by side.

Two plans: which layers moved between stages, each stage's time and memory, and the predicted
numbers. Two profiles: which layers got slower or bigger (forward, backward, activation and
parameter bytes at one micro-batch size), which were added or removed, and, given planning
settings, the effect on the plan (both profiles planned with the same settings, then diffed as
plans).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from pipeplan.check.regress import moved_layers, rank_peaks
from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.formats.plan import Plan, PlanSettings
from pipeplan.formats.io import file_sha256, load_json, load_plan, load_profile
from pipeplan.errors import format_validation_error
from pipeplan.api import plan_any
from pipeplan.formats.limits import check_microbatch_count

__all__ = [
    "LayerDelta", "StageRow", "PlanDiff", "ProfileDiff", "diff_plans", "diff_profiles", "diff_files",
    "diff_settings",
]


@dataclass(frozen=True)
class LayerDelta:
    """One layer's costs in profile A and profile B (None where the layer is absent)."""

    name: str
    """Layer name."""
    forward_ms: tuple[Optional[float], Optional[float]]
    """Forward time of one micro-batch, A then B."""
    backward_ms: tuple[Optional[float], Optional[float]]
    """Backward time of one micro-batch, A then B."""
    activation_bytes: tuple[Optional[int], Optional[int]]
    """Bytes kept for backward per micro-batch, A then B."""
    param_bytes: tuple[Optional[int], Optional[int]]
    """Parameter bytes, A then B."""

    @property
    def time_change_ms(self) -> float:
        """Change of forward + backward time, B minus A (absent layers count as 0)."""
        a = (self.forward_ms[0] or 0.0) + (self.backward_ms[0] or 0.0)
        b = (self.forward_ms[1] or 0.0) + (self.backward_ms[1] or 0.0)
        return b - a

    @property
    def bytes_change(self) -> int:
        """Change of activation + parameter bytes, B minus A."""
        a = (self.activation_bytes[0] or 0) + (self.param_bytes[0] or 0)
        b = (self.activation_bytes[1] or 0) + (self.param_bytes[1] or 0)
        return b - a


@dataclass(frozen=True)
class StageRow:
    """One stage of two plans."""

    index: int
    """Stage index."""
    layers: tuple[int, int]
    """Layer counts, A then B (0 where the plan has no such stage)."""
    compute_ms: tuple[float, float]
    """Forward + backward of one micro-batch, A then B."""
    peak_memory_bytes: tuple[int, int]
    """Predicted peak, A then B."""


@dataclass
class PlanDiff:
    """Two plans compared."""

    a: Plan
    """First plan."""
    b: Plan
    """Second plan."""
    moved: list[tuple[str, int, int]]
    """Layers in a different stage: (name, stage in A, stage in B)."""
    only_in_a: list[str]
    """Layers only A places."""
    only_in_b: list[str]
    """Layers only B places."""
    stages: list[StageRow]
    """Per stage, A beside B."""
    rank_peaks: list[tuple[int, Optional[int], Optional[int]]]
    """Per rank: (rank, peak in A, peak in B)."""


@dataclass
class ProfileDiff:
    """Two profiles compared, and optionally the plans made from them."""

    model: tuple[str, str]
    """Model names, A then B."""
    microbatch_size: int
    """The micro-batch size whose costs are compared."""
    changed: list[LayerDelta]
    """Layers whose costs differ (or that exist in one profile only), largest time change first."""
    unchanged: int
    """How many layers have identical costs."""
    plan_diff: Optional[PlanDiff] = None
    """Both profiles planned with the same settings, when settings were given."""
    plan_errors: list[str] = field(default_factory=list)
    """Why a side could not be planned (e.g. nothing fits)."""


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """Compare two plans stage by stage.

    Notes
    -----
    O(L + S).
    """
    in_a = {n for s in a.stages for n in s.layers}
    in_b = {n for s in b.stages for n in s.layers}
    stages_a = {s.index: s for s in a.stages}
    stages_b = {s.index: s for s in b.stages}
    rows = []
    for index in sorted(set(stages_a) | set(stages_b)):
        sa, sb = stages_a.get(index), stages_b.get(index)
        rows.append(StageRow(
            index=index,
            layers=(len(sa.layers) if sa else 0, len(sb.layers) if sb else 0),
            compute_ms=((sa.forward_ms + sa.backward_ms) if sa else 0.0,
                        (sb.forward_ms + sb.backward_ms) if sb else 0.0),
            peak_memory_bytes=(sa.peak_memory_bytes if sa else 0, sb.peak_memory_bytes if sb else 0),
        ))
    peaks_a, peaks_b = rank_peaks(a), rank_peaks(b)
    ranks = [(r, peaks_a.get(r), peaks_b.get(r)) for r in sorted(set(peaks_a) | set(peaks_b))]
    order_a = [n for s in sorted(a.stages, key=lambda s: s.index) for n in s.layers]
    order_b = [n for s in sorted(b.stages, key=lambda s: s.index) for n in s.layers]
    return PlanDiff(
        a=a, b=b, moved=moved_layers(a, b),
        only_in_a=[n for n in order_a if n not in in_b],
        only_in_b=[n for n in order_b if n not in in_a],
        stages=rows, rank_peaks=ranks,
    )


def diff_profiles(a, b, *, microbatch_size: int | None = None, settings: PlanSettings | None = None,
                  sha256: tuple[str, str] = ("", ""), planner: Callable | None = None) -> ProfileDiff:
    """Compare two profiles layer by layer, and plan both when ``settings`` are given.

    Parameters
    ----------
    a, b : Profile
    microbatch_size : int, optional
        Compare costs at this size; default the smallest size both profiles have.
    settings : PlanSettings, optional
        Plan both profiles with these settings and diff the plans.
    sha256 : (str, str)
        The files' sha256, recorded in the plans.
    planner : callable, optional
        Defaults to :func:`pipeplan.plan.make_plan`.

    Returns
    -------
    ProfileDiff

    Raises
    ------
    BadInputError
        If the profiles share no micro-batch size, or ``microbatch_size`` is not in both.

    Notes
    -----
    O(L) plus two planner calls with settings.
    """
    common = sorted(set(a.microbatch_sizes) & set(b.microbatch_sizes))
    if not common:
        raise BadInputError(
            f"profiles share no micro-batch size ({a.microbatch_sizes} vs {b.microbatch_sizes}); "
            f"profile both at a common size"
        )
    size = common[0] if microbatch_size is None else microbatch_size
    if size not in common:
        raise BadInputError(f"--microbatch-size: {size} is not profiled in both; choose one of {common}")
    layers_a = {layer.name: layer for layer in a.layers}
    layers_b = {layer.name: layer for layer in b.layers}
    names = [layer.name for layer in a.layers] + [n for n in layers_b if n not in layers_a]
    changed, unchanged = [], 0
    for name in names:
        la, lb = layers_a.get(name), layers_b.get(name)
        ca = la.cost_at(size) if la else None
        cb = lb.cost_at(size) if lb else None
        delta = LayerDelta(
            name=name,
            forward_ms=(ca.forward_ms if ca else None, cb.forward_ms if cb else None),
            backward_ms=(ca.backward_ms if ca else None, cb.backward_ms if cb else None),
            activation_bytes=(ca.activation_bytes if ca else None, cb.activation_bytes if cb else None),
            param_bytes=(la.param_bytes if la else None, lb.param_bytes if lb else None),
        )
        same = (delta.forward_ms[0] == delta.forward_ms[1] and delta.backward_ms[0] == delta.backward_ms[1]
                and delta.activation_bytes[0] == delta.activation_bytes[1]
                and delta.param_bytes[0] == delta.param_bytes[1])
        if same:
            unchanged += 1
        else:
            changed.append(delta)
    changed.sort(key=lambda d: (-abs(d.time_change_ms), -abs(d.bytes_change), d.name))
    result = ProfileDiff(model=(a.model, b.model), microbatch_size=size, changed=changed, unchanged=unchanged)
    if settings is not None:
        if planner is None:
            planner = plan_any

        plans = []
        for label, profile, sha in (("A", a, sha256[0]), ("B", b, sha256[1])):
            check_microbatch_count(settings.global_batch, profile.microbatch_sizes, settings.microbatch_size)
            try:
                plans.append(planner(profile, settings, profile_sha256=sha))
            except InfeasibleError as exc:
                result.plan_errors.append(f"{label} ({profile.model}): {exc}")
        if len(plans) == 2:
            result.plan_diff = diff_plans(*plans)
    return result


def _kind(data) -> str:
    if isinstance(data, dict) and "stages" in data and "predicted" in data:
        return "plan"
    if isinstance(data, dict) and "layers" in data:
        return "profile"
    return "unknown"


def diff_files(path_a: str | Path, path_b: str | Path, *, settings: PlanSettings | None = None,
               microbatch_size: int | None = None, planner: Callable | None = None):
    """Diff two plan files or two profile files.

    Parameters
    ----------
    path_a, path_b : path
        Both plans or both profiles.
    settings : PlanSettings, optional
        For profiles: plan both with these settings and diff the plans too.
    microbatch_size : int, optional
        For profiles: the micro-batch size whose costs to compare.
    planner : callable, optional
        Defaults to :func:`pipeplan.plan.make_plan`.

    Returns
    -------
    PlanDiff or ProfileDiff

    Raises
    ------
    BadInputError
        A file that is neither a plan nor a profile, one of each, or a bad file.
    """
    kinds = [_kind(load_json(p)) for p in (path_a, path_b)]
    for path, kind in zip((path_a, path_b), kinds):
        if kind == "unknown":
            raise BadInputError(f"{path}: neither a plan (stages, predicted) nor a profile (layers)")
    if kinds[0] != kinds[1]:
        raise BadInputError(
            f"{path_a} is a {kinds[0]} but {path_b} is a {kinds[1]}; diff two plans or two profiles"
        )
    if kinds[0] == "plan":
        return diff_plans(load_plan(path_a), load_plan(path_b))
    return diff_profiles(
        load_profile(path_a), load_profile(path_b), microbatch_size=microbatch_size, settings=settings,
        sha256=(file_sha256(path_a), file_sha256(path_b)), planner=planner,
    )


def diff_settings(settings_from: str | Path | None = None, **overrides) -> PlanSettings | None:
    """Planning settings for a profile diff: a plan file's settings, changed by the given options.

    Parameters
    ----------
    settings_from : path, optional
        A plan file (e.g. the baseline) whose ``settings`` to start from.
    **overrides
        PlanSettings fields (``stages``, ``global_batch``, ``memory_cap_bytes``, ``schedule``,
        ``microbatch_size``, ...); None values are ignored.

    Returns
    -------
    PlanSettings or None
        None when neither a plan file nor any option was given (diff the layers only).

    Raises
    ------
    BadInputError
        Without a plan file, when ``stages`` or ``global_batch`` is missing; or invalid values.

    Examples
    --------
    >>> diff_settings() is None
    True
    >>> diff_settings(stages=4, global_batch=32).stages
    4
    """
    from pydantic import ValidationError

    given = {k: v for k, v in overrides.items() if v is not None}
    if settings_from is None and not given:
        return None
    if settings_from is not None:
        base = load_plan(settings_from).settings.model_dump()
    else:
        missing = [name for name in ("stages", "global_batch") if name not in given]
        if missing:
            raise BadInputError(
                f"diff: planning both profiles needs {' and '.join('--' + m.replace('_', '-') for m in missing)} "
                f"(or --settings-from PLAN)"
            )
        base = {}
    try:
        return PlanSettings.model_validate({**base, **given})
    except ValidationError as exc:
        raise BadInputError(format_validation_error("diff settings", exc)) from None
