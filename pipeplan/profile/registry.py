"""Names of the built-in models and the contract of user models (no torch needed).

A MODEL argument is either a built-in preset name (``gpt2-tiny``, ``gpt2``, ``llama-tiny``,
``bert-tiny``, ``convnet-tiny``, ...) or ``module:callable``, a user function that returns a
model. This module resolves the name and checks the options; building the model lives in
:mod:`pipeplan.profile.models` (which imports torch).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from pipeplan.errors import BadInputError

__all__ = [
    "FAMILIES",
    "PRESETS",
    "ALIASES",
    "ModelBundle",
    "InputSpec",
    "resolve_builtin",
    "is_user_model",
    "load_user_callable",
]

#: Model families and the configuration keys each accepts.
FAMILIES: dict[str, tuple[str, ...]] = {
    "gpt2": ("layers", "hidden", "heads", "vocab", "max_positions"),
    "llama": ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_positions"),
    "bert": ("layers", "hidden", "heads", "ffn", "vocab", "max_positions"),
    "convnet": ("layers", "hidden", "image_size", "classes"),
}

#: Built-in presets: family plus configuration. Sizes follow the public models of the same
#: name (GPT-2 small is ``gpt2``); the ``-tiny`` ones are for tests and demos.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-tiny": dict(family="gpt2", layers=4, hidden=128, heads=4, vocab=1024, max_positions=512),
    "gpt2": dict(family="gpt2", layers=12, hidden=768, heads=12, vocab=50257, max_positions=1024),
    "gpt2-medium": dict(family="gpt2", layers=24, hidden=1024, heads=16, vocab=50257, max_positions=1024),
    "gpt2-large": dict(family="gpt2", layers=36, hidden=1280, heads=20, vocab=50257, max_positions=1024),
    "gpt2-xl": dict(family="gpt2", layers=48, hidden=1600, heads=25, vocab=50257, max_positions=1024),
    "llama-tiny": dict(family="llama", layers=4, hidden=128, heads=4, kv_heads=2, ffn=352, vocab=1024,
                       max_positions=512),
    "llama-small": dict(family="llama", layers=8, hidden=512, heads=8, kv_heads=4, ffn=1376, vocab=32000,
                        max_positions=2048),
    "llama-1b": dict(family="llama", layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                     max_positions=4096),
    "llama-7b": dict(family="llama", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000,
                     max_positions=4096),
    "bert-tiny": dict(family="bert", layers=4, hidden=128, heads=2, ffn=512, vocab=1024, max_positions=512),
    "bert-base": dict(family="bert", layers=12, hidden=768, heads=12, ffn=3072, vocab=30522, max_positions=512),
    "convnet-tiny": dict(family="convnet", layers=4, hidden=16, image_size=32, classes=10),
    "convnet": dict(family="convnet", layers=8, hidden=64, image_size=64, classes=100),
}

#: Short names for a family's usual preset.
ALIASES = {"llama": "llama-small", "bert": "bert-base", "resnet": "convnet"}


def resolve_builtin(name: str, **overrides: Any) -> dict[str, Any]:
    """The configuration of a built-in model: the preset with the options given applied.

    Parameters
    ----------
    name : str
        A preset name (see ``PRESETS``) or an alias.
    **overrides
        Configuration keys of the family (``layers``, ``hidden``, ...); ``None`` values are ignored.

    Returns
    -------
    dict
        ``family`` plus the family's keys, every one set.

    Raises
    ------
    BadInputError
        If the name is unknown, an option does not apply to the family, or sizes disagree.

    Examples
    --------
    >>> cfg = resolve_builtin("gpt2-tiny", layers=2)
    >>> cfg["family"], cfg["layers"], cfg["hidden"]
    ('gpt2', 2, 128)
    """
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        raise BadInputError(
            f"MODEL: {name!r} is not a built-in model; use one of {known}, "
            f"or 'module:callable' for your own model"
        )
    config = dict(PRESETS[key])
    family = config["family"]
    for option, value in overrides.items():
        if value is None:
            continue
        if option not in FAMILIES[family]:
            raise BadInputError(
                f"--{option.replace('_', '-')}: does not apply to {name!r} (a {family} model); "
                f"it takes {', '.join('--' + k.replace('_', '-') for k in FAMILIES[family])}"
            )
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise BadInputError(f"--{option.replace('_', '-')}: {value!r} must be a positive integer")
        config[option] = value
    if family in ("gpt2", "llama", "bert"):
        # Scale the width-dependent sizes along with --hidden unless given explicitly.
        if overrides.get("hidden") is not None and overrides.get("heads") is None:
            config["heads"] = max(1, config["hidden"] // 64) if config["hidden"] >= 64 else 1
        if config["hidden"] % config["heads"]:
            raise BadInputError(
                f"--hidden {config['hidden']} is not divisible by --heads {config['heads']}; "
                f"choose a hidden size that is a multiple of the head count"
            )
        if family == "llama":
            if overrides.get("kv_heads") is None and config["heads"] % config["kv_heads"]:
                config["kv_heads"] = config["heads"]
            if config["heads"] % config["kv_heads"]:
                raise BadInputError(
                    f"heads {config['heads']} is not a multiple of kv_heads {config['kv_heads']}"
                )
            if overrides.get("hidden") is not None and overrides.get("ffn") is None:
                config["ffn"] = _llama_ffn(config["hidden"])
        if family == "bert" and overrides.get("hidden") is not None and overrides.get("ffn") is None:
            config["ffn"] = 4 * config["hidden"]
    return config


def _llama_ffn(hidden: int) -> int:
    # Llama's rule: 2/3 of 4*hidden, rounded up to a multiple of 32.
    size = int(2 * 4 * hidden / 3)
    return 32 * ((size + 31) // 32)


def is_user_model(name: str) -> bool:
    """True for ``module:callable`` (a user model), False for a built-in name."""
    return ":" in name


@dataclass
class InputSpec:
    """One input tensor of a user model, per micro-batch (the batch dimension comes first).

    Examples
    --------
    >>> InputSpec(shape=(128,), dtype="int64", high=50257)   # token ids
    InputSpec(shape=(128,), dtype='int64', high=50257)
    """

    shape: tuple[int, ...]
    """Shape of ONE sample; the micro-batch dimension is put in front."""
    dtype: str = "float32"
    """torch dtype name: float32, int64, ... (floating inputs follow ``--dtype``)."""
    high: Optional[int] = None
    """For integer inputs: values are drawn from [0, high)."""

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.shape)
        if any(s <= 0 for s in self.shape):
            raise BadInputError(f"InputSpec.shape {self.shape}: every size must be positive")
        if self.dtype.startswith("int") and not self.high:
            raise BadInputError(f"InputSpec: integer input {self.shape} needs high= (values in [0, high))")


@dataclass
class ModelBundle:
    """A model and how to feed it: what ``module:callable`` returns, and what built-ins give.

    The user's callable may return a ``ModelBundle``, or a tuple ``(model, batch)`` where
    ``batch`` is a micro-batch factory or an input spec, or ``(model, batch, loss_fn)``.
    """

    model: Any
    """The ``torch.nn.Module``."""
    make_batch: Optional[Callable[..., Any]] = None
    """``make_batch(microbatch_size)`` or ``make_batch(microbatch_size, seq_len)`` returns the
    model's inputs (a tensor, a tuple of tensors, or a dict of keyword inputs such as
    ``input_ids``, ``attention_mask``, ``labels``) or ``(inputs, target)`` when ``loss_fn`` is set.
    A factory with a ``seed`` parameter gets the batch seed."""
    input_spec: Optional[Sequence[InputSpec]] = None
    """Instead of ``make_batch``: one :class:`InputSpec` per positional input (random values)."""
    loss_fn: Optional[Callable[[Any, Any], Any]] = None
    """``loss_fn(output, target) -> scalar``; without it, backward uses a random output gradient."""
    units: Optional[Sequence[str]] = None
    """Default units (dotted module names or globs); ``--units`` overrides."""
    kinds: dict[str, str] = field(default_factory=dict)
    """Role of each unit (embedding, block, norm, head, other), for launchers."""
    config: dict[str, Any] = field(default_factory=dict)
    """How the model was built (recorded in the profile's ``measurement``)."""
    sequence_length: Optional[int] = None
    """Tokens per sample for LMs, recorded in the profile."""
    loss_in_output: bool = False
    """The model computes its own loss from its inputs (HuggingFace with ``labels``): the loss is
    the output's ``loss`` (or its first element), and ``loss_fn`` is not used."""

    def __post_init__(self) -> None:
        if self.make_batch is None and self.input_spec is None:
            raise BadInputError(
                "the model callable must return a micro-batch factory or an input spec with the "
                "model: return (model, make_batch) or (model, [InputSpec(...)]); see docs/profiling.md"
            )
        if self.input_spec is not None and not isinstance(self.input_spec, (list, tuple)):
            self.input_spec = [self.input_spec]


def load_user_callable(spec: str) -> Callable[..., Any]:
    """Import ``module:callable`` and return the callable.

    Raises
    ------
    BadInputError
        If the module cannot be imported or has no such callable.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise BadInputError(f"MODEL: {spec!r} must be 'module:callable', e.g. mypkg.models:build")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise BadInputError(
            f"MODEL: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
            f"check the name and that it is on PYTHONPATH"
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise BadInputError(f"MODEL: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise BadInputError(f"MODEL: {spec!r} is not callable")
    return target


def call_with_accepted(func: Callable[..., Any], options: dict[str, Any]) -> Any:
    """Call ``func`` with the options its signature accepts (None values are left out)."""
    given = {k: v for k, v in options.items() if v is not None}
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return func(**given)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return func(**given)
    return func(**{k: v for k, v in given.items() if k in params})
