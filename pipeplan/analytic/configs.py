"""A transformer's shape, read from a HuggingFace ``config.json`` (as JSON: no torch, no network).

:func:`load_model_config` takes a path or the name of a config shipped in
``pipeplan/analytic/model_configs/`` and returns a :class:`ModelConfig`, the family-neutral shape
that the FLOP, memory and time models read. The per-family readers live in
:mod:`pipeplan.analytic.families`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from pipeplan.errors import BadInputError
from pipeplan.formats.io import load_json

__all__ = ["ModelConfig", "UnitNames", "shipped_configs", "read_config_json",
           "shipped_config_dir"]


@dataclass(frozen=True)
class UnitNames:
    """The HF module names of the four kinds of unit (so exports match the real model)."""

    embedding: str
    """The embedding unit's name, e.g. ``model.embed_tokens``."""
    block_prefix: str
    """Decoder blocks are ``f"{block_prefix}.{i}"``, e.g. ``model.layers``."""
    norm: Optional[str]
    """The final norm (``model.norm``); None where the model has none (OPT-350m)."""
    head: str
    """The output projection with the loss (``lm_head``)."""
    embedding_modules: tuple[str, ...] = ()
    """Every module the embedding unit covers (token and position tables, OPT's project_in)."""
    norm_modules: tuple[str, ...] = ()
    """Every module the norm unit covers (the norm, OPT's project_out)."""


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's shape, as the analytic model reads it.

    Every field is in the model's own units (elements, not bytes). Checks in ``__post_init__``
    raise :class:`BadInputError` naming the config field.
    """

    name: str
    """Model name (the shipped config's name or the file's stem)."""
    family: str
    """HF ``model_type``: llama, mistral, qwen2, gemma2, gpt2, gpt_neox, opt, mixtral, qwen3_moe,
    deepseek_v3, gpt_oss."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Key/value heads (grouped-query attention); equal to num_heads for multi-head attention."""
    head_dim: int
    """Per-head width; ``hidden_size / num_heads`` unless the config says (gemma2: 256)."""
    intermediate_size: int
    """The dense MLP's inner width (Mixtral, GPT-OSS: also each expert's; see
    ``expert_intermediate_size``)."""
    vocab_size: int
    max_positions: int
    """Context length the config was trained at (``max_position_embeddings``)."""
    names: UnitNames
    norm: str = "rmsnorm"
    """``rmsnorm`` (weight only) or ``layernorm`` (weight and bias)."""
    gated_mlp: bool = True
    """SwiGLU/GeGLU (gate, up, down) rather than two GEMMs with an activation between."""
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tied_embeddings: bool = False
    """The head reuses the token table. The profile lists it as a tied weight of the embedding and
    the head, counted in the embedding; a stage holding the head alone keeps a copy (as Megatron
    keeps one on the last stage)."""
    learned_positions: int = 0
    """Rows of a learned position table (GPT-2: n_positions; OPT: max_positions + 2); 0: rotary."""
    embed_proj_dim: Optional[int] = None
    """OPT's word_embed_proj_dim where it differs from hidden_size (project_in / project_out)."""
    parallel_residual: bool = False
    """GPT-NeoX: ``x + attn(ln1(x)) + mlp(ln2(x))``: both norms read the same x."""
    sandwich_norms: bool = False
    """Gemma 2: a norm after attention and after the MLP as well as before each."""
    final_norm: bool = True
    num_experts: int = 0
    """Mixture-of-experts: routed experts per MoE layer (0: dense MLP)."""
    experts_per_token: int = 0
    """Mixture-of-experts: top-k routed experts each token is sent to."""
    expert_intermediate_size: int = 0
    """One routed expert's inner width (``moe_intermediate_size``); 0: ``intermediate_size``."""
    shared_expert_intermediate_size: int = 0
    """Inner width of the shared-expert MLP every token passes through (DeepSeek-V3:
    ``n_shared_experts x moe_intermediate_size``); 0: none."""
    shared_experts: int = 0
    """Shared experts (DeepSeek's ``n_shared_experts``; transformers fuses them into one MLP)."""
    dense_layers: tuple[int, ...] = ()
    """Layers of a mixture-of-experts model with a dense MLP instead (DeepSeek-V3's
    ``first_k_dense_replace``, Qwen3-MoE's ``mlp_only_layers``)."""
    router_bias: bool = False
    """The router has a bias (GPT-OSS)."""
    expert_bias: bool = False
    """Each expert's GEMMs have biases (GPT-OSS)."""
    attention_sinks: bool = False
    """A learned per-head logit in each softmax's denominator (GPT-OSS): one parameter per head."""
    qk_norm: bool = False
    """RMSNorm over each query and key head (Qwen3): ``2 x head_dim`` parameters."""
    q_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V3): the query's low-rank width (0: a full q_proj)."""
    kv_lora_rank: int = 0
    """Multi-head latent attention: the compressed key/value width (0: not latent attention)."""
    qk_rope_head_dim: int = 0
    """Multi-head latent attention: the rotary part of each query/key head (shared by the heads
    for the key). ``head_dim`` is the whole query/key head: ``qk_nope_head_dim + qk_rope_head_dim``."""
    v_head_dim: int = 0
    """Multi-head latent attention: each value head's width (0: ``head_dim``)."""
    mtp_layers: int = 0
    """Multi-token prediction depths (DeepSeek-V3's ``num_nextn_predict_layers``), units of their
    own after the final norm."""
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    """Dropout after attention and after the MLP (and on the embedding), as Megatron applies it."""
    sliding_window: Optional[int] = None
    """Keys each query sees at most, on the layers listed in ``sliding_layers``."""
    sliding_layers: tuple[int, ...] = ()
    logit_softcap: bool = False
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The config as read (recorded in the profile)."""
    origin: str = field(default="", compare=False)
    """Where it was read from: a path, or ``shipped:NAME``."""

    def __post_init__(self) -> None:
        where = f"{self.name}"
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "vocab_size", "max_positions"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BadInputError(f"{where}: {key}: {value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise BadInputError(
                f"{where}: num_key_value_heads: {self.num_kv_heads} does not divide "
                f"num_attention_heads {self.num_heads}"
            )
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise BadInputError(
                f"{where}: num_experts_per_tok: {self.experts_per_token} must be between 1 and "
                f"the number of experts {self.num_experts}"
            )

    @property
    def q_width(self) -> int:
        """Width of the query projection's output (heads x head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the key (or value) projection's output."""
        return self.num_kv_heads * self.head_dim

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3) rather than (grouped-)query attention."""
        return self.kv_lora_rank > 0

    @property
    def value_head_dim(self) -> int:
        """Width of one value head (and of the attention output per head)."""
        return self.v_head_dim or self.head_dim

    @property
    def expert_width(self) -> int:
        """One routed expert's inner width."""
        return self.expert_intermediate_size or self.intermediate_size

    def is_moe_layer(self, index: int | None = None) -> bool:
        """Whether block ``index`` routes its tokens to experts (None: a routed layer of the model,
        where it has any). Multi-token prediction depths (index >= num_layers) are routed too."""
        return bool(self.num_experts) and (index is None or index not in self.dense_layers)

    def block_name(self, index: int) -> str:
        return f"{self.names.block_prefix}.{index}"

    def summary(self) -> dict[str, Any]:
        """The normalised shape, as recorded in the profile."""
        out = asdict(self)
        out.pop("raw")
        out.pop("names")
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()
                if v not in (None, (), 0, False) or k in ("num_kv_heads",)}


def shipped_config_dir():
    return resources.files("pipeplan.analytic").joinpath("model_configs")


def shipped_configs() -> list[str]:
    """Names of the configs shipped with pipeplan, sorted.

    Examples
    --------
    >>> "llama3-8b" in shipped_configs()
    True
    """
    return sorted(p.name[:-5] for p in shipped_config_dir().iterdir() if p.name.endswith(".json"))


def read_config_json(config: str | Path) -> tuple[dict[str, Any], str, str]:
    """The JSON object of ``config`` (a path or a shipped name), its name and where it came from.

    Raises
    ------
    BadInputError
        If it is neither an existing file nor a shipped name, or not a JSON object.
    """
    text = str(config)
    path = Path(text)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        data, origin = load_json(path), str(path)
        name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    elif text in shipped_configs():
        data, origin, name = json.loads(shipped_config_dir().joinpath(f"{text}.json").read_text()), f"shipped:{text}", text
    else:
        raise BadInputError(
            f"{text}: no such config file, and not a shipped config; shipped: {', '.join(shipped_configs())}"
        )
    if not isinstance(data, dict):
        raise BadInputError(f"{origin}: expected a JSON object (a HuggingFace config.json), found {type(data).__name__}")
    data = dict(data)
    name = str(data.pop("_pipeplan_name", name))
    data.pop("_source", None)
    return data, name, origin
