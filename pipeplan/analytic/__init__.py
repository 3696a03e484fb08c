"""Analytic profiles: estimate a profile from a model config and a GPU spec, per tensor-parallel degree.

Importing this package imports neither torch nor transformers: configs are read as JSON.

    from pipeplan.analytic import analytic_profile, get_gpu
    profile = analytic_profile("llama3-70b", get_gpu("h100-sxm"), seq_len=8192,
                               microbatch_sizes=[1, 2], tensor_parallel=[1, 2, 4, 8])

See docs/analytic.md for every formula and its source.
"""

from __future__ import annotations

from pipeplan.analytic.api import analytic_profile, analytic_profile_to_file, parse_degrees, summary_rows
from pipeplan.analytic.configs import ModelConfig, shipped_configs
from pipeplan.analytic.families import load_model_config
from pipeplan.analytic.efficiency import DEFAULT_EFFICIENCY, EfficiencyModel
from pipeplan.facts.gpus import GPUS, GpuSpec, get_gpu, load_gpu_spec

__all__ = [
    "analytic_profile", "analytic_profile_to_file", "parse_degrees", "summary_rows",
    "ModelConfig", "load_model_config", "shipped_configs",
    "EfficiencyModel", "DEFAULT_EFFICIENCY",
    "GPUS", "GpuSpec", "get_gpu", "load_gpu_spec",
]
