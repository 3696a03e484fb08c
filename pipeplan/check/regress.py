"""CI regression check: re-plan each profile with its baseline's settings and compare.

A team keeps profiles in ``profiles/`` and one committed baseline plan per profile in
``profiles/baselines/``. ``check_profiles`` re-plans every baseline's profile with the settings
the baseline recorded and reports, per baseline: predicted throughput against the baseline's
(a drop beyond the tolerance fails), every rank's peak memory against the memory cap (over it
fails, for the new plan and for the committed one), and which layers moved between stages.

File convention: baseline ``<baseline_dir>/<name>.plan.json`` (or ``<name>.json``) belongs to
profile ``<profiles_dir>/<name>.json``; failing that, to the one profile in ``profiles_dir``
whose ``model`` is the baseline's ``profile.model``. See docs/ci.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.formats.plan import Plan
from pipeplan.quantities import format_bytes
from pipeplan.formats.io import file_sha256, load_json, load_plan, write_json_atomic
from pipeplan.formats.limits import check_microbatch_count
from pipeplan.formats.io import load_profile
from pipeplan.api import plan_any

__all__ = [
    "Finding",
    "BaselineCheck",
    "CheckReport",
    "check_profiles",
    "check_baseline",
    "find_baselines",
    "find_profile",
    "rank_peaks",
    "moved_layers",
]

Severity = Literal["fail", "info"]


@dataclass(frozen=True)
class Finding:
    """One thing a check found."""

    severity: Severity
    """``"fail"`` makes the check (and ``pipeplan check``) fail; ``"info"`` is reported only."""
    topic: Literal["throughput", "memory", "boundaries", "infeasible", "profile"]
    """What it is about."""
    message: str
    """One sentence with the numbers."""


@dataclass
class BaselineCheck:
    """The result of re-planning one baseline's profile."""

    name: str
    """The baseline's name (file name without ``.plan.json``)."""
    baseline_path: str
    """Path of the baseline plan."""
    profile_path: str
    """Path of the profile it was matched with."""
    model: str
    """Model name."""
    baseline: Plan
    """The committed plan."""
    current: Optional[Plan]
    """The re-made plan, or None when nothing fits any more."""
    memory_cap_bytes: Optional[int]
    """The cap checked against (the baseline's, or the override)."""
    tolerance: float
    """Largest allowed relative throughput drop, e.g. 0.02."""
    profile_changed: bool
    """Whether the profile's sha256 differs from the one the baseline recorded."""
    findings: list[Finding] = field(default_factory=list)
    """What was found, failures first."""

    @property
    def failed(self) -> bool:
        """True when any finding is a failure."""
        return any(f.severity == "fail" for f in self.findings)

    @property
    def throughput_change(self) -> Optional[float]:
        """Relative change of predicted samples per second (-0.2 = 20% slower); None if infeasible."""
        if self.current is None:
            return None
        base = self.baseline.predicted.samples_per_second
        if base <= 0:
            return 0.0
        return self.current.predicted.samples_per_second / base - 1.0


@dataclass
class CheckReport:
    """All baselines' results."""

    checks: list[BaselineCheck]
    """One per baseline, in file-name order."""
    tolerance: float
    """The tolerance used."""
    updated: list[str] = field(default_factory=list)
    """Baselines rewritten by ``update=True``."""

    @property
    def failed(self) -> bool:
        """True when any baseline failed."""
        return any(check.failed for check in self.checks)

    @property
    def exit_code(self) -> int:
        """1 when any baseline failed, else 0 (bad input raises instead: exit 2)."""
        return 1 if self.failed else 0


def rank_peaks(plan: Plan) -> dict[int, int]:
    """Each rank's predicted peak memory in bytes.

    The plan's per-rank summary when it has one; otherwise the sum of the rank's stages'
    peaks (exact for one stage per rank, an upper bound otherwise).
    """
    if plan.ranks:
        return {r.rank: r.peak_memory_bytes for r in plan.ranks}
    peaks: dict[int, int] = {}
    for stage in plan.stages:
        peaks[stage.rank] = peaks.get(stage.rank, 0) + stage.peak_memory_bytes
    return dict(sorted(peaks.items()))


def moved_layers(before: Plan, after: Plan) -> list[tuple[str, int, int]]:
    """Layers whose stage differs between two plans: ``(name, stage before, stage after)``.

    Layers in only one of the plans are left out. O(L).
    """
    stage_before = {n: s.index for s in before.stages for n in s.layers}
    moved = []
    for stage in sorted(after.stages, key=lambda s: s.index):
        for name in stage.layers:
            if name in stage_before and stage_before[name] != stage.index:
                moved.append((name, stage_before[name], stage.index))
    return moved


def find_baselines(baseline_dir: str | Path) -> list[Path]:
    """The baseline plan files in a folder: ``*.json``, sorted by name.

    Raises
    ------
    BadInputError
        If the folder is missing or holds no JSON file.
    """
    folder = Path(baseline_dir)
    if not folder.is_dir():
        raise BadInputError(f"--baseline: {folder} is not a folder; give the folder of baseline plans")
    paths = sorted(p for p in folder.glob("*.json") if p.is_file())
    if not paths:
        raise BadInputError(
            f"--baseline: {folder} holds no baseline plans (*.plan.json); make one with "
            f"`pipeplan plan PROFILE ... -o {folder}/<profile name>.plan.json`"
        )
    return paths


def _baseline_name(path: Path) -> str:
    name = path.name
    for suffix in (".plan.json", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def find_profile(baseline_path: Path, plan: Plan, profiles_dir: str | Path) -> Path:
    """The profile a baseline belongs to (see the module docstring for the convention).

    Raises
    ------
    BadInputError
        If no profile, or more than one, matches.
    """
    folder = Path(profiles_dir)
    by_name = folder / f"{_baseline_name(baseline_path)}.json"
    if by_name.is_file():
        return by_name
    candidates = []
    for path in sorted(folder.glob("*.json")):
        if path.resolve() == baseline_path.resolve():
            continue
        try:
            data = load_json(path)
        except BadInputError:
            continue
        if isinstance(data, dict) and "layers" in data and data.get("model") == plan.profile.model:
            candidates.append(path)
    if len(candidates) > 1:
        same = [p for p in candidates if file_sha256(p) == plan.profile.sha256]
        if len(same) == 1:
            return same[0]
        raise BadInputError(
            f"{baseline_path}: profiles {[str(p) for p in candidates]} all have model "
            f"{plan.profile.model!r}; name the baseline after one of them (<name>.plan.json)"
        )
    if not candidates:
        raise BadInputError(
            f"{baseline_path}: no profile {by_name} and none in {folder} with model "
            f"{plan.profile.model!r}; name the baseline <profile name>.plan.json"
        )
    return candidates[0]


def check_baseline(
    baseline_path: str | Path,
    profile_path: str | Path,
    *,
    tolerance: float = 0.02,
    memory_cap_bytes: int | None = None,
    planner: Callable | None = None,
) -> BaselineCheck:
    """Re-plan one profile with its baseline's settings and compare.

    Parameters
    ----------
    baseline_path, profile_path : path
    tolerance : float
        Largest allowed relative drop of predicted samples per second (0.02 = 2%).
    memory_cap_bytes : int, optional
        Check against this cap (and re-plan under it) instead of the baseline's.
    planner : callable, optional
        ``planner(profile, settings, profile_sha256=...) -> Plan``; defaults to
        :func:`pipeplan.plan.make_plan`.

    Returns
    -------
    BaselineCheck

    Raises
    ------
    BadInputError
        Bad files, or settings the profile no longer allows (e.g. more stages than layers).

    Notes
    -----
    One planner call; the comparison is O(L + p).
    """
    if planner is None:
        planner = plan_any
    baseline_path, profile_path = Path(baseline_path), Path(profile_path)
    baseline = load_plan(baseline_path)
    profile = load_profile(profile_path)
    sha = file_sha256(profile_path)
    settings = baseline.settings
    if memory_cap_bytes is not None:
        settings = settings.model_copy(update={"memory_cap_bytes": int(memory_cap_bytes)})
    cap = settings.memory_cap_bytes
    check = BaselineCheck(
        name=_baseline_name(baseline_path), baseline_path=str(baseline_path),
        profile_path=str(profile_path), model=profile.model, baseline=baseline, current=None,
        memory_cap_bytes=cap, tolerance=tolerance, profile_changed=sha != baseline.profile.sha256,
    )
    findings = check.findings
    if profile.model != baseline.profile.model:
        findings.append(Finding("info", "profile", (
            f"profile model {profile.model!r} differs from the baseline's {baseline.profile.model!r}")))
    try:
        check_microbatch_count(settings.global_batch, profile.microbatch_sizes, settings.microbatch_size)
        current = planner(profile, settings, profile_sha256=sha)
    except InfeasibleError as exc:
        findings.append(Finding("fail", "infeasible", f"no plan fits any more: {exc}"))
        current = None
    except BadInputError as exc:
        raise BadInputError(f"{baseline_path}: re-planning {profile_path} failed: {exc}") from None
    check.current = current
    if current is not None:
        base_sps = baseline.predicted.samples_per_second
        now_sps = current.predicted.samples_per_second
        change = check.throughput_change
        numbers = f"{base_sps:.6g} -> {now_sps:.6g} samples/s"
        if change < -tolerance:
            findings.append(Finding("fail", "throughput", (
                f"predicted throughput fell {-100 * change:.3g}% ({numbers}), more than the "
                f"{100 * tolerance:.3g}% tolerance; bottleneck stage {current.predicted.bottleneck_stage}")))
        elif change > tolerance:
            findings.append(Finding("info", "throughput", (
                f"predicted throughput rose {100 * change:.3g}% ({numbers}); refresh the baseline "
                f"with `pipeplan check ... --update`")))
        if cap is not None:
            for rank, peak in rank_peaks(current).items():
                if peak > cap:
                    findings.append(Finding("fail", "memory", (
                        f"re-made plan: rank {rank} peaks at {format_bytes(peak)}, over the "
                        f"{format_bytes(cap)} cap")))
        moved = moved_layers(baseline, current)
        if moved:
            shown = ", ".join(f"{n} {a}->{b}" for n, a, b in moved[:6])
            more = f" and {len(moved) - 6} more" if len(moved) > 6 else ""
            findings.append(Finding("info", "boundaries", f"{len(moved)} layers changed stage: {shown}{more}"))
        if (current.schedule, current.microbatch_size, current.virtual_stages) != (
                baseline.schedule, baseline.microbatch_size, baseline.virtual_stages):
            findings.append(Finding("info", "boundaries", (
                f"configuration changed: schedule {baseline.schedule} -> {current.schedule}, "
                f"micro-batch {baseline.microbatch_size} -> {current.microbatch_size}, "
                f"stages per rank {baseline.virtual_stages} -> {current.virtual_stages}")))
    if cap is not None:
        for rank, peak in rank_peaks(baseline).items():
            if peak > cap:
                findings.append(Finding("fail", "memory", (
                    f"committed baseline: rank {rank} peaks at {format_bytes(peak)}, over the "
                    f"{format_bytes(cap)} cap; re-plan and commit the new baseline")))
    findings.sort(key=lambda f: f.severity != "fail")
    return check


def check_profiles(
    profiles_dir: str | Path,
    baseline_dir: str | Path,
    *,
    tolerance: float = 0.02,
    memory_cap_bytes: int | None = None,
    update: bool = False,
    planner: Callable | None = None,
) -> CheckReport:
    """Check every baseline in ``baseline_dir`` against its profile in ``profiles_dir``.

    Parameters
    ----------
    profiles_dir : path
        Folder of profiles.
    baseline_dir : path
        Folder of baseline plans (``<profile name>.plan.json``).
    tolerance : float
        Largest allowed relative throughput drop, in [0, 1).
    memory_cap_bytes : int, optional
        Override every baseline's memory cap.
    update : bool
        Rewrite each baseline that re-planned (passing or not) with the new plan.
    planner : callable, optional
        See :func:`check_baseline`.

    Returns
    -------
    CheckReport
        ``exit_code`` 1 when a throughput drop beyond the tolerance or a cap overrun was found.

    Raises
    ------
    BadInputError
        Missing folders, no baselines, a baseline without a profile, bad files, bad tolerance.

    Examples
    --------
    >>> check_profiles("profiles", "profiles/baselines", tolerance=1.5)
    Traceback (most recent call last):
    ...
    pipeplan.errors.BadInputError: --tolerance: 1.5 must be in [0, 1), e.g. 0.02 for 2%

    Notes
    -----
    One planner call per baseline.
    """
    if not 0 <= tolerance < 1:
        raise BadInputError(f"--tolerance: {tolerance} must be in [0, 1), e.g. 0.02 for 2%")
    if not Path(profiles_dir).is_dir():
        raise BadInputError(f"{profiles_dir}: is not a folder; give the folder of profiles")
    report = CheckReport(checks=[], tolerance=tolerance)
    for baseline_path in find_baselines(baseline_dir):
        plan = load_plan(baseline_path)
        profile_path = find_profile(baseline_path, plan, profiles_dir)
        check = check_baseline(baseline_path, profile_path, tolerance=tolerance,
                               memory_cap_bytes=memory_cap_bytes, planner=planner)
        report.checks.append(check)
        if update and check.current is not None:
            write_json_atomic(baseline_path, check.current)
            report.updated.append(str(baseline_path))
    return report
