"""Recomputation as the launchers run it: Megatron's selective modules (analytic parts, planner,
show, export through megatron-core's TransformerConfig, doctor) and one recomputation on every
stage under --launcher megatron (docs/cost-model.md, "Recomputation as the launchers run it")."""

from __future__ import annotations

import json

import pytest
from cli_checks import invoke, one_line_error
from doctor_profiles import decoder_profile, write_profile

from pipeplan.analytic import analytic_profile
from pipeplan.analytic.efficiency import DEFAULT_EFFICIENCY as EFF
from pipeplan.analytic.families import load_model_config
from pipeplan.api import plan_any
from pipeplan.doctor import doctor_file
from pipeplan.launchers.megatron.reader import parse_megatron
from pipeplan.errors import BadInputError
from pipeplan.export import export_plan
from pipeplan.formats.gpu import resolve_gpu
from pipeplan.formats.io import load_plan, load_profile
from pipeplan.formats.plan import PlanSettings
from pipeplan.formats.profile import LayerCost, Profile
from pipeplan.plan.costmodel import CostModel, layer_sums, prefix_sums
from pipeplan.plan.graph import build_layer_graph
from pipeplan.plan.recompute import check_recompute_modules, with_selective_modules
from pipeplan.cluster.presets import resolve_cluster
from pipeplan.requests import ClusterRequest, PipelineRequest
from pipeplan.show import plan_tables

SEQ, B = 1024, 1


@pytest.fixture(scope="module")
def oss():
    cfg = load_model_config("gpt-oss-120b")
    gpu = resolve_gpu("b200", None)
    return cfg, gpu, analytic_profile(cfg, gpu, seq_len=SEQ, microbatch_sizes=(B,))


def _memory_ms(bytes_moved, gpu):
    # efficiency.part_ms of a memory-bound part: bytes / (HBM x memory efficiency) + kernel latency.
    return 1e3 * bytes_moved / (gpu.hbm_bytes_per_s * EFF.memory) + EFF.kernel_latency_us / 1e3


def test_analytic_module_parts_are_the_hand_computation(oss):
    cfg, gpu, profile = oss
    block = profile.layers[1].cost_at(B)
    modules = block.selective_modules
    tokens, h, e = SEQ * B, cfg.hidden_size, 2
    assert set(modules) == {"core_attn", "layernorm", "moe_act", "moe"}  # GPT-OSS: no shared experts, no MLA
    # layernorm: the input norm's output (the QKV GEMM's input), s b h x 2 bytes; it reruns both norms,
    # each a read and a write of s b h.
    assert modules["layernorm"].saved_bytes == e * tokens * h
    assert modules["layernorm"].recompute_ms == pytest.approx(2 * _memory_ms(e * tokens * h * 2, gpu), abs=2e-6)
    # moe_act: the SwiGLU's output for each token's k expert copies (the down projection's input);
    # it reruns the activation, which reads the gate and up outputs and writes the product (3 passes).
    inner = tokens * cfg.experts_per_token * cfg.expert_width
    assert modules["moe_act"].saved_bytes == e * inner
    assert modules["moe_act"].recompute_ms == pytest.approx(_memory_ms(e * inner * 3, gpu), abs=2e-6)
    # core_attn is what the profile's own selective fields give (to the byte's rounding).
    assert abs(modules["core_attn"].saved_bytes - (block.activation_bytes - block.selective_activation_bytes)) <= 1
    assert modules["core_attn"].recompute_ms == pytest.approx(block.selective_recompute_ms, abs=1e-6)
    # Units that are no block offer none.
    assert profile.layers[0].cost_at(B).selective_modules is None


def test_rewritten_profile_costs_the_chosen_modules(oss):
    _, _, profile = oss
    chosen = with_selective_modules(profile, ["moe_act", "layernorm"])
    for old, new in zip(profile.layers, chosen.layers):
        c, n = old.cost_at(B), new.cost_at(B)
        given = c.selective_modules or {}
        freed = sum(given[m].saved_bytes for m in ("layernorm", "moe_act") if m in given)
        assert n.selective_activation_bytes == c.activation_bytes - freed
        assert n.selective_recompute_ms == pytest.approx(sum(given[m].recompute_ms for m in ("layernorm", "moe_act")
                                                             if m in given), abs=1e-6)
        assert (n.forward_ms, n.activation_bytes) == (c.forward_ms, c.activation_bytes)


def test_plan_stages_list_the_modules_and_they_add_up(oss):
    _, _, profile = oss
    base = dict(stages=2, global_batch=4, microbatch_size=B, schedule="1f1b", optimizer="adam-fp32-grads")
    none = plan_any(profile, PipelineRequest(**base, recompute="none"), profile_sha256="0" * 64)
    plan = plan_any(profile, PipelineRequest(**base, recompute="selective", recompute_modules=["layernorm", "moe_act"],
                                             layers_per_stage=[len(s.layers) for s in none.stages]),
                    profile_sha256="0" * 64)
    assert plan.settings.recompute_modules == ["layernorm", "moe_act"]
    for stage, plain in zip(plan.stages, none.stages):
        parts = stage.recompute_modules
        assert stage.recompute_granularity == "selective" and set(parts) == {"layernorm", "moe_act"}
        assert stage.activation_bytes - sum(p.saved_bytes for p in parts.values()) == stage.selective_activation_bytes
        assert stage.backward_ms - plain.backward_ms == pytest.approx(sum(p.recompute_ms for p in parts.values()),
                                                                      abs=1e-5)
    titles = [getattr(x, "title", None) for x in plan_tables(plan).renderables]
    assert "selective recomputation by module (per micro-batch)" in titles
    # Without the option the plan is the one pipeplan made before (no parts, no modules).
    again = plan_any(profile, PipelineRequest(**base, recompute="none"), profile_sha256="0" * 64)
    assert json.dumps(again.model_dump(mode="json")) == json.dumps(none.model_dump(mode="json"))
    assert all(s.recompute_modules is None for s in none.stages) and none.settings.recompute_modules is None


@pytest.mark.parametrize("modules,match", [
    (["fancy"], "fancy is not one of"),
    (["moe", "moe_act"], "moe already recomputes moe_act"),
    (["layernorm", "layernorm"], "named twice"),
])
def test_bad_module_sets_are_refused(modules, match):
    with pytest.raises(BadInputError, match=match):
        check_recompute_modules(modules)


def test_modules_a_profile_lacks_are_refused(oss):
    cfg = load_model_config("llama3-8b")
    dense = analytic_profile(cfg, resolve_gpu("h100-sxm", None), seq_len=256, microbatch_sizes=(1,))
    with pytest.raises(BadInputError, match="no layer of the profile has moe_act"):
        with_selective_modules(dense, ["moe_act"])
    bare = Profile.model_validate({**dense.model_dump(), "layers": [
        {**layer.model_dump(), "costs": [{**c.model_dump(), "selective_modules": None} for c in layer.costs]}
        for layer in dense.layers]})
    with pytest.raises(BadInputError, match="gives no selective_modules"):
        with_selective_modules(bare, ["layernorm"])


def test_a_module_cannot_free_more_than_the_layer_keeps():
    with pytest.raises(ValueError, match="saved_bytes"):
        LayerCost(microbatch_size=1, forward_ms=1, backward_ms=2, activation_bytes=10, output_bytes=1,
                  selective_modules={"layernorm": {"saved_bytes": 11, "recompute_ms": 0.1}})


def test_export_writes_the_modules_megatron_core_accepts(oss):
    pytest.importorskip("torch")
    try:
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        pytest.skip("megatron-core not installed")
    _, _, profile = oss
    plan = plan_any(profile, PipelineRequest(stages=2, global_batch=4, microbatch_size=B, schedule="1f1b",
                                             recompute="selective", recompute_modules=["moe_act", "layernorm"],
                                             launcher="megatron"), profile_sha256="0" * 64)
    text = export_plan(plan, profile, "megatron")[".sh"]
    line = next(w for w in text.splitlines() if w.strip().startswith("--recompute-modules"))
    modules = line.split()[1:]
    assert modules == ["moe_act", "layernorm"] and "--recompute-granularity selective" in text
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8, num_moe_experts=8,
                               moe_grouped_gemm=True, recompute_granularity="selective", recompute_modules=modules)
    assert config.recompute_modules == ["moe_act", "layernorm"]


def test_doctor_reads_the_modules():
    text = ("torchrun pretrain_gpt.py --num-layers 4 --micro-batch-size 1 --global-batch-size 8 "
            "--recompute-granularity selective --recompute-modules layernorm moe_act --seq-length 128")
    config = parse_megatron("x.sh", text)
    assert config.recompute == "selective" and config.recompute_modules == ("moe_act", "layernorm")
    with pytest.raises(BadInputError, match="x.sh: --recompute-modules: fancy"):
        parse_megatron("x.sh", text.replace("moe_act", "fancy"))


def test_megatron_plans_recompute_alike_on_every_stage():
    # A cap that binds: the torch planner recomputes a prefix of stages, Megatron's one setting all or none.
    profile = analytic_profile(load_model_config("llama3-8b"), resolve_gpu("h100-sxm", None), seq_len=4096,
                               microbatch_sizes=(1,))
    base = dict(stages=4, global_batch=16, microbatch_size=1, schedule="1f1b", optimizer="adam-fp32-grads")
    free = plan_any(profile, PipelineRequest(**base, recompute="none"), profile_sha256="0" * 64)
    cap = int(max(r.peak_memory_bytes for r in free.ranks) * 0.7)
    torch_plan = plan_any(profile, PipelineRequest(**base, memory_cap_bytes=cap), profile_sha256="0" * 64)
    megatron = plan_any(profile, PipelineRequest(**base, memory_cap_bytes=cap, launcher="megatron"),
                        profile_sha256="0" * 64)
    modes = {(s.recompute, s.recompute_granularity) for s in megatron.stages}
    assert len(modes) == 1 and modes != {(False, None)}
    assert len({(s.recompute, s.recompute_granularity) for s in torch_plan.stages}) > 1  # the prefix it may mix
    assert megatron.predicted.iteration_ms >= torch_plan.predicted.iteration_ms


def test_cli_plans_the_modules_and_check_replans_them(tmp_path):
    profile = tmp_path / "oss.json"
    result = invoke("profile", "gpt-oss-120b", "--analytic", "--gpu", "b200", "--seq-len", "512",
                    "--microbatch-sizes", "1", "-o", profile)
    assert result.exit_code == 0, result.stderr
    plan = tmp_path / "plan.json"
    result = invoke("plan", profile, "--stages", "2", "--global-batch", "4", "--schedule", "1f1b",
                    "--recompute", "selective", "--recompute-modules", "layernorm,moe_act", "-o", plan)
    assert result.exit_code == 0, result.stderr
    assert "selective recomputation by module" in result.stdout
    written = load_plan(plan)
    assert written.settings.recompute_modules == ["moe_act", "layernorm"]  # Megatron's order
    assert all(set(s.recompute_modules) == {"moe_act", "layernorm"} for s in written.stages)
    # Re-planned from its own settings (pipeplan check's path), byte for byte.
    again = plan_any(load_profile(profile), written.settings, profile_sha256=written.profile.sha256)
    assert again.model_dump_json() == written.model_dump_json()
    one_line_error(invoke("plan", profile, "--stages", "2", "--recompute-modules", "layernorm,fancy"), 2,
                   "--recompute-modules", "fancy")


# ------------------------------------------------------------------ Megatron's block method


@pytest.fixture(scope="module")
def llama():
    return analytic_profile(load_model_config("llama3-8b"), resolve_gpu("h100-sxm", None), seq_len=4096,
                            microbatch_sizes=(1,))


MEGATRON = dict(stages=4, global_batch=16, microbatch_size=1, schedule="1f1b", optimizer="adam-fp32-grads",
                launcher="megatron")


@pytest.mark.parametrize("n", [1, 3, 9])
def test_block_recomputes_the_first_n_blocks_of_each_stage(llama, n):
    none = plan_any(llama, PipelineRequest(**MEGATRON, recompute="none"), profile_sha256="0" * 64)
    split = [len(s.layers) for s in none.stages]
    plan = plan_any(llama, PipelineRequest(**MEGATRON, recompute="all", recompute_method="block", recompute_num_layers=n,
                                           layers_per_stage=split), profile_sha256="0" * 64)
    layers = {layer.name: layer for layer in llama.layers}
    previous = {layer.name: llama.layers[i - 1] if i else None for i, layer in enumerate(llama.layers)}
    for stage, plain in zip(plan.stages, none.stages):
        # Hand: Megatron's TransformerBlock checkpoints its first N layers; embedding, norm, head stay.
        first = [name for name in stage.layers if layers[name].kind == "block"][:n]
        forward = sum(layers[name].cost_at(1).forward_ms for name in first)
        kept = (sum(layers[name].cost_at(1).activation_bytes for name in stage.layers)
                - sum(layers[name].cost_at(1).activation_bytes for name in first)
                + sum(previous[name].cost_at(1).output_bytes for name in first))
        assert stage.recompute and stage.recompute_granularity is None
        assert stage.backward_ms - plain.backward_ms == pytest.approx(forward, abs=1e-5)
        assert stage.checkpoint_bytes == kept
    # The chain DP costs the same split the same way (array sums against float sums).
    searched = plan_any(llama, PipelineRequest(**MEGATRON, recompute="all", recompute_method="block",
                                               recompute_num_layers=n), profile_sha256="0" * 64)
    again = plan_any(llama, PipelineRequest(**MEGATRON, recompute="all", recompute_method="block", recompute_num_layers=n,
                                            layers_per_stage=[len(s.layers) for s in searched.stages]),
                     profile_sha256="0" * 64)
    assert [s.peak_memory_bytes for s in searched.stages] == [s.peak_memory_bytes for s in again.stages]
    assert searched.predicted.iteration_ms == pytest.approx(again.predicted.iteration_ms, rel=1e-9)


def test_block_export_is_what_megatron_core_accepts(llama):
    pytest.importorskip("torch")
    try:
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        pytest.skip("megatron-core not installed")
    import torch

    plan = plan_any(llama, PipelineRequest(**MEGATRON, recompute="all", recompute_method="block", recompute_num_layers=3),
                    profile_sha256="0" * 64)
    text = export_plan(plan, llama, "megatron")[".sh"]
    words = text.split()
    flag = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--recompute")}
    assert flag == {"--recompute-granularity": "full", "--recompute-method": "block", "--recompute-num-layers": "3"}
    config = TransformerConfig(num_layers=32, hidden_size=64, num_attention_heads=8, pipeline_model_parallel_size=4,
                               pipeline_dtype=torch.bfloat16, recompute_granularity="full", recompute_method="block",
                               recompute_num_layers=3)
    assert (config.recompute_method, config.recompute_num_layers) == ("block", 3)


@pytest.mark.parametrize("fields,match", [
    (dict(recompute_method="uniform", recompute_num_layers=2), "uniform groups of 2"),
    (dict(recompute_method="block"), "give --recompute-num-layers"),
    (dict(recompute_num_layers=2), "give --recompute-method"),
    (dict(recompute_method="block", recompute_num_layers=2, launcher=None), "give --launcher megatron"),
])
def test_methods_not_costed_are_refused(llama, fields, match):
    request = PipelineRequest(**{**MEGATRON, "recompute": "all", **fields})
    with pytest.raises(BadInputError, match=match):
        plan_any(llama, request, profile_sha256="0" * 64)


def test_doctor_costs_a_scripts_block_method(tmp_path):
    profile = write_profile(decoder_profile(8, 512, 8, 512, 1000, sizes=(1,)), tmp_path / "profile.json")
    script = tmp_path / "train.sh"
    costed = {}
    for method in ("uniform --recompute-num-layers 1", "block --recompute-num-layers 2"):
        script.write_text("torchrun --nproc_per_node 2 pretrain_gpt.py --num-layers 8 --pipeline-model-parallel-size 2 "
                          f"--micro-batch-size 1 --global-batch-size 8 --recompute-granularity full "
                          f"--recompute-method {method}\n")
        result, _, _ = doctor_file("megatron", script, profile, PlanSettings(stages=1, global_batch=1))
        costed[method.split()[0]] = result.plan
    block, uniform = costed["block"], costed["uniform"]
    assert (block.settings.recompute_method, block.settings.recompute_num_layers) == ("block", 2)
    assert uniform.settings.recompute_method is None
    # Two of each stage's four blocks recompute: less extra backward, more kept, than every layer.
    for b, u in zip(block.stages, uniform.stages):
        assert b.backward_ms < u.backward_ms and b.checkpoint_bytes > u.checkpoint_bytes


@pytest.mark.parametrize("n", [1, 2, 5, 40])
def test_block_sums_agree_between_the_array_and_float_paths(llama, n):
    # Every stage [lo, hi) of the chain: the DP's prefix-sum cut at the N-th block against the
    # stage's own layers; the head (not a block) is never among the recomputed ones.
    graph = build_layer_graph(llama, 1, n)
    between = prefix_sums(graph)
    cost = CostModel()
    total = graph.num_layers
    for lo in range(0, total, 3):
        for hi in range(lo + 1, total + 1, 4):
            exact, fast = layer_sums(graph, range(lo, hi)), between(lo, hi)
            for mode in ("block",):
                assert cost.recompute_ms(fast, mode) == pytest.approx(cost.recompute_ms(exact, mode), abs=1e-6)
                assert cost.kept_bytes(fast, 0, mode) == pytest.approx(cost.kept_bytes(exact, 0, mode), abs=1)
                assert cost.recompute_bytes(fast, mode) == cost.recompute_bytes(exact, mode)
    head = [i for i, layer in enumerate(llama.layers) if layer.kind == "head"][0]
    blocks = [i for i in range(head - 5, head + 1) if llama.layers[i].kind == "block"][:n]
    assert cost.recompute_bytes(layer_sums(graph, range(head - 5, head + 1)), "block") == \
        max(graph.activation_bytes[blocks])


def test_doctor_costs_a_scripts_modules(oss, tmp_path):
    _, _, profile = oss
    path = write_profile(profile, tmp_path / "oss.json")
    script = tmp_path / "train.sh"
    kept = {}
    for modules in ("", "--recompute-modules layernorm moe_act"):
        script.write_text("torchrun --nproc_per_node 2 pretrain_gpt.py --num-layers 36 --pipeline-model-parallel-size 2 "
                          f"--micro-batch-size 1 --global-batch-size 8 --recompute-granularity selective {modules}\n")
        result, _, _ = doctor_file("megatron", script, path, PlanSettings(stages=1, global_batch=1))
        kept[modules] = result.plan
    default, chosen = kept[""], kept["--recompute-modules layernorm moe_act"]
    assert default.settings.recompute_modules is None and chosen.settings.recompute_modules == ["moe_act", "layernorm"]
    # The attention core with flash attention frees only its statistics; the two modules free more.
    for d, c in zip(default.stages, chosen.stages):
        assert c.selective_activation_bytes < d.selective_activation_bytes


def test_cluster_parts_count_only_the_recomputed_blocks_twice(oss):
    # GPT-OSS on 64 B200 at its published layout: the routed experts' part of a block-N plan lies
    # between none's and full's by N of the 36 blocks' forward (the parts' attribution, not only the total).
    _, _, profile = oss
    base = dict(num_gpus=64, cluster=resolve_cluster("dgx-b200"), global_batch=1280, microbatch_size=1,
                data_parallel=64, tensor_parallel=1, stages=1, expert_parallel=8, zero_stage=1, schedule="1f1b",
                launcher="megatron", optimizer="adam-fp32-grads", memory_cap_bytes=2**50)
    plans = {name: plan_any(profile, ClusterRequest(**base, **fields), profile_sha256="0" * 64) for name, fields in (
        ("none", dict(recompute="none")), ("full", dict(recompute="all")),
        ("block", dict(recompute="all", recompute_method="block", recompute_num_layers=9)))}
    experts = {name: plan.predicted.expert_compute_ms for name, plan in plans.items()}
    forward_share = (experts["full"] - experts["none"]) * 9 / 36
    assert experts["block"] - experts["none"] == pytest.approx(forward_share, rel=1e-6)
