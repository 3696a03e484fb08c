"""torchtitan's per-op selective activation checkpointing of one block, costed (analytic).

``[activation_checkpoint] mode = "selective"``, ``selective_ac_option = "op"`` wraps every
transformer block in torch's selective checkpoint with torchtitan's policy
(``torchtitan/distributed/activation_checkpoint.py``, ``_apply_op_sac``; the save list
``_op_sac_save_list`` of ``torchtitan/models/llama3/infra/parallelize.py``, torchtitan 0.2.2):

- the outputs of ``aten.mm`` are saved, **except every second one**: a per-block counter of the
  forward's ``mm`` calls saves the 1st, 3rd, 5th, ... and recomputes the 2nd, 4th, ...
  (``meta[mm_count_key] % 2 == 0`` is recomputed). A Llama block calls them in the order
  ``wq, wk, wv, wo, w1, w3, w2`` (``Attention.forward``; ``FeedForward.forward`` evaluates
  ``w2(silu(w1(x)) * w3(x))``), so ``wq, wv, w1, w2`` are saved and ``wk, wo, w3`` recomputed;
- the attention kernel's outputs are saved (``_scaled_dot_product_flash_attention`` and its
  efficient, cuDNN and math variants: the attention output and its fp32 log-sum-exp);
- ``reduce_scatter_tensor`` results are saved (the row-parallel outputs under tensor
  parallelism, which torchtitan always runs with sequence parallelism);
- everything else (the norms, rotary, the SwiGLU, the residual adds) is recomputed, and the
  block keeps its input (the checkpoint's argument).

So the block keeps, per micro-batch in flight::

    kept = input (e s b h / t_sp) + attention output and softmax statistics
           + sum over saved mm (e x tokens x its output width on the rank)
           + per row-parallel GEMM at t > 1 its reduce-scattered output (e s b h / t)

and its backward first runs again every forward part but the saved GEMMs and the attention
kernel. Under ``--precision`` (torchao's Float8 and MX linears) each linear still calls
``torch.mm``, on torchao's quantized tensor subclasses, and the checkpoint's dispatch mode sees
that ``aten.mm`` before the subclass turns it into ``_scaled_mm``: the GEMMs are counted and
their (16-bit) outputs saved as in bf16, and every kept tensor here is at the training dtype
(torch saves what the ops return, not Transformer Engine's quantized copies). Costed for dense blocks with standard (grouped-query) attention, what
torchtitan's Llama 3 / Qwen 3 models run; mixture-of-experts and latent-attention blocks (grouped
GEMMs, ``per_op_sac_force_recompute_mm_shapes_by_fqns``) are not costed yet and offer none.
"""

from __future__ import annotations

from pipeplan.analytic.memory import ATTENTION_CORE_TERMS, block_activation_terms
from pipeplan.analytic.shapes import block_gemms, kv_heads_per_rank

__all__ = ["op_sac_saved_gemms", "op_sac_kept_bytes", "unit_op_sac"]

#: The attention kernel's parts: its outputs are on the save list, so it is not run again.
_ATTENTION_PARTS = ("attention_core", "softmax")


def op_sac_saved_gemms(cfg, index: int, shape) -> tuple[str, ...]:
    """The GEMMs whose outputs the policy saves: the odd-numbered ``mm`` calls.

    Examples
    --------
    >>> from pipeplan.analytic.families import load_model_config
    >>> from pipeplan.analytic.flops import Shape
    >>> op_sac_saved_gemms(load_model_config("llama3-8b"), 0, Shape(8192, 1))
    ('q_proj', 'v_proj', 'gate_proj', 'down_proj')
    """
    return tuple(g.name for i, g in enumerate(block_gemms(cfg, index)) if i % 2 == 0)


def _output_width(gemm, cfg, t: int) -> int:
    # One rank's output columns, as pipeplan.analytic.flops._gemm_parts splits them.
    if gemm.split in ("column", "vocab"):
        return kv_heads_per_rank(cfg, t) * cfg.head_dim if gemm.kv else -(-gemm.out_features // t)
    return gemm.out_features


def op_sac_kept_bytes(cfg, index: int, shape) -> float:
    """Bytes one block keeps per micro-batch under the per-op policy (module docstring)."""
    t, e, tokens = shape.tensor_parallel, shape.dtype_bytes, shape.tokens
    terms = block_activation_terms(cfg, shape, index)
    # The checkpoint's input (the sequence shard under sequence parallelism) and the attention
    # kernel's output, at the training dtype; its softmax statistics (or, without flash
    # attention, the math kernel's probabilities) as the terms give them.
    kept = e * tokens * cfg.hidden_size / shape.sp_share + e * tokens * (cfg.num_heads // t) * cfg.value_head_dim
    kept += sum(terms.get(name, 0.0) for name in ATTENTION_CORE_TERMS if "mask" not in name)
    saved = set(op_sac_saved_gemms(cfg, index, shape))
    for gemm in block_gemms(cfg, index):
        if gemm.name in saved:
            kept += e * tokens * gemm.route * _output_width(gemm, cfg, t)
        if t > 1 and gemm.split == "row":
            kept += e * tokens * gemm.out_features / t  # the reduce-scattered output (saved)
    return kept


def unit_op_sac(cfg, kind: str, index: int, shape, forward, ms_of) -> dict | None:
    """The ``selective_op_sac`` field of a dense block's entry: ``saved_bytes`` (of the block's
    activation bytes, what the policy does not keep) and ``recompute_ms`` (``ms_of`` the forward
    parts run again); None for other units and for blocks it is not costed for."""
    if kind != "block" or cfg.is_moe_layer(index) or cfg.latent_attention:
        return None
    total = sum(block_activation_terms(cfg, shape, index).values())
    freed = max(0.0, total - op_sac_kept_bytes(cfg, index, shape))
    skip = set(op_sac_saved_gemms(cfg, index, shape)) | set(_ATTENTION_PARTS)
    again = [p for p in forward if p.name not in skip]
    return {"saved_bytes": int(round(freed)), "recompute_ms": round(float(ms_of(again)), 6)}
