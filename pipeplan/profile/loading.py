"""Turning a MODEL argument (built-in name or ``module:callable``) into a model and batches."""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import torch

from pipeplan.errors import BadInputError
from pipeplan.profile.registry import (
    InputSpec,
    ModelBundle,
    call_with_accepted,
    is_user_model,
    load_user_callable,
)
from pipeplan.profile.models import builtin_bundle, torch_dtype_of
from pipeplan.profile.hf import hf_bundle, is_hf_model

__all__ = ["load_bundle", "make_microbatch", "Batch", "call_model", "split_inputs", "output_loss",
           "default_loss", "first_tensor", "accepts_seq_len"]

#: ``(inputs, target)``: a tuple of positional inputs or a dict of keyword inputs, and the loss
#: target or None.
Batch = tuple[Any, Any]


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a batch's inputs (a tuple, or a dict of keyword inputs)."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    return tuple(inputs), {}


def call_model(model: Any, inputs: Any) -> Any:
    """``model(*inputs)`` or ``model(**inputs)`` for a dict of keyword inputs."""
    args, kwargs = split_inputs(inputs)
    return model(*args, **kwargs)


def first_tensor(output: Any) -> Any:
    """The first floating tensor of a model output (a tensor, tuple, dict or ``ModelOutput``)."""
    from torch.utils._pytree import tree_flatten

    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    raise BadInputError(f"the model's output ({type(output).__name__}) holds no floating tensor to train on")


def default_loss(output: Any, target: Any = None) -> Any:
    """The loss of a model without one: the mean square of its (first floating) output.

    Any scalar would drive backward; this one is cheap, never constant, and needs no target.
    """
    return first_tensor(output).float().pow(2).mean()


def output_loss(output: Any) -> Any:
    """The loss a model computed itself: ``output.loss`` (a ``ModelOutput``), or the first element.

    Raises
    ------
    BadInputError
        If the output carries no loss (a HuggingFace model called without ``labels``).
    """
    loss = getattr(output, "loss", None) if not isinstance(output, (tuple, list)) else output[0]
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise BadInputError(
            f"the model returned no loss ({type(output).__name__}); give its batch 'labels' "
            f"or a loss_fn"
        )
    return loss


def load_bundle(model: str, *, seed: int = 0, device: Any = "cpu", dtype: Any = "fp32",
                materialise: Optional[Sequence[str]] = None, **options: Any) -> ModelBundle:
    """Build the model named by ``model`` and say how to feed it.

    Parameters
    ----------
    model : str
        Built-in name, or ``module:callable`` (see docs/profiling.md for the contract).
    seed : int
        Weight seed (built-ins: per unit; user models: ``torch.manual_seed`` before the call).
    device, dtype
        Where the model goes and its floating dtype (``fp32``, ``bf16``, ``fp16``).
    materialise : sequence of str, optional
        Built-ins only: build just these units (the rest stay on the meta device).
    **options
        Size options (``layers``, ``hidden``, ``heads``, ``vocab``, ...). A user callable gets
        those its signature accepts.

    Raises
    ------
    BadInputError
        Unknown built-in, import failure, a callable that raises or returns the wrong thing.
    """
    torch_dtype = torch_dtype_of(dtype)

    if is_hf_model(model):
        return hf_bundle(model, seed=seed, device=device, dtype=torch_dtype, **options)
    if not is_user_model(model):
        return builtin_bundle(model, seed=seed, device=device, dtype=torch_dtype,
                              units=list(materialise) if materialise is not None else None, **options)
    func = load_user_callable(model)
    torch.manual_seed(seed)
    try:
        result = call_with_accepted(func, options)
    except BadInputError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code; report it in one line
        raise BadInputError(
            f"MODEL: {model} raised {type(exc).__name__}: {exc}; fix the callable or the options given to it"
        ) from None
    bundle = _to_bundle(model, result)
    if not isinstance(bundle.model, torch.nn.Module):
        raise BadInputError(
            f"MODEL: {model} returned {type(bundle.model).__name__} as the model; return a torch.nn.Module"
        )
    bundle.model.to(device=device)
    if torch_dtype != torch.float32:
        bundle.model.to(dtype=torch_dtype)
    bundle.model.train()
    bundle.config = {"callable": model, **{k: v for k, v in options.items() if v is not None}, **bundle.config}
    return bundle


def _to_bundle(model: str, result: Any) -> ModelBundle:
    if isinstance(result, ModelBundle):
        return result
    if isinstance(result, torch.nn.Module):
        raise BadInputError(
            f"MODEL: {model} returned only a model; return (model, make_batch) or "
            f"(model, [InputSpec(...)]) so the profiler can feed it (docs/profiling.md)"
        )
    if isinstance(result, tuple) and len(result) in (2, 3):
        net, batch = result[0], result[1]
        loss = result[2] if len(result) == 3 else None
        if isinstance(batch, (InputSpec, list, tuple)):
            specs = [batch] if isinstance(batch, InputSpec) else list(batch)
            specs = [s if isinstance(s, InputSpec) else InputSpec(**s) for s in specs]
            return ModelBundle(model=net, input_spec=specs, loss_fn=loss)
        if callable(batch):
            return ModelBundle(model=net, make_batch=batch, loss_fn=loss)
    raise BadInputError(
        f"MODEL: {model} returned {type(result).__name__}; return a ModelBundle, (model, make_batch), "
        f"(model, make_batch, loss_fn) or (model, [InputSpec(...)]) (docs/profiling.md)"
    )


def accepts_seq_len(func: Any) -> bool:
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.name == "seq_len" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def make_microbatch(bundle: ModelBundle, microbatch_size: int, seq_len: Optional[int] = None, *,
                    seed: int = 0, device: Any = "cpu", dtype: Any = "fp32") -> Batch:
    """One micro-batch ``(inputs, target)`` for the bundle, on ``device``.

    ``inputs`` is always a tuple of positional inputs; floating ones are cast to ``dtype``.
    ``target`` is None when the bundle has no ``loss_fn``.

    Raises
    ------
    BadInputError
        If the factory raises or returns something that is not tensors.
    """
    torch_dtype = torch_dtype_of(dtype)
    if bundle.make_batch is not None:
        func = bundle.make_batch
        try:
            if bundle.config.get("family") is not None or _accepts_seed(func):  # takes the seed too
                raw = func(microbatch_size, seq_len, seed=seed)
            elif accepts_seq_len(func):
                raw = func(microbatch_size, seq_len)
            else:
                raw = func(microbatch_size)
        except BadInputError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's factory
            raise BadInputError(
                f"the micro-batch factory raised {type(exc).__name__} at micro-batch size "
                f"{microbatch_size}: {exc}; fix the factory or change --microbatch-sizes/--seq-len"
            ) from None
    else:
        generator = torch.Generator().manual_seed(seed)
        tensors = []
        for spec in bundle.input_spec or ():
            shape = (microbatch_size, *spec.shape)
            dt = getattr(torch, spec.dtype, None)
            if not isinstance(dt, torch.dtype):
                raise BadInputError(f"InputSpec.dtype {spec.dtype!r} is not a torch dtype name")
            if dt.is_floating_point:
                tensors.append(torch.randn(shape, generator=generator))
            else:
                tensors.append(torch.randint(0, spec.high or 2, shape, generator=generator, dtype=dt))
        raw = tuple(tensors)
        if bundle.loss_fn is not None:
            raise BadInputError(
                "an input spec gives no loss target; with loss_fn, return a make_batch that "
                "returns (inputs, target)"
            )
    if bundle.loss_fn is not None:
        if not (isinstance(raw, (tuple, list)) and len(raw) == 2):
            raise BadInputError(
                "with a loss_fn, the micro-batch factory must return (inputs, target); "
                f"it returned {type(raw).__name__}"
            )
        inputs, target = raw
    else:
        inputs, target = raw, None
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, dict):
        bad = [k for k, t in inputs.items() if not isinstance(t, torch.Tensor)]
        if bad or not inputs:
            raise BadInputError(
                "the micro-batch factory's dict of keyword inputs must map names to tensors; "
                f"{bad[0] if bad else 'it'} is {type(inputs.get(bad[0])).__name__ if bad else 'empty'}"
            )
    elif not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise BadInputError(
            "the micro-batch factory must return a tensor, a tuple of tensors or a dict of keyword "
            f"inputs; got {type(inputs).__name__}"
        )

    def place(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(device)
        return t.to(torch_dtype) if t.is_floating_point() else t

    # The target keeps its dtype (the loss decides); only its device follows the model.
    if isinstance(target, torch.Tensor):
        target = target.to(device)
    if isinstance(inputs, dict):
        return {k: place(t) for k, t in inputs.items()}, target
    return tuple(place(t) for t in inputs), target


def _accepts_seed(func: Any) -> bool:
    try:
        return "seed" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
