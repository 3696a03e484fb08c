"""What Megatron-LM refuses at start-up in a config its reader read (errors, not notes)."""

from __future__ import annotations

from pipeplan.launchers.config import LauncherConfig, Problem

__all__ = ["startup_problems"]


def startup_problems(config: LauncherConfig) -> list[Problem]:
    """The world size and global batch Megatron-LM refuses before training."""
    s, out = config.settings, []
    d = config.data_degree
    world = int(s["world size"]) if "world size" in s else None
    model = config.tensor_degree * config.pipeline_degree * config.context_degree
    if world and world % model:
        # Megatron refuses this at start-up (parallel_state.initialize_model_parallel raises
        # "world_size (W) is not divisible by t x p x cp"): an error, not a note.
        out.append(Problem("world-size", "error", f"world size {world}",
                           f"the script starts {world} processes, not a multiple of t x p x cp = {model}: "
                           f"Megatron refuses it at start-up ('world_size ({world}) is not divisible by "
                           f"{model}'); the data-parallel size is taken as 1 below",
                           f"start a multiple of {model} processes (e.g. NUM_NODES = {-(-model // 8)} at 8 GPUs "
                           f"per node), or give --world-size for the real job"))
    gbs = s.get("--global-batch-size")
    if gbs is not None and config.num_microbatches is None:
        out.append(Problem("refused", "error", f"--global-batch-size {gbs}",
                           f"{gbs} is not divisible by --micro-batch-size {config.microbatch_size} x data-parallel "
                           f"size {d or 1}; Megatron-LM refuses it",
                           f"use a multiple of {config.microbatch_size * (d or 1)}"))
    return out
