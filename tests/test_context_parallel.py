"""Context parallelism: each term against a hand computation of its documented formula
(docs/cluster-model.md, "Context parallelism"), the rank order against megatron-core's own
RankGenerator, the rules (exit 2), and the exports checked by megatron-core's and torchtitan's
config code."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from pipeplan.analytic.api import analytic_profile
from pipeplan.cli import app
from pipeplan.cluster.collectives import send_ms
from pipeplan.cluster.context import (ATTENTION_BACKWARD_FACTOR, add_context_exchange, chunk_bytes,
                                      context_buffer_bytes, context_link, context_profile)
from pipeplan.cluster.placement import Layout
from pipeplan.cluster.presets import PRESETS
from pipeplan.cluster.profile_view import degree_view
from pipeplan.errors import BadInputError
from pipeplan.export import export_plan
from pipeplan.facts.gpus import get_gpu
from pipeplan.facts.training_state import state_memory, training_state
from pipeplan.formats.io import dump_model, load_plan

from test_export_parallel import _megatron_core, megatron_flags, torchtitan_accepts

DGX = PRESETS["dgx-h100"]
SEQ = 4096

#: A small Llama with grouped-query attention (8 heads, 4 KV heads).
TINY = {
    "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
    "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 4096, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    config = root / "config.json"
    config.write_text(json.dumps(TINY))
    profile = analytic_profile(config, get_gpu("h100-sxm"), seq_len=SEQ, microbatch_sizes=(1, 2),
                               tensor_parallel=(1, 2))
    path = root / "tiny.json"
    path.write_text(dump_model(profile))
    return profile, path


def _plan(tmp_path, path, *args):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", str(path), "--cluster", "dgx-h100", "-q", "-o", str(out),
                                      *map(str, args)])
    assert result.exit_code == 0, result.output
    return load_plan(out)


# --------------------------------------------------------------------------- terms by hand


def test_every_token_wise_field_is_one_cth_and_parameters_stay(tiny):
    profile, _ = tiny
    scaled = context_profile(profile, 4)
    for layer, mine in zip(profile.layers, scaled.layers):
        assert mine.param_bytes == layer.param_bytes
        for cost, own in zip(layer.costs, mine.costs):
            assert own.forward_ms == pytest.approx(cost.forward_ms / 4)
            assert own.backward_ms == pytest.approx(cost.backward_ms / 4)
            assert own.activation_bytes == math.ceil(cost.activation_bytes / 4)
            assert own.output_bytes == math.ceil(cost.output_bytes / 4)
            assert own.selective_recompute_ms == pytest.approx(cost.selective_recompute_ms / 4)
            if cost.tensor_parallel_forward_bytes is not None:
                assert own.tensor_parallel_forward_bytes == math.ceil(cost.tensor_parallel_forward_bytes / 4)
                assert own.tensor_parallel_forward_count == cost.tensor_parallel_forward_count
    assert context_profile(profile, 1) is profile


def test_kv_chunk_and_buffers_by_hand(tiny):
    profile, _ = tiny
    # b x s / C tokens x (K and V) x KV heads on the rank x head_dim x 2 bytes (bf16)
    assert chunk_bytes(profile, 2, 2, 4) == 2 * (SEQ // 4) * 2 * (4 // 2) * 64 * 2
    assert chunk_bytes(profile, 1, 8, 2) == 1 * (SEQ // 2) * 2 * 1 * 64 * 2   # t above the KV heads: one each
    assert context_buffer_bytes(profile, 2, 2, 4) == 4 * chunk_bytes(profile, 2, 2, 4)
    assert context_buffer_bytes(profile, 2, 2, 1) == 0


@pytest.mark.parametrize("tensor, context, link", [(2, 4, "intra"), (2, 8, "inter"), (1, 2, "intra")])
def test_exchange_is_the_ring_beyond_the_attention_it_overlaps(tiny, tensor, context, link):
    profile, _ = tiny
    view = add_context_exchange(degree_view(context_profile(profile, context), tensor, DGX, selective=False),
                                profile, context, DGX)
    base = degree_view(context_profile(profile, context), tensor, DGX)
    assert context_link(tensor, context, 8).link == link
    wire = DGX.inter_node if link == "inter" else DGX.intra_node
    exposed = 0
    for layer, plain in zip(view.profile.layers, base.profile.layers):
        source = next(layer_ for layer_ in profile.layers if layer_.name == layer.name)
        for cost, before in zip(layer.costs, plain.costs):
            entry = next(c for c in source.costs if c.microbatch_size == cost.microbatch_size
                         and (c.tensor_parallel or 1) == tensor)
            attention = entry.selective_recompute_ms / context
            chunk = cost.microbatch_size * SEQ // context * 2 * max(4 // tensor, 1) * 64 * 2
            if attention > 0:
                forward = (context - 1) * max(0.0, send_ms(chunk, wire) - attention / context)
                backward = (context - 1) * max(0.0, send_ms(2 * chunk, wire)
                                               - ATTENTION_BACKWARD_FACTOR * attention / context)
            else:
                forward = backward = 0.0
            assert view.context_ms[(layer.name, cost.microbatch_size)] == pytest.approx((forward, backward))
            assert cost.forward_ms == pytest.approx(before.forward_ms + forward)
            assert cost.backward_ms == pytest.approx(before.backward_ms + backward)
            assert cost.backward_input_ms == pytest.approx(before.backward_input_ms + backward)
            exposed += forward + backward
    assert exposed > 0 or link != "inter"  # on the network the ring outlasts a small model's attention


@pytest.mark.parametrize("t, c, d, p", [(2, 4, 2, 1), (2, 8, 1, 2), (8, 2, 2, 2), (1, 4, 4, 2), (4, 4, 1, 2)])
def test_groups_are_megatron_cores(t, c, d, p):
    core = _megatron_core()
    gen = core.ps.RankGenerator(tp=t, ep=1, dp=d, pp=p, cp=c, order="tp-cp-ep-dp-pp")
    layout = Layout(d * c, t, p, 8)
    cp_groups = gen.get_ranks("cp")
    assert tuple(cp_groups[0]) == tuple(i * t for i in range(c))
    for group in cp_groups:
        assert layout.span(group) == context_link(t, c, 8)
    # Gradients are reduced over the data x context group: the layout's data group at d x C.
    assert tuple(gen.get_ranks("dp-cp")[0]) == layout.data_group(0, 0)
    assert tuple(gen.get_ranks("pp")[0]) == layout.pipeline_group(0, 0)
    assert tuple(gen.get_ranks("tp")[0]) == layout.tensor_group(0, 0)


# --------------------------------------------------------------------------- plans


def test_c1_is_the_plan_without_the_option(tmp_path, tiny):
    _, path = tiny
    plain = _plan(tmp_path, path, "--gpus", 16, "--global-batch", 16)
    one = _plan(tmp_path, path, "--gpus", 16, "--global-batch", 16, "--context-parallel", 1)
    assert one.settings.context_parallel == 1
    assert one.model_copy(update={"settings": plain.settings}) == plain
    assert plain.parallelism.context is None and plain.predicted.context_exchange_ms is None


def test_a_context_parallel_plan_by_hand(tmp_path, tiny):
    profile, path = tiny
    d, t, c = 2, 2, 4
    plan = _plan(tmp_path, path, "--gpus", 16, "--global-batch", 8, "--context-parallel", c, "--tensor-parallel", t,
                 "--stages", 1, "--recompute", "none", "--microbatch-size", 2, "--zero", 1)
    par = plan.parallelism
    assert (par.data, par.tensor, par.pipeline, par.context, par.num_gpus) == (d, t, 1, c, 16)
    # the C ranks of a group share each sample: d x m x b
    assert par.data * plan.num_microbatches * plan.microbatch_size == 8
    view = add_context_exchange(degree_view(context_profile(profile, c), t, DGX), profile, c, DGX)
    m, b = plan.num_microbatches, plan.microbatch_size
    exchange = m * sum(sum(view.context_ms[(name, b)]) for stage in plan.stages for name in stage.layers)
    p_ = plan.predicted
    assert p_.context_exchange_ms == pytest.approx(exchange, abs=1e-5)
    parts = (p_.compute_ms + p_.tensor_parallel_ms + p_.context_exchange_ms + p_.transfer_ms + p_.bubble_ms
             + (p_.overhead_ms or 0) + p_.data_parallel_ms + p_.optimizer_ms + (p_.host_wait_ms or 0))
    assert parts == pytest.approx(p_.iteration_ms, abs=1e-4)
    stage = plan.stages[0]
    # The optimizer state is sharded over d x C (the distributed optimizer's group), not d.
    params = stage.param_bytes / profile.dtype_bytes
    own = state_memory(params, training_state("adam", profile.dtype_bytes), 1, d * c)
    assert stage.optimizer_bytes == pytest.approx(own.optimizer_bytes, abs=1)
    assert stage.context_buffer_bytes == context_buffer_bytes(profile, b, t, c)
    assert plan.ranks[0].peak_memory_bytes == stage.peak_memory_bytes
    # activations: 1/C of the profile's at t (as the view gives them), plus the KV buffers
    acts = sum(layer.costs[0].activation_bytes for layer in view.profile.layers
               for cost in [layer.costs[0]] if cost.microbatch_size == b)
    assert stage.peak_activation_bytes >= acts + stage.context_buffer_bytes
    shown = CliRunner().invoke(app, ["show", str(tmp_path / "plan.json")])
    assert "context-parallel exchange" in shown.output and "x C=4 x" in shown.output
    assert "of it KV chunks" in shown.output


@pytest.mark.parametrize("args, words", [
    (["--gpus", 24, "--context-parallel", 3], "2 x 3 does not divide the profile's sequence 4096"),
    (["--gpus", 16, "--context-parallel", 32], "32 does not divide --gpus 16"),
])
def test_rules_exit_2(tmp_path, tiny, args, words):
    _, path = tiny
    result = CliRunner().invoke(app, ["plan", str(path), "--cluster", "dgx-h100", "-q", *map(str, args)])
    assert result.exit_code == 2 and words in result.output, result.output


def test_needs_gpus(tiny):
    _, path = tiny
    result = CliRunner().invoke(app, ["plan", str(path), "--stages", "2", "--context-parallel", "2"])
    assert result.exit_code == 2 and "--context-parallel: needs --gpus" in result.output


# --------------------------------------------------------------------------- exports and doctor


@pytest.fixture(scope="module")
def cp_plan(tmp_path_factory, tiny):
    _, path = tiny
    root = tmp_path_factory.mktemp("cpplan")
    return _plan(root, path, "--gpus", 32, "--global-batch", 16, "--context-parallel", 4, "--tensor-parallel", 2,
                 "--stages", 2, "--schedule", "1f1b")


def test_megatron_export_is_megatron_cores(tiny, cp_plan):
    import torch

    profile, _ = tiny
    core = _megatron_core()
    par = cp_plan.parallelism
    flags = megatron_flags(export_plan(cp_plan, profile, "megatron")[".sh"])
    assert flags["--context-parallel-size"] == "4" and flags["--cp-comm-type"] == "p2p"
    config = core.TC(num_layers=int(flags["--num-layers"]), hidden_size=64, num_attention_heads=8,
                     tensor_model_parallel_size=int(flags["--tensor-model-parallel-size"]),
                     pipeline_model_parallel_size=int(flags["--pipeline-model-parallel-size"]),
                     pipeline_model_parallel_layout=flags.get("--pipeline-model-parallel-layout"),
                     context_parallel_size=int(flags["--context-parallel-size"]),
                     cp_comm_type=flags["--cp-comm-type"], sequence_parallel="--sequence-parallel" in flags,
                     pipeline_dtype=torch.bfloat16)
    world = par.num_gpus
    # Megatron-LM: data-parallel size = world / (t x p x cp)
    d = world // (config.tensor_model_parallel_size * config.pipeline_model_parallel_size
                  * config.context_parallel_size)
    assert d == par.data
    gen = core.ps.RankGenerator(tp=config.tensor_model_parallel_size, ep=1, dp=d, cp=config.context_parallel_size,
                                pp=config.pipeline_model_parallel_size, order="tp-cp-ep-dp-pp")
    assert sorted(r for group in gen.get_ranks("dp-cp") for r in group) == list(range(world))
    calculator = core.calc.ConstantNumMicroBatchesCalculator(
        int(flags["--global-batch-size"]), int(flags["--micro-batch-size"]), d, False, 0)
    assert calculator.get() == cp_plan.num_microbatches


def test_torchtitan_export_is_torchtitans(tmp_path, tiny, cp_plan):
    profile, _ = tiny
    text = export_plan(cp_plan, profile, "torchtitan")[".toml"]
    config, dims, microbatches = torchtitan_accepts(tmp_path, text, cp_plan.parallelism.num_gpus)
    assert config.parallelism.context_parallel_degree == 4 and dims.cp == 4
    assert microbatches == cp_plan.num_microbatches


def test_deepspeed_export_refuses(tiny, cp_plan):
    profile, _ = tiny
    with pytest.raises(BadInputError, match="no context axis"):
        export_plan(cp_plan, profile, "deepspeed")


def test_doctor_costs_a_megatron_script_with_context_parallelism(tmp_path, tiny, cp_plan):
    profile, path = tiny
    flags = export_plan(cp_plan, profile, "megatron")[".sh"].split("PIPEPLAN_MEGATRON_ARGS=(")[1].split(")\n")[0]
    script = tmp_path / "train.sh"
    script.write_text("torchrun pretrain_gpt.py " + " ".join(flags.split()) + " --untie-embeddings-and-output-weights\n")
    result = CliRunner().invoke(app, ["doctor", "megatron", str(script), "--profile", str(path), "--cluster",
                                      "dgx-h100", "--world-size", "32", "--same-layout"])
    assert "not in the cluster model" not in result.output, result.output
    assert "32 GPUs as d=2 x t=2 x C=4 x p=2" in result.output, result.output
    assert "+ context-parallel exchange" in result.output


# --------------------------------------------------------------------------- the search over C


def test_search_tries_c_only_at_long_sequences(tiny):
    from pipeplan.cluster.context import MIN_TOKENS_PER_RANK, context_choices
    from pipeplan.formats.plan import PlanSettings

    profile, _ = tiny
    settings = PlanSettings(num_gpus=64, cluster=DGX)
    assert context_choices(profile, settings) == [1]          # 4096 tokens: C = 1 alone, plans as before
    long = profile.model_copy(update={"sequence_length": 65536})
    assert context_choices(long, settings) == [1, 2, 4, 8]    # 2C | s, C | 64, s / C >= 8192
    assert all(65536 // c >= MIN_TOKENS_PER_RANK for c in context_choices(long, settings))
    assert context_choices(long, settings.model_copy(update={"context_parallel": 2})) == [2]


def test_searched_c_is_the_best_fixed_c(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpsearch")
    config = root / "config.json"
    config.write_text(json.dumps(TINY))
    profile = analytic_profile(config, get_gpu("h100-sxm"), seq_len=16384, microbatch_sizes=(1,),
                               tensor_parallel=(1, 2))
    path = root / "tiny16k.json"
    path.write_text(dump_model(profile))
    args = ("--gpus", 16, "--global-batch", 16, "--stages", 2, "--schedule", "1f1b")
    searched = _plan(root, path, *args)
    fixed = {c: _plan(root, path, *args, "--context-parallel", c) for c in (1, 2)}
    chosen = searched.parallelism.context or 1
    assert searched.settings.context_parallel is None
    assert searched.predicted.iteration_ms == min(p.predicted.iteration_ms for p in fixed.values())
    same = fixed[chosen]
    assert searched.model_copy(update={"settings": same.settings, "notes": same.notes}) == same
    assert "context-parallel degree searched" in searched.notes[-1]


def test_run_refuses_a_context_parallel_plan(cp_plan):
    from pipeplan.run.launch import check_parallelism

    par = cp_plan.parallelism.model_copy(update={"tensor": 1, "num_gpus": 16})
    with pytest.raises(BadInputError, match="parallelism.context: C=4: pipeplan run does not run context"):
        check_parallelism(cp_plan.model_copy(update={"parallelism": par}), "plan.json")


def test_doctor_costs_torchtitans_context_parallel_degree(tmp_path, tiny, cp_plan):
    profile, path = tiny
    toml = tmp_path / "job.toml"
    toml.write_text(export_plan(cp_plan, profile, "torchtitan")[".toml"] + '\n[model]\nname = "tiny_llama"\n')
    result = CliRunner().invoke(app, ["doctor", "torchtitan", str(toml), "--profile", str(path), "--cluster",
                                      "dgx-h100", "--same-layout"])
    assert "32 GPUs as d=2 x t=2 x C=4 x p=2" in result.output, result.output
