"""torchtitan's activation checkpointing as pipeplan costs it: per-op SAC's kept bytes and rerun
forward against the policy of torchtitan 0.2.2 written out by hand, every-N-th-block SAC, one
setting on every stage, the export read back by torchtitan's ConfigManager and by doctor, and
bad input (docs/cost-model.md, "Recomputation as the launchers run it")."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_checks import invoke, one_line_error
from test_export_fixtures import torchtitan_config_manager

from pipeplan.analytic import analytic_profile
from pipeplan.analytic.efficiency import DEFAULT_EFFICIENCY as EFF
from pipeplan.analytic.efficiency import parts_ms
from pipeplan.analytic.families import load_model_config
from pipeplan.analytic.flops import Shape, unit_work
from pipeplan.analytic.op_sac import op_sac_saved_gemms
from pipeplan.api import plan_any
from pipeplan.doctor import doctor_file, read_config
from pipeplan.errors import BadInputError
from pipeplan.export import export_plan
from pipeplan.formats.gpu import resolve_gpu
from pipeplan.formats.io import dump_model, load_plan, load_profile
from pipeplan.formats.plan import PlanSettings
from pipeplan.plan.torchtitan_ac import layer_sac_blocks, parse_selective_ac_option, with_torchtitan_selective
from pipeplan.requests import PipelineRequest

SEQ, B = 1024, 2
SHA = "0" * 64


@pytest.fixture(scope="module")
def llama():
    cfg = load_model_config("llama3-8b")
    gpu = resolve_gpu("h100-sxm", None)
    return cfg, gpu, analytic_profile(cfg, gpu, seq_len=SEQ, microbatch_sizes=(B,))


def _block_ms(cfg, gpu, names, shape):
    peak, bw = gpu.flops_for("bf16"), gpu.hbm_bytes_per_s
    forward = unit_work(cfg, "block", 0, shape).forward
    return parts_ms([p for p in forward if p.name in names], peak, bw, EFF)


def test_op_sac_keeps_what_torchtitans_policy_saves(llama):
    cfg, gpu, profile = llama
    # mm calls in a Llama block's forward: wq, wk, wv, wo, w1, w3, w2; the odd-numbered are saved.
    assert op_sac_saved_gemms(cfg, 0, Shape(SEQ, B)) == ("q_proj", "v_proj", "gate_proj", "down_proj")
    block = profile.layers[1].cost_at(B)
    tokens, h, f, e = SEQ * B, cfg.hidden_size, cfg.intermediate_size, 2
    kv = cfg.num_kv_heads * cfg.head_dim
    # The block's input, wq's output, wv's output, the attention output, its fp32 log-sum-exp
    # (4 bytes per head and token), w1's output and w2's output.
    kept = e * tokens * (h + h + kv + h + f + h) + 4 * cfg.num_heads * tokens
    assert block.activation_bytes - block.selective_op_sac.saved_bytes == kept
    # What runs again: every forward part but the four saved GEMMs and the attention kernel.
    forward = [p.name for p in unit_work(cfg, "block", 0, Shape(SEQ, B)).forward]
    again = [n for n in forward if n not in ("q_proj", "v_proj", "gate_proj", "down_proj", "attention_core")]
    assert set(again) == {"input_norm", "k_proj", "rotary", "o_proj", "attention_residual", "mlp_norm", "up_proj",
                          "activation", "mlp_residual"}
    assert block.selective_op_sac.recompute_ms == pytest.approx(_block_ms(cfg, gpu, again, Shape(SEQ, B)), abs=2e-6)
    # Units torchtitan does not wrap (embedding, norm, head) offer none.
    assert all(layer.cost_at(B).selective_op_sac is None for layer in profile.layers if layer.kind != "block")


def test_op_sac_under_tensor_parallelism_keeps_the_reduce_scattered_outputs():
    cfg = load_model_config("llama3-8b")
    gpu = resolve_gpu("h100-sxm", None)
    t = 2
    profile = analytic_profile(cfg, gpu, seq_len=SEQ, microbatch_sizes=(1,), tensor_parallel=(t,))
    block = profile.layers[1].cost_at(1, t)
    tokens, h, f, e = SEQ, cfg.hidden_size, cfg.intermediate_size, 2
    kv = cfg.num_kv_heads * cfg.head_dim
    # Sequence-parallel input h / t; wq, wv, w1 column shards; w2's partial output h; the attention
    # output and statistics of the rank's heads; wo's and w2's reduce-scattered outputs h / t each.
    kept = e * tokens * (h / t + h / t + kv / t + h / t + f / t + h + 2 * h / t) + 4 * cfg.num_heads // t * tokens
    assert block.activation_bytes - block.selective_op_sac.saved_bytes == kept


def _plan(profile, **kw):
    base = dict(stages=1, global_batch=B, microbatch_size=B, schedule="1f1b", recompute="selective",
                launcher="torchtitan")
    return plan_any(profile, PipelineRequest(**{**base, **kw}), profile_sha256=SHA)


def test_op_sac_plan_keeps_and_reruns_the_sums(llama):
    _, _, profile = llama
    none = _plan(profile, recompute="none")
    plan = _plan(profile)
    [stage], [plain] = plan.stages, none.stages
    costs = [layer.cost_at(B) for layer in profile.layers]
    kept = sum(c.activation_bytes - (c.selective_op_sac.saved_bytes if c.selective_op_sac else 0) for c in costs)
    assert stage.recompute_granularity == "selective" and stage.selective_activation_bytes == kept
    rerun = sum(c.selective_op_sac.recompute_ms for c in costs if c.selective_op_sac)
    assert stage.backward_ms - plain.backward_ms == pytest.approx(rerun, abs=1e-5)
    assert plan.settings.selective_ac_option is None  # the default, op


@pytest.mark.parametrize("every", [1, 2, 3])
def test_every_nth_block_recomputes_in_full(llama, every):
    _, _, profile = llama
    none = _plan(profile, recompute="none")
    plan = _plan(profile, selective_ac_option=str(every))
    blocks = [i for i, layer in enumerate(profile.layers) if layer.kind == "block"]
    chosen = layer_sac_blocks(profile, every)
    # torchtitan's _apply_layer_sac: a counter over the blocks from 1, count % N == 0 checkpointed.
    assert chosen == [b for n, b in enumerate(blocks, start=1) if n % every == 0]
    costs = [layer.cost_at(B) for layer in profile.layers]
    kept = sum(c.activation_bytes for i, c in enumerate(costs) if i not in chosen)
    kept += sum(costs[i - 1].output_bytes for i in chosen)  # each checkpointed block keeps its input
    [stage], [plain] = plan.stages, none.stages
    assert stage.selective_activation_bytes == kept
    assert stage.backward_ms - plain.backward_ms == pytest.approx(sum(costs[i].forward_ms for i in chosen), abs=1e-5)
    # The peak: kept bytes plus the largest rebuilt block's freed bytes (one at a time).
    freed = max(costs[i].activation_bytes - costs[i - 1].output_bytes for i in chosen)
    assert plan.ranks[0].peak_memory_bytes - none.ranks[0].peak_memory_bytes == pytest.approx(
        kept + freed - plain.activation_bytes, abs=len(costs) + 2)


def test_torchtitan_recomputes_alike_on_every_stage(llama):
    _, _, profile = llama
    base = dict(stages=4, global_batch=16, microbatch_size=B, schedule="1f1b")
    # Between what fits with every stage recomputing (31.7 GiB) and without recomputation (37.0 GiB).
    cap = 34 * 2**30
    plan = plan_any(profile, PipelineRequest(**base, memory_cap_bytes=cap, launcher="torchtitan"), profile_sha256=SHA)
    modes = {(s.recompute, s.recompute_granularity) for s in plan.stages}
    assert len(modes) == 1 and modes != {(False, None)}


@pytest.mark.parametrize("option", ["op", "2"])
def test_export_torchtitan_reads_and_doctor_costs_the_same(llama, tmp_path, option):
    _, _, profile = llama
    plan = plan_any(profile, PipelineRequest(stages=2, global_batch=8, microbatch_size=B, schedule="1f1b",
                                             recompute="selective", selective_ac_option=option,
                                             launcher="torchtitan"), profile_sha256=SHA)
    files = export_plan(plan, profile, "torchtitan")
    toml = tmp_path / "job.toml"
    toml.write_text(files[".toml"])
    config = torchtitan_config_manager()().parse_args(["--job.config_file", str(toml)])
    assert (config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option) == ("selective",
                                                                                                     option)
    prof = tmp_path / "profile.json"
    prof.write_text(dump_model(profile))
    parsed, _ = read_config("torchtitan", toml, profile)
    assert parsed.recompute == "selective" and parsed.settings["activation_checkpoint.selective_ac_option"] == option
    settings = PlanSettings(stages=1, global_batch=1, bandwidth_bytes_per_s=plan.settings.bandwidth_bytes_per_s)
    result, _, _ = doctor_file("torchtitan", toml, prof, settings)
    assert result.plan is not None
    for doctor_stage, stage in zip(result.plan.stages, plan.stages):
        assert doctor_stage.selective_activation_bytes == stage.selective_activation_bytes
        assert doctor_stage.backward_ms == pytest.approx(stage.backward_ms, abs=1e-6)


def test_doctor_reads_torchtitans_default_option(llama):
    # No selective_ac_option: torchtitan 0.2's default "2" (every second block), not per op.
    _, _, profile = llama
    settings = PlanSettings(stages=1, launcher="torchtitan", selective_ac_option="2")
    layer_sac = with_torchtitan_selective(profile, settings)
    op = with_torchtitan_selective(profile, settings.model_copy(update={"selective_ac_option": None}))
    assert layer_sac.layers[2].cost_at(B).selective_recompute_ms == layer_sac.layers[2].cost_at(B).forward_ms
    assert layer_sac.layers[1].cost_at(B).selective_recompute_ms == 0.0
    assert op.layers[1].cost_at(B).selective_recompute_ms == op.layers[1].cost_at(B).selective_op_sac.recompute_ms


def test_bad_input_exits_2(llama, tmp_path):
    _, _, profile = llama
    prof = tmp_path / "profile.json"
    prof.write_text(dump_model(profile))
    args = ("plan", prof, "--stages", "2", "--global-batch", "4", "--recompute", "selective")
    one_line_error(invoke(*args, "--launcher", "torchtitan", "--selective-ac-option", "every"), 2,
                   "--selective-ac-option", "every")
    one_line_error(invoke(*args, "--launcher", "torchtitan", "--selective-ac-option", "0"), 2, "--selective-ac-option")
    one_line_error(invoke(*args, "--launcher", "megatron", "--selective-ac-option", "op"), 2, "--selective-ac-option",
                   "--launcher torchtitan")
    one_line_error(invoke(*args, "--launcher", "torchtitan", "--recompute-modules", "layernorm"), 2,
                   "--recompute-modules")
    with pytest.raises(BadInputError, match="selective_ac_option"):
        parse_selective_ac_option("1e3")
    # A measured profile (no selective_op_sac) has no per-op form.
    bare = profile.model_copy(update={"layers": [layer.model_copy(update={"costs": [
        c.model_copy(update={"selective_op_sac": None}) for c in layer.costs]}) for layer in profile.layers]})
    with pytest.raises(BadInputError, match="per-op activation checkpointing"):
        with_torchtitan_selective(bare, PlanSettings(stages=1, launcher="torchtitan", recompute="selective"))
    # doctor: a selective_ac_option torchtitan's apply_ac refuses.
    toml = tmp_path / "bad.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 2\nseq_len = 1024\n'
                    '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "sometimes"\n')
    one_line_error(invoke("doctor", "torchtitan", toml, "--profile", prof), 2, "selective_ac_option", "sometimes")
    assert Path(toml).exists()


def test_cli_plan_records_the_option_and_replans_byte_for_byte(llama, tmp_path):
    _, _, profile = llama
    prof = tmp_path / "profile.json"
    prof.write_text(dump_model(profile))
    out = tmp_path / "plan.json"
    result = invoke("plan", prof, "--stages", "2", "--global-batch", "8", "--microbatch-size", str(B), "--schedule",
                    "1f1b", "--launcher", "torchtitan", "--recompute", "selective", "--selective-ac-option", "3",
                    "-o", out)
    assert result.exit_code == 0, result.stderr
    written = load_plan(out)
    assert written.settings.selective_ac_option == "3"
    assert all(s.recompute_granularity == "selective" for s in written.stages)
    again = plan_any(load_profile(prof), written.settings, profile_sha256=written.profile.sha256)
    assert again.model_dump_json() == written.model_dump_json()
    assert invoke("show", out).exit_code == 0


@pytest.mark.parametrize("section,note", [('mode = "selective"\nselective_ac_option = "0"', None),
                                          ('mode = "memory_budget"', "memory_budget")])
def test_doctor_reads_every_block_and_notes_memory_budget(llama, tmp_path, section, note):
    _, _, profile = llama
    prof = tmp_path / "profile.json"
    prof.write_text(dump_model(profile))
    toml = tmp_path / "job.toml"
    toml.write_text(f'[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = {B}\nseq_len = {SEQ}\n'
                    f'[activation_checkpoint]\n{section}\n')
    settings = PlanSettings(stages=1, global_batch=1)
    result, _, _ = doctor_file("torchtitan", toml, prof, settings)
    [stage] = result.plan.stages
    if note is None:
        # "0": torchtitan's _apply_layer_sac checkpoints every block (not ac_freq), costed as N = 1.
        every = _plan(profile, selective_ac_option="1")
        assert stage.selective_activation_bytes == every.stages[0].selective_activation_bytes
    else:
        assert not stage.recompute and any(note in n for n in result.notes)
