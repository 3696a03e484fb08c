"""Activation memory per unit (Korthikanti et al. 2022), parameters and training state.

Korthikanti, Casper, Lym, McAfee, Andersch, Shoeybi, Catanzaro, "Reducing Activation
Recomputation in Large Transformer Models", MLSys 2023 (arXiv:2205.05198), section 4: a GPT-3
block stores ``s b h (34 + 5 a s / h)`` bytes in 16-bit training: 11 s b h + 5 a s^2 b for
attention, 19 s b h for the MLP, 4 s b h for the two layer norms. With tensor parallelism t the
attention and MLP insides divide by t (``s b h (10 + 24 / t + 5 a s / (h t))``); with sequence
parallelism as well, everything does (``s b h / t (34 + 5 a s / h)``); selective recomputation of
the attention core drops the ``5 a s^2 b`` term (``34 s b h / t``).

:func:`block_activation_terms` writes that sum as named tensors so that it extends to what the
paper's GPT-3 block lacks: grouped KV heads, gated MLPs (Megatron's fused SwiGLU keeps the
up/gate output and the product: ``3 s b f``), RMSNorm, Gemma 2's extra norms, GPT-NeoX's parallel
residual (both norms read one tensor), no dropout (modern configs: no masks), flash attention
(no ``s^2`` tensors; the softmax statistics ``4 a s b`` bytes in fp32 instead),
mixture-of-experts (each token's k expert copies; the shared experts' own SwiGLU tensors),
multi-head latent attention (the low-rank outputs and their norms' outputs; query, key and value
at their own head widths) and Qwen3's per-head query/key norms.
"""

from __future__ import annotations

from pipeplan.analytic.configs import ModelConfig
from pipeplan.analytic.flops import Shape
from pipeplan.analytic.shapes import kv_heads_per_rank
from pipeplan.facts.training_state import training_state

__all__ = ["QUANTIZED_INPUT_TERMS", "block_activation_terms", "unit_activation_bytes", "unit_routed_activation_bytes",
           "unit_output_bytes", "unit_loss_elements",
           "MEGATRON_ADAM_BYTES_PER_PARAM", "training_state_bytes", "ATTENTION_CORE_TERMS"]

#: Megatron's mixed-precision Adam: 16-bit weight 2 + fp32 gradient 4 + fp32 master weight 4 +
#: two fp32 moments 8 = 18 (Korthikanti et al. 2022 and the Megatron-LM distributed optimizer docs),
#: from the one table of training state (:mod:`pipeplan.facts.training_state`).
MEGATRON_ADAM_BYTES_PER_PARAM = int(training_state("adam-fp32-grads", 2).total_bytes)

#: The saved inputs of the GEMMs a quantized ``--precision`` runs (pipeplan.analytic.flops): Transformer
#: Engine keeps them quantized, column-wise (what the weight gradient reads): ``q`` bytes per element.
QUANTIZED_INPUT_TERMS = ("qkv_input", "q_b_input", "kv_b_input", "out_proj_input", "mlp_input",
                         "down_proj_input", "fc2_input", "shared_down_proj_input")

#: The terms selective recomputation frees (recomputed in backward from Q, K and V).
ATTENTION_CORE_TERMS = ("softmax_output", "softmax_dropout_mask", "softmax_dropout_output", "softmax_stats")


def _attention_input_terms(cfg: ModelConfig, shape: Shape) -> dict[str, float]:
    t, e, tokens = shape.tensor_parallel, shape.dtype_bytes, shape.tokens
    heads_rank = cfg.num_heads // t
    if not cfg.latent_attention:
        q_rank = heads_rank * cfg.head_dim
        kv_rank = kv_heads_per_rank(cfg, t) * cfg.head_dim
        terms = {"query": e * tokens * q_rank, "key": e * tokens * kv_rank, "value": e * tokens * kv_rank}
        if cfg.qk_norm:
            terms["qk_norm_input"] = e * tokens * (q_rank + kv_rank)
        return terms
    terms = {}
    if cfg.q_lora_rank:
        # q_a's output (the norm's input) and the norm's output (q_b's input).
        terms["q_a_output"] = e * tokens * cfg.q_lora_rank
        terms["q_b_input"] = e * tokens * cfg.q_lora_rank
    terms["kv_a_output"] = e * tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    terms["kv_b_input"] = e * tokens * cfg.kv_lora_rank
    terms["query"] = e * tokens * heads_rank * cfg.head_dim
    terms["key"] = e * tokens * heads_rank * cfg.head_dim
    terms["value"] = e * tokens * heads_rank * cfg.value_head_dim
    return terms


def _mlp_terms(cfg: ModelConfig, index: int | None, shape: Shape, replicated: float) -> dict[str, float]:
    t, e, tokens = shape.tensor_parallel, shape.dtype_bytes, shape.tokens
    moe = cfg.is_moe_layer(index)
    routed = cfg.experts_per_token if moe else 1
    terms = {"mlp_input": e * replicated * routed}
    if moe:
        terms["router_probs"] = e * tokens * cfg.num_experts
    inner = tokens * routed * (cfg.expert_width if moe else cfg.intermediate_size) // t
    if cfg.gated_mlp:
        terms["gate_up_output"] = 2 * e * inner
        terms["down_proj_input"] = e * inner
    else:
        terms["activation_input"] = e * inner
        terms["fc2_input"] = e * inner
    if moe and cfg.shared_expert_intermediate_size:
        shared = tokens * cfg.shared_expert_intermediate_size // t
        terms["shared_gate_up_output"] = 2 * e * shared
        terms["shared_down_proj_input"] = e * shared
    return terms


def block_activation_terms(cfg: ModelConfig, shape: Shape, index: int | None = None) -> dict[str, float]:
    """Bytes one rank keeps for one block's backward, per tensor, at ``shape``.

    ``index``: the block (a dense or a routed layer of a mixture of experts; None: a routed one).

    Examples
    --------
    A GPT-3-style block without flash attention gives Korthikanti's ``34 s b h + 5 a s^2 b``:

    >>> from pipeplan.analytic.families import load_model_config
    >>> cfg = load_model_config("gpt3-175b")
    >>> s, b, h, a = 2048, 1, 12288, 96
    >>> sum(block_activation_terms(cfg, Shape(s, b, flash_attention=False)).values()) == 34*s*b*h + 5*a*s*s*b
    True
    """
    t, e, tokens, h = shape.tensor_parallel, shape.dtype_bytes, shape.tokens, cfg.hidden_size
    replicated = tokens * h / shape.sp_share
    mask = 1.0 if cfg.hidden_dropout else 0.0
    terms = {
        "input_norm_input": e * replicated,
        "qkv_input": e * replicated,
        **_attention_input_terms(cfg, shape),
    }
    heads_rank = cfg.num_heads // t
    if shape.flash_attention:
        terms["softmax_stats"] = 4.0 * heads_rank * tokens
    else:
        scores = heads_rank * shape.microbatch_size * shape.seq_len ** 2
        terms["softmax_output"] = e * scores
        if cfg.attention_dropout:
            terms["softmax_dropout_mask"] = 1.0 * scores
            terms["softmax_dropout_output"] = e * scores
    terms["out_proj_input"] = e * tokens * heads_rank * cfg.value_head_dim
    terms["attention_dropout_mask"] = mask * replicated
    if cfg.sandwich_norms:
        terms["post_attention_norm_input"] = e * replicated
    if not cfg.parallel_residual:
        terms["mlp_norm_input"] = e * replicated
    terms.update(_mlp_terms(cfg, index, shape, replicated))
    if cfg.sandwich_norms:
        terms["post_feedforward_norm_input"] = e * replicated
    terms["mlp_dropout_mask"] = mask * replicated
    if shape.quantized_bytes is not None:
        # docs/analytic.md, "Precision": TE saves these quantized (q bytes, not e).
        for name in QUANTIZED_INPUT_TERMS:
            if name in terms:
                terms[name] = terms[name] * shape.quantized_bytes / e
    return {k: v for k, v in terms.items() if v}


def unit_activation_bytes(cfg: ModelConfig, kind: str, index: int, shape: Shape,
                          selective: bool = False) -> int:
    """Bytes one rank keeps for backward of one unit, per micro-batch in flight.

    ``selective``: the attention core is recomputed in backward (its terms are not kept).
    The embedding keeps the token ids (int64) and its dropout mask; the final norm its input; the
    head its input and the fp32 softmax of the vocabulary-parallel cross-entropy (4 s b V / t).
    """
    tokens, h, e = shape.tokens, cfg.hidden_size, shape.dtype_bytes
    replicated = tokens * h / shape.sp_share
    if kind in ("block", "mtp"):
        terms = block_activation_terms(cfg, shape, index)
        if selective:
            terms = {k: v for k, v in terms.items() if k not in ATTENTION_CORE_TERMS}
        total = sum(terms.values())
        if kind == "mtp":
            # Its two norms' inputs, the projection's 2h input, its output norm's input, and the
            # shared head's input and fp32 softmax (as the head's).
            vocab_rank = -(-cfg.vocab_size // shape.tensor_parallel)
            projection = shape.quantized_bytes if shape.quantized_bytes is not None else e
            total += e * (2 * replicated + 2 * replicated) + projection * 2 * tokens * h + 4.0 * tokens * vocab_rank
        return int(round(total))
    if kind == "embedding":
        total = 8.0 * tokens + (replicated if cfg.hidden_dropout else 0.0)
        if cfg.embed_proj_dim:
            total += e * tokens * cfg.embed_proj_dim
        return int(round(total))
    if kind == "norm":
        total = e * replicated if cfg.final_norm else 0.0
        if cfg.embed_proj_dim:
            total += e * tokens * h
        return int(round(total))
    if kind == "head":
        width = cfg.embed_proj_dim or h
        vocab_rank = -(-cfg.vocab_size // shape.tensor_parallel)
        return int(round(e * tokens * width / shape.sp_share + 4.0 * tokens * vocab_rank))
    raise ValueError(kind)


def unit_loss_elements(cfg: ModelConfig, kind: str, shape: Shape) -> int:
    """Elements of one rank's logits that a unit's cross-entropy reads per micro-batch, ``s b V / t``
    (the head's, and a multi-token-prediction block's shared head's); 0 for a unit with no loss.
    Its working memory per loss implementation: :func:`pipeplan.facts.loss.loss_working_bytes`."""
    if kind not in ("head", "mtp"):
        return 0
    return int(shape.tokens * -(-cfg.vocab_size // shape.tensor_parallel))


#: The terms of an MoE block that scale with the tokens a rank's experts receive: the dispatched
#: k copies of each token and the routed experts' own tensors.
ROUTED_TERMS = ("mlp_input", "gate_up_output", "down_proj_input", "activation_input", "fc2_input")


def unit_routed_activation_bytes(cfg: ModelConfig, kind: str, index: int, shape: Shape) -> int:
    """Of :func:`unit_activation_bytes`, the routed experts' share (the dispatched tokens and the
    experts' tensors, :data:`ROUTED_TERMS`); 0 for a unit without routed experts. The busiest
    rank under ``--expert-imbalance f`` keeps ``f`` times this share.

    Examples
    --------
    >>> from pipeplan.analytic.families import load_model_config
    >>> cfg = load_model_config("mixtral-8x7b")
    >>> s, b, h, f, k = 4096, 1, 4096, 14336, 2
    >>> unit_routed_activation_bytes(cfg, "block", 0, Shape(s, b)) == 2 * (k * s * h + 3 * k * s * f)
    True
    """
    if kind not in ("block", "mtp") or not cfg.is_moe_layer(index):
        return 0
    terms = block_activation_terms(cfg, shape, index)
    return int(round(sum(v for k, v in terms.items() if k in ROUTED_TERMS)))


def unit_output_bytes(cfg: ModelConfig, kind: str, shape: Shape, index: int | None = None) -> int:
    """Bytes one rank sends to the next pipeline stage: the hidden states (its sequence shard
    with sequence parallelism); the head's output is the loss (4 bytes). A multi-token prediction
    depth (number ``index``) computes its own loss and passes on the main model's hidden states
    for the head, and, but for the last depth, its own for the next depth."""
    if kind == "head":
        return 4
    hidden = shape.dtype_bytes * shape.tokens * cfg.hidden_size
    if kind == "mtp":
        last = index is None or index >= cfg.num_layers + cfg.mtp_layers - 1
        return int((1 if last else 2) * hidden // shape.sp_share)
    width = cfg.embed_proj_dim if (kind == "norm" and cfg.embed_proj_dim) else cfg.hidden_size
    return int(shape.dtype_bytes * shape.tokens * width // shape.sp_share)


def training_state_bytes(params: int, bytes_per_param: int = MEGATRON_ADAM_BYTES_PER_PARAM) -> int:
    """Weights, gradients and optimizer state of ``params`` parameters (Megatron's 18 B each)."""
    return params * bytes_per_param
