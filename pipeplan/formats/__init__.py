"""File formats: the profile (per-layer costs) and the plan (a chosen pipeline)."""

from pipeplan.formats.plan import Plan, PlanStage
from pipeplan.formats.profile import Layer, LayerCost, Profile
from pipeplan.formats.io import load_plan, load_profile, write_json_atomic, dump_model

__all__ = [
    "Layer",
    "LayerCost",
    "Plan",
    "PlanStage",
    "Profile",
    "dump_model",
    "load_plan",
    "load_profile",
    "write_json_atomic",
]
