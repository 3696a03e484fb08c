"""The GEMMs and parameters of each unit, and how the Megatron split shards them at degree t.

A unit is the embedding, one decoder block, the final norm, or the head with the loss. Each
block GEMM is column-parallel (output features split over t ranks: Q/K/V, MLP up/gate, experts'
first GEMM), row-parallel (input features split: the attention output projection, MLP down) or
replicated (the MoE router); the token table and the head are vocabulary-parallel (rows split).
Norms, row-parallel biases and learned position tables are replicated on every rank
(Shoeybi et al. 2019, "Megatron-LM", section 3; Narayanan et al. 2021, section 2.3).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.analytic.configs import ModelConfig
from pipeplan.errors import BadInputError

__all__ = ["Gemm", "block_gemms", "head_gemm", "unit_param_count", "check_tensor_parallel", "kv_heads_per_rank"]


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


def block_gemms(cfg: ModelConfig) -> list[Gemm]:
    """The GEMMs of one decoder block, in forward order.

    Examples
    --------
    >>> from pipeplan.analytic.families import load_model_config
    >>> [g.name for g in block_gemms(load_model_config("llama3-8b"))]
    ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']
    """
    h, f = cfg.hidden_size, cfg.intermediate_size
    gemms = [
        Gemm("q_proj", h, cfg.q_width, cfg.qkv_bias, "column"),
        Gemm("k_proj", h, cfg.kv_width, cfg.qkv_bias, "column", kv=True),
        Gemm("v_proj", h, cfg.kv_width, cfg.qkv_bias, "column", kv=True),
        Gemm("o_proj", cfg.q_width, h, cfg.out_bias, "row"),
    ]
    experts = cfg.num_experts or 1
    route = cfg.experts_per_token if cfg.num_experts else 1
    if cfg.num_experts:
        gemms.append(Gemm("router", h, cfg.num_experts, False, "none"))
    if cfg.gated_mlp:
        gemms += [
            Gemm("gate_proj", h, f, cfg.mlp_bias, "column", experts, route),
            Gemm("up_proj", h, f, cfg.mlp_bias, "column", experts, route),
        ]
    else:
        gemms.append(Gemm("fc1", h, f, cfg.mlp_bias, "column", experts, route))
    gemms.append(Gemm("down_proj" if cfg.gated_mlp else "fc2", f, h, cfg.mlp_bias, "row", experts, route))
    return gemms


def head_gemm(cfg: ModelConfig) -> Gemm:
    """The output projection over the vocabulary (vocabulary-parallel)."""
    return Gemm("lm_head", cfg.embed_proj_dim or cfg.hidden_size, cfg.vocab_size, False, "vocab")


def _norm_count(cfg: ModelConfig) -> int:
    return cfg.hidden_size * (2 if cfg.norm == "layernorm" else 1)


def unit_param_count(cfg: ModelConfig, kind: str, t: int = 1) -> int:
    """Parameters one rank holds of a unit at tensor-parallel degree t.

    ``kind`` is ``embedding``, ``block``, ``norm`` or ``head``. Tied heads count the token table
    again (a pipeline stage holding the head keeps its own copy).

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
        norms = (4 if cfg.sandwich_norms else 2) * _norm_count(cfg)
        return norms + sum(g.weight_count(cfg, t) for g in block_gemms(cfg))
    if kind == "norm":
        return (_norm_count(cfg) if cfg.final_norm else 0) + (cfg.embed_proj_dim or 0) * h
    if kind == "head":
        return head_gemm(cfg).weight_count(cfg, t)
    raise ValueError(kind)
