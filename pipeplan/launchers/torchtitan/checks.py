"""What torchtitan refuses at start-up in a config its reader read (errors, not notes)."""

from __future__ import annotations

from pipeplan.launchers.config import LauncherConfig, Problem

__all__ = ["startup_problems"]


def startup_problems(config: LauncherConfig) -> list[Problem]:
    """A local batch its pipeline cannot split into micro-batches."""
    if config.num_microbatches is None:
        return [Problem("refused", "error", "training.local_batch_size",
                        f"not divisible by parallelism.pipeline_parallel_microbatch_size {config.microbatch_size}; "
                        f"torchtitan refuses it", "use a multiple of the micro-batch size")]
    return []
