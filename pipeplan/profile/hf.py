"""The ``hf:`` model source: a HuggingFace ``transformers`` model built from a config, no weights.

``hf:gpt2``, ``hf:llama``, ``hf:qwen2``, ``hf:bert``, ``hf:vit`` (any ``model_type`` that
``transformers.AutoConfig.for_model`` knows) or ``hf:path/to/config.json``. The size options
(``layers``, ``hidden``, ``heads``, ``vocab``) override the config's fields; ``config`` (a path to
a ``config.json`` or a dict) replaces the family's defaults. The model class follows the config's
``architectures`` when it names one, else the family's usual training head: masked LM for
encoders (BERT, RoBERTa), image classification for ViT, causal LM for the rest.

What the source fixes, so that a pipeline computes exactly what one process does:

- ``use_cache=False`` (a ``DynamicCache`` output does not trace) and every dropout probability 0
  (a pipelined step and a single process draw different dropout masks); ``keep_dropout=True``
  keeps the config's;
- the units are the items of the model's outermost ``ModuleList``s (its repeated blocks: the
  encoder's and the decoder's in an encoder-decoder), the rest of the model coarser units around
  them (:func:`pipeplan.profile.units.select_units`); ``--layers`` sizes both stacks;
- batches are dicts of keyword inputs with ``labels``, so that the model computes its own loss
  (``ModelOutput.loss``): random tokens for language models (``labels`` = the tokens; the model
  shifts them itself), random images and class ids for image classifiers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from pipeplan.errors import BadInputError
from pipeplan.profile.registry import ModelBundle

__all__ = ["is_hf_model", "hf_bundle", "hf_config", "read_config", "hf_unit_kinds", "HF_PREFIX"]

HF_PREFIX = "hf:"

#: Size options and the config fields they set (transformers' ``attribute_map`` translates
#: them for families that spell them otherwise, e.g. GPT-2's ``n_layer``).
_OPTION_FIELDS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
                  "vocab": "vocab_size", "ffn": "intermediate_size", "kv_heads": "num_key_value_heads",
                  "max_positions": "max_position_embeddings", "image_size": "image_size",
                  "classes": "num_labels"}

#: model_type -> task, where the causal-LM default is wrong.
_TASKS = {"bert": "masked-lm", "roberta": "masked-lm", "distilbert": "masked-lm", "albert": "masked-lm",
          "electra": "masked-lm", "vit": "image-classification", "deit": "image-classification",
          "t5": "seq2seq-lm", "bart": "seq2seq-lm", "mt5": "seq2seq-lm"}


def is_hf_model(name: str) -> bool:
    """True for ``hf:...`` model names.

    Examples
    --------
    >>> is_hf_model("hf:gpt2"), is_hf_model("gpt2-tiny")
    (True, False)
    """
    return isinstance(name, str) and name.startswith(HF_PREFIX)


def _read_config_file(path: str) -> dict[str, Any]:
    from pipeplan.formats.io import load_json

    data = load_json(path, f"--config {path}")
    if not isinstance(data, dict):
        raise BadInputError(f"--config {path}: a HuggingFace config.json is a JSON object")
    return data


def read_config(model: str, path: str) -> dict[str, Any]:
    """``--config FILE`` for ``model``: the config as a dict (kept whole in the profile, so that
    ``run`` rebuilds the same model without the file).

    Raises
    ------
    BadInputError
        ``model`` is not ``hf:``, or the file is unreadable.
    """
    if not is_hf_model(model):
        raise BadInputError(f"--config: only hf: models take a transformers config; {model!r} is not one")
    data = _read_config_file(path)
    _check_sizes(f"--config {path}", data.get)
    return data


def _check_sizes(source: str, get: Any) -> None:
    for key in _SIZE_FIELDS:
        value = get(key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            # transformers builds such a model (no blocks, no heads): a typo, not a model to plan.
            raise BadInputError(f"{source}: {key}: {value} must be >= 1")


#: Config fields that count layers, heads or widths: each must be at least 1.
_SIZE_FIELDS = ("n_layer", "num_hidden_layers", "num_layers", "num_decoder_layers", "encoder_layers",
                "decoder_layers", "n_head", "num_attention_heads", "num_heads", "num_key_value_heads",
                "n_embd", "hidden_size", "d_model", "intermediate_size", "d_ff", "vocab_size")


def hf_config(name: str, config: Any = None, keep_dropout: bool = False, **options: Any) -> Any:
    """The ``transformers`` config of ``hf:NAME`` with the options applied.

    Raises
    ------
    BadInputError
        transformers missing, an unknown ``model_type``, an unreadable config file, an option
        the family does not have.
    """
    try:
        import transformers
    except ImportError:
        raise BadInputError(
            f"MODEL: {name} needs transformers; install it with pip install -e \".[hf]\""
        ) from None
    spec = name[len(HF_PREFIX):]
    if isinstance(config, (str, Path)):
        data = _read_config_file(str(config))
    elif isinstance(config, dict):
        data = dict(config)
    elif config is None and spec.endswith(".json"):
        data = _read_config_file(spec)
    else:
        data = {}
    model_type = data.pop("model_type", None) or (spec if not spec.endswith(".json") else None)
    if not model_type:
        raise BadInputError(f"MODEL: {name}: the config names no model_type; add \"model_type\": \"gpt2\" or similar")
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as exc:
        from difflib import get_close_matches

        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        known = sorted(CONFIG_MAPPING.keys())
        if model_type in known:  # known, but the config's fields are wrong
            cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise BadInputError(f"MODEL: {name}: transformers refuses the config of {model_type!r}: {cause}") from None
        # transformers' own message lists all its model types (822 in 5.24): name the nearest instead.
        close = get_close_matches(str(model_type), known, n=3, cutoff=0.7)
        hint = f"did you mean {', '.join(close)}?" if close else f"{len(known)} are known, e.g. gpt2, llama, bert"
        raise BadInputError(f"MODEL: {name}: transformers does not know model_type {model_type!r}; {hint}") from None
    for option, value in options.items():
        if value is None:
            continue
        if option not in _OPTION_FIELDS:
            raise BadInputError(
                f"--{option.replace('_', '-')}: does not apply to {name}; it takes "
                f"{', '.join('--' + k.replace('_', '-') for k in _OPTION_FIELDS)} (or --config)"
            )
        if int(value) < 1:
            raise BadInputError(f"--{option.replace('_', '-')}: {value} must be >= 1")
        field = _OPTION_FIELDS[option]
        if option == "hidden" and getattr(cfg, "model_type", "") == "gpt2":
            field = "n_embd"
        setattr(cfg, field, int(value))
        if option == "layers":
            # Encoder-decoders (T5, BART) size their decoder apart; --layers sets both stacks.
            for decoder_field in ("num_decoder_layers", "decoder_layers"):
                if hasattr(cfg, decoder_field):
                    setattr(cfg, decoder_field, int(value))
        if option == "hidden" and options.get("ffn") is None:
            for ffn_field in ("intermediate_size", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim"):
                if hasattr(cfg, ffn_field):
                    setattr(cfg, ffn_field, 4 * int(value))
        if option == "heads" and hasattr(cfg, "num_key_value_heads") and options.get("kv_heads") is None:
            cfg.num_key_value_heads = int(value)
        if option == "heads" and hasattr(cfg, "decoder_attention_heads"):
            cfg.decoder_attention_heads = int(value)
    if hasattr(cfg, "d_kv") and (options.get("hidden") is not None or options.get("heads") is not None):
        # T5's head size is its own field (64 by default), not hidden / heads.
        cfg.d_kv = max(1, int(cfg.d_model) // int(cfg.num_heads))
    _check_sizes(str(config) if isinstance(config, (str, Path)) else (spec if spec.endswith(".json") else name),
                 lambda key, default: getattr(cfg, key, default))
    cfg.use_cache = False
    if not keep_dropout:
        for key, value in list(cfg.to_dict().items()):
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key) and value > 0:
                setattr(cfg, key, 0.0)
    # Special tokens outside a small test vocabulary only make transformers warn.
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value >= getattr(cfg, "vocab_size", value + 1):
            setattr(cfg, key, None)
    return cfg


def _task(cfg: Any) -> str:
    architectures = getattr(cfg, "architectures", None) or []
    if architectures:
        return "architecture"
    return _TASKS.get(cfg.model_type, "causal-lm")


def _model_class(cfg: Any) -> Any:
    import transformers

    task = _task(cfg)
    if task == "architecture":
        cls = getattr(transformers, cfg.architectures[0], None)
        if cls is None:
            raise BadInputError(f"config architectures: transformers has no class {cfg.architectures[0]!r}")
        return cls
    auto = {"masked-lm": transformers.AutoModelForMaskedLM, "causal-lm": transformers.AutoModelForCausalLM,
            "image-classification": transformers.AutoModelForImageClassification,
            "seq2seq-lm": transformers.AutoModelForSeq2SeqLM}[task]
    return auto


def hf_unit_kinds(model: Any, order: Sequence[str]) -> dict[str, str]:
    """Each unit's role, for the launchers that name layers by it (Megatron-LM, torchtitan).

    The repeated blocks are ``block``; before the first block, an ``nn.Embedding`` or an
    ``...Embeddings`` module with weights is an ``embedding`` and anything else (dropout, rotary
    tables) ``other``; after the last block, a norm is ``norm``, the last unit ``head``, anything
    else ``other``; units between two block lists (an encoder's final norm, a decoder's
    embedding) are ``other``.
    """
    import torch

    lists = _repeated_blocks(model)
    is_block = [any(name.startswith(f"{outer}.") and name[len(outer) + 1:].isdigit() for outer in lists)
                for name in order]
    if not any(is_block):
        return {}
    first, last = is_block.index(True), len(order) - 1 - is_block[::-1].index(True)
    kinds = {}
    for index, name in enumerate(order):
        module = model.get_submodule(name)
        if is_block[index]:
            kinds[name] = "block"
        elif index < first:
            # BERT's and ViT's are modules of their own; a rotary table (no weights) is not one.
            embedding = isinstance(module, torch.nn.Embedding) or (
                "embedding" in type(module).__name__.lower() and any(True for _ in module.parameters()))
            kinds[name] = "embedding" if embedding else "other"
        elif index > last and index == len(order) - 1:
            kinds[name] = "head"
        elif index > last and "norm" in type(module).__name__.lower():
            kinds[name] = "norm"
        else:
            kinds[name] = "other"
    return kinds


def _repeated_blocks(model: Any) -> list[str]:
    """The dotted names of the model's outermost ``ModuleList``s of two or more items (its blocks:
    one list for a decoder-only or encoder-only model, the encoder's and the decoder's for T5 or
    BART), in registration order; lists inside a block (T5's ``block.0.layer``) are not blocks.

    Examples
    --------
    >>> import torch
    >>> block = torch.nn.Module(); block.layer = torch.nn.ModuleList([torch.nn.Linear(1, 1)] * 2)
    >>> m = torch.nn.Module(); m.enc = torch.nn.ModuleList([block, block])
    >>> m.dec = torch.nn.ModuleList([torch.nn.Linear(1, 1)] * 3)
    >>> _repeated_blocks(m)
    ['enc', 'dec']
    """
    import torch

    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        if any(name.startswith(outer + ".") for outer in found):
            continue
        found.append(name)
    return found


def _batch_factory(cfg: Any, device: Any, dtype: Any):
    import torch

    task = _task(cfg)
    image = task == "image-classification" or hasattr(cfg, "image_size") and hasattr(cfg, "num_channels")

    def make_batch(microbatch_size: int, seq_len: Optional[int] = None, seed: int = 0) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(seed)
        if image:
            size = int(cfg.image_size)
            pixels = torch.randn(microbatch_size, int(cfg.num_channels), size, size, generator=generator)
            labels = torch.randint(0, int(cfg.num_labels), (microbatch_size,), generator=generator)
            return {"pixel_values": pixels.to(device=device, dtype=dtype), "labels": labels.to(device)}
        tokens = int(seq_len or 128)
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if limit and tokens > int(limit):
            raise BadInputError(f"--seq-len {tokens} exceeds the model's {int(limit)} positions")
        ids = torch.randint(0, int(cfg.vocab_size), (microbatch_size, tokens), generator=generator)
        batch = {"input_ids": ids.to(device), "labels": ids.clone().to(device)}
        if task == "seq2seq-lm":
            batch["decoder_input_ids"] = ids.clone().to(device)
        return batch

    return make_batch


def hf_bundle(name: str, *, seed: int = 0, device: Any = "cpu", dtype: Any = None, config: Any = None,
              keep_dropout: bool = False, **options: Any) -> ModelBundle:
    """``hf:NAME`` as a :class:`ModelBundle`: the model (random weights from ``seed``), a batch
    factory of keyword inputs with ``labels``, and the repeated blocks as units.

    Examples
    --------
    >>> b = hf_bundle("hf:gpt2", layers=2, hidden=32, heads=2, vocab=64)  # doctest: +SKIP
    >>> b.units  # doctest: +SKIP
    ['transformer.h.*']
    """
    import torch

    cfg = hf_config(name, config=config, keep_dropout=keep_dropout, **options)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
    torch.manual_seed(seed)
    try:
        model = _model_class(cfg).from_config(cfg)
    except BadInputError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' own checks on the config
        raise BadInputError(
            f"MODEL: {name}: transformers cannot build the model from this config: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    if getattr(model, "loss_type", "") is None and type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        # transformers 5 leaves GPT-2's loss_type unset and warns, once per process (the
        # profile, every rank), that it uses ForCausalLM: name the loss it uses anyway.
        model.loss_type = "ForCausalLM"
    model.to(device=device)
    if torch_dtype != torch.float32:
        model.to(dtype=torch_dtype)
    model.train()
    blocks = _repeated_blocks(model)
    kinds: dict[str, str] = {}
    recorded = {k: v for k, v in options.items() if v is not None}
    return ModelBundle(
        model=model,
        make_batch=_batch_factory(cfg, device, torch_dtype),
        units=[f"{name}.*" for name in blocks] or None,
        kinds=kinds,
        config={"hf": name, "model_type": cfg.model_type, "hf_class": type(model).__name__,
                "config": cfg.to_diff_dict(), **recorded},
        loss_in_output=True,
    )
