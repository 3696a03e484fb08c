"""``pipeplan run --verify``: does the pipeline compute what one process computes?

Before the timed steps, every rank runs the first step's batch through the whole model in one
process (the same weights from the same seed), micro-batch by micro-batch as the schedule splits
it, each loss divided by the micro-batch count (torch's schedules scale the gradients the same
way), and keeps the loss and the gradients. With data parallelism (``d`` replicas) the batch
is the global one, ``d x m`` micro-batches, of which each replica ran its ``m``
(:mod:`pipeplan.run.gradsync`). After the pipelined first step (and the tied-weight sync and
the data-parallel gradient average), each rank compares the gradients of its own stages'
parameters, by the full model's names; the last stage compares the loss (over the global
batch). Every replica is checked: each stage appears once per replica (``data_rank``). Per stage, the figure is the largest over its
parameters of ``max|g_pipe - g_ref| / max|g_ref|`` (relative to the parameter's largest
gradient, so that entries near zero do not blow it up), and the loss's ``|l_pipe - l_ref| /
|l_ref|``. Above the tolerance the run fails (exit 1).

Summation order differs between a pipeline and one process (gradients are accumulated per
micro-batch, tied weights summed across stages), so fp32 differences of 1e-7 to 1e-5 are
expected; the default tolerance is 1e-4 for fp32 and 2e-2 for bf16 and fp16.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pipeplan.errors import BadInputError, PipeplanError
from pipeplan.profile.tracing import active_dropout

__all__ = ["active_dropout", "dropout_refusal", "refuse_dropout", "microbatches", "reference_step", "compare_stage", "compare_rank", "summarize", "default_tolerance",
           "attach_verdict", "check_verdict", "verdict_lines", "VerifyFailedError"]


def dropout_refusal(model: str, names: Sequence[str]) -> str:
    """Why ``--verify`` cannot check a model with active dropout, and what to do."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"run --verify: {model} has dropout with p > 0 ({shown}): a pipelined step and one process draw "
            f"different dropout masks, so their gradients cannot be compared; build the model with dropout 0 "
            f"for --verify (hf: models are), or run without --verify")


def refuse_dropout(model: str, bundle: Any) -> None:
    """Raise :class:`BadInputError` when the bundle's model (if built) has active dropout."""
    names = active_dropout(bundle.model) if bundle is not None and bundle.model is not None else []
    if names:
        raise BadInputError(dropout_refusal(model, names))


class VerifyFailedError(PipeplanError):
    """The pipelined step differs from one process by more than the tolerance (exit 1)."""

    exit_code = 1


def default_tolerance(dtype: str) -> float:
    """1e-4 in fp32, 2e-2 in half precision.

    Examples
    --------
    >>> default_tolerance("fp32"), default_tolerance("bf16")
    (0.0001, 0.02)
    """
    return 1e-4 if dtype in ("fp32", "float32", "tf32") else 2e-2


def microbatches(inputs: Any, target: Any, count: int) -> list[tuple[Any, Any]]:
    """The batch split into ``count`` micro-batches along dim 0, as torch's schedules split it."""
    import torch

    def split(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor):
            return list(torch.tensor_split(value, count))
        return [value] * count

    if isinstance(inputs, dict):
        parts = {k: split(v) for k, v in inputs.items()}
        mbs = [{k: parts[k][i] for k in inputs} for i in range(count)]
    else:
        columns = [split(v) for v in inputs]
        mbs = [tuple(col[i] for col in columns) for i in range(count)]
    return list(zip(mbs, split(target)))


def reference_step(bundle: Any, inputs: Any, target: Any, num_microbatches: int,
                   loss_fn: Optional[Any] = None) -> tuple[float, dict[str, Any]]:
    """Loss and gradients (by parameter name) of one single-process step of ``bundle.model``.

    Parameters
    ----------
    bundle : ModelBundle
        The whole model, built with the run's seed.
    inputs, target
        The step's whole batch (all micro-batches).
    num_microbatches : int
    loss_fn : callable, optional
        ``loss(output, target)``; default the bundle's (its own loss when ``loss_in_output``,
        else its ``loss_fn``, else the mean square of the output).
    """
    from pipeplan.profile.loading import call_model, default_loss, output_loss

    model = bundle.model
    for p in model.parameters():
        p.grad = None
    losses = []
    for mb, tgt in microbatches(inputs, target, num_microbatches):
        out = call_model(model, mb)
        if bundle.loss_in_output:
            loss = output_loss(out)
        elif loss_fn is not None:
            loss = loss_fn(out, tgt)
        elif bundle.loss_fn is not None:
            loss = bundle.loss_fn(out, tgt)
        else:
            loss = default_loss(out)
        (loss / num_microbatches).backward()
        losses.append(float(loss.detach()))
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return sum(losses) / len(losses), grads


def compare_stage(stage_index: int, module: Any, names: dict[str, str], ref_grads: dict[str, Any],
                  loss: Optional[float] = None, ref_loss: Optional[float] = None) -> dict[str, Any]:
    """The largest relative gradient difference of one stage (and its loss, on the last)."""

    worst, worst_name, compared, missing = 0.0, None, 0, []
    grads: dict[str, Any] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        canonical = names.get(name, name)
        if grads.get(canonical) is None:
            grads[canonical] = param.grad
    for canonical, grad in grads.items():
        ref = ref_grads.get(canonical)
        if ref is None and grad is None:
            continue
        if ref is None or grad is None:
            missing.append(canonical)
            continue
        scale = float(ref.abs().max())
        diff = float((grad.detach().to(ref.dtype) - ref).abs().max())
        rel = diff / scale if scale > 0 else diff
        compared += 1
        if rel > worst or worst_name is None:
            worst, worst_name = rel, canonical
    record: dict[str, Any] = {"stage": stage_index, "max_rel_grad_diff": worst, "worst_parameter": worst_name,
                              "parameters_compared": compared, "missing_gradients": missing}
    if loss is not None and ref_loss is not None:
        record["loss"] = loss
        record["reference_loss"] = ref_loss
        record["loss_rel_diff"] = abs(loss - ref_loss) / abs(ref_loss) if ref_loss else abs(loss)
    return record


def compare_rank(modules: Sequence[Any], stages: Sequence[Any], param_names: Sequence[dict[str, str]],
                 reference: tuple[float, dict[str, Any]], step_losses: Sequence[Any],
                 num_stages: int) -> list[dict[str, Any]]:
    """:func:`compare_stage` for each of a rank's stages; the last stage also compares the loss
    (the mean of the step's micro-batch losses)."""
    import torch

    ref_loss, ref_grads = reference
    rows = []
    for module, stage, names in zip(modules, stages, param_names):
        loss = None
        if stage.index == num_stages - 1 and step_losses:
            loss = float(torch.stack([x.detach().float() for x in step_losses]).mean())
        rows.append(compare_stage(stage.index, module, names, ref_grads, loss=loss,
                                  ref_loss=ref_loss if loss is not None else None))
    return rows


def summarize(per_rank: Sequence[Optional[list[dict[str, Any]]]], tolerance: float) -> Optional[dict[str, Any]]:
    """One verdict from every rank's per-stage records (None when nothing was verified).

    Examples
    --------
    >>> s = summarize([[{"stage": 0, "max_rel_grad_diff": 1e-7, "missing_gradients": []}],
    ...                [{"stage": 1, "max_rel_grad_diff": 2e-3, "missing_gradients": [], "loss_rel_diff": 0.0}]], 1e-4)
    >>> s["passed"], s["worst_stage"]
    (False, 1)
    """
    stages = sorted((r for rows in per_rank if rows for r in rows), key=lambda r: r["stage"])
    if not stages:
        return None
    failures = []
    for row in stages:
        figure = max(row["max_rel_grad_diff"], row.get("loss_rel_diff", 0.0))
        row["max_rel_diff"] = figure
        if figure > tolerance:
            replica = f" replica {row['data_rank']}" if "data_rank" in row else ""
            failures.append(f"stage {row['stage']}{replica}: {figure:.3g} (worst {row.get('worst_parameter')})")
        if row.get("missing_gradients"):
            failures.append(f"stage {row['stage']}: no gradient for {', '.join(row['missing_gradients'][:3])}")
    worst = max(stages, key=lambda r: r["max_rel_diff"])
    return {"passed": not failures, "tolerance": tolerance, "stages": stages,
            "worst_stage": worst["stage"], "max_rel_diff": worst["max_rel_diff"], "failures": failures,
            "method": "one single-process step on the first step's batch, micro-batch by micro-batch; "
                      "per parameter max|g_pipe - g_ref| / max|g_ref|, per stage the largest, and the loss"}


def attach_verdict(report: dict[str, Any], ranks: Sequence[dict[str, Any]], dtype: str,
                   tolerance: Optional[float] = None) -> Optional[dict[str, Any]]:
    """Put the verdict of every rank's ``verify`` records into ``report['verify']``."""
    tol = default_tolerance(dtype) if tolerance is None else float(tolerance)
    verdict = summarize([r.get("verify") for r in ranks], tol)
    if verdict is None:
        verdict = {"passed": False, "tolerance": tol, "stages": [], "failures": ["no rank compared anything"],
                   "max_rel_diff": None, "worst_stage": None}
    builders = sorted({r.get("stage_builder") for r in ranks if r.get("stage_builder")})
    verdict["stage_builder"] = builders[0] if len(builders) == 1 else builders
    report["verify"] = verdict
    return verdict


def verdict_lines(verdict: dict[str, Any]) -> list[str]:
    """Human-readable lines: one per stage, then the verdict."""
    lines = []
    for row in verdict.get("stages", []):
        loss = f", loss {row['loss_rel_diff']:.2e}" if "loss_rel_diff" in row else ""
        replica = f" (replica {row['data_rank']})" if "data_rank" in row else ""
        lines.append(f"verify: stage {row['stage']}{replica}: largest relative gradient difference "
                     f"{row['max_rel_grad_diff']:.2e} ({row.get('worst_parameter')}){loss}")
    if verdict["passed"]:
        lines.append(f"verify: passed: every stage within {verdict['tolerance']:g} of one process "
                     f"(largest {verdict['max_rel_diff']:.2e}, stage {verdict['worst_stage']})")
    else:
        lines.append(f"verify: FAILED (tolerance {verdict['tolerance']:g}): " + "; ".join(verdict["failures"]))
    return lines


def check_verdict(report: dict[str, Any]) -> None:
    """Raise :class:`VerifyFailedError` when the report's ``verify`` failed."""
    verdict = report.get("verify")
    if verdict is not None and not verdict["passed"]:
        raise VerifyFailedError(
            f"run --verify: the pipeline differs from one process by more than {verdict['tolerance']:g}: "
            + "; ".join(verdict["failures"])
        )
