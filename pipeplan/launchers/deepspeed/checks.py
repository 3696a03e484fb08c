"""What DeepSpeed refuses at start-up in a config its reader read (errors, not notes)."""

from __future__ import annotations

from pipeplan.launchers.config import LauncherConfig, Problem

__all__ = ["startup_problems"]


def startup_problems(config: LauncherConfig) -> list[Problem]:
    """The ZeRO stage and batch DeepSpeed's engine asserts on."""
    s, out = config.settings, []
    d = config.data_degree
    if config.zero_stage >= 2 and config.pipeline_degree > 1:
        out.append(Problem("refused", "error", f"zero_optimization.stage {config.zero_stage}",
                           "DeepSpeed's PipelineEngine asserts the ZeRO stage is below 2 (\"ZeRO-2 and ZeRO-3 are "
                           "incompatible with pipeline parallelism\")", "use zero_optimization.stage 1"))
    total = s.get("train_batch_size")
    if total is not None and d is not None:
        expected = config.microbatch_size * config.num_microbatches * d
        if int(total) != expected:
            out.append(Problem(
                "refused", "error", f"train_batch_size {total}",
                f"DeepSpeed asserts train_batch_size == micro-batch {config.microbatch_size} x gradient "
                f"accumulation {config.num_microbatches} x data-parallel {d} = {expected}",
                f"set train_batch_size to {expected}"))
    return out
