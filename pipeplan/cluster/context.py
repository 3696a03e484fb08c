"""Context parallelism: each sequence split over ``C`` GPUs, its KV exchanged on a ring.

Megatron-core's context parallelism (``--context-parallel-size C``, ``parallel_state``: ranks
ordered tensor, context, expert, data, pipeline; gradients reduced over the data x context
group) gives each rank ``s / C`` tokens of every sequence: the sequence is cut into ``2 C``
chunks and rank ``i`` holds chunks ``i`` and ``2 C - 1 - i``
(``megatron.core.utils.get_batch_on_this_cp_rank``), so under a causal mask every rank does the
same share of the attention. One GPU of a context-parallel group therefore sees (docs/cluster-model.md,
"Context parallelism"):

- every token-wise part of the profile at sequence ``s`` (GEMMs, norms, activations, boundary
  bytes, the tensor-parallel collectives' payloads) at ``1 / C``, and the attention core at
  ``1 / C`` of the whole sequence's (the balanced causal share), :func:`context_profile`;
- the KV exchange of Megatron-core's default ``cp_comm_type = "p2p"`` (Transformer Engine's ring
  attention): ``C - 1`` steps, each sending the rank's KV chunk to the ring's next rank while the
  attention of the chunk received before runs; the backward passes the KV and its gradient dKV
  the same way. Exposed is what a step's send takes beyond the attention block it overlaps::

      chunk_bytes  = b x s / C x 2 x kv_heads_per_rank x head_dim x dtype_bytes    (K and V)
      forward_ms  += (C - 1) x max(0, send(chunk_bytes)     - attention_forward_ms / C)
      backward_ms += (C - 1) x max(0, send(2 x chunk_bytes) - 2.5 x attention_forward_ms / C)

  with ``attention_forward_ms`` the rank's attention core (the profile's ``selective_recompute_ms``
  at ``1 / C``), its backward 2.5 times it (FlashAttention-2's, as the analytic profile counts),
  and ``send`` one point-to-point hop on the link the group spans (:func:`context_link`);
- the received chunks: two buffers of one chunk's K and V in the forward, and of its K, V and
  dK, dV in the backward, while one layer's attention runs: ``4 x chunk_bytes`` of the largest
  unit, once per GPU (:func:`context_buffer_bytes`).

Parameters are not divided by ``C``; the training state is sharded (ZeRO, the distributed
optimizer) and the gradients reduced over the ``d x C`` ranks that hold the same weights.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pipeplan.cluster.collectives import send_ms
from pipeplan.cluster.placement import GroupSpan
from pipeplan.cluster.profile_view import degree_view, stage_pass_ms
from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.formats.profile import LayerCost

__all__ = ["context_profile", "context_link", "add_context_exchange", "context_buffer_bytes",
           "check_context_request", "stage_context_ms", "chunk_bytes", "ATTENTION_BACKWARD_FACTOR",
           "context_notes", "context_choices", "MIN_TOKENS_PER_RANK", "best_over_context", "ranks_with_buffers",
           "context_view", "largest_buffer_bytes"]

#: The attention core's backward over its forward (FlashAttention-2: QK^T again, then 2 x the
#: forward's GEMMs; the analytic profile's own factor, pipeplan/analytic/flops.py).
ATTENTION_BACKWARD_FACTOR = 2.5

#: LayerCost fields that scale with the rank's tokens (everything but the parameters and counts).
_TOKEN_FIELDS = ("forward_ms", "backward_ms", "activation_bytes", "output_bytes", "backward_input_ms",
                 "backward_weight_ms", "tensor_parallel_forward_bytes", "tensor_parallel_backward_bytes",
                 "selective_activation_bytes", "selective_recompute_ms", "working_bytes")


#: The fewest tokens of each sequence a rank keeps where the search tries C (``--context-parallel``
#: unset): Meta's Llama 3 405B long-context stage ran 131,072 tokens at C = 16, 8,192 per rank, the
#: sequence its short-context stage trained at without context parallelism. Below it the search
#: keeps C = 1 (so plans of sequences under 16,384 are as before); ``--context-parallel`` fixes any C.
MIN_TOKENS_PER_RANK = 8192


def context_choices(profile, settings) -> list[int]:
    """The degrees the search tries: the request's C, else 1 and every C dividing the GPUs with
    ``2 C`` dividing the sequence and at least :data:`MIN_TOKENS_PER_RANK` tokens per rank, for a
    dense analytic profile (one with the attention core's time and shape)."""
    if getattr(settings, "context_parallel", None) is not None:
        return [settings.context_parallel]
    s, n = getattr(profile, "sequence_length", None), settings.num_gpus or 1
    shape = (profile.measurement or {}).get("config_shape") or {}
    if (not s or getattr(profile, "experts", None) is not None or not shape.get("head_dim")
            or any(getattr(c, "selective_recompute_ms", None) is None for layer in profile.layers for c in layer.costs)):
        return [1]
    return [1] + [c for c in range(2, n + 1) if n % c == 0 and s % (2 * c) == 0 and s // c >= MIN_TOKENS_PER_RANK]


def check_context_request(profile, settings) -> int:
    """The request's context-parallel degree ``C`` (1 when not given), after Megatron's rules.

    Raises
    ------
    BadInputError
        If ``2 C`` does not divide the profile's sequence (Megatron's load-balanced split needs
        ``2 C`` equal chunks), the profile gives no sequence, no attention core
        (``selective_recompute_ms``: an analytic profile), no KV shape, or has experts.
    """
    c = getattr(settings, "context_parallel", None) or 1
    if c == 1:
        return 1
    s = getattr(profile, "sequence_length", None)
    if not s:
        raise BadInputError("--context-parallel: the profile gives no sequence_length to split")
    if s % (2 * c):
        raise BadInputError(f"--context-parallel: 2 x {c} does not divide the profile's sequence {s} (Megatron "
                            f"splits each sequence into 2 C chunks for the causal load balance)")
    if getattr(profile, "experts", None) is not None:
        raise BadInputError("--context-parallel: context parallelism with experts is not modelled; give 1")
    shape = (profile.measurement or {}).get("config_shape") or {}
    if not shape.get("head_dim") or not (shape.get("num_kv_heads") or shape.get("num_heads")):
        raise BadInputError("--context-parallel: the profile records no attention shape (config_shape's "
                            "head_dim, num_kv_heads): use an analytic profile (pipeplan profile --analytic)")
    if any(getattr(cost, "selective_recompute_ms", None) is None for layer in profile.layers for cost in layer.costs):
        raise BadInputError("--context-parallel: the profile gives no attention core time (selective_recompute_ms): "
                            "use an analytic profile (pipeplan profile --analytic)")
    return c


def context_profile(profile, context: int):
    """The profile one GPU of a context-parallel group of ``context`` sees: every token-wise
    field at ``1 / C`` (bytes rounded up), parameters as they are (module docstring)."""
    if context == 1:
        return profile
    layers = []
    for layer in profile.layers:
        costs = []
        for cost in layer.costs:
            update = {}
            for name in _TOKEN_FIELDS:
                value = getattr(cost, name, None)
                if value is None:
                    continue
                update[name] = int(math.ceil(value / context)) if name.endswith("_bytes") else value / context
            if getattr(cost, "loss_working_bytes", None):
                # The loss's working memory per form, token-wise as working_bytes (pipeplan.facts.loss).
                update["loss_working_bytes"] = {form: int(math.ceil(value / context))
                                                for form, value in cost.loss_working_bytes.items()}
            costs.append(cost.model_copy(update=update))
        layers.append(layer.model_copy(update={"costs": costs}))
    return profile.model_copy(update={"layers": layers})


def context_link(tensor: int, context: int, gpus_per_node: int) -> GroupSpan:
    """The context-parallel group's shape: ``C`` GPUs ``t`` apart (tensor innermost, then
    context), on one node (NVLink domain, where ``gpus_per_node`` is the domain's GPUs) while
    ``t x C <= gpus_per_node``, else ``gpus_per_node / t`` per node.

    Examples
    --------
    >>> context_link(8, 16, 8)
    GroupSpan(ranks_per_node=1, nodes=16)
    >>> context_link(2, 4, 8).link
    'intra'
    """
    if tensor * context <= gpus_per_node:
        return GroupSpan(ranks_per_node=context, nodes=1)
    per_node = max(1, gpus_per_node // tensor)
    return GroupSpan(ranks_per_node=per_node, nodes=context // per_node)


def chunk_bytes(profile, microbatch_size: int, tensor: int, context: int) -> int:
    """One rank's K and V of one unit's attention: ``b x s / C`` tokens x both x its KV heads."""
    shape = (profile.measurement or {}).get("config_shape") or {}
    head_dim = int(shape["head_dim"])
    if shape.get("latent_attention"):
        # Multi-head latent attention exchanges the up-projected keys and values of every head.
        heads = int(shape["num_heads"]) // tensor
        width = heads * (head_dim + int(shape.get("v_head_dim") or head_dim))
    else:
        kv_heads = int(shape.get("num_kv_heads") or shape["num_heads"])
        width = 2 * max(kv_heads // tensor, 1) * head_dim
    return microbatch_size * (profile.sequence_length // context) * width * profile.dtype_bytes


def _exchange_ms(attention_forward_ms: float, chunk: int, context: int, link) -> tuple[float, float]:
    """The ring's exposed forward and backward time of one unit (module docstring)."""
    steps = context - 1
    forward = steps * max(0.0, send_ms(chunk, link) - attention_forward_ms / context)
    backward = steps * max(0.0, send_ms(2 * chunk, link) - ATTENTION_BACKWARD_FACTOR * attention_forward_ms / context)
    return forward, backward


def add_context_exchange(view, profile, context: int, cluster, gpus_per_domain=None):
    """``view`` (a :class:`pipeplan.cluster.profile_view.DegreeView` of the
    :func:`context_profile`) with each attention unit's exposed exchange added to its forward,
    backward and input-gradient pass (the exchange is on the input-gradient path; selective
    recomputation runs the forward's again in the backward), kept apart in ``context_ms``. The
    group's link is NVLink inside one NVLink domain of ``gpus_per_domain`` GPUs (default: a node)."""
    if context == 1:
        return view
    span = context_link(view.tensor_parallel, context, gpus_per_domain or cluster.gpus_per_node)
    link = cluster.inter_node if span.link == "inter" else cluster.intra_node
    scaled = {layer.name: layer for layer in context_profile(profile, context).layers}
    layers, parts = [], {}
    for layer in view.profile.layers:
        source = {c.microbatch_size: c for c in scaled[layer.name].costs
                  if (getattr(c, "tensor_parallel", None) or 1) == view.tensor_parallel}
        costs = []
        for cost in layer.costs:
            attention_ms = source[cost.microbatch_size].selective_recompute_ms or 0.0
            forward = backward = 0.0
            if attention_ms > 0:
                chunk = chunk_bytes(profile, cost.microbatch_size, view.tensor_parallel, context)
                forward, backward = _exchange_ms(attention_ms, chunk, context, link)
                if view.selective:
                    backward += forward
            parts[(layer.name, cost.microbatch_size)] = (forward, backward)
            update = {"forward_ms": cost.forward_ms + forward, "backward_ms": cost.backward_ms + backward}
            if cost.backward_input_ms is not None:
                update["backward_input_ms"] = cost.backward_input_ms + backward
            costs.append(LayerCost(**{**cost.model_dump(exclude_none=True), **update}))
        layers.append(layer.model_copy(update={"costs": costs}))
    return replace(view, profile=view.profile.model_copy(update={"layers": layers}), context_ms=parts)


def stage_context_ms(view, layer_names, microbatch_size: int, recompute: bool) -> float:
    """The exchange's exposed time of a stage per micro-batch (the forward's twice if it recomputes)."""
    return stage_pass_ms(view.context_ms, layer_names, microbatch_size, bool(recompute))


def context_buffer_bytes(profile, microbatch_size: int, tensor: int, context: int) -> int:
    """The received KV chunks one GPU holds while a unit's attention runs: two buffers of one
    chunk's K and V, and in the backward of its dK and dV too (``4 x chunk_bytes``); 0 at C = 1."""
    if context == 1:
        return 0
    return 4 * chunk_bytes(profile, microbatch_size, tensor, context)


def ranks_with_buffers(ranks, buffer_bytes: int) -> list:
    """A plan's rank summaries with the ring's received KV chunks added to each peak."""
    return [r.model_copy(update={"peak_memory_bytes": r.peak_memory_bytes + buffer_bytes}) for r in ranks]


def context_notes(notes: list, layout_index: int, profile, degrees: tuple, gpus_per_node: int) -> list:
    """A cluster plan's notes with the layout's (at ``layout_index``) naming C, and one on the
    exchange; the notes as they are at C = 1 (``degrees`` is ``(d, t, p, C)``)."""
    d, t, p, c = degrees
    if c == 1:
        return notes
    out = list(notes)
    out[layout_index] = out[layout_index].replace(f"d={d} x t={t} x p={p}", f"d={d} x t={t} x C={c} x p={p}").replace(
        "(tensor, data, pipeline)", "(tensor, context, data, pipeline)")
    span = context_link(t, c, gpus_per_node)
    out.append(f"context parallel C={c}: each rank holds {profile.sequence_length // c} tokens of each sequence "
               f"(2C chunks, causal load balance); KV exchanged on a ring of point-to-point sends overlapped "
               f"with attention (Megatron's cp_comm_type p2p) on "
               f"{'the network' if span.link == 'inter' else 'the intra-node link'}; gradients reduced and "
               f"state sharded over d x C = {d * c}")
    return out


def best_over_context(plan_at, choices):
    """The fastest plan over the context-parallel degrees ``choices`` (C searched): ``plan_at(C,
    full)`` is one exact cluster search at that C (``full`` False: without the runners-up planned
    in full, only its winner wanted); the fastest C (ties to the smaller) is then planned in full,
    the same plan ``--context-parallel C`` makes, and records C as searched
    (``settings.context_parallel`` null, ``parallelism.context`` the choice).

    Raises
    ------
    BadInputError
        What the search at C = 1 raises for bad input.
    InfeasibleError
        The first search's, when no C fits.
    """
    best_c, best_ms, first_error, tried = None, None, None, []
    for c in choices:
        try:
            plan = plan_at(c, False)
        except (InfeasibleError, BadInputError) as error:
            if c == 1 and isinstance(error, BadInputError):
                raise
            first_error = first_error or error
            tried.append(f"C={c}: {str(error).splitlines()[0][:80]}")
            continue
        tried.append(f"C={c}: {plan.predicted.iteration_ms:.1f} ms")
        if best_ms is None or plan.predicted.iteration_ms < best_ms:
            best_c, best_ms = c, plan.predicted.iteration_ms
    if best_c is None:
        raise first_error
    best = plan_at(best_c, True)
    return best.model_copy(update={
        "settings": best.settings.model_copy(update={"context_parallel": None}),
        "notes": [*best.notes, f"context-parallel degree searched (at least {MIN_TOKENS_PER_RANK} tokens per rank): "
                  + "; ".join(tried)]})


def context_view(profile, source, context: int, tensor: int, cluster, selective: bool, experts, num_gpus: int,
                 tp_comm=None, moe_a2a: bool = False):
    """The profile one GPU sees at degree ``tensor`` and ``context`` (``source``: the
    :func:`context_profile` of ``profile``), collectives and the exchange timed on ``cluster``'s
    links, the exchange's on the NVLink domain a job of ``num_gpus`` gets (``tp_comm``, ``moe_a2a``:
    :func:`pipeplan.cluster.profile_view.degree_view`'s)."""
    if context == 1:
        return degree_view(profile, tensor, cluster, selective=selective, experts=experts, tp_comm=tp_comm,
                           moe_a2a=moe_a2a)
    view = degree_view(source, tensor, cluster, selective=selective, experts=experts, tp_comm=tp_comm,
                           moe_a2a=moe_a2a)
    return add_context_exchange(view, profile, context, cluster, cluster.domain_gpus_for(num_gpus))


def largest_buffer_bytes(profile, microbatch_size, tensor: int, context: int) -> int:
    """The KV buffers at the largest micro-batch size a replica may run (the given one, else the
    profile's): what the pipeline planner's cap is lowered by; 0 at C = 1."""
    if context == 1:
        return 0
    sizes = profile.microbatch_sizes if microbatch_size is None else [microbatch_size]
    return max(context_buffer_bytes(profile, b, tensor, context) for b in sizes)
