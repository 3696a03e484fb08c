"""The GEMMs and parameters of each unit, and how the Megatron split shards them at degree t.

A unit is the embedding, one decoder block, the final norm, or the head with the loss. Each
block GEMM is column-parallel (output features split over t ranks: Q/K/V, MLP up/gate, experts'
first GEMM), row-parallel (input features split: the attention output projection, MLP down) or
replicated (the MoE router, multi-head latent attention's down projections, as Megatron-core's
MLASelfAttention keeps them "duplicated"); the token table and the head are vocabulary-parallel
(rows split). Norms, row-parallel biases and learned position tables are replicated on every rank
(Shoeybi et al. 2019, "Megatron-LM", section 3; Narayanan et al. 2021, section 2.3).

A mixture-of-experts block's routed experts are GEMMs with ``copies`` (the experts) of which each
token passes through ``route`` (top-k); :func:`unit_expert_param_count` counts them apart from the
dense parameters, as expert parallelism divides them (and only them) over its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.analytic.configs import ModelConfig
from pipeplan.errors import BadInputError

__all__ = ["Gemm", "block_gemms", "head_gemm", "unit_param_count", "unit_expert_param_count",
           "unit_active_param_count", "mtp_projection_gemm", "check_tensor_parallel", "kv_heads_per_rank",
           "tied_table_count"]


@dataclass(frozen=True)
class Gemm:
    """One matrix multiply of a unit: ``tokens x in_features @ in_features x out_features``."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    split: str
    """``column``, ``row``, ``vocab`` (rows of a vocabulary-parallel head) or ``none``."""
    copies: int = 1
    """Weight copies (experts); each token goes through ``route`` of them."""
    route: int = 1
    """How many of the copies each token passes through (top-k of a mixture of experts)."""
    kv: bool = False
    """A key or value projection: with t above the KV heads, each rank keeps one head (replicated)."""
    expert: bool = False
    """One of a mixture of experts' routed GEMMs (not the router, not a shared expert)."""

    def weight_count(self, cfg: ModelConfig, t: int) -> int:
        """Weight and bias elements one rank holds at degree t."""
        out, inp = self.out_features, self.in_features
        bias = out if self.bias else 0
        if self.split == "column":
            out = kv_heads_per_rank(cfg, t) * cfg.head_dim if self.kv else out // t
            bias = out if self.bias else 0
        elif self.split == "row":
            inp //= t
        elif self.split == "vocab":
            out = -(-out // t)
        return self.copies * (inp * out + bias)

    def flops_per_token(self, t: int) -> float:
        """Forward FLOPs per token on one rank (a multiply-add is 2)."""
        share = 1 if self.split == "none" else t
        return 2.0 * self.route * self.in_features * self.out_features / share


def kv_heads_per_rank(cfg: ModelConfig, t: int) -> int:
    """KV heads on one rank: ``num_kv_heads / t``, or one (replicated) where t exceeds them."""
    return max(cfg.num_kv_heads // t, 1)


def check_tensor_parallel(cfg: ModelConfig, t: int) -> None:
    """Raise BadInputError unless degree t splits the heads and the MLP evenly (Megatron's rule)."""
    if t < 1:
        raise BadInputError(f"--tensor-parallel: {t} must be positive")
    if cfg.num_heads % t:
        raise BadInputError(
            f"--tensor-parallel: {t} does not divide num_attention_heads {cfg.num_heads} of {cfg.name}; "
            f"use a divisor of {cfg.num_heads}"
        )
    if cfg.num_kv_heads % t and t % cfg.num_kv_heads:
        raise BadInputError(
            f"--tensor-parallel: {t} and num_key_value_heads {cfg.num_kv_heads} of {cfg.name}: one must "
            f"divide the other"
        )
    if cfg.intermediate_size % t:
        raise BadInputError(
            f"--tensor-parallel: {t} does not divide intermediate_size {cfg.intermediate_size} of {cfg.name}"
        )
    for key, width in (("the expert width (moe_intermediate_size)", cfg.expert_width if cfg.num_experts else 0),
                       ("the shared experts' width", cfg.shared_expert_intermediate_size)):
        if width % t:
            raise BadInputError(f"--tensor-parallel: {t} does not divide {key} {width} of {cfg.name}")


def _attention_gemms(cfg: ModelConfig) -> list[Gemm]:
    h, bias = cfg.hidden_size, cfg.qkv_bias
    if not cfg.latent_attention:
        return [
            Gemm("q_proj", h, cfg.q_width, bias, "column"),
            Gemm("k_proj", h, cfg.kv_width, bias, "column", kv=True),
            Gemm("v_proj", h, cfg.kv_width, bias, "column", kv=True),
            Gemm("o_proj", cfg.q_width, h, cfg.out_bias, "row"),
        ]
    # Multi-head latent attention (transformers' DeepseekV3Attention; biases on the down
    # projections and the output as attention_bias says).
    a, rope, value = cfg.num_heads, cfg.qk_rope_head_dim, cfg.value_head_dim
    nope = cfg.head_dim - rope
    gemms = ([Gemm("q_a_proj", h, cfg.q_lora_rank, bias, "none"),
              Gemm("q_b_proj", cfg.q_lora_rank, a * cfg.head_dim, False, "column")]
             if cfg.q_lora_rank else [Gemm("q_proj", h, a * cfg.head_dim, False, "column")])
    return gemms + [
        Gemm("kv_a_proj_with_mqa", h, cfg.kv_lora_rank + rope, bias, "none"),
        Gemm("kv_b_proj", cfg.kv_lora_rank, a * (nope + value), False, "column"),
        Gemm("o_proj", a * value, h, cfg.out_bias, "row"),
    ]


def _mlp_gemms(cfg: ModelConfig, index: int | None) -> list[Gemm]:
    h = cfg.hidden_size
    if not cfg.is_moe_layer(index):
        f, bias = cfg.intermediate_size, cfg.mlp_bias
        if cfg.gated_mlp:
            return [Gemm("gate_proj", h, f, bias, "column"), Gemm("up_proj", h, f, bias, "column"),
                    Gemm("down_proj", f, h, bias, "row")]
        return [Gemm("fc1", h, f, bias, "column"), Gemm("fc2", f, h, bias, "row")]
    e, k, f, bias = cfg.num_experts, cfg.experts_per_token, cfg.expert_width, cfg.expert_bias or cfg.mlp_bias
    gemms = [
        Gemm("router", h, e, cfg.router_bias, "none"),
        Gemm("gate_proj", h, f, bias, "column", e, k, expert=True),
        Gemm("up_proj", h, f, bias, "column", e, k, expert=True),
        Gemm("down_proj", f, h, bias, "row", e, k, expert=True),
    ]
    shared = cfg.shared_expert_intermediate_size
    if shared:
        gemms += [Gemm("shared_gate_proj", h, shared, False, "column"),
                  Gemm("shared_up_proj", h, shared, False, "column"),
                  Gemm("shared_down_proj", shared, h, False, "row")]
    return gemms


def block_gemms(cfg: ModelConfig, index: int | None = None) -> list[Gemm]:
    """The GEMMs of decoder block ``index``, in forward order (None: a routed block where the
    model has experts; the layers of a dense model are all alike).

    Examples
    --------
    >>> from pipeplan.analytic.families import load_model_config
    >>> [g.name for g in block_gemms(load_model_config("llama3-8b"))]
    ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']
    >>> [g.name for g in block_gemms(load_model_config("deepseek-v3"), 3)][:5]
    ['q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj']
    """
    return _attention_gemms(cfg) + _mlp_gemms(cfg, index)


def head_gemm(cfg: ModelConfig) -> Gemm:
    """The output projection over the vocabulary (vocabulary-parallel)."""
    return Gemm("lm_head", cfg.embed_proj_dim or cfg.hidden_size, cfg.vocab_size, False, "vocab")


def _norm_count(cfg: ModelConfig) -> int:
    return cfg.hidden_size * (2 if cfg.norm == "layernorm" else 1)


def _block_small_count(cfg: ModelConfig, t: int) -> int:
    """A block's norms and other non-GEMM parameters on one rank."""
    count = (4 if cfg.sandwich_norms else 2) * _norm_count(cfg)
    if cfg.latent_attention:
        count += cfg.q_lora_rank + cfg.kv_lora_rank  # q_a_layernorm, kv_a_layernorm (RMSNorm)
    if cfg.qk_norm:
        count += 2 * cfg.head_dim  # q_norm, k_norm: one RMSNorm over a head, shared by the heads
    if cfg.attention_sinks:
        count += cfg.num_heads // t  # one sink logit per head, split with the heads
    return count


def mtp_projection_gemm(cfg: ModelConfig) -> Gemm:
    # DeepSeek-V3 report section 2.2: M_k [RMSNorm(h); RMSNorm(Emb(t))], a 2h -> h projection
    # (Megatron-core's MultiTokenPredictionLayer.eh_proj), costed here as replicated.
    return Gemm("eh_proj", 2 * cfg.hidden_size, cfg.hidden_size, False, "none")


def unit_param_count(cfg: ModelConfig, kind: str, t: int = 1, index: int | None = None) -> int:
    """Parameters one rank holds of a unit at tensor-parallel degree t.

    ``kind`` is ``embedding``, ``block`` (number ``index``: DeepSeek-V3's first layers are dense),
    ``norm``, ``head`` or ``mtp`` (a multi-token prediction depth: its two input norms, the
    ``2h -> h`` projection, one routed block and its output norm; the token table and the head
    it shares with the main model are not counted: they are tied weights). The head counts its
    whole matrix, tied or not (:func:`tied_table_count` is the part a tie shares).

    Examples
    --------
    >>> from pipeplan.analytic.families import load_model_config
    >>> cfg = load_model_config("llama3-8b")
    >>> unit_param_count(cfg, "block"), unit_param_count(cfg, "block", 8)
    (218112000, 27271168)
    """
    h = cfg.hidden_size
    if kind == "embedding":
        width = cfg.embed_proj_dim or h
        count = -(-cfg.vocab_size // t) * width + cfg.learned_positions * h
        if cfg.embed_proj_dim:
            count += cfg.embed_proj_dim * h
        return count
    if kind == "block":
        return _block_small_count(cfg, t) + sum(g.weight_count(cfg, t) for g in block_gemms(cfg, index))
    if kind == "mtp":
        block = unit_param_count(cfg, "block", t, index)
        return block + 3 * _norm_count(cfg) + mtp_projection_gemm(cfg).weight_count(cfg, t)
    if kind == "norm":
        return (_norm_count(cfg) if cfg.final_norm else 0) + (cfg.embed_proj_dim or 0) * h
    if kind == "head":
        return head_gemm(cfg).weight_count(cfg, t)
    raise ValueError(kind)


def unit_expert_param_count(cfg: ModelConfig, kind: str, t: int = 1, index: int | None = None) -> int:
    """The routed experts' parameters among :func:`unit_param_count`'s (0 for a dense unit).

    Expert parallelism over E' ranks leaves each rank ``1/E'`` of these (E' dividing the experts);
    the rest of the unit (attention, norms, router, shared experts) stays whole.

    Examples
    --------
    >>> from pipeplan.analytic.families import load_model_config
    >>> unit_expert_param_count(load_model_config("mixtral-8x7b"), "block")   # 8 x 3 x 4096 x 14336
    1409286144
    """
    if kind not in ("block", "mtp"):
        return 0
    return sum(g.weight_count(cfg, t) for g in block_gemms(cfg, index) if g.expert)


def unit_active_param_count(cfg: ModelConfig, kind: str, index: int | None = None) -> int:
    """Parameters one token passes through in a unit: all but the routed experts it is not sent to
    (``experts_per_token`` of ``num_experts``)."""
    experts = unit_expert_param_count(cfg, kind, 1, index)
    active = experts // cfg.num_experts * cfg.experts_per_token if experts else 0
    return unit_param_count(cfg, kind, 1, index) - experts + active


def tied_table_count(cfg: ModelConfig, t: int = 1) -> int:
    """Elements of the token table (one rank's rows at degree t): what a tied head, and a
    multi-token prediction depth, share with the embedding."""
    return -(-cfg.vocab_size // t) * (cfg.embed_proj_dim or cfg.hidden_size)
