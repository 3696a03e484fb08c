"""FLOPs and bytes moved per unit and micro-batch: the named parts that time is computed from.

Each unit's forward, input-gradient (B) and weight-gradient (W) passes are lists of
:class:`Part`: a GEMM, the attention core, or a memory-bound elementwise step (norms, residual
adds, activations, rotary, dropout, softmax, cross-entropy). Their FLOPs and HBM bytes are one
rank's at tensor-parallel degree t (docs/analytic.md, "FLOPs"):

- a GEMM ``[T, k] @ [k, n]`` is ``2 T k n`` FLOPs forward, the same again for B (``dX = dY W^T``)
  and for W (``dW = X^T dY``), divided by t when column-, row- or vocabulary-parallel;
- causal attention is ``4 T d_head heads keys`` forward (scores and values), with ``keys`` the
  mean number of keys a query sees (``(s + 1) / 2``; with a sliding window w on ``s > w``:
  ``(w (w + 1) / 2 + (s - w) w) / s``); its backward is twice that, plus the forward's
  QK^T again under flash attention (Dao 2023, FlashAttention-2, section 3.1.2: 2.5x forward);
- elementwise steps do no FLOPs that matter; they move bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeplan.analytic.configs import ModelConfig
from pipeplan.analytic.shapes import Gemm, block_gemms, head_gemm, kv_heads_per_rank, mtp_projection_gemm

__all__ = ["UNQUANTIZED_GEMMS", "ROUTER_LAUNCHES", "DISPATCH_LAUNCHES", "Part", "Shape", "UnitWork", "unit_work", "mean_keys_per_query", "model_flops_per_token"]


@dataclass(frozen=True)
class Shape:
    """What one cost entry is computed at."""

    seq_len: int
    microbatch_size: int
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    flash_attention: bool = True
    dtype_bytes: int = 2
    quantized_bytes: float | None = None
    """``--precision``'s bytes per element of a quantized GEMM operand (None: bf16 throughout;
    :mod:`pipeplan.facts.precision`)."""

    @property
    def tokens(self) -> int:
        return self.seq_len * self.microbatch_size

    @property
    def sp_share(self) -> int:
        """What the replicated-in-Megatron parts (norms, dropouts, residuals) divide by."""
        return self.tensor_parallel if self.sequence_parallel else 1


@dataclass(frozen=True)
class Part:
    """One kernel's work on one rank."""

    name: str
    kind: str
    """``gemm``, ``attention`` or ``memory`` (picks the efficiency that applies)."""
    flops: float
    bytes: float
    quantized: bool = False
    """A GEMM run at ``--precision``'s peak (its operands quantized)."""
    m: float = 0.0
    """A GEMM's output rows per group (tokens, or for a weight gradient the input features); 0:
    not a GEMM (the efficiency model's tile and wave terms apply only where m, n and k are given)."""
    n: float = 0.0
    """A GEMM's output columns (one rank's, after the tensor-parallel split)."""
    k: float = 0.0
    """A GEMM's reduction length (a weight gradient's: the tokens)."""
    groups: int = 1
    """Independent GEMMs of one shape in one grouped launch (a routed GEMM's experts)."""
    launches: int = 1
    """Kernels the framework launches from the host for this part (the host-overhead term)."""


@dataclass
class UnitWork:
    """A unit's parts per pass, at one :class:`Shape`."""

    forward: list[Part] = field(default_factory=list)
    backward_input: list[Part] = field(default_factory=list)
    backward_weight: list[Part] = field(default_factory=list)
    attention_core: list[Part] = field(default_factory=list)
    """The forward parts selective recomputation runs again (a subset of ``forward``)."""

    def flops(self) -> float:
        return sum(p.flops for p in self.forward + self.backward_input + self.backward_weight)


def mean_keys_per_query(seq_len: int, window: int | None) -> float:
    """Keys a causal query attends to, on average over the sequence.

    Examples
    --------
    >>> mean_keys_per_query(4, None)
    2.5
    >>> mean_keys_per_query(4, 2)   # keys 1, 2, 2, 2
    1.75
    """
    s = seq_len
    if window is None or window >= s:
        return (s + 1) / 2
    w = window
    return (w * (w + 1) / 2 + (s - w) * w) / s


#: GEMMs that stay in the training dtype under a quantized ``--precision``: Megatron-LM's router
#: (fp32/bf16) and its output layer (not a Transformer Engine module), the OPT projections.
UNQUANTIZED_GEMMS = frozenset({"router", "lm_head", "project_in", "project_out"})

#: GEMMs whose input an earlier GEMM of the unit already cast (TE's fused LayerNormLinear casts
#: the norm's output once for query, key and value; LayerNormMLP once for gate and up).
_SHARED_INPUT_GEMMS = frozenset({"k_proj", "v_proj", "up_proj", "shared_up_proj", "kv_a_proj_with_mqa"})


def _gemm_dims(gemm: Gemm, routed: float, inp: int, out: int) -> tuple[dict, dict, dict]:
    """Each pass's GEMM shape (``m x k @ k x n`` per group; docs/analytic.md, "GEMM shapes"):
    forward ``[T, i] @ [i, o]``; input gradient ``[T, o] @ [o, i]``; weight gradient
    ``[i, T] @ [T, o]``. A routed GEMM is one grouped GEMM over its experts, each with
    ``T = routed / experts`` tokens (evenly loaded), as Megatron-core's grouped MLP runs them."""
    groups = gemm.copies if gemm.expert else 1
    tokens = routed / groups
    return (dict(m=tokens, n=out, k=inp, groups=groups), dict(m=tokens, n=inp, k=out, groups=groups),
            dict(m=inp, n=out, k=tokens, groups=groups))


def _quantized_gemm_parts(gemm: Gemm, shape: Shape, routed: float, inp: int, out: int, weights: int,
                          flops: float) -> tuple[list[Part], list[Part], list[Part]]:
    """A GEMM at ``--precision`` (docs/analytic.md, "Precision"): its two operands quantized
    (``q`` bytes each element), its output in the dtype (``e``); the forward first casts its input
    (read ``e``, write row-wise and column-wise copies: ``e + 2q`` per element) unless a GEMM
    before it cast the same input; the input gradient first casts the output gradient likewise.
    The weights' casts happen once per iteration (TE's ``is_first_microbatch``) and are not counted."""
    q, e = shape.quantized_bytes, shape.dtype_bytes
    moved = q * (routed * inp + weights) + e * routed * out
    dims_f, dims_b, dims_w = _gemm_dims(gemm, routed, inp, out)
    forward = [Part(gemm.name, "gemm", flops, moved, True, **dims_f)]
    if gemm.name not in _SHARED_INPUT_GEMMS:
        forward.insert(0, Part(f"{gemm.name}_quantize", "memory", 0.0, (e + 2 * q) * routed * inp))
    backward = [Part(f"{gemm.name}_grad_quantize", "memory", 0.0, (e + 2 * q) * routed * out),
                Part(gemm.name, "gemm", flops, moved, True, **dims_b)]
    return forward, backward, [Part(gemm.name, "gemm", flops, moved, True, **dims_w)]


def _gemm_parts(gemm: Gemm, cfg: ModelConfig, shape: Shape) -> tuple[list[Part], list[Part], list[Part]]:
    t, e, tokens = shape.tensor_parallel, shape.dtype_bytes, shape.tokens
    inp, out = gemm.in_features, gemm.out_features
    if gemm.split == "column" or gemm.split == "vocab":
        out = kv_heads_per_rank(cfg, t) * cfg.head_dim if gemm.kv else -(-out // t)
    elif gemm.split == "row":
        inp //= t
    routed = tokens * gemm.route
    weights = gemm.weight_count(cfg, t)
    flops = 2.0 * routed * inp * out
    if shape.quantized_bytes is not None and gemm.name not in UNQUANTIZED_GEMMS:
        return _quantized_gemm_parts(gemm, shape, routed, inp, out, weights, flops)
    moved = e * (routed * inp + weights + routed * out)
    dims_f, dims_b, dims_w = _gemm_dims(gemm, routed, inp, out)
    return ([Part(gemm.name, "gemm", flops, moved, **dims_f)], [Part(gemm.name, "gemm", flops, moved, **dims_b)],
            [Part(gemm.name, "gemm", flops, moved, **dims_w)])


def _memory(name: str, elements: float, passes: float, shape: Shape, extra_bytes: float = 0.0) -> Part:
    return Part(name, "memory", 0.0, shape.dtype_bytes * elements * passes + extra_bytes)


def _add_gemm(work: UnitWork, gemm: Gemm, cfg: ModelConfig, shape: Shape) -> None:
    f, b, w = _gemm_parts(gemm, cfg, shape)
    work.forward += f
    work.backward_input += b
    work.backward_weight += w


def _add_memory(work: UnitWork, name: str, elements: float, shape: Shape, reads_writes: float = 2.0,
                extra_bytes: float = 0.0) -> None:
    # Forward reads and writes the tensor; backward reads the gradient and the saved input and
    # writes the input gradient: about twice the forward's traffic.
    work.forward.append(_memory(name, elements, reads_writes, shape, extra_bytes))
    work.backward_input.append(_memory(name, elements, 2 * reads_writes, shape, extra_bytes))


def _attention_projections(work: UnitWork, cfg: ModelConfig, gemms: dict, shape: Shape) -> None:
    t, tokens = shape.tensor_parallel, shape.tokens
    if not cfg.latent_attention:
        for name in ("q_proj", "k_proj", "v_proj"):
            _add_gemm(work, gemms[name], cfg, shape)
        q_rank = cfg.num_heads // t * cfg.head_dim
        kv_rank = kv_heads_per_rank(cfg, t) * cfg.head_dim
        if cfg.qk_norm:
            _add_memory(work, "qk_norm", tokens * (q_rank + kv_rank), shape)
        if not cfg.learned_positions:
            _add_memory(work, "rotary", tokens * (q_rank + kv_rank), shape)
        return
    # Multi-head latent attention: each low-rank output is normed (RMSNorm) before its up
    # projection; rotary applies to each head's rope part of the query and the one shared key part.
    if cfg.q_lora_rank:
        _add_gemm(work, gemms["q_a_proj"], cfg, shape)
        _add_memory(work, "q_a_layernorm", tokens * cfg.q_lora_rank, shape)
        _add_gemm(work, gemms["q_b_proj"], cfg, shape)
    else:
        _add_gemm(work, gemms["q_proj"], cfg, shape)
    _add_gemm(work, gemms["kv_a_proj_with_mqa"], cfg, shape)
    _add_memory(work, "kv_a_layernorm", tokens * cfg.kv_lora_rank, shape)
    _add_gemm(work, gemms["kv_b_proj"], cfg, shape)
    _add_memory(work, "rotary", tokens * (cfg.num_heads // t + 1) * cfg.qk_rope_head_dim, shape)


def _attention_core(work: UnitWork, cfg: ModelConfig, index: int, shape: Shape) -> None:
    t, tokens, e = shape.tensor_parallel, shape.tokens, shape.dtype_bytes
    window = cfg.sliding_window if index in cfg.sliding_layers else None
    keys = mean_keys_per_query(shape.seq_len, window)
    heads = cfg.num_heads // t
    if cfg.latent_attention:
        # Scores over the query/key width, values over the value width; reads Q, K, V, writes O.
        qk, v = heads * cfg.head_dim, heads * cfg.value_head_dim
        core_flops = 2.0 * tokens * (qk + v) * keys
        core_bytes = e * tokens * (2 * qk + 2 * v)
    else:
        q_rank = heads * cfg.head_dim
        kv_rank = kv_heads_per_rank(cfg, t) * cfg.head_dim
        core_flops = 4.0 * tokens * q_rank * keys
        core_bytes = e * tokens * (2 * q_rank + 2 * kv_rank)
    core = [Part("attention_core", "attention", core_flops, core_bytes)]
    if not shape.flash_attention:
        scores = heads * shape.microbatch_size * shape.seq_len ** 2
        # Write the scores, read and write the softmax, read the probabilities into P @ V;
        # dropout reads and writes them again and writes a one-byte mask.
        passes = 4 + (2 if cfg.attention_dropout else 0)
        core.append(Part("softmax", "memory", 0.0, e * scores * passes + (scores if cfg.attention_dropout else 0)))
    work.forward += core
    work.attention_core = list(core)
    backward_factor = 2.5 if shape.flash_attention else 2.0
    work.backward_input += [Part(p.name, p.kind, p.flops * backward_factor, p.bytes * 2) for p in core]


#: Kernels Megatron-core 0.16.1's MoE layer launches per layer besides its GEMMs, unfused (its
#: defaults), counted with ``benchmarks/count_moe_launches.py``: the router (softmax, top-k, the
#: aux load-balancing loss) 26 forward with its gating GEMM and 19 backward with its two; the
#: dispatcher's permute, chunk sort and unpermute 19 forward and 12 backward. The routing and
#: permute parts carry them (less the router's GEMMs and the unpermute's own one) as their launches.
ROUTER_LAUNCHES = (26 - 1, 19 - 2)
DISPATCH_LAUNCHES = (19 - 1, 12 - 1)


def _add_routing(work: UnitWork, cfg: ModelConfig, shape: Shape) -> None:
    """The router's softmax and top-k over its logits, then the tokens' permutation.

    Megatron-core's router (``moe/router.py``) keeps the logits in fp32 (``moe_router_dtype``):
    the softmax reads and writes them and the top-k reads the probabilities, three passes of
    ``tokens x num_experts`` fp32 values forward, twice that backward (the softmax's gradient
    reads the probabilities and the incoming gradient and writes its own)."""
    logits = shape.tokens * cfg.num_experts
    work.forward.append(Part("router_softmax_topk", "memory", 0.0, 4.0 * logits * 3, launches=ROUTER_LAUNCHES[0]))
    work.backward_input.append(Part("router_softmax_topk", "memory", 0.0, 4.0 * logits * 6,
                                    launches=ROUTER_LAUNCHES[1]))
    _add_token_moves(work, "token_permute", cfg, shape, DISPATCH_LAUNCHES)


def _add_token_moves(work: UnitWork, name: str, cfg: ModelConfig, shape: Shape,
                     launches: tuple[int, int] = (1, 1)) -> None:
    """A permutation of the routed tokens: copies, no FLOPs.

    The dispatcher's permute (``moe/moe_utils.py: permute``) gathers each token's hidden state
    into its k expert slots: it reads ``tokens x h`` and writes ``k x tokens x h``; the unpermute
    reads the k slots (and the routing weights) and writes their weighted sum, ``tokens x h``.
    Each one's backward is the other's gather, the same bytes. Fused (``--moe-permute-fusion``)
    or not, the bytes are these; the local sort by expert after an all-to-all moves them again
    and is left out (its ranks' share is the same per rank at any E)."""
    replicated = shape.tokens * cfg.hidden_size / shape.sp_share
    moved = shape.dtype_bytes * replicated * (1 + cfg.experts_per_token)
    work.forward.append(Part(name, "memory", 0.0, moved, launches=launches[0]))
    work.backward_input.append(Part(name, "memory", 0.0, moved, launches=launches[1]))


def _mlp(work: UnitWork, cfg: ModelConfig, index: int, gemms: dict, shape: Shape) -> None:
    t, tokens = shape.tensor_parallel, shape.tokens
    moe = cfg.is_moe_layer(index)
    if moe:
        _add_gemm(work, gemms["router"], cfg, shape)
        _add_routing(work, cfg, shape)
    up = ("gate_proj", "up_proj") if cfg.gated_mlp else ("fc1",)
    for name in up:
        _add_gemm(work, gemms[name], cfg, shape)
    routed = tokens * (cfg.experts_per_token if moe else 1)
    inner = (cfg.expert_width if moe else cfg.intermediate_size) // t
    _add_memory(work, "activation", routed * inner, shape, 3.0 if cfg.gated_mlp else 2.0)
    _add_gemm(work, gemms["down_proj" if cfg.gated_mlp else "fc2"], cfg, shape)
    if moe:
        _add_token_moves(work, "token_unpermute", cfg, shape)
    if moe and cfg.shared_expert_intermediate_size:
        # The shared experts: a dense SwiGLU MLP every token passes through (DeepSeekMoE).
        for name in ("shared_gate_proj", "shared_up_proj"):
            _add_gemm(work, gemms[name], cfg, shape)
        _add_memory(work, "shared_activation", tokens * cfg.shared_expert_intermediate_size // t, shape, 3.0)
        _add_gemm(work, gemms["shared_down_proj"], cfg, shape)


def _block(cfg: ModelConfig, index: int, shape: Shape) -> UnitWork:
    work = UnitWork()
    replicated = shape.tokens * cfg.hidden_size / shape.sp_share
    gemms = {g.name: g for g in block_gemms(cfg, index)}
    dropout_bytes = replicated if cfg.hidden_dropout else 0.0

    _add_memory(work, "input_norm", replicated, shape)
    _attention_projections(work, cfg, gemms, shape)
    _attention_core(work, cfg, index, shape)
    _add_gemm(work, gemms["o_proj"], cfg, shape)
    if cfg.sandwich_norms:
        _add_memory(work, "post_attention_norm", replicated, shape)
    if not cfg.parallel_residual:
        _add_memory(work, "attention_residual", replicated, shape, 1.5, dropout_bytes)
    _add_memory(work, "mlp_norm", replicated, shape)
    _mlp(work, cfg, index, gemms, shape)
    if cfg.sandwich_norms:
        _add_memory(work, "post_feedforward_norm", replicated, shape)
    _add_memory(work, "mlp_residual", replicated, shape, 2.0 if cfg.parallel_residual else 1.5, dropout_bytes)
    return work


def _mtp(cfg: ModelConfig, index: int, shape: Shape) -> UnitWork:
    """A multi-token prediction depth (DeepSeek-V3 report section 2.2): embed the next tokens
    (the shared table), norm both inputs, project ``[h; emb]`` (2h) to h, one routed block, its
    output norm, and the shared head with its own cross-entropy loss."""
    tokens, h = shape.tokens, cfg.hidden_size
    replicated = tokens * h / shape.sp_share
    work = UnitWork()
    work.forward.append(_memory("embedding_lookup", tokens * h, 2.0, shape, 8.0 * tokens))
    _add_memory(work, "mtp_input_norms", 2 * replicated, shape)
    _add_gemm(work, mtp_projection_gemm(cfg), cfg, shape)
    block = _block(cfg, index, shape)
    work.forward += block.forward
    work.backward_input += block.backward_input
    work.backward_weight += block.backward_weight
    work.attention_core = list(block.attention_core)
    _add_memory(work, "mtp_output_norm", replicated, shape)
    head = _head(cfg, shape)
    work.forward += head.forward
    work.backward_input += head.backward_input
    work.backward_weight += head.backward_weight
    return work


def _embedding(cfg: ModelConfig, shape: Shape) -> UnitWork:
    work = UnitWork()
    tokens, h = shape.tokens, cfg.hidden_size
    width = cfg.embed_proj_dim or h
    # Gather the rows (read + write), add the position rows (learned tables), dropout.
    passes = 2.0 + (2.0 if cfg.learned_positions else 0.0)
    work.forward.append(_memory("embedding_lookup", tokens * width, passes, shape, 8.0 * tokens))
    # The weight gradient is dense (torch's embedding backward): the whole table's shard is
    # written (zero-filled, then the output gradient scatter-added into it), every micro-batch.
    tables = -(-cfg.vocab_size // shape.tensor_parallel) * width + cfg.learned_positions * h
    work.backward_weight.append(_memory("embedding_grad", tables + tokens * width * (2.0 if cfg.learned_positions else 1.0),
                                        1.0, shape, 8.0 * tokens))
    if cfg.embed_proj_dim:
        _add_gemm(work, Gemm("project_in", cfg.embed_proj_dim, h, False, "none"), cfg, shape)
    if cfg.hidden_dropout:
        _add_memory(work, "embedding_dropout", tokens * h / shape.sp_share, shape, 2.0, tokens * h / shape.sp_share)
    return work


def _norm(cfg: ModelConfig, shape: Shape) -> UnitWork:
    work = UnitWork()
    if cfg.final_norm:
        _add_memory(work, "final_norm", shape.tokens * cfg.hidden_size / shape.sp_share, shape)
    if cfg.embed_proj_dim:
        _add_gemm(work, Gemm("project_out", cfg.hidden_size, cfg.embed_proj_dim, False, "none"), cfg, shape)
    return work


def _head(cfg: ModelConfig, shape: Shape) -> UnitWork:
    work = UnitWork()
    _add_gemm(work, head_gemm(cfg), cfg, shape)
    logits = shape.tokens * -(-cfg.vocab_size // shape.tensor_parallel)
    # Cross-entropy in fp32 (as Megatron's vocab-parallel loss): read the logits, write and read
    # the fp32 probabilities; backward reads them and writes the logits' gradient.
    e = shape.dtype_bytes
    softcap = 2 * e * logits if cfg.logit_softcap else 0.0
    work.forward.append(Part("cross_entropy", "memory", 0.0, logits * (e + 8) + softcap))
    work.backward_input.append(Part("cross_entropy", "memory", 0.0, logits * (e + 4) + softcap))
    return work


def unit_work(cfg: ModelConfig, kind: str, index: int, shape: Shape) -> UnitWork:
    """The parts of one unit (``embedding``, ``block`` number ``index``, ``norm``, ``head``,
    ``mtp`` depth number ``index - num_layers``)."""
    if kind == "block":
        return _block(cfg, index, shape)
    if kind == "mtp":
        return _mtp(cfg, index, shape)
    return {"embedding": _embedding, "norm": _norm, "head": _head}[kind](cfg, shape)


def model_flops_per_token(cfg: ModelConfig, seq_len: int, flash_attention: bool = False) -> float:
    """Training FLOPs per token of the whole model (forward + B + W, degree 1).

    Without flash attention this is the standard accounting: 6 N (N: the parameters that enter a
    GEMM, counting each token's top-k experts) plus the causal attention's
    ``12 x layers x heads x head_dim x mean keys``.
    """
    shape = Shape(seq_len, 1, flash_attention=flash_attention)
    total = unit_work(cfg, "embedding", 0, shape).flops() + unit_work(cfg, "norm", 0, shape).flops()
    total += unit_work(cfg, "head", 0, shape).flops()
    cache: dict = {}
    for i in range(cfg.num_layers):
        key = (i in cfg.sliding_layers, cfg.is_moe_layer(i))
        if key not in cache:
            cache[key] = unit_work(cfg, "block", i, shape).flops()
        total += cache[key]
    return total / seq_len
