"""Expert parallelism: each term against a hand computation from its documented formula
(docs/cluster-model.md, expert parallelism), the rules (exit 2), and a cluster plan's MoE parts."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pipeplan.analytic.api import analytic_profile
from pipeplan.cli import app
from pipeplan.cluster.collectives import all_to_all_ms, collective_ms
from pipeplan.cluster.dataparallel import data_parallel_sync, moe_data_parallel_sync
from pipeplan.cluster.experts import expert_data_degree, expert_group, moe_static_bytes
from pipeplan.cluster.iteration import iteration_parts
from pipeplan.cluster.placement import GroupSpan, Layout
from pipeplan.cluster.presets import PRESETS
from pipeplan.cluster.profile_view import ExpertGroup, degree_view
from pipeplan.facts.gpus import get_gpu
from pipeplan.facts.training_state import state_bytes_per_param_byte, state_memory, training_state
from pipeplan.formats.cluster import Link
from pipeplan.formats.io import dump_model, load_plan
from pipeplan.plan.costmodel import CostModel, LayerSums
from pipeplan.errors import BadInputError
from pipeplan.plan.assemble import plan_simulation
from pipeplan.run.launch import check_parallelism
from pipeplan.run.plans import simulate_plan

DGX = PRESETS["dgx-h100"]

#: A small Mixtral: 4 routed blocks of 8 experts, top-2.
TINY_MIXTRAL = {
    "model_type": "mixtral", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
    "num_key_value_heads": 8, "num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 4096, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
TINY_DENSE = {**{k: v for k, v in TINY_MIXTRAL.items() if k not in ("num_local_experts", "num_experts_per_tok")},
              "model_type": "llama"}


@pytest.fixture(scope="module")
def moe_profile(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    config = root / "config.json"
    config.write_text(json.dumps(TINY_MIXTRAL))
    profile = analytic_profile(config, get_gpu("h100-sxm"), seq_len=1024, microbatch_sizes=(1, 2),
                               tensor_parallel=(1, 2))
    path = root / "tiny-mixtral.json"
    path.write_text(dump_model(profile))
    return profile, path


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    config = root / "config.json"
    config.write_text(json.dumps(TINY_DENSE))
    path = root / "tiny-llama.json"
    path.write_text(dump_model(analytic_profile(config, get_gpu("h100-sxm"), seq_len=1024, microbatch_sizes=(1,))))
    return path


# ---------------------------------------------------------------- all-to-all


def test_all_to_all_one_node_by_hand():
    nv = Link(bandwidth_bytes_per_s=400e9, latency_us=3.0, efficiency=0.5, call_latency_us=8.0)
    ib = Link(bandwidth_bytes_per_s=50e9, latency_us=14.0, efficiency=1.0)
    # 8 ranks on one node: (8 - 1) / 8 of 1 GB at 0.5 x 400 GB/s, one call and one hop of the node's link.
    expected = (8.0 + 3.0) / 1e3 + 7 / 8 * 1e9 / 200e9 * 1e3
    assert all_to_all_ms(1e9, 8, 8, nv, ib) == pytest.approx(expected)
    assert all_to_all_ms(1e9, 1, 1, nv, ib) == 0.0 and all_to_all_ms(0, 8, 8, nv, ib) == 0.0


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 16), st.floats(1e3, 1e10))
def test_all_to_all_across_nodes_by_hand(per_node, nodes, size):
    nv, ib = DGX.intra_node, DGX.inter_node
    n = per_node * nodes
    got = all_to_all_ms(size, n, per_node, nv, ib)
    if n == 1:
        assert got == 0.0
        return
    link = ib if nodes > 1 else nv
    intra = (per_node - 1) / n * size / nv.achieved_bytes_per_s * 1e3
    inter = (n - per_node) / n * size / ib.achieved_bytes_per_s * 1e3
    assert got == pytest.approx((link.call_latency_us + link.latency_us) / 1e3 + max(intra, inter))
    # More of the group off the node never makes it faster (the network is the slower link).
    if nodes > 1:
        assert got >= all_to_all_ms(size, per_node, per_node, nv, ib)


# ---------------------------------------------------------------- placement


def test_expert_groups_follow_megatron_order():
    layout = Layout(data=8, tensor=2, pipeline=2, gpus_per_node=8)
    assert layout.expert_group(4) == (0, 1, 2, 3)                       # ETP 1: consecutive
    assert layout.expert_group(4, expert_tensor=2) == (0, 2, 4, 6)      # ETP innermost
    assert layout.expert_data_group(4) == (0, 4, 8, 12)                 # EDP = 16 / 4
    assert expert_data_degree(data=8, tensor=2, expert=4, expert_tensor=1) == 4
    assert expert_data_degree(data=8, tensor=2, expert=4, expert_tensor=2) == 2


# ---------------------------------------------------------------- the view: memory and time


def test_view_divides_the_experts_and_adds_the_all_to_alls(moe_profile):
    profile, _ = moe_profile
    group = ExpertGroup(expert=4, expert_tensor=1, imbalance=1.0, ranks_per_node=4)
    plain, view = degree_view(profile, 1, DGX), degree_view(profile, 1, DGX, experts=group)
    moe_units = [layer for layer in profile.layers if layer.expert_param_bytes]
    assert len(moe_units) == 4
    for layer, seen, base in zip(profile.layers, view.profile.layers, plain.profile.layers):
        cost = layer.cost_at(1)
        got, was = seen.costs[0], base.costs[0]
        if not layer.expert_param_bytes:
            assert seen.param_bytes == layer.param_bytes and got.forward_ms == was.forward_ms
            continue
        # Memory: the dense part whole, 1 / (E x ETP) of the routed experts.
        experts = math.ceil(layer.expert_param_bytes / 4)
        assert seen.expert_param_bytes == experts
        assert seen.param_bytes == layer.param_bytes - layer.expert_param_bytes + experts
        # Time: one dispatch and one combine per pass, each S = tokens x top-k x hidden x 2 bytes.
        assert cost.expert_dispatch_bytes == 1024 * 2 * 512 * 2
        a2a = (DGX.intra_node.call_latency_us + DGX.intra_node.latency_us) / 1e3 \
            + 3 / 4 * cost.expert_dispatch_bytes / DGX.intra_node.achieved_bytes_per_s * 1e3
        # And the host's launches of the second local expert's routed GEMMs (8 experts / E = 4).
        more_f, more_b = (_host_wait_by_hand(cost, 2)[i] - (w or 0.0)
                          for i, w in enumerate((cost.host_wait_forward_ms, cost.host_wait_backward_ms)))
        assert got.forward_ms == pytest.approx(cost.forward_ms + 2 * a2a + more_f)
        assert got.backward_ms == pytest.approx(cost.backward_ms + 2 * a2a + more_b)
        share = cost.backward_input_ms / cost.backward_ms
        assert got.backward_input_ms == pytest.approx(cost.backward_input_ms + 2 * a2a + share * more_b)
        parts = view.expert_ms[(layer.name, 1)]
        assert parts["dispatch"] == parts["combine"] == pytest.approx((a2a, a2a))
        assert parts["experts"] == (cost.expert_forward_ms, cost.expert_backward_ms)
        # E = 1: no all-to-all, but all 8 experts' GEMMs are this rank's launches.
        assert was.forward_ms == pytest.approx(cost.forward_ms + _host_wait_by_hand(cost, 8)[0]
                                               - (cost.host_wait_forward_ms or 0.0))


def _host_wait_by_hand(cost, local_experts):
    """docs/analytic.md, "Host overhead": each local expert beyond the first launches the unit's
    routed GEMMs again from C++ (4.9 us each); the GPU's time is the pass less the profile's wait."""
    waits = []
    for pass_ms, wait, host, per in ((cost.forward_ms, cost.host_wait_forward_ms, cost.host_forward_ms,
                                      cost.expert_host_forward_ms),
                                     (cost.backward_ms, cost.host_wait_backward_ms, cost.host_backward_ms,
                                      cost.expert_host_backward_ms)):
        wait = wait or 0.0
        waits.append(max(wait, host + (local_experts - 1) * per - (pass_ms - wait)))
    return waits


def test_routed_gemm_launches_per_local_expert_by_hand(moe_profile):
    """A Mixtral block's routed GEMMs (gate, up, down: 3 forward, 6 backward) cost the host 4.9 us
    per launch and local expert beyond the first; the view's wait is the plan's named host part."""
    profile, _ = moe_profile
    layer = next(layer for layer in profile.layers if layer.expert_param_bytes)
    cost = layer.cost_at(1)
    assert (cost.expert_host_forward_ms, cost.expert_host_backward_ms) == (pytest.approx(3 * 4.9e-3),
                                                                          pytest.approx(6 * 4.9e-3))
    # The profile's own pass is max(gpu, host): the host's time is at most the pass.
    assert cost.host_forward_ms <= cost.forward_ms + 1e-6
    for e, local in ((1, 8), (2, 4), (8, 1)):
        view = degree_view(profile, 1, DGX, experts=ExpertGroup(expert=e, ranks_per_node=e))
        waits = view.host_wait_ms.get((layer.name, 1), (cost.host_wait_forward_ms or 0.0,
                                                        cost.host_wait_backward_ms or 0.0))
        assert waits == pytest.approx(tuple(_host_wait_by_hand(cost, local)))
    # One local expert (E = 8 of 8 experts) adds nothing to the profile's wait.
    assert _host_wait_by_hand(cost, 1) == pytest.approx([cost.host_wait_forward_ms or 0.0,
                                                         cost.host_wait_backward_ms or 0.0])


def test_view_imbalance_scales_the_busiest_ranks_experts(moe_profile):
    profile, _ = moe_profile
    f = 1.5
    view = degree_view(profile, 1, DGX, experts=ExpertGroup(expert=8, imbalance=f, ranks_per_node=8))
    layer = next(layer for layer in profile.layers if layer.expert_param_bytes)
    cost, got = layer.cost_at(2), next(c for c in view.profile.layers[1].costs if c.microbatch_size == 2)
    a2a = all_to_all_ms(f * cost.expert_dispatch_bytes, 8, 8, DGX.intra_node, DGX.inter_node)
    assert got.forward_ms == pytest.approx(cost.forward_ms + (f - 1) * cost.expert_forward_ms + 2 * a2a)
    assert got.backward_ms == pytest.approx(cost.backward_ms + (f - 1) * cost.expert_backward_ms + 2 * a2a)
    share = cost.backward_input_ms / cost.backward_ms
    assert got.backward_input_ms == pytest.approx(cost.backward_input_ms + share * (f - 1) * cost.expert_backward_ms
                                                  + 2 * a2a)
    # The routed experts are part of the unit's forward: the profile's share is below the whole.
    assert 0 < cost.expert_forward_ms < cost.forward_ms
    # The busiest rank keeps f times the routed tensors: the k token copies (mlp_input, 2 k s b h)
    # and the SwiGLU's 3 k s b f (docs/cluster-model.md), 16-bit.
    s, b, h, k, inner = 1024, 2, 512, 2, 1024
    assert cost.expert_activation_bytes == 2 * (k * s * b * h + 3 * k * s * b * inner)
    assert got.activation_bytes == cost.activation_bytes + math.ceil((f - 1) * cost.expert_activation_bytes)


def test_expert_tensor_parallel_shards_the_experts_at_t(moe_profile):
    profile, _ = moe_profile
    view = degree_view(profile, 2, DGX, experts=ExpertGroup(expert=2, expert_tensor=2, ranks_per_node=2))
    for layer, seen in zip(profile.layers, view.profile.layers):
        if layer.expert_param_bytes:
            at_2 = next(c for c in layer.costs if c.degree == 2)
            assert seen.param_bytes == at_2.param_bytes - at_2.expert_param_bytes + math.ceil(
                layer.expert_param_bytes / 4)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_cost_model_state_shards_experts_over_edp(zero):
    class Settings:
        bandwidth_bytes_per_s = None
        optimizer, zero_stage, data_parallel, action_overhead_ms = "adam-fp32-grads", zero, 8, None
        expert_data_parallel = 2
    model = CostModel.from_settings(Settings, 2)
    dense, experts = 3e9, 5e9
    sums = LayerSums.of(param_bytes=dense + experts, tied_copy_param_bytes=0.0, expert_param_bytes=experts)
    # Megatron's state: 2 + 4 + 12 bytes per parameter; ZeRO shards its parts over d, the experts' over EDP.
    by_hand = (state_memory(dense / 2, training_state("adam-fp32-grads", 2), zero, 8).total_bytes
               + state_memory(experts / 2, training_state("adam-fp32-grads", 2), zero, 2).total_bytes)
    assert model.state_bytes(sums) == pytest.approx(by_hand, rel=1e-9)
    assert moe_static_bytes("adam-fp32-grads", 2, zero, 8, 2, dense + experts, experts) == pytest.approx(by_hand)
    if zero == 0:
        assert model.expert_static_bytes_per_param_byte is None   # nothing sharded: one term


def test_cost_model_without_experts_is_unchanged():
    class Settings:
        bandwidth_bytes_per_s = None
        optimizer, zero_stage, data_parallel, action_overhead_ms = "adam", 1, 8, None
        expert_data_parallel = None
    model = CostModel.from_settings(Settings, 2)
    assert model.expert_static_bytes_per_param_byte is None
    assert model.state_bytes(LayerSums.of(param_bytes=4e9, tied_copy_param_bytes=0.0)) == \
        state_bytes_per_param_byte("adam", 2, 1, 8) * 4e9


# ---------------------------------------------------------------- gradient sync


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_sync_dense_over_d_experts_over_edp(zero):
    adam = training_state("adam", 2)
    span, expert_span = GroupSpan(8, 4), GroupSpan(1, 4)      # d = 32; EDP = 4 across the nodes
    got = moe_data_parallel_sync(1e9, 3e9, adam, zero, span, expert_span, DGX, 4)
    dense = data_parallel_sync(1e9, adam, zero, span, DGX, 4)
    expert = data_parallel_sync(3e9, adam, zero, expert_span, DGX, 4)
    assert got.exposed_ms == pytest.approx(dense.exposed_ms + expert.exposed_ms)
    if zero == 0:   # the experts' all-reduce of 2-byte gradients, flat over the 4 nodes' NICs
        ring = collective_ms("all-reduce", 3e9 * 2, 1, 4, DGX.intra_node, DGX.inter_node)
        assert expert.gradient_ms == pytest.approx(ring)


# ---------------------------------------------------------------- iteration parts


def test_iteration_parts_with_experts_add_up():
    moe = {"dispatch": 5.0, "combine": 5.0, "experts": 30.0, "shared_expert": 2.0}
    parts = iteration_parts(80.0, 8.0, 5.0, 15.0, [100.0, 90.0], [20.0, 20.0], [3.0, 3.0], expert_ms=moe)
    assert parts.compute_ms == pytest.approx(80.0 - 8.0 - 42.0)
    assert (parts.expert_dispatch_ms, parts.expert_combine_ms, parts.expert_compute_ms, parts.shared_expert_ms) \
        == (5.0, 5.0, 30.0, 2.0)
    assert parts.iteration_ms == pytest.approx(123.0)


# ---------------------------------------------------------------- the cluster plan


def _plan(path, *args, gpus=16):
    result = CliRunner().invoke(app, ["plan", str(path), "--gpus", str(gpus), "--cluster", "dgx-h100",
                                      "--global-batch", "32", "-q", *args])
    return result


def test_plan_fixed_expert_parallel_memory_and_parts(moe_profile, tmp_path):
    profile, path = moe_profile
    out = tmp_path / "plan.json"
    result = _plan(path, "--expert-parallel", "4", "--data-parallel", "8", "--tensor-parallel", "1",
                   "--zero", "1", "-o", str(out))
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    par = plan.parallelism
    assert (par.expert, par.data, par.expert_data) == (4, 8, 2)
    state = training_state("adam", 2)
    by_name = {layer.name: layer for layer in profile.layers}
    for stage in plan.stages:
        experts = sum(math.ceil((by_name[n].expert_param_bytes or 0) / 4) for n in stage.layers)
        # The experts' weights, gradients and Adam state, the optimizer state sharded over EDP = 2.
        assert stage.expert_state_bytes == state_memory(experts / 2, state, 1, 2).total_bytes
        dense = state_memory((stage.param_bytes - experts) / 2, state, 1, 8)
        assert (stage.weight_bytes, stage.optimizer_bytes) == (dense.weight_bytes, dense.optimizer_bytes)
    p = plan.predicted
    total = (p.compute_ms + p.tensor_parallel_ms + p.expert_dispatch_ms + p.expert_compute_ms + p.expert_combine_ms
             + p.shared_expert_ms + p.transfer_ms + p.bubble_ms + (p.overhead_ms or 0) + p.data_parallel_ms
             + p.optimizer_ms + (p.host_wait_ms or 0))  # this small model's units wait for the host's launches
    assert total == pytest.approx(p.iteration_ms, abs=1e-4)
    assert p.expert_dispatch_ms > 0 and p.expert_compute_ms > 0 and p.shared_expert_ms == 0
    shown = CliRunner().invoke(app, ["show", str(out)])
    assert shown.exit_code == 0
    for text in ("expert dispatch", "routed experts", "expert combine", "experts E=4"):
        assert text in shown.output
    # The host-bound units' wait is the plan's named part: the critical rank's stages' waits.
    waits = sum(c.host_wait_forward_ms + c.host_wait_backward_ms for layer in profile.layers for c in layer.costs
                if c.host_wait_forward_ms is not None and c.microbatch_size == plan.microbatch_size)
    assert p.host_wait_ms > 0 and waits > 0 and "host launches (GPU waiting)" in shown.output


def test_run_refuses_an_ep_plan_and_the_replay_holds_one_gpus_experts(moe_profile, tmp_path):
    """pipeplan run builds every expert on every rank, so it refuses E > 1 (exit 2 naming the field);
    the run report's replay of such a plan simulates the plan's own per-GPU stages (1/E of the
    experts, the all-to-alls), not the whole-model profile."""
    profile, path = moe_profile
    out = tmp_path / "plan.json"
    assert _plan(path, "--expert-parallel", "4", "--data-parallel", "8", "--tensor-parallel", "1",
                 "--zero", "1", "-o", str(out)).exit_code == 0
    plan = load_plan(out)
    with pytest.raises(BadInputError, match="parallelism.expert: E=4"):
        check_parallelism(plan, str(out))
    replay = simulate_plan(plan, profile)
    assert replay.iteration_ms == pytest.approx(plan_simulation(plan).iteration_ms)
    whole = simulate_plan(plan.model_copy(update={"parallelism": None}), profile)
    # The whole-model replay would hold 4x the experts and miss the all-to-alls.
    assert whole.iteration_ms != pytest.approx(replay.iteration_ms)


def test_plan_searches_expert_parallel_and_replans_the_same(moe_profile, tmp_path):
    _, path = moe_profile
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert _plan(path, "-o", str(first)).exit_code == 0
    assert _plan(path, "-o", str(second)).exit_code == 0
    assert first.read_bytes() == second.read_bytes()
    plan = load_plan(first)
    assert plan.parallelism.expert is not None and plan.parallelism.data % plan.parallelism.expert == 0
    assert plan.settings.expert_parallel is None and plan.settings.expert_data_parallel is None


def test_dense_plan_has_no_expert_fields(dense_path, tmp_path):
    out = tmp_path / "dense.json"
    assert _plan(dense_path, "-o", str(out)).exit_code == 0
    text = out.read_text()
    assert "expert" not in text


@pytest.mark.parametrize("args, words", [
    (["--expert-parallel", "3", "--data-parallel", "3"], None),   # a CLI rule before the profile
    (["--expert-parallel", "3", "--data-parallel", "24"], ("--expert-parallel", "3", "8 experts")),
    (["--expert-parallel", "4", "--data-parallel", "6", "--tensor-parallel", "1"],
     ("--expert-parallel", "4", "--tensor-parallel 1 x --data-parallel 6")),
    (["--expert-tensor-parallel", "2", "--tensor-parallel", "1"], ("--expert-tensor-parallel", "divide")),
    (["--expert-imbalance", "0.5"], ("--expert-imbalance",)),
])
def test_bad_expert_options_exit_2(moe_profile, args, words):
    _, path = moe_profile
    result = _plan(path, *args, gpus=24)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1
    for word in words or ("--",):
        assert word in result.output


def test_an_expert_group_may_span_the_tensor_groups(moe_profile, tmp_path):
    """MoE parallel folding: with ETP 1 the expert layers' ranks are laid out over t x d, so E = 8
    at t = 2, d = 4 plans (E does not divide d), with EDP = t x d / E = 1."""
    _, path = moe_profile
    out = tmp_path / "plan.json"
    result = _plan(path, "--expert-parallel", "8", "--data-parallel", "4", "--tensor-parallel", "2", "-o", str(out),
                   gpus=16)
    assert result.exit_code == 0, result.output
    par = load_plan(out).parallelism
    assert (par.expert, par.data, par.tensor, par.expert_data) == (8, 4, 2, 1)


def test_expert_options_on_a_dense_profile_exit_2_as_a_subprocess(dense_path):
    run = subprocess.run([sys.executable, "-m", "pipeplan", "plan", str(dense_path), "--gpus", "16", "--cluster",
                          "dgx-h100", "--expert-parallel", "2"], capture_output=True, text=True)
    assert run.returncode == 2
    assert "--expert-parallel" in run.stderr and "no experts" in run.stderr and "Traceback" not in run.stderr


def test_expert_group_on_the_network_when_it_spans_nodes():
    class Settings:
        expert_tensor_parallel, expert_imbalance = None, None
    group = expert_group(Settings, DGX, data=16, tensor=1, pipeline=1, expert=16)
    assert (group.expert, group.ranks_per_node) == (16, 8)
    assert expert_group(Settings, DGX, data=16, tensor=1, pipeline=1, expert=4).ranks_per_node == 4


# ---------------------------------------------------------------- the Megatron-LM export


def test_megatron_export_of_an_ep_plan_is_megatron_cores(moe_profile, tmp_path):
    """The flags build megatron-core's own TransformerConfig (its MoE checks) and its expert rank
    generator, whose expert-parallel groups are the plan's (E consecutive GPUs at ETP 1)."""
    pytest.importorskip("torch")
    try:
        import torch
        from megatron.core import parallel_state
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        pytest.skip("megatron-core not installed")
    from pipeplan.export import export_plan
    from tests.test_export_parallel import megatron_flags

    profile, path = moe_profile
    out = tmp_path / "plan.json"
    result = _plan(path, "--expert-parallel", "4", "--data-parallel", "8", "--tensor-parallel", "2",
                   "--launcher", "megatron", "-o", str(out))
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    flags = megatron_flags(export_plan(plan, profile, "megatron")[".sh"])
    assert (flags["--num-experts"], flags["--expert-model-parallel-size"], flags["--expert-tensor-parallel-size"],
            flags["--moe-router-topk"]) == ("8", "4", "1", "2")
    config = TransformerConfig(
        num_layers=int(flags["--num-layers"]), hidden_size=512, num_attention_heads=8,
        tensor_model_parallel_size=int(flags["--tensor-model-parallel-size"]),
        pipeline_model_parallel_size=int(flags["--pipeline-model-parallel-size"]),
        pipeline_model_parallel_layout=flags.get("--pipeline-model-parallel-layout"),
        sequence_parallel="--sequence-parallel" in flags, pipeline_dtype=torch.bfloat16,
        num_moe_experts=int(flags["--num-experts"]), moe_router_topk=int(flags["--moe-router-topk"]),
        moe_ffn_hidden_size=int(flags["--moe-ffn-hidden-size"]),
        expert_model_parallel_size=int(flags["--expert-model-parallel-size"]),
        expert_tensor_parallel_size=int(flags["--expert-tensor-parallel-size"]),
        moe_token_dispatcher_type=flags["--moe-token-dispatcher-type"])
    par = plan.parallelism
    etp, ep, pp = config.expert_tensor_parallel_size, config.expert_model_parallel_size, par.pipeline
    edp = par.num_gpus // (etp * ep * pp)
    assert edp == par.expert_data
    experts = parallel_state.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-ep-dp-pp")
    layout = Layout(par.data, par.tensor, par.pipeline, par.gpus_per_node)
    assert tuple(experts.get_ranks("ep")[0]) == layout.expert_group(ep, etp)
    assert tuple(experts.get_ranks("dp")[0]) == layout.expert_data_group(ep, etp)


# ---------------------------------------------------------------- doctor


#: The parallel flags of NVIDIA's examples/mixtral/train_mixtral_8x7b_distributed.sh (Megatron-LM),
#: restated: Mixtral 8x7B, t = 1, p = 4, E = 8, the distributed optimizer, 8 GPUs per node.
MIXTRAL_SCRIPT = """#!/bin/bash
GPUS_PER_NODE=8
NNODES=${SLURM_NNODES:-"1"}
ARGS=(--seq-length 4096 --num-layers 32 --hidden-size 4096 --num-attention-heads 32
      --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall
      --micro-batch-size 1 --global-batch-size 256 --bf16
      --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size EP
      --use-distributed-optimizer --sequence-parallel)
torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NNODES pretrain_gpt.py ${ARGS[@]}
"""


@pytest.fixture(scope="module")
def mixtral_8x7b(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral") / "mixtral-8x7b.json"
    path.write_text(dump_model(analytic_profile("mixtral-8x7b", get_gpu("h100-sxm"), seq_len=4096,
                                                microbatch_sizes=(1,), tensor_parallel=(1,))))
    return path


@pytest.mark.parametrize("ep", [8, 1])
def test_doctor_reads_the_expert_parallel_size_of_nvidias_mixtral_script(mixtral_8x7b, tmp_path, ep):
    """On 32 H100s (SLURM_NNODES=4) the script fits at its E = 8: no over-memory error, and doctor
    says what the experts take; at E = 1 every GPU would hold every expert, and it does not fit."""
    script = tmp_path / "train_mixtral_8x7b_distributed.sh"
    script.write_text(MIXTRAL_SCRIPT.replace("EP", str(ep)))
    result = CliRunner().invoke(app, ["doctor", "megatron", str(script), "--profile", str(mixtral_8x7b),
                                      "--cluster", "dgx-h100", "--var", "SLURM_NNODES=4"])
    if ep == 8:
        assert result.exit_code == 0, result.output
        assert "over-memory" not in result.output
        assert "--expert-model-parallel-size 8: each GPU holds 1 of the 8 experts" in result.output
        assert "experts" in result.output.split("memory per GPU:")[1].splitlines()[1]
    else:
        assert result.exit_code == 1 and result.output.count("[over-memory]") == 4


@settings(max_examples=15, deadline=None)
@given(e=st.sampled_from([1, 2, 4, 8]), f=st.floats(1.0, 3.0), size=st.sampled_from([1, 2]))
def test_view_property_experts_add_up_and_time_only_grows(moe_profile, e, f, size):
    """At any E and imbalance: the GPUs of a group hold every expert once (up to rounding), the
    dense bytes are untouched, and no unit gets faster than the plain view but by the host's
    launches of the experts it no longer holds."""
    profile, _ = moe_profile
    plain = degree_view(profile, 1, DGX)
    view = degree_view(profile, 1, DGX, experts=ExpertGroup(expert=e, imbalance=f, ranks_per_node=e))
    for layer, seen, base in zip(profile.layers, view.profile.layers, plain.profile.layers):
        held = (seen.expert_param_bytes or 0) * e
        assert 0 <= held - (layer.expert_param_bytes or 0) < e
        assert seen.param_bytes - (seen.expert_param_bytes or 0) == layer.param_bytes - (layer.expert_param_bytes or 0)
        got = next(c for c in seen.costs if c.microbatch_size == size)
        was = next(c for c in base.costs if c.microbatch_size == size)
        # Less the GPU's wait for the host (fewer local experts launch fewer GEMMs: that may shrink).
        got_wait = view.host_wait_ms.get((layer.name, size), (0.0, 0.0))
        was_wait = plain.host_wait_ms.get((layer.name, size), (0.0, 0.0))
        assert got.forward_ms - got_wait[0] >= was.forward_ms - was_wait[0] - 1e-9
        assert got.backward_ms - got_wait[1] >= was.backward_ms - was_wait[1] - 1e-9
        assert got_wait[0] <= was_wait[0] + 1e-9 and got_wait[1] <= was_wait[1] + 1e-9
        if layer.expert_param_bytes and (e > 1 or f > 1):
            assert got.forward_ms - got_wait[0] > was.forward_ms - was_wait[0]


def test_torchtitan_export_of_an_ep_plan_is_torchtitans(moe_profile, tmp_path):
    """torchtitan's ConfigManager and ParallelDims read the plan's expert degrees."""
    pytest.importorskip("torch")
    from pipeplan.export import export_plan
    from tests.test_export_parallel import torchtitan_accepts

    _, path = moe_profile
    out = tmp_path / "plan.json"
    result = _plan(path, "--expert-parallel", "4", "--data-parallel", "8", "--tensor-parallel", "2",
                   "--launcher", "torchtitan", "-o", str(out))
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    text = export_plan(plan, None, "torchtitan")[".toml"]
    config, dims, _ = torchtitan_accepts(tmp_path, text, plan.parallelism.num_gpus)
    assert (dims.ep, dims.etp, dims.tp) == (4, 1, 2)
    assert config.parallelism.expert_parallel_degree == plan.parallelism.expert


def test_deepspeed_export_of_an_ep_plan_builds_deepspeeds_moe_layer(moe_profile, tmp_path):
    """The DeepSpeed export's 'moe' entry is DeepSpeed-MoE's own layer arguments: its MoE layer
    built with them holds the plan's experts per GPU (num_experts / E)."""
    pytest.importorskip("deepspeed")
    import torch
    from deepspeed.moe.layer import MoE

    from pipeplan.export import export_plan

    profile, path = moe_profile
    out = tmp_path / "plan.json"
    assert _plan(path, "--expert-parallel", "4", "--data-parallel", "8", "--tensor-parallel", "1",
                 "--launcher", "deepspeed", "--zero", "1", "-o", str(out)).exit_code == 0
    plan = load_plan(out)
    exported = json.loads(export_plan(plan, profile, "deepspeed")[".json"])
    moe = exported["moe"]
    assert moe == {"num_experts": 8, "ep_size": 4, "k": 2, "enable_expert_tensor_parallelism": False}
    layer = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), **moe)
    assert (layer.num_local_experts, layer.ep_size) == (2, 4)
    assert any("ep_size=4" in note for note in exported["pipeplan"]["notes"])


def test_doctor_reads_the_expert_degree_of_torchtitan_and_deepspeed(moe_profile, tmp_path):
    """torchtitan's parallelism.expert_parallel_degree and DeepSpeed-MoE's ep_size (--ep-size) are
    read, and doctor's cluster costing says how many experts each GPU holds."""
    from pipeplan.launchers.deepspeed.reader import parse_deepspeed
    from pipeplan.launchers.torchtitan.reader import parse_torchtitan
    from pipeplan.export import export_plan

    profile, path = moe_profile
    out = tmp_path / "plan.json"
    assert _plan(path, "--expert-parallel", "4", "--data-parallel", "8", "--tensor-parallel", "2",
                 "--launcher", "torchtitan", "-o", str(out)).exit_code == 0
    toml = tmp_path / "job.toml"
    # The export has no [model] table (the user's own); torchtitan's MoE model, the profile's 4 blocks.
    toml.write_text(export_plan(load_plan(out), profile, "torchtitan")[".toml"] + '\n[model]\nname = "deepseek_v3"\n')
    config = parse_torchtitan(str(toml), toml.read_text(), num_layers=4, validate_with_torchtitan=False)
    assert config.expert_degree == 4
    result = CliRunner().invoke(app, ["doctor", "torchtitan", str(toml), "--profile", str(path), "--cluster",
                                      "dgx-h100", "--same-layout"])
    assert "experts: parallelism.expert_parallel_degree = 4: each GPU holds 2 of the 8 experts" in result.output, \
        result.output
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4}))
    assert parse_deepspeed(str(ds), ds.read_text(), num_stages=2, world_size=16, ep_size=8).expert_degree == 8
    with pytest.raises(BadInputError, match="--ep-size: 0 must be at least 1"):
        parse_deepspeed(str(ds), ds.read_text(), num_stages=2, ep_size=0)
