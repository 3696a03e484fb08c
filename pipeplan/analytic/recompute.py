"""What each of Megatron's selective-recomputation modules frees and costs, per unit (analytic).

Megatron-core's ``recompute_modules`` (``megatron/core/transformer/transformer_config.py``;
``transformer_layer.py``, ``moe/experts.py``, ``multi_latent_attention.py`` read them) are costed
from the unit's activation tensors (:func:`pipeplan.analytic.memory.block_activation_terms`) and
its forward parts (:func:`pipeplan.analytic.flops.unit_work`). A module's ``saved_bytes`` are the
tensors the layer no longer keeps; its ``recompute_ms`` the forward parts it runs again:

========================  ==========================================  ===================================
module                    frees (activation terms)                    runs again (forward parts)
========================  ==========================================  ===================================
``core_attn``             the attention core's (softmax output,       ``attention_core``, ``softmax``
                          dropout, fp32 softmax statistics)
``layernorm``             the two norms' outputs: ``qkv_input``, and  ``input_norm``, ``mlp_norm``
                          in dense layers ``mlp_input`` (an MoE
                          layer's terms count the experts' k copies,
                          not the norm's output)
``mlp`` (dense layers)    the MLP's insides (its input is the         the parts between ``mlp_norm`` and
                          checkpoint, kept)                           the residual
``moe_act`` (MoE layers)  the routed experts' activation output       ``activation``
                          (``down_proj_input`` / ``fc2_input``)
``moe`` (MoE layers)      every MLP term (its input, the norm's       the parts between ``mlp_norm`` and
                          output, is not among the terms)             the residual
``shared_experts``        the shared experts' SwiGLU tensors          ``shared_*`` parts
``mla_up_proj`` (MLA)     query, key and value (the up projections'   ``q_b_proj``, ``kv_b_proj``,
                          outputs after rotary)                       ``rotary``
========================  ==========================================  ===================================

``moe_act``, ``layernorm`` and ``mla_up_proj`` use Megatron's output-discarding checkpoint (the
output is dropped once consumed, rebuilt before the consumer's backward); the others a normal
checkpoint of the submodule. A recomputed MoE layer's token dispatch is not counted again here.
"""

from __future__ import annotations

from pipeplan.analytic.memory import ATTENTION_CORE_TERMS, block_activation_terms

__all__ = ["module_terms", "module_parts", "unit_selective_modules"]

_MLP_TERMS = ("mlp_input", "router_probs", "gate_up_output", "down_proj_input", "activation_input", "fc2_input")
_SHARED_TERMS = ("shared_gate_up_output", "shared_down_proj_input")
_SHARED_PARTS = ("shared_gate_proj", "shared_up_proj", "shared_activation", "shared_down_proj")
_MLP_END = ("post_feedforward_norm", "mlp_residual")


def module_terms(cfg, index: int, terms: dict[str, float]) -> dict[str, tuple[str, ...]]:
    """Per module this block has, the activation terms its recompute frees."""
    moe = cfg.is_moe_layer(index)
    out = {"core_attn": tuple(t for t in ATTENTION_CORE_TERMS if t in terms),
           "layernorm": ("qkv_input",) if moe else ("qkv_input", "mlp_input")}
    if moe:
        out["moe_act"] = ("down_proj_input",) if cfg.gated_mlp else ("fc2_input",)
        out["moe"] = _MLP_TERMS + _SHARED_TERMS
        if cfg.shared_expert_intermediate_size:
            out["shared_experts"] = _SHARED_TERMS
    else:
        out["mlp"] = tuple(t for t in _MLP_TERMS if t != "mlp_input")
    if cfg.latent_attention:
        out["mla_up_proj"] = ("query", "key", "value")
    return {m: tuple(t for t in names if t in terms) for m, names in out.items()}


def module_parts(cfg, index: int, forward) -> dict[str, list]:
    """Per module this block has, the forward parts its recompute runs again."""
    names = [p.name for p in forward]
    start = names.index("mlp_norm") + 1 if "mlp_norm" in names else None
    mlp = []
    if start is not None:
        end = next((i for i in range(start, len(names)) if names[i] in _MLP_END), len(names))
        mlp = forward[start:end]
    by_name = lambda wanted: [p for p in forward if p.name in wanted]  # noqa: E731
    moe = cfg.is_moe_layer(index)
    out = {"core_attn": by_name(("attention_core", "softmax")), "layernorm": by_name(("input_norm", "mlp_norm"))}
    if moe:
        out["moe_act"] = [p for p in mlp if p.name == "activation"]
        out["moe"] = list(mlp)
        if cfg.shared_expert_intermediate_size:
            out["shared_experts"] = [p for p in mlp if p.name in _SHARED_PARTS]
    else:
        out["mlp"] = list(mlp)
    if cfg.latent_attention:
        out["mla_up_proj"] = by_name(("q_b_proj", "kv_b_proj", "rotary"))
    return out


def unit_selective_modules(cfg, kind: str, index: int, shape, forward, ms_of) -> dict[str, dict] | None:
    """The ``selective_modules`` field of a block's (or MTP depth's) entry: per module,
    ``saved_bytes`` (its terms' bytes, summed) and ``recompute_ms`` (``ms_of`` its parts); None
    for other units."""
    if kind not in ("block", "mtp"):
        return None
    terms = block_activation_terms(cfg, shape, index)
    freed, parts = module_terms(cfg, index, terms), module_parts(cfg, index, forward)
    return {m: {"saved_bytes": int(sum(terms[t] for t in freed[m])), "recompute_ms": round(float(ms_of(parts[m])), 6)}
            for m in freed}
