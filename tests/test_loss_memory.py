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


# ------------------------------------------------------------------ the planner's working term

SEQ, BATCH, GPT2_VOCAB = 128, 2, 50257


@pytest.fixture(scope="module")
def gpt2_profile(tmp_path_factory):
    from pipeplan.analytic import analytic_profile, get_gpu
    from pipeplan.formats.io import write_json_atomic

    profile = analytic_profile("gpt2", get_gpu("h100-sxm"), seq_len=SEQ, microbatch_sizes=(BATCH,),
                               tensor_parallel=(1, 2))
    path = tmp_path_factory.mktemp("loss") / "gpt2.profile.json"
    write_json_atomic(path, profile)
    return profile, path


def test_the_analytic_head_carries_each_loss_forms_working_bytes(gpt2_profile):
    profile, _ = gpt2_profile
    tokens = SEQ * BATCH
    for layer in profile.layers:
        for cost in layer.costs:
            if layer.kind != "head":
                assert cost.working_bytes is None and cost.loss_working_bytes is None, layer.name
                continue
            # s b V / t logits: 2 bytes each for Megatron's (the bf16 logits or their cast
            # gradient beside the fp32 copy), 8 for torch's (two fp32 gradients); V / t rounded up.
            n = tokens * -(-GPT2_VOCAB // cost.degree)
            assert cost.loss_working_bytes == {"vocab-parallel": 2 * n, "torch-eager": 8 * n}
            assert cost.working_bytes == 2 * n  # without a launcher: Megatron's (facts.loss.DEFAULT_LOSS)


def _plan(profile, launcher):
    from pipeplan.api import plan_any
    from pipeplan.requests import PipelineRequest

    request = PipelineRequest(stages=2, global_batch=4 * BATCH, microbatch_size=BATCH, schedule="1f1b",
                          launcher=launcher)
    return plan_any(profile, request, profile_sha256="0" * 64)


def test_the_launchers_loss_is_in_the_head_stages_peak_once(gpt2_profile):
    profile, _ = gpt2_profile
    n = SEQ * BATCH * GPT2_VOCAB
    plain, titan = _plan(profile, None), _plan(profile, "torchtitan")
    assert [s.layers for s in plain.stages] == [s.layers for s in titan.stages]
    heads = {layer.name for layer in profile.layers if layer.kind == "head"}
    head = next(j for j, s in enumerate(plain.stages) if heads & set(s.layers))
    for j, (a, b) in enumerate(zip(plain.stages, titan.stages)):
        if j != head:
            assert a.peak_memory_bytes == b.peak_memory_bytes and a.working_bytes is None is b.working_bytes
            continue
        assert (a.working_bytes, b.working_bytes) == (2 * n, 8 * n)
        # Once, whatever the micro-batches in flight (a transient of one pass, not kept).
        assert b.peak_memory_bytes - a.peak_memory_bytes == 6 * n
        assert b.in_flight >= 1


def test_a_stage_adds_its_largest_layers_working_bytes_not_their_sum():
    import numpy as np

    from pipeplan.plan import CostModel, layer_sums
    from pipeplan.plan.graph import LayerGraph
    import networkx as nx

    ones = np.ones(3)
    graph = LayerGraph(names=("a", "b", "c"), forward_ms=ones, backward_ms=2 * ones, backward_input_ms=ones,
                       backward_weight_ms=ones, backward_split_measured=True, param_bytes=0 * ones,
                       activation_bytes=np.array([10.0, 20.0, 30.0]), output_bytes=ones,
                       graph=nx.path_graph(3, nx.DiGraph), chain=True, working_bytes=np.array([100.0, 0.0, 300.0]))
    memory = CostModel().breakdown(layer_sums(graph, (0, 1, 2)), index=0, layers=(0, 1, 2), in_bytes=0, out_bytes=0,
                                   in_flight=3, mode="none", last=True).memory
    assert memory.working_bytes == 300.0
    assert memory.peak_bytes == 3 * 60.0 + 300.0


def test_show_names_the_loss_working_memory(gpt2_profile, tmp_path):
    from cli_checks import invoke

    _, path = gpt2_profile
    out = tmp_path / "plan.json"
    result = invoke("plan", path, "--stages", 2, "--global-batch", 4 * BATCH, "--microbatch-size", BATCH,
                    "--schedule", "1f1b", "--launcher", "torchtitan", "-q", "-o", out)
    assert result.exit_code == 0, result.output
    shown = invoke("show", out)
    assert shown.exit_code == 0, shown.output
    assert "of it working" in shown.output
    from pipeplan.quantities import format_bytes
    assert format_bytes(8 * SEQ * BATCH * GPT2_VOCAB) in shown.output
