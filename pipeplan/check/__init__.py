"""Guarding plans in CI: ``check`` (re-plan against committed baselines) and ``diff``."""

from pipeplan.check.diff import PlanDiff, ProfileDiff, diff_files, diff_plans, diff_profiles
from pipeplan.check.regress import BaselineCheck, CheckReport, Finding, check_baseline, check_profiles
from pipeplan.check.report import check_junit, render_check, render_diff

__all__ = [
    "BaselineCheck",
    "CheckReport",
    "Finding",
    "PlanDiff",
    "ProfileDiff",
    "check_baseline",
    "check_junit",
    "check_profiles",
    "diff_files",
    "diff_plans",
    "diff_profiles",
    "render_check",
    "render_diff",
]
