"""Measuring a real torch model per unit into a profile (``pipeplan profile``).

Importing this package does not import torch: its face is the torch-free part (the registry of
built-ins and the profiling entry points, which import torch when they run). The torch-needing
modules are imported by name where they are used, e.g. for the executor (one pipeline rank
building its own stage)::

    from pipeplan.profile.loading import load_bundle, make_microbatch
    from pipeplan.profile.models import loss_fn
    from pipeplan.profile.units import build_stage
    stage = build_stage("gpt2-tiny", ["blocks.2", "blocks.3"], seed=0, device="cpu", layers=4)
    bundle = load_bundle("gpt2-tiny", materialise=[], layers=4)    # no weights built
    inputs, target = make_microbatch(bundle, microbatch_size=2, seq_len=128, seed=step)
"""

from __future__ import annotations

from pipeplan.profile.api import parse_microbatch_sizes, profile_model, profile_to_file, summary_table
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
]
