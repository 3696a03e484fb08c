"""The MoE all-to-all overlap (``--overlap moe-a2a``: megatron-core's overlap_moe_expert_parallel_comm,
Megatron Bridge's moe_a2a_overlap): each dispatch and combine keeps only what the compute of its
partner phase in the combined 1F1B step does not cover (docs/cluster-model.md, expert parallelism)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from pipeplan.analytic.api import analytic_profile
from pipeplan.cli import app
from pipeplan.cluster.overlap import OVERLAPS, expert_all_to_all_exposed_ms
from pipeplan.cluster.presets import PRESETS
from pipeplan.cluster.profile_view import ExpertGroup, degree_view
from pipeplan.cluster.space import recompute_families
from pipeplan.facts.gpus import get_gpu
from pipeplan.formats.io import dump_model, load_plan

DGX = PRESETS["dgx-h100"]

#: A small Mixtral: 4 routed blocks of 8 experts, top-2 (as tests/test_expert_parallel.py's).
TINY_MIXTRAL = {
    "model_type": "mixtral", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
    "num_key_value_heads": 8, "num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 4096, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def moe_profile(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    config = root / "config.json"
    config.write_text(json.dumps(TINY_MIXTRAL))
    profile = analytic_profile(config, get_gpu("h100-sxm"), seq_len=1024, microbatch_sizes=(1,),
                               tensor_parallel=(1,))
    path = root / "tiny-mixtral.json"
    path.write_text(dump_model(profile))
    return profile, path


def test_exposed_phases_by_hand():
    # Megatron's phases: combine_bwd | attn_fwd, dispatch_fwd | mlp_bwd, dispatch_bwd | mlp_fwd,
    # combine_fwd | attn_bwd; each all-to-all keeps max(0, comm - its phase's compute).
    (dispatch, combine) = expert_all_to_all_exposed_ms((4.0, 3.0), (2.0, 5.0), attention_ms=(1.0, 3.0),
                                                       experts_ms=(2.5, 1.0))
    assert dispatch == (4.0 - 1.0, 3.0 - 2.5)
    assert combine == (0.0, 5.0 - 1.0)
    # Enough compute everywhere hides them all; none leaves them whole.
    assert expert_all_to_all_exposed_ms((1.0, 1.0), (1.0, 1.0), (9.0, 9.0), (9.0, 9.0)) == ((0.0, 0.0), (0.0, 0.0))
    assert expert_all_to_all_exposed_ms((1.0, 2.0), (3.0, 4.0), (0.0, 0.0), (0.0, 0.0)) == ((1.0, 2.0), (3.0, 4.0))
    assert "moe-a2a" in OVERLAPS


def test_view_keeps_the_exposed_rest_and_reports_the_hidden(moe_profile):
    profile, _ = moe_profile
    # Four ranks on four nodes: every all-to-all byte on the network, so they are long enough to show.
    group = ExpertGroup(expert=4, expert_tensor=1, imbalance=1.0, ranks_per_node=1)
    plain = degree_view(profile, 1, DGX, experts=group)
    over = degree_view(profile, 1, DGX, experts=group, moe_a2a=True)
    checked = 0
    for layer, seen, base in zip(profile.layers, over.profile.layers, plain.profile.layers):
        if not layer.expert_param_bytes:
            assert seen.costs[0].forward_ms == base.costs[0].forward_ms
            continue
        cost = layer.cost_at(1)
        a2a = plain.expert_ms[(layer.name, 1)]["dispatch"][0]
        attention_f = cost.forward_ms - cost.expert_forward_ms
        attention_b = cost.backward_ms - cost.expert_backward_ms
        dispatch = (max(0.0, a2a - cost.expert_backward_ms), max(0.0, a2a - cost.expert_forward_ms))
        combine = (max(0.0, a2a - attention_b), max(0.0, a2a - attention_f))
        parts = over.expert_ms[(layer.name, 1)]
        assert parts["dispatch"] == pytest.approx(dispatch)
        assert parts["combine"] == pytest.approx(combine)
        assert parts["a2a_hidden"] == pytest.approx((2 * a2a - dispatch[0] - combine[0],
                                                     2 * a2a - dispatch[1] - combine[1]))
        got, whole = seen.costs[0], base.costs[0]
        # The plain view charges both all-to-alls whole; beside them the per-local-expert host
        # launches (the same in both views) stay: swap the whole all-to-alls for the exposed rest.
        charged = plain.expert_ms[(layer.name, 1)]
        charged_f, charged_b = (charged["dispatch"][i] + charged["combine"][i] for i in (0, 1))
        assert got.forward_ms == pytest.approx(whole.forward_ms - charged_f + dispatch[0] + combine[0])
        assert got.backward_ms == pytest.approx(whole.backward_ms - charged_b + dispatch[1] + combine[1])
        assert got.backward_input_ms == pytest.approx(whole.backward_input_ms - charged_b + dispatch[1] + combine[1])
        assert sum(parts["a2a_hidden"]) > 0
        checked += 1
    assert checked == 4


def _plan(path, out, overlap):
    return CliRunner().invoke(app, ["plan", str(path), "--gpus", "16", "--cluster", "dgx-h100", "--global-batch",
                                    "32", "-q", "--expert-parallel", "8", "--data-parallel", "16",
                                    "--tensor-parallel", "1", "--zero", "1", "--overlap", overlap, "-o", str(out)])


def test_plan_parts_add_up_and_show_names_the_hidden(moe_profile, tmp_path):
    _, path = moe_profile
    plain, over = tmp_path / "plain.json", tmp_path / "over.json"
    for out, overlap in ((plain, "none"), (over, "moe-a2a")):
        result = _plan(path, out, overlap)
        assert result.exit_code == 0, result.output
    p, q = load_plan(plain).predicted, load_plan(over).predicted
    assert p.expert_all_to_all_hidden_ms is None and q.expert_all_to_all_hidden_ms > 0
    assert q.expert_dispatch_ms + q.expert_combine_ms < p.expert_dispatch_ms + p.expert_combine_ms
    assert q.iteration_ms < p.iteration_ms
    total = (q.compute_ms + q.tensor_parallel_ms + q.expert_dispatch_ms + q.expert_compute_ms + q.expert_combine_ms
             + q.shared_expert_ms + q.transfer_ms + q.bubble_ms + (q.overhead_ms or 0) + q.data_parallel_ms
             + q.optimizer_ms + (q.host_wait_ms or 0))
    assert total == pytest.approx(q.iteration_ms, abs=1e-4)
    shown = CliRunner().invoke(app, ["show", str(over)])
    assert shown.exit_code == 0 and "all-to-alls hidden behind compute (moe-a2a" in shown.output


def test_unknown_overlap_names_moe_a2a(moe_profile, tmp_path):
    _, path = moe_profile
    result = _plan(path, tmp_path / "x.json", "moe-a2a,bogus")
    assert result.exit_code == 2 and "moe-a2a" in result.output


def test_no_full_recompute_under_moe_a2a(moe_profile, tmp_path):
    # megatron-core's TransformerConfig asserts recompute_granularity != 'full' with
    # overlap_moe_expert_parallel_comm: an explicit --recompute all is exit 2, auto recomputes nothing.
    _, path = moe_profile
    result = CliRunner().invoke(app, ["plan", str(path), "--gpus", "16", "--cluster", "dgx-h100", "--global-batch",
                                      "32", "-q", "--expert-parallel", "8", "--data-parallel", "16",
                                      "--tensor-parallel", "1", "--zero", "1", "--overlap", "moe-a2a",
                                      "--recompute", "all", "-o", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "moe-a2a" in result.output
    # The search's families: auto (which may recompute layers in full) becomes none under moe-a2a.
    auto = SimpleNamespace(recompute="auto", overlap=["grad-reduce", "moe-a2a"])
    assert recompute_families(auto, True) == [("plain", "none"), ("selective", "none")]
    assert recompute_families(SimpleNamespace(recompute="auto", overlap=None), True)[0] == ("plain", "auto")
