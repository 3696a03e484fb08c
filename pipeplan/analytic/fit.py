"""Fit the efficiency model's terms to measured iteration times (``pipeplan calibrate --runs``).

The free parameters are the float fields of :class:`EfficiencyModel` with a numeric bound
(:func:`fittable_fields`): a field added to the model with bounds is fitted with no change here.
Each is moved in log space above its lower bound, ``u = log(value - lower)`` (a fraction of a
peak and a latency alike change by factors, and the value stays above its bound), and held at
its upper bound where it has one.

The solver is Levenberg-Marquardt (Levenberg 1944; Marquardt 1963) on the residuals
``r_i = log(predicted_i / measured_i)``: each re-linearisation takes a forward-difference
Jacobian (one evaluation per free parameter, a step of 1% in the value above its bound), then
solves ``(JᵀJ + λ diag(JᵀJ)) δ = -Jᵀr``, halving or quadrupling the damping λ as a step lowers
the squared error or not. An evaluation is whatever the caller's ``residuals`` does (the API
rebuilds each run's analytic profile and plans its layout): the cost of a fit is
``iterations x (free parameters + 1)`` evaluations, plus one per rejected step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import annotated_types
import numpy as np
from pydantic import ValidationError

from pipeplan.analytic.efficiency import EfficiencyModel
from pipeplan.errors import BadInputError, format_validation_error
from pipeplan.formats.reading import load_json

__all__ = ["load_efficiency", "Bounds", "fittable_fields", "parse_fit_fields", "FitResult", "fit_log_residuals", "to_log_space",
           "from_log_space"]

#: Re-linearisations at most; a fit of a few terms to a few runs settles in 3-6.
MAX_ITERATIONS = 12
#: Forward-difference step in log space (a 1% change of the value above its bound).
STEP = 0.01
#: A step that lowers the squared error by less than this share of it ends the fit.
RELATIVE_GAIN = 1e-6
#: Largest step of one parameter in one iteration, in log space (a factor of e).
MAX_STEP = 1.0


def load_efficiency(path) -> EfficiencyModel:
    """Read an efficiency model file (what ``pipeplan calibrate --runs -o`` writes: the JSON of
    :class:`EfficiencyModel`, a field left out at its default); ``pipeplan profile --analytic
    --efficiency`` and ``calibrate --runs --efficiency`` take it.

    Raises
    ------
    BadInputError
        A missing or malformed file, an unknown field, a value out of its bounds: one line naming
        the file and the field.
    """
    data = load_json(path)
    if not isinstance(data, dict):
        raise BadInputError(f"{path}: expected a JSON object (an efficiency model), found {type(data).__name__}")
    try:
        return EfficiencyModel.model_validate(data)
    except ValidationError as exc:
        raise BadInputError(format_validation_error(path, exc)) from None


@dataclass(frozen=True)
class Bounds:
    """A field's numeric bounds (None: unbounded on that side) and whether each is open."""

    lower: Optional[float]
    upper: Optional[float]
    upper_open: bool = False

    def clamp(self, value: float) -> float:
        """``value`` within the upper bound (an open one: just below it)."""
        if self.upper is None:
            return value
        top = self.upper - abs(self.upper) * 1e-9 if self.upper_open else self.upper
        return min(value, top)


def fittable_fields(model: type = EfficiencyModel) -> dict[str, Bounds]:
    """The float fields of ``model`` with a numeric bound, and the bounds, in field order.

    Examples
    --------
    >>> list(fittable_fields())[:4]
    ['gemm', 'attention', 'memory', 'kernel_latency_us']
    """
    out = {}
    for name, field in model.model_fields.items():
        if field.annotation is not float:
            continue
        lower = upper = None
        upper_open = False
        for item in field.metadata:
            if isinstance(item, (annotated_types.Gt, annotated_types.Ge)):
                lower = float(item.gt if isinstance(item, annotated_types.Gt) else item.ge)
            elif isinstance(item, (annotated_types.Lt, annotated_types.Le)):
                upper_open = isinstance(item, annotated_types.Lt)
                upper = float(item.lt if upper_open else item.le)
        if lower is not None or upper is not None:
            out[name] = Bounds(lower, upper, upper_open)
    return out


def parse_fit_fields(text: Optional[str]) -> list[str]:
    """``--fit gemm,attention`` to the field names (default: every fittable field).

    Raises
    ------
    BadInputError
        A name that is not a bounded float field of the efficiency model, or one given twice.
    """
    known = fittable_fields()
    if text is None:
        return list(known)
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise BadInputError(f"--fit: {', '.join(unknown) or repr(text)} is not a fittable term of the efficiency "
                            f"model; it has {', '.join(known)}")
    if len(set(names)) != len(names):
        raise BadInputError(f"--fit: {text!r} names a term twice")
    return names


def to_log_space(value: float, bounds: Bounds) -> float:
    """``log(value - lower)`` (``log(upper - value)`` for a field with only an upper bound). A value
    on its bound (a latency of 0) has no logarithm, and a log step from just above it would not
    move it: it starts one of its unit from the bound (the caller keeps the start where the fit
    does not beat it)."""
    if bounds.lower is not None:
        offset = value - bounds.lower
    elif bounds.upper is not None:
        offset = bounds.upper - value
    else:
        offset = value
    return math.log(offset if offset > 0 else 1.0)


def from_log_space(u: float, bounds: Bounds) -> float:
    """The inverse of :func:`to_log_space`, held within the upper bound."""
    if bounds.lower is not None:
        return bounds.clamp(bounds.lower + math.exp(u))
    if bounds.upper is not None:
        return bounds.upper - math.exp(u)
    return math.exp(u)


@dataclass(frozen=True)
class FitResult:
    """Where the solver stopped: the parameters (log space), the residuals there, and its work."""

    u: np.ndarray
    residuals: np.ndarray
    iterations: int
    evaluations: int
    converged: bool


def _jacobian(residuals, u: np.ndarray, r: np.ndarray, upper: np.ndarray) -> np.ndarray:
    columns = []
    for j in range(len(u)):
        step = STEP if u[j] + STEP <= upper[j] else -STEP  # at the upper bound: step down
        moved = u.copy()
        moved[j] += step
        columns.append((residuals(moved) - r) / step)
    return np.stack(columns, axis=1)


def fit_log_residuals(residuals: Callable[[np.ndarray], np.ndarray], u0: np.ndarray, upper: np.ndarray, *,
                      max_iterations: int = MAX_ITERATIONS) -> FitResult:
    """Levenberg-Marquardt on ``residuals(u)`` from ``u0``, each ``u[j]`` at most ``upper[j]``.

    ``residuals`` maps the log-space parameters to one residual per measurement; it must be
    deterministic (the same ``u``, the same residuals), and so is the fit.
    """
    u = np.minimum(np.asarray(u0, dtype=float), upper)
    r = residuals(u)
    evaluations, cost, damping, converged = 1, float(r @ r), 1e-3, False
    iteration = 0
    for iteration in range(1, max_iterations + 1):
        jacobian = _jacobian(residuals, u, r, upper)
        evaluations += len(u)
        normal, gradient = jacobian.T @ jacobian, jacobian.T @ r
        # A term at its upper bound that the error would push past it stays there (projected
        # Levenberg-Marquardt: only the others move).
        free = ~((u >= upper - 1e-12) & (gradient < 0))
        if not free.any():
            converged = True
            break
        scale = np.diag(normal).copy()
        scale[scale <= 0] = 1e-12  # a term no run is sensitive to: the damping alone holds it
        for _ in range(8):
            delta = np.zeros_like(u)
            block = normal[np.ix_(free, free)] + damping * np.diag(scale[free])
            delta[free] = np.clip(np.linalg.solve(block, -gradient[free]), -MAX_STEP, MAX_STEP)
            trial = np.minimum(u + delta, upper)
            r_trial = residuals(trial)
            evaluations += 1
            trial_cost = float(r_trial @ r_trial)
            if trial_cost < cost:
                break
            damping *= 4
        else:
            converged = True  # no step lowers the error: a minimum at this resolution
            break
        step_size = float(np.max(np.abs(trial - u)))
        gain = cost - trial_cost
        u, r, cost, damping = trial, r_trial, trial_cost, max(damping / 2, 1e-9)
        if gain <= 1e-14 + RELATIVE_GAIN * cost or step_size < 1e-7 or cost < 1e-20:
            converged = True
            break
    return FitResult(u=u, residuals=r, iterations=iteration, evaluations=evaluations, converged=converged)
