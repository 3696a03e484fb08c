"""Running a plan on torch.distributed.pipelining under torchrun (``pipeplan run``, ``calibrate``).

Importing this package does not import torch: the ranks import it in their own processes.

- :func:`run_plan` / :func:`run_plan_file`: launch one process per pipeline rank, collect the
  measurements, and return the run report (:mod:`pipeplan.run.report`).
- :func:`balanced_plan`: a plan of any schedule (interleaved, zero-bubble, V-shapes), split
  evenly and predicted by the simulator.
- :func:`calibrate_profile`: scale a profile's per-layer times by what a run measured.
"""

from __future__ import annotations

from pipeplan.run.launch import RunFailedError, run_plan, run_plan_file, run_plans, torchrun_command
from pipeplan.run.plans import balanced_plan, simulate_plan
from pipeplan.run.report import build_report, report_table

__all__ = [
    "RunFailedError",
    "run_plan",
    "run_plans",
    "run_plan_file",
    "torchrun_command",
    "balanced_plan",
    "simulate_plan",
    "build_report",
    "report_table",
    "calibrate_profile",
    "calibrate_files",
]


def __getattr__(name: str):
    if name in ("calibrate_profile", "calibrate_files"):
        from pipeplan.run import calibrate

        return getattr(calibrate, name)
    raise AttributeError(f"module 'pipeplan.run' has no attribute {name!r}")
