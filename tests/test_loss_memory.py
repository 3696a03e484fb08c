"""The loss's working memory (pipeplan.facts.loss) against torch's own allocations, and the head's
working bytes as the planner costs them: hand computation, once in the stage's peak, named by show.

The measurement: the loss alone (its logits made by a small head's GEMM), its
forward and backward under ``torch.profiler.profile(profile_memory=True)`` on the CPU; the trace's
``[memory]`` events carry the CPU allocator's running total ("Total Allocated"), whose largest value
above the one before the head's GEMM is the loss's peak: its kept fp32 softmax plus its working bytes.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")

from pipeplan.facts.loss import LOSS_FORMS, loss_working_bytes  # noqa: E402
from test_export_fixtures import torchtitan_config_manager  # noqa: E402

TOKENS, VOCAB = 256, 2048  # small: 0.5 M logits, a second on two cores


def _peak_above_start_bytes(run, trace_path) -> int:
    """The largest live CPU bytes during ``run()`` above those at its start (the profiler's trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    prof.export_chrome_trace(str(trace_path))
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    events.sort(key=lambda e: float(e["ts"]))
    totals = [e["args"]["Total Allocated"] for e in events]
    start = totals[0] - events[0]["args"]["Bytes"]
    return max(totals) - start


#: The head's hidden size here: its input and input gradient (tokens x HIDDEN) stay small beside the
#: logits (tokens x VOCAB), as at a real head; its weight is frozen (its gradient is training state).
HIDDEN = 8


def _head(dtype, batch_first: bool):
    """The head's input (a leaf), its frozen weight and the labels, made before the measurement."""
    shape = (1, TOKENS, HIDDEN) if batch_first else (TOKENS, 1, HIDDEN)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, dtype=dtype)
    labels = torch.randint(0, VOCAB, shape[:2])
    return x, weight, labels


def _torch_eager(dtype):
    # torchtitan/components/loss.py: cross_entropy_loss, as torchtitan 0.2.2 writes it (the package
    # loaded without torchtitan/__init__, which pulls triton kernels: test_export_fixtures').
    torchtitan_config_manager()
    from torchtitan.components.loss import cross_entropy_loss

    x, weight, labels = _head(dtype, batch_first=True)

    def run():
        pred = x @ weight.t()  # the head's logits, freed after the loss as torchtitan's train step does
        loss = cross_entropy_loss(pred, labels)
        del pred
        loss.backward()
    return run


def _vocab_parallel(dtype):
    # megatron/core/tensor_parallel/cross_entropy.py, what compute_language_model_loss calls.
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    x, weight, labels = _head(dtype, batch_first=False)

    def run():
        pred = x @ weight.t()
        loss = vocab_parallel_cross_entropy(pred, labels).sum()
        del pred
        loss.backward()
    return run


@pytest.fixture
def tensor_parallel_group(tmp_path):
    """One rank's tensor-parallel group (gloo), as Megatron-core's loss all-reduces over it."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _measured_working_bytes(run, tmp_path) -> int:
    # The loss keeps 4 n (its fp32 softmax) for the backward: the rest of the peak is working.
    return _peak_above_start_bytes(run, tmp_path / "trace.json") - 4 * TOKENS * VOCAB


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_torch_eager_loss_working_bytes_are_torchs_allocations(tmp_path, dtype):
    dtype = getattr(torch, dtype)
    measured = _measured_working_bytes(_torch_eager(dtype), tmp_path)
    e = torch.tensor([], dtype=dtype).element_size()
    # Besides the vocabulary-sized tensors, only per-token ones (labels, the loss, the input's
    # gradient): O(tokens).
    assert abs(measured - loss_working_bytes("torch-eager", TOKENS * VOCAB, e)) <= 64 * TOKENS


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_vocab_parallel_loss_working_bytes_are_torchs_allocations(tmp_path, dtype, tensor_parallel_group):
    dtype = getattr(torch, dtype)
    measured = _measured_working_bytes(_vocab_parallel(dtype), tmp_path)
    e = torch.tensor([], dtype=dtype).element_size()
    assert abs(measured - loss_working_bytes("vocab-parallel", TOKENS * VOCAB, e)) <= 64 * TOKENS


def test_loss_working_bytes_by_hand():
    n = 3 * 1000
    # bf16 logits: Megatron's one fp32 copy, in place, beside the bf16 logits (or their cast gradient).
    assert loss_working_bytes("vocab-parallel", n, 2) == 2 * n
    # torch's log_softmax + nll_loss: two fp32 gradients beside the kept fp32 log_softmax output.
    assert loss_working_bytes("torch-eager", n, 2) == 8 * n
    # fp32 logits: .float() copies nothing; Megatron works in place, torch still needs two gradients.
    assert loss_working_bytes("vocab-parallel", n, 4) == 0
    assert loss_working_bytes("torch-eager", n, 4) == 8 * n
    assert set(LOSS_FORMS) == {"vocab-parallel", "torch-eager"}
    with pytest.raises(ValueError):
        loss_working_bytes("fused", n, 2)
