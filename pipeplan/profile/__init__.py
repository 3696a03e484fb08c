"""Measuring a real torch model per unit into a profile (``pipeplan profile``).

Importing this package does not import torch; the names below load their module (and torch)
on first use.

For the executor (one pipeline rank building its own stage)::

    from pipeplan.profile import build_stage, load_bundle, make_microbatch, loss_fn
    stage = build_stage("gpt2-tiny", ["blocks.2", "blocks.3"], seed=0, device="cpu", layers=4)
    bundle = load_bundle("gpt2-tiny", materialise=[], layers=4)    # no weights built
    inputs, target = make_microbatch(bundle, microbatch_size=2, seq_len=128, seed=step)
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from pipeplan.profile.registry import ALIASES, PRESETS, InputSpec, ModelBundle, resolve_builtin

__all__ = [
    "ALIASES",
    "PRESETS",
    "InputSpec",
    "ModelBundle",
    "resolve_builtin",
    "profile_model",
    "profile_to_file",
    "parse_microbatch_sizes",
    "summary_table",
    "build_model",
    "build_stage",
    "build_stage_from_profile",
    "model_spec",
    "load_bundle",
    "make_microbatch",
    "example_batch",
    "loss_fn",
    "init_unit",
    "UnitChain",
    "UnitGraph",
    "default_units",
    "select_units",
    "trace_units",
    "builtin_units",
    "builtin_kinds",
]

_LAZY = {
    "profile_model": "pipeplan.profile.api",
    "profile_to_file": "pipeplan.profile.api",
    "parse_microbatch_sizes": "pipeplan.profile.api",
    "summary_table": "pipeplan.profile.api",
    "build_model": "pipeplan.profile.models",
    "example_batch": "pipeplan.profile.models",
    "loss_fn": "pipeplan.profile.models",
    "init_unit": "pipeplan.profile.models",
    "builtin_units": "pipeplan.profile.models",
    "builtin_kinds": "pipeplan.profile.models",
    "build_stage": "pipeplan.profile.units",
    "build_stage_from_profile": "pipeplan.profile.units",
    "model_spec": "pipeplan.profile.units",
    "UnitChain": "pipeplan.profile.units",
    "UnitGraph": "pipeplan.profile.units",
    "default_units": "pipeplan.profile.units",
    "select_units": "pipeplan.profile.units",
    "trace_units": "pipeplan.profile.units",
    "load_bundle": "pipeplan.profile.loading",
    "make_microbatch": "pipeplan.profile.loading",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeplan.profile' has no attribute {name!r}")
    return getattr(import_module(module), name)
