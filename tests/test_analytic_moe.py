"""Mixture-of-experts models in analytic profiles: the CLI builds them, the profile records their
total and active parameters, the experts' bytes apart from the dense ones, the experts' shape, the
multi-token prediction depths and the tied weights; the FLOPs of a routed layer are the router,
top-k experts and the shared experts (hand computations from docs/analytic.md); bad configs exit 2.

The counts themselves are checked against transformers in tests/test_analytic_params.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

from pipeplan.analytic import analytic_profile, get_gpu
from pipeplan.analytic.api import model_parameter_counts
from pipeplan.analytic.collectives import unit_collectives
from pipeplan.analytic.configs import shipped_config_dir
from pipeplan.analytic.families import load_model_config
from pipeplan.analytic.flops import Shape, unit_work
from cli_checks import invoke
from pipeplan.errors import BadInputError
from pipeplan.launchers.common import tied_weight_notes
from pipeplan.formats.io import load_profile

from conftest import REPO, make_profile_dict


MOE_MODELS = ["deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "mixtral-8x7b"]


@pytest.mark.parametrize("name", MOE_MODELS)
def test_cli_builds_each_moe_model_and_records_its_counts(tmp_path, name):
    out = tmp_path / "p.json"
    result = invoke("profile", name, "--analytic", "--gpu", "h100-sxm", "--seq-len", 1024,
                    "--microbatch-sizes", "1", "--tensor-parallel", "1,2", "-o", out)
    assert result.exit_code == 0, result.output
    assert "B active" in result.output
    profile = load_profile(out)
    cfg = load_model_config(name)
    counts = model_parameter_counts(cfg)
    assert profile.parameters == counts and counts.active < counts.total
    # The layers' bytes add up to the total (each tied weight once), at 2 bytes per parameter.
    assert sum(layer.param_bytes for layer in profile.layers) == 2 * counts.total
    experts = profile.experts
    assert (experts.num_experts, experts.experts_per_token) == (cfg.num_experts, cfg.experts_per_token)
    assert experts.expert_intermediate_size == cfg.expert_width
    routed = [layer for layer in profile.layers if layer.expert_param_bytes]
    blocks = [layer for layer in profile.layers if layer.kind == "block"]
    assert len(routed) == len(blocks) - len(cfg.dense_layers) + cfg.mtp_layers
    gated = 3 * cfg.hidden_size * cfg.expert_width * cfg.num_experts
    for layer in routed:
        assert layer.expert_param_bytes % experts.num_experts == 0
        # Dense part = attention + norms + router (+ shared experts): what EP leaves whole.
        assert layer.expert_param_bytes >= 2 * gated and layer.param_bytes > layer.expert_param_bytes
        at2 = layer.cost_at(1, 2)
        assert at2.expert_param_bytes < layer.expert_param_bytes and at2.expert_param_bytes <= at2.param_bytes
    # Active = total less the routed experts a token skips.
    skipped = sum(layer.expert_param_bytes for layer in routed) // 2 * (cfg.num_experts - cfg.experts_per_token) \
        // cfg.num_experts
    assert counts.active == counts.total - skipped


def test_deepseek_v3_dense_layers_mtp_depth_and_its_ties(tmp_path):
    profile = analytic_profile("deepseek-v3", get_gpu("h100-sxm"), seq_len=1024, microbatch_sizes=[1])
    names = [layer.name for layer in profile.layers]
    assert names[-3:] == ["model.norm", "model.layers.61", "lm_head"]
    depth = profile.layers[-2]
    assert depth.kind == "other" and "multi-token prediction" in depth.description
    # first_k_dense_replace = 3: blocks 0-2 dense, 3-60 routed.
    by_name = {layer.name: layer for layer in profile.layers}
    assert [by_name[f"model.layers.{i}"].expert_param_bytes for i in range(3)] == [None] * 3
    assert by_name["model.layers.3"].expert_param_bytes == 2 * 256 * 3 * 7168 * 2048
    # The depth shares the token table and the head: counted in the embedding and the head.
    ties = {tie.name: tie for tie in profile.tied_weights}
    assert ties["model.embed_tokens.weight"].layers == ["model.embed_tokens", "model.layers.61"]
    assert ties["lm_head.weight"].layers == ["lm_head", "model.layers.61"]
    assert ties["lm_head.weight"].param_bytes == 2 * 129280 * 7168
    # The (last) depth computes its own loss and sends the main model's hidden states on; with two
    # depths the first also sends its own to the second.
    assert depth.costs[0].output_bytes == profile.layers[-3].costs[0].output_bytes
    data = json.loads(shipped_config_dir().joinpath("deepseek-v3.json").read_text())
    data.update(num_hidden_layers=4, num_nextn_predict_layers=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    two = analytic_profile(path, get_gpu("h100-sxm"), seq_len=1024, microbatch_sizes=[1])
    assert [layer.name for layer in two.layers][-4:] == ["model.norm", "model.layers.4", "model.layers.5", "lm_head"]
    norm_out = two.layers[-4].costs[0].output_bytes
    assert [layer.costs[0].output_bytes for layer in two.layers[-3:-1]] == [2 * norm_out, norm_out]
    assert two.tied_weights[0].layers == ["model.embed_tokens", "model.layers.4", "model.layers.5"]
    assert profile.measurement["multi_token_prediction"]["depths"] == 1


def _forward_gemm_flops(cfg, index, names, tokens):
    work = unit_work(cfg, "block", index, Shape(tokens, 1))
    return sum(p.flops for p in work.forward if p.kind == "gemm" and p.name in names)


def test_routed_layer_flops_are_router_top_k_and_shared_experts():
    """DeepSeek-V3, a routed block, per token: the router 2 h E, top-k experts 3 x 2 h f each,
    the shared expert 3 x 2 h S; forward, B and W each (docs/analytic.md, "FLOPs")."""
    cfg = load_model_config("deepseek-v3")
    h, e, k, f, s = 7168, 256, 8, 2048, 2048
    tokens = 1024
    mlp = ("router", "gate_proj", "up_proj", "down_proj", "shared_gate_proj", "shared_up_proj", "shared_down_proj")
    expected = tokens * (2 * h * e + k * 3 * 2 * h * f + 3 * 2 * h * s)
    assert _forward_gemm_flops(cfg, 3, mlp, tokens) == expected
    # A dense block (0): the dense MLP of intermediate_size, no router.
    assert _forward_gemm_flops(cfg, 0, mlp, tokens) == tokens * 3 * 2 * h * 18432
    # Latent attention's GEMMs: q_a, q_b, kv_a, kv_b, o.
    attention = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    per_token = 2 * (h * 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * h)
    assert _forward_gemm_flops(cfg, 3, attention, tokens) == tokens * per_token
    # The attention core: scores over 192 wide heads, values over 128: 2 T a (192 + 128) keys.
    work = unit_work(cfg, "block", 3, Shape(tokens, 1))
    core = next(p for p in work.forward if p.name == "attention_core")
    assert core.flops == 2.0 * tokens * 128 * (192 + 128) * (tokens + 1) / 2


def test_routing_and_token_permutation_bytes_by_hand():
    """A routed block's memory-bound MoE steps (docs/analytic.md, "Mixture of experts"): the
    router's softmax and top-k over fp32 logits (3 passes forward, 6 backward, 4 bytes each), the
    permute and the unpermute (each ``(1 + k) T h`` 16-bit elements, forward and backward), all
    in the routed experts' share, which expert parallelism moves and the imbalance scales."""
    cfg = load_model_config("mixtral-8x7b")
    h, experts, k, tokens = 4096, 8, 2, 2048
    work = unit_work(cfg, "block", 0, Shape(tokens, 1))
    forward = {p.name: p for p in work.forward}
    backward = {p.name: p for p in work.backward_input}
    assert forward["router_softmax_topk"].bytes == 4 * tokens * experts * 3
    assert backward["router_softmax_topk"].bytes == 4 * tokens * experts * 6
    for name in ("token_permute", "token_unpermute"):
        assert forward[name].bytes == backward[name].bytes == 2 * (1 + k) * tokens * h
        assert forward[name].flops == 0 and forward[name].kind == "memory"
    # A dense block has none of them.
    dense = {p.name for p in unit_work(load_model_config("llama3-8b"), "block", 0, Shape(tokens, 1)).forward}
    assert not dense & {"router_softmax_topk", "token_permute", "token_unpermute"}


def test_gpt_oss_expert_bytes_at_degree_2_keep_the_row_biases_whole():
    """Column-parallel gate/up (weights and biases halved), row-parallel down (weights halved,
    the bias replicated), per expert."""
    profile = analytic_profile("gpt-oss-120b", get_gpu("h100-sxm"), seq_len=1024, microbatch_sizes=[1],
                               tensor_parallel=[1, 2])
    h, f, e = 2880, 2880, 128
    block = profile.layers[1]
    assert block.expert_param_bytes == 2 * e * (h * 2 * f + 2 * f + f * h + h)
    assert block.cost_at(1, 2).expert_param_bytes == 2 * e * (h * f + f + f // 2 * h + h)
    # Sliding (even) and full (odd) blocks cost differently; their parameters are alike.
    sliding, full = profile.layers[1].costs[0], profile.layers[2].costs[0]
    assert sliding.forward_ms < full.forward_ms and profile.layers[1].param_bytes == profile.layers[2].param_bytes


def test_a_tied_model_on_one_stage_holds_one_copy(tmp_path):
    """Gemma 2 9B's head shares the token table: one stage holding both counts 9.24e9 parameters
    (it counted 10.16e9, the table twice); a stage holding the head alone keeps a copy."""
    out = tmp_path / "g.json"
    result = invoke("profile", "gemma2-9b", "--analytic", "--gpu", "h100-sxm", "--seq-len", 1024,
                    "--microbatch-sizes", "1", "-o", out)
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    total = profile.parameters.total
    assert total == 9_241_705_984
    table = 256000 * 3584 * 2
    assert profile.tied_weights[0].layers == ["model.embed_tokens", "lm_head"]
    assert profile.tied_weights[0].param_bytes == table and profile.layers[-1].param_bytes == 0
    for stages, expected in ((1, 2 * total), (2, 2 * total + table)):
        plan = tmp_path / f"plan{stages}.json"
        result = invoke("plan", out, "--stages", stages, "--schedule", "1f1b", "--global-batch", 8, "-o", plan, "-q")
        assert result.exit_code == 0, result.output
        data = json.loads(plan.read_text())
        assert sum(stage["param_bytes"] for stage in data["stages"]) == expected


@pytest.mark.parametrize("family,drop,field", [
    ("deepseek_v3", "n_routed_experts", "n_routed_experts"),
    ("deepseek_v3", "moe_intermediate_size", "moe_intermediate_size"),
    ("qwen3_moe", "num_experts", "num_experts"),
    ("qwen3_moe", "moe_intermediate_size", "moe_intermediate_size"),
    ("gpt_oss", "num_local_experts", "num_local_experts"),
    ("mixtral", "num_experts_per_tok", "num_experts_per_tok"),
])
def test_an_moe_config_without_its_expert_fields_exits_2(tmp_path, family, drop, field):
    shipped = {"deepseek_v3": "deepseek-v3", "qwen3_moe": "qwen3-30b-a3b", "gpt_oss": "gpt-oss-120b",
               "mixtral": "mixtral-8x7b"}[family]
    data = json.loads(shipped_config_dir().joinpath(f"{shipped}.json").read_text())
    data.pop(drop)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data))
    result = invoke("profile", config, "--analytic", "--gpu", "h100-sxm", "-o", tmp_path / "p.json")
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert str(config) in line and field in line and "missing field" in line
    assert f"a {family} (mixture-of-experts) config must give" in line
    assert "Traceback" not in result.output and not (tmp_path / "p.json").exists()


def test_top_k_above_the_experts_exits_2_with_the_rule(tmp_path):
    data = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64,
            "num_experts": 4, "num_experts_per_tok": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 1000}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data))
    result = invoke("profile", config, "--analytic", "--gpu", "h100-sxm", "-o", tmp_path / "p.json")
    assert result.exit_code == 2
    line = " ".join(result.output.split())
    assert "num_experts_per_tok: 8 must be between 1 and num_experts 4" in line and str(config) in line


def _with_experts(**changes):
    data = make_profile_dict(n_layers=2, sizes=(1,))
    data["experts"] = {"num_experts": 4, "experts_per_token": 2, "expert_intermediate_size": 8}
    data["layers"][1]["expert_param_bytes"] = 400
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return data


@pytest.mark.parametrize("change,needle", [
    ({"experts": None}, "needs the profile's experts"),
    ({"experts": {"num_experts": 3, "experts_per_token": 2, "expert_intermediate_size": 8}}, "not a multiple"),
    ({"experts": {"num_experts": 4, "experts_per_token": 5, "expert_intermediate_size": 8}}, "exceeds num_experts"),
    ({"parameters": {"total": 10, "active": 11}}, "exceeds total"),
])
def test_bad_expert_fields_in_a_profile_are_refused(tmp_path, change, needle):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_with_experts(**change)))
    with pytest.raises(BadInputError, match=needle):
        load_profile(path)


def test_expert_bytes_beyond_the_layers_are_refused_and_a_good_profile_loads(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_with_experts(parameters={"total": 500, "active": 300})))
    assert load_profile(path).layers[1].expert_param_bytes == 400
    data = _with_experts()
    data["layers"][1]["expert_param_bytes"] = 2000
    path.write_text(json.dumps(data))
    with pytest.raises(BadInputError, match="exceeds param_bytes"):
        load_profile(path)


def test_an_mtp_depth_moves_what_its_embedding_block_and_head_move_at_degree_2():
    cfg = load_model_config("deepseek-v3")
    shape = Shape(1024, 1, 2, sequence_parallel=True)
    parts = [unit_collectives(cfg, kind, shape) for kind in ("embedding", "block", "head")]
    depth = unit_collectives(cfg, "mtp", shape)
    assert depth.forward_bytes == sum(p.forward_bytes for p in parts) > 0
    assert depth.backward_count == sum(p.backward_count for p in parts)


def test_megatron_export_of_deepseek_says_untie_and_leaves_the_mtp_copy_to_megatron(tmp_path):
    """DeepSeek-V3's head is its own matrix (untie: Megatron ties by default); the MTP depth's
    copy of the token table is Megatron's MTP's to sync, not an embedding/head tie."""
    profile = analytic_profile("deepseek-v3", get_gpu("h100-sxm"), seq_len=1024, microbatch_sizes=[1])
    names = [layer.name for layer in profile.layers]
    plan = NS(stages=[NS(index=0, rank=0, layers=names[:32]), NS(index=1, rank=1, layers=names[32:])])
    notes = tied_weight_notes(plan, profile, "megatron")
    assert "--untie-embeddings-and-output-weights" in notes[0]
    assert any("model.embed_tokens.weight" in n and "--mtp-num-layers" in n for n in notes)
    gemma = analytic_profile("gemma2-9b", get_gpu("h100-sxm"), seq_len=1024, microbatch_sizes=[1])
    names = [layer.name for layer in gemma.layers]
    plan = NS(stages=[NS(index=0, rank=0, layers=names[:20]), NS(index=1, rank=1, layers=names[20:])])
    (note,) = tied_weight_notes(plan, gemma, "megatron")
    assert "leave the flag off" in note and "model.embed_tokens.weight" in note


def test_the_missing_expert_field_as_a_subprocess_is_one_line_and_exit_2(tmp_path):
    data = json.loads(shipped_config_dir().joinpath("deepseek-v3.json").read_text())
    del data["num_experts_per_tok"]
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data))
    done = subprocess.run([sys.executable, "-m", "pipeplan", "profile", str(config), "--analytic", "--gpu",
                           "h100-sxm", "-o", str(tmp_path / "p.json")], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2, done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and str(config) in lines[0] and "num_experts_per_tok: missing field" in lines[0]
    assert "Traceback" not in done.stderr
