"""What a first plan assumes about ``pipeplan run``: that it can run the model, and the
schedule's own time per action before any run was calibrated.

The schedule's own time per action (posting a transfer, torch's bookkeeping around each
forward, backward and weight-gradient call: ``settings.action_overhead_ms``) is 0 in the cost
model unless a calibrated profile carries a measured figure. At 0 a first plan prefers schedules
with many actions (interleaved at high ``v``), which then run slower than predicted. This
module gives the term a measured default per device and communication backend:

=========== ========= ========== =====================================================
device      backend   ms/action  how it was measured
=========== ========= ========== =====================================================
cpu         gloo      1.0        the median of 21 runs of benchmarks/bench_executor.py on
                                 the 2-core development CPU, 2 ranks, every schedule
                                 (range 0.53-1.94; docs/benchmarks.md, "Executor with the
                                 overhead term")
cuda        nccl      none       not measured: no GPU machine has run pipeplan run yet
=========== ========= ========== =====================================================

Precedence: ``--action-overhead-ms`` (``0`` turns it off), then the profile's calibrated
``measurement.action_overhead_ms`` (``pipeplan calibrate``), then this default, else 0.

No torch needed.
"""

from __future__ import annotations

from typing import Any, Optional
from pipeplan.errors import BadInputError

__all__ = ["ACTION_OVERHEAD_MS", "default_action_overhead_ms", "default_overhead_note", "runnable_problem",
           "refuse_unrunnable", "execution_order_note"]

#: (device type, backend) -> (ms per action, how it was measured).
ACTION_OVERHEAD_MS: dict[tuple[str, str], tuple[float, str]] = {
    ("cpu", "gloo"): (1.0, "median of 21 pipeplan runs on the 2-core development CPU (2 ranks, every "
                           "schedule, 0.53-1.94 ms; docs/benchmarks.md)"),
}

_BACKEND = {"cpu": "gloo", "cuda": "nccl"}


def default_action_overhead_ms(profile: Any) -> Optional[tuple[float, str]]:
    """``(ms, source)`` of the measured default for where ``profile`` was measured, or None.

    Only profiles measured by ``pipeplan profile`` say where (``measurement.device_type``);
    imported and analytic profiles get none.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> default_action_overhead_ms(SimpleNamespace(source="measured", measurement={"device_type": "cpu"}))[0]
    1.0
    >>> default_action_overhead_ms(SimpleNamespace(source="analytic", measurement=None)) is None
    True
    """
    measurement = getattr(profile, "measurement", None) or {}
    if getattr(profile, "source", None) != "measured":
        return None
    device = measurement.get("device_type")
    return ACTION_OVERHEAD_MS.get((device, _BACKEND.get(device, "")))


def default_overhead_note(profile: Any, settings: Any) -> Optional[str]:
    """The plan's note when the default per-action overhead applies to ``settings`` (as given by
    the user, before the profile's defaults), else None."""
    if settings.action_overhead_ms is not None or (getattr(profile, "measurement", None) or {}).get("action_overhead_ms"):
        return None
    default = default_action_overhead_ms(profile)
    if default is None:
        return None
    ms, source = default
    device = profile.measurement["device_type"]
    return (f"the schedule's own time per action is the default for {device}/{_BACKEND[device]}, {ms:g} ms "
            f"({source}); --action-overhead-ms overrides it, pipeplan calibrate measures it on your machine")


def runnable_problem(profile: Any) -> Optional[str]:
    """Why no stage builder of ``pipeplan run`` can run this profile's model, or None.

    Only measured profiles that recorded ``measurement.stage_builders`` can say (no torch is
    needed here).

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> p = SimpleNamespace(model="m:f", measurement={"stage_builders": {"units": False, "traced": False,
    ...     "traced_error": "torch.export failed"}})
    >>> runnable_problem(p)[:60]
    "no stage builder of pipeplan run can run m:f: torch.fx's gra"
    """
    builders = (getattr(profile, "measurement", None) or {}).get("stage_builders")
    if not builders or builders.get("units") or builders.get("traced"):
        return None
    return (f"no stage builder of pipeplan run can run {profile.model}: torch.fx's graph leaves some "
            f"unit's inputs unknown (fx: {(profile.measurement or {}).get('fx_error') or 'values computed outside units'}) "
            f"and torch's tracer cannot split it before every unit "
            f"({builders.get('traced_error', 'unknown error')}); choose coarser units (--units) "
            f"or make the forward traceable by torch.export")


def execution_order_note(profile: Any) -> Optional[str]:
    """Why the stages must be runs of consecutive layers in the profile's (execution) order, or None.

    ``pipeplan run``'s traced stage builder (HF models, user models torch.fx cannot wire) splits
    torch's traced graph before each stage's first unit (``SplitPoint.BEGINNING``), so a stage
    holds every unit the forward runs from there to the next stage's first unit. A split of the
    layer DAG that is not a run of the execution order (GPT-2's ``wpe`` alone in stage 0, before
    ``wte``, which the forward calls first) would run as a different split, whose stages no
    longer match the plan. Profiles recorded which builder runs them
    (``measurement.stage_builders.run_uses``); others (built-ins, imported) give None.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> execution_order_note(SimpleNamespace(measurement={"stage_builders": {"run_uses": "traced"}}))[:40]
    'stages follow the layer order: pipeplan '
    >>> execution_order_note(SimpleNamespace(measurement={"stage_builders": {"run_uses": "units"}})) is None
    True
    """
    builders = (getattr(profile, "measurement", None) or {}).get("stage_builders") or {}
    if builders.get("run_uses") != "traced":
        return None
    return ("stages follow the layer order: pipeplan run's traced stage builder splits the model before each "
            "stage's first unit in the order the forward runs them, so the split is the best one along that order "
            "(not over every split of the layer graph)")


def refuse_unrunnable(profile: Any) -> None:
    """Raise when no stage builder of ``pipeplan run`` can run the profile's model.

    Raises
    ------
    BadInputError
        With :func:`runnable_problem`'s reason.
    """
    problem = runnable_problem(profile)
    if problem is not None:
        raise BadInputError(f"profile {profile.model}: {problem}")
