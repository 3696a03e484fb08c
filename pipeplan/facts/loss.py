"""The loss's working memory: what a cross-entropy over the vocabulary allocates and frees within
one pass, above the fp32 softmax (or log-softmax) it keeps for the backward.

The head's ``activation_bytes`` count what the loss keeps per micro-batch in flight, ``4 x tokens x
V / t`` bytes (one fp32 tensor of the rank's vocabulary share). Each implementation also holds,
for a moment, other vocabulary-sized tensors: this module gives their largest sum over the forward
and the backward of the loss alone (``working_bytes`` of the head's profile entry), per
implementation, from each one's code. ``e`` is the bytes per element of the logits the head's
GEMM writes (2 in bf16 training), ``n = tokens x V / t`` the elements of the rank's logits.

``vocab-parallel`` (Megatron-core's ``vocab_parallel_cross_entropy``,
``megatron/core/tensor_parallel/cross_entropy.py``, 0.16.1; what ``compute_language_model_loss``
calls without ``--cross-entropy-loss-fusion``): ``vocab_parallel_logits.float()`` makes the one fp32
copy, which every later step changes in place (``-= logits_max``, ``torch.exp(.., out=)``,
``div_``) into the softmax it saves; the backward writes the gradient into that softmax in place
(``grad_input = softmax``, ``mul_``), which autograd then casts to the logits' dtype. So
forward: the ``e``-byte logits beside their fp32 copy (``e x n`` above the kept ``4 n``);
backward: the cast gradient beside the fp32 one (``e x n``)::

    working_bytes = e x n        (0 in fp32 training: no copy, no cast)

``torch-eager`` (torchtitan's ``cross_entropy_loss``, ``torchtitan/components/loss.py``, 0.2.2:
``F.cross_entropy(pred.flatten(0, 1).float(), labels, reduction="sum")``, that is
``log_softmax`` then ``nll_loss``): the forward holds the ``e``-byte logits, their fp32 copy and
the fp32 ``log_softmax`` output (kept) at once (``e + 4`` above the kept); the backward allocates
``nll_loss``'s fp32 gradient and ``log_softmax``'s fp32 gradient beside the kept output (``8``
above it), then the cast (``4 + e``, after the first is freed)::

    working_bytes = max(e + 4, 8) x n = 8 n   (e <= 4; in fp32 no copy: max(4, 8) n)

Both measured on the CPU with torch's profiler (``profile_memory=True``: the allocator's running
total in the trace's ``[memory]`` events), the loss alone over its forward and backward,
``tests/test_loss_memory.py``; docs/cost-model.md, "The loss's working memory".

Which applies is the launcher's (:data:`pipeplan.launchers.registry.LAUNCHERS`' ``loss``); without a
launcher, :data:`DEFAULT_LOSS` (Megatron's form, the one the head's kept softmax is counted for).

Examples
--------
>>> loss_working_bytes("vocab-parallel", elements=1000, logits_dtype_bytes=2)
2000
>>> loss_working_bytes("torch-eager", elements=1000, logits_dtype_bytes=2)
8000
"""

from __future__ import annotations

__all__ = ["LOSS_FORMS", "DEFAULT_LOSS", "loss_working_bytes", "loss_working_bytes_by_form"]

#: The loss implementations whose working memory is costed (module docstring).
LOSS_FORMS = ("vocab-parallel", "torch-eager")

#: The loss costed without a launcher: Megatron's vocabulary-parallel cross-entropy, whose fp32
#: softmax the head's kept bytes already count (pipeplan.analytic.memory).
DEFAULT_LOSS = "vocab-parallel"

#: fp32, the dtype both losses compute in.
_FP32_BYTES = 4


def loss_working_bytes(form: str, elements: int, logits_dtype_bytes: int) -> int:
    """Bytes a loss form allocates and frees within one pass above its kept fp32 softmax, for
    ``elements`` logits (tokens x the rank's vocabulary share) of ``logits_dtype_bytes`` each.

    Raises
    ------
    ValueError
        For a form not in :data:`LOSS_FORMS`.
    """
    e = int(logits_dtype_bytes)
    copy = _FP32_BYTES if e < _FP32_BYTES else 0  # .float() copies only a narrower dtype
    if form == "vocab-parallel":
        # Forward: the logits beside their fp32 copy; backward: the cast gradient beside the fp32 one.
        return int(elements) * (e if copy else 0)
    if form == "torch-eager":
        # Forward: logits + fp32 copy beside the kept log_softmax output; backward: nll_loss's and
        # log_softmax's fp32 gradients beside it (then the cast, 4 + e, after the first is freed).
        return int(elements) * max(e + copy, 2 * _FP32_BYTES)
    raise ValueError(f"loss form {form!r} is not one of {', '.join(LOSS_FORMS)}")


def loss_working_bytes_by_form(elements: int, logits_dtype_bytes: int) -> dict[str, int]:
    """:func:`loss_working_bytes` of every form (a head's profile entry carries them all)."""
    return {form: loss_working_bytes(form, elements, logits_dtype_bytes) for form in LOSS_FORMS}
