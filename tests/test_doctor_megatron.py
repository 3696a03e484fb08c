"""doctor on Megatron-LM launch scripts: the layout megatron-core builds, the bugs users filed, --fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from pipeplan.doctor import DoctorOptions, doctor_file, read_config
from pipeplan.launchers.megatron.reader import megatron_layout_of, parse_megatron
from pipeplan.launchers.megatron.shell import read_script
from pipeplan.errors import BadInputError
from pipeplan.launchers.megatron.writer import interleaved_refusal
from pipeplan.formats.plan import PlanSettings

from doctor_profiles import decoder_profile, gpt3_175b, llama3_8b, llama3_70b, write_profile

DATA = Path(__file__).parent / "data" / "doctor"
GIB = 2**30
SETTINGS = PlanSettings(stages=1, global_batch=1, memory_cap_bytes=80 * GIB, bandwidth_bytes_per_s=25e9)


def _doctor(name, profile, tmp_path, settings=SETTINGS, **kw):
    path = write_profile(profile, tmp_path / "profile.json")
    return doctor_file("megatron", DATA / name, path, settings, **kw)


def _codes(result, severity=None):
    return {f.code for f in result.findings if severity is None or f.severity == severity}


def _flagged(result):
    return [f for f in result.findings if f.severity in ("error", "warning")]


# ------------------------------------------------------------------------ reading scripts


def test_script_reader_expands_arrays_variables_and_defaults():
    text = (DATA / "megatron_llama3_8b_pp4.sh").read_text()
    config = parse_megatron("x.sh", text)
    assert (config.pipeline_degree, config.tensor_degree, config.data_degree) == (4, 2, 1)
    assert (config.microbatch_size, config.num_microbatches, config.num_layers) == (1, 128, 32)
    assert config.sharded_optimizer and config.sequence_parallel
    script = read_script("x.sh", text)
    assert script.scalars["WORLD_SIZE"] == "8"  # $(($GPUS_PER_NODE*$NUM_NODES))
    assert "--mock-data" in script.arrays["DATA_ARGS_LIST"]


def test_plain_argument_list_is_read():
    config = parse_megatron("a.args", (DATA / "megatron_issue1304_30_layers_pp4.args").read_text())
    assert (config.num_layers, config.pipeline_degree, config.num_microbatches) == (30, 4, 16)


@pytest.mark.parametrize("text,where", [
    ("torchrun x.py --num-layers 8 --hidden-size \"1024\n", "unterminated"),
    ("ARGS=(\n --num-layers 8\n", "never closed"),
    ("torchrun x.py --num-layers eight --pipeline-model-parallel-size 2 --micro-batch-size 1", "--num-layers"),
    ("torchrun x.py --num-layers 8 --recompute-granularity fancy --micro-batch-size 1", "--recompute-granularity"),
    ("torchrun x.py --num-layers $LAYERS --micro-batch-size 1", "--num-layers"),
    ("echo hello", "no command"),
])
def test_bad_scripts_name_the_file_and_setting(tmp_path, text, where):
    path = tmp_path / "train.sh"
    path.write_text(text)
    with pytest.raises(BadInputError) as info:
        read_config("megatron", path, llama3_8b())
    assert str(path) in str(info.value) and where in str(info.value)


def test_variables_the_script_does_not_set_come_from_var(tmp_path):
    path = tmp_path / "train.sh"
    path.write_text("torchrun x.py --num-layers $LAYERS --pipeline-model-parallel-size 2 --micro-batch-size 1 "
                    "--global-batch-size 8")
    config, layout = read_config("megatron", path, None, DoctorOptions(variables=(("LAYERS", "8"),)))
    assert config.num_layers == 8 and [len(s.units) for s in layout.stages] == [5, 5]


# ------------------------------------------------------------------------ layout = megatron-core's


def _core():
    pytest.importorskip("torch")
    try:
        import torch
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_config import TransformerConfig
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    except ImportError:
        pytest.skip("megatron-core not installed")
    return torch, TransformerConfig, get_num_layers_to_build, get_transformer_layer_offset


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), v=st.sampled_from([1, 2, 3, 5, 8]), per=st.integers(1, 4), first=st.integers(0, 5),
       last=st.integers(0, 5), mode=st.sampled_from(["even", "uneven", "account"]))
def test_layout_matches_megatron_core(p, v, per, first, last, mode):
    """Every (rank, virtual stage) builds the layers megatron-core's own helpers say."""
    torch, TransformerConfig, num_to_build, offset = _core()
    kw, flags = {}, []
    if mode == "even":
        layers = p * v * per
    elif mode == "uneven":
        first, last = first * v, last * v  # megatron-core needs them divisible by v
        layers = first + last + (p - 2) * v * per
        kw.update(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
        flags += ["--decoder-first-pipeline-num-layers", str(first), "--decoder-last-pipeline-num-layers", str(last)]
    else:
        layers = p * v * per - 2
        if layers < 1 or (v > 1 and per < 2):
            return
        kw.update(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
        flags += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    if layers < 1:
        return
    if v > 1:
        kw["virtual_pipeline_model_parallel_size"] = v
        flags += ["--num-virtual-stages-per-pipeline-rank", str(v)]
    try:
        core = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=8, pipeline_dtype=torch.bfloat16,
                                 pipeline_model_parallel_size=p, **kw)
        expected = {(r, vs): (offset(core, vs if v > 1 else None, r), num_to_build(core, vs if v > 1 else None, r))
                    for r in range(p) for vs in range(v)}
    except (AssertionError, ValueError, ZeroDivisionError):
        return  # megatron-core refuses it (or fails on it: p = 2 uneven with v > 1 divides by zero)
    text = " ".join(["--num-layers", str(layers), "--pipeline-model-parallel-size", str(p),
                     "--micro-batch-size", "1", *flags])
    layout = megatron_layout_of(parse_megatron("a.args", text))
    assert not layout.problems
    for stage in layout.stages:
        decoders = [int(u.split(".")[1]) for u in stage.units if u.startswith("decoder.")]
        start, count = expected[(stage.rank, stage.vstage)]
        assert decoders == list(range(start, start + count))


@pytest.mark.parametrize("layout,p", [("Et*3|(tt|)*2,t|L", 5), ("E|t*4|t*4|tL", 4), ("Ett|tt|tt|tt|t|tt|t|tL", 4)])
def test_layout_string_parsed_by_megatron_core(layout, p):
    torch, TransformerConfig, num_to_build, offset = _core()
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    real = PipelineParallelLayerLayout(layout, p)
    count = sum(str(x).lower().endswith("decoder") for row in real.layout for stage in row for x in stage)
    config = parse_megatron("a.args", f"--num-layers {count} --pipeline-model-parallel-size {p} --micro-batch-size 1 "
                                      f"--pipeline-model-parallel-layout '{layout}'")
    ours = megatron_layout_of(config)
    assert not ours.problems
    for stage in ours.stages:
        built = real.layout[stage.rank][stage.vstage]
        assert sum(u.startswith("decoder.") for u in stage.units) == sum("decoder" in str(x).lower() for x in built)


# ------------------------------------------------------------------------ the filed bugs


def test_issue_468_80_layers_pp16_vp2_trains_64(tmp_path):
    result, text, _ = _doctor("megatron_issue468_80_layers_pp16_vp2.sh", llama3_70b(), tmp_path)
    lost = next(f for f in result.findings if f.code == "layers-lost")
    assert lost.severity == "error" and "16 of 80 transformer layers" in lost.message and "only 64" in lost.message
    refused = next(f for f in result.findings if f.code == "refused")
    assert "--num-layers-per-virtual-pipeline-stage 2" in refused.setting
    assert result.exit_code == 1 and result.best is not None  # and a plan that trains all 80


def test_issue_1304_30_layers_become_28(tmp_path):
    result, _, _ = _doctor("megatron_issue1304_30_layers_pp4.args", decoder_profile(30, 2048, 16, 2048, 50257), tmp_path)
    lost = next(f for f in result.findings if f.code == "layers-lost")
    assert "only 28 are trained" in lost.message and "decoder.28, decoder.29" in lost.message


def test_interleaved_micro_batches_megatron_refuses(tmp_path):
    result, _, _ = _doctor("megatron_bridge_interleaved_m6.sh", llama3_8b(), tmp_path)
    finding = next(f for f in result.findings if f.code == "schedule-refuses")
    assert finding.severity == "error" and "The remainder of M" in finding.message
    assert "use 8 micro-batches" in finding.fix
    # and the best plan is one Megatron runs
    best = result.best
    assert best.schedule == "1f1b" or interleaved_refusal(4, best.num_microbatches) is None


@pytest.mark.parametrize("m,refused", [(2, True), (4, False), (6, True), (7, True), (8, False), (9, True), (12, False)])
def test_interleaved_rule_is_megatron_cores(monkeypatch, m, refused):
    """megatron-core's own forward_backward_pipelining_with_interleaving, run up to its check."""
    torch, TransformerConfig, _, _ = _core()
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel import schedules

    core = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=8, pipeline_dtype=torch.bfloat16,
                             pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    chunk = torch.nn.Linear(2, 2)
    chunk.config = core
    group = SimpleNamespace(size=lambda: 4, rank=lambda: 0)
    comm = SimpleNamespace(config=core, pp_group=group)
    groups = SimpleNamespace(tp=group, cp=group, embd=None, pos_embd=None, pp=group, dp_cp=group)
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: zeros(*a, **{**k, "device": "cpu"}))
    reached = RuntimeError("past megatron's micro-batch check")

    def stop(*args, **kwargs):
        raise reached

    from megatron.core.enums import ModelType

    monkeypatch.setattr(schedules, "get_model_type", lambda model: ModelType.encoder_or_decoder)
    monkeypatch.setattr(schedules, "get_pp_rank_microbatches", stop)  # the first call after the check
    with pytest.raises((ValueError, RuntimeError)) as info:
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=None, data_iterator=[None, None], model=[chunk, chunk], num_microbatches=m,
            seq_length=4, micro_batch_size=1, p2p_communicator=comm, pg_collection=groups)
    megatron_refused = info.value is not reached
    assert megatron_refused == refused == (interleaved_refusal(4, m) is not None)


def test_uneven_first_stage_memory_is_not_underestimated(tmp_path):
    """Megatron-Bridge 5077: an uneven pipeline's first rank holds more than an even share."""
    profile = llama3_8b()
    path = tmp_path / "train.sh"
    path.write_text("torchrun --nproc_per_node 4 pretrain_gpt.py --num-layers 32 --pipeline-model-parallel-size 4 "
                    "--decoder-first-pipeline-num-layers 14 --decoder-last-pipeline-num-layers 6 "
                    "--micro-batch-size 1 --global-batch-size 32 --bf16")
    prof_path = write_profile(profile, tmp_path / "p.json")
    result, _, _ = doctor_file("megatron", path, prof_path, SETTINGS.model_copy(update={"memory_cap_bytes": None}))
    peaks = [r.peak_memory_bytes for r in result.plan.ranks]
    even_share = sum(peaks) / len(peaks)
    assert peaks[0] > 1.3 * even_share  # 14 layers x 4 micro-batches in flight on rank 0
    cap = int((peaks[0] + even_share) / 2)
    result, _, _ = doctor_file("megatron", path, prof_path, SETTINGS.model_copy(update={"memory_cap_bytes": cap}))
    over = [f for f in result.findings if f.code == "over-memory"]
    assert over and over[0].message.startswith("rank 0 ") and "over the" in over[0].message


# ------------------------------------------------------------------------ no false alarms


@pytest.mark.parametrize("name,profile", [("megatron_llama3_8b_pp4.sh", llama3_8b), ("megatron_gpt3_175b.sh", gpt3_175b)])
def test_example_scripts_raise_no_alarm(tmp_path, name, profile):
    result, text, _ = _doctor(name, profile(), tmp_path)
    assert result.exit_code == 0 and not _flagged(result), text
    assert result.plan is not None and result.best is not None
    assert any("give --cluster" in note for note in result.notes)  # t > 1: memory is not claimed


# ------------------------------------------------------------------------ --fix


@pytest.mark.parametrize("name,profile", [
    ("megatron_llama3_8b_pp4.sh", llama3_8b),
    ("megatron_issue468_80_layers_pp16_vp2.sh", llama3_70b),
    ("megatron_bridge_interleaved_m6.sh", llama3_8b),
])
def test_fix_round_trips_and_keeps_other_settings(tmp_path, name, profile):
    out = tmp_path / "fixed.sh"
    result, _, written = _doctor(name, profile(), tmp_path, fix_output=out)
    assert written == [out]
    original, fixed = (DATA / name).read_text(), out.read_text()
    config, layout = read_config("megatron", out, None)
    best = result.best
    assert not layout.problems
    assert [s.rank for s in layout.stages] == [s.rank for s in sorted(best.stages, key=lambda s: s.index)]
    blocks = [sum(u.startswith("decoder.") for u in s.units) for s in layout.stages]
    assert blocks == [sum(n.startswith("layers.") for n in s.layers) for s in sorted(best.stages, key=lambda s: s.index)]
    assert config.microbatch_size == best.microbatch_size and config.num_microbatches == best.num_microbatches
    # every line that does not carry a pipeline flag is kept as it was
    touched = ("--pipeline-model-parallel-layout", "--num-layers-per-virtual-pipeline-stage", "--micro-batch-size",
               "--num-virtual-stages-per-pipeline-rank", "MICRO_BATCH_SIZE=", "MBS=", "VP=", "--recompute")
    kept = [line for line in original.splitlines() if not any(t in line for t in touched)]
    assert [line for line in fixed.splitlines() if line in kept] == kept
    again, _, _ = doctor_file("megatron", out, tmp_path / "profile.json", SETTINGS)
    assert again.exit_code == 0 and again.speedup == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------------ the planner, told the launcher


def test_planner_does_not_pick_interleaved_counts_megatron_refuses():
    """PlanSettings.launcher = megatron: no interleaved plan with a micro-batch count Megatron refuses."""
    from pipeplan.api import plan_profile  # noqa: F401  (the public API the CLI calls)
    from pipeplan.plan import make_plan

    profile = llama3_8b(sizes=(1, 2))
    base = PlanSettings(stages=4, global_batch=6, schedule="interleaved", virtual_stages=2, microbatch_size=1,
                        memory_cap_bytes=None, recompute="none")
    free = make_plan(profile, base, profile_sha256="0" * 64)  # torch's class runs 6 micro-batches
    assert free.num_microbatches == 6 and interleaved_refusal(4, 6) is not None
    with pytest.raises(BadInputError, match="launcher megatron: its interleaved schedule refuses 6"):
        make_plan(profile, base.model_copy(update={"launcher": "megatron"}), profile_sha256="0" * 64)
    auto = base.model_copy(update={"launcher": "megatron", "schedule": "auto", "virtual_stages": None,
                                   "microbatch_size": None, "global_batch": 12})
    plan = make_plan(profile, auto, profile_sha256="0" * 64)
    assert plan.schedule in ("1f1b", "interleaved")
    assert plan.schedule == "1f1b" or interleaved_refusal(4, plan.num_microbatches) is None
    refused = [a for a in plan.alternatives if a.reason.startswith("refused") and "launcher megatron" in a.reason]
    assert refused  # 12 / 2 = 6 micro-batches were on offer and refused
    with pytest.raises(BadInputError, match="deepspeed runs 1f1b"):
        make_plan(profile, base.model_copy(update={"launcher": "deepspeed"}), profile_sha256="0" * 64)


# ------------------------------------------------------------------------ script edits, by property

_STYLES = ("array", "continuation", "variable", "inline")


def _script(style: str, mbs: int, gbs: int, vp: int | None) -> str:
    flags = [("--num-layers", "24"), ("--pipeline-model-parallel-size", "4"), ("--micro-batch-size", str(mbs)),
             ("--global-batch-size", str(gbs)), ("--hidden-size", "1024")]
    if vp:
        flags.append(("--num-layers-per-virtual-pipeline-stage", str(vp)))
    if style == "array":
        body = "\n".join(f"    {f} {v}  # {f[2:]}" for f, v in flags)
        return f"ARGS=(\n{body}\n)\ntorchrun --nproc_per_node 4 pretrain_gpt.py ${{ARGS[@]}} --bf16\n"
    if style == "continuation":
        body = " \\\n".join(f"    {f} {v}" for f, v in flags)
        return f"torchrun --nproc_per_node 4 pretrain_gpt.py \\\n{body} \\\n    --bf16\n"
    if style == "variable":
        names = {f: f[2:].upper().replace("-", "_") for f, _ in flags}
        head = "".join(f"{names[f]}={v}\n" for f, v in flags)
        return head + "torchrun pretrain_gpt.py " + " ".join(f'{f} "${{{names[f]}}}"' for f, _ in flags) + "\n"
    return "torchrun pretrain_gpt.py " + " ".join(f"{f}={v}" for f, v in flags) + " --bf16\n"


@settings(max_examples=40, deadline=None)
@given(style=st.sampled_from(_STYLES), mbs=st.integers(1, 8), gbs=st.integers(1, 64), vp=st.sampled_from([None, 1, 2, 3]),
       new_mbs=st.integers(1, 16), layout=st.sampled_from(["Et*6|t*6|t*6|t*6L", "Et*2|(t*3|)*6,t*4L"]))
def test_fix_edits_are_what_megatron_reads(style, mbs, gbs, vp, new_mbs, layout):
    from pipeplan.doctor.fix import edit_flag

    text = _script(style, mbs, gbs, vp)
    anchors = ("--pipeline-model-parallel-size",)
    edited = edit_flag(text, "--num-layers-per-virtual-pipeline-stage", None)
    edited = edit_flag(edited, "--micro-batch-size", str(new_mbs), after=anchors)
    edited = edit_flag(edited, "--pipeline-model-parallel-layout", layout, after=anchors)
    before, after = parse_megatron("a.sh", text), parse_megatron("b.sh", edited)
    assert after.microbatch_size == new_mbs
    assert after.settings["--pipeline-model-parallel-layout"] == layout
    assert "--num-layers-per-virtual-pipeline-stage" not in after.settings
    for flag in ("--num-layers", "--pipeline-model-parallel-size", "--global-batch-size", "--hidden-size"):
        assert after.settings.get(flag) == before.settings.get(flag)
    assert not megatron_layout_of(after).problems


@pytest.mark.parametrize("layers, p, flags, v", [
    (80, 4, ["--num-layers-per-virtual-pipeline-stage", "4"], 5),   # Llama 3 70B at PP 4 VP 5
    (126, 8, ["--num-virtual-stages-per-pipeline-rank", "8", "--account-for-embedding-in-pipeline-split",
              "--account-for-loss-in-pipeline-split"], 8),          # Llama 3.1 405B at PP 8 VP 8
])
def test_published_virtual_stage_counts_read_as_megatron_builds_them(layers, p, flags, v):
    """The recipes' VP 5 and VP 8 are read, not refused, and each (rank, virtual stage) builds
    the layers megatron-core's own helpers say."""
    torch, TransformerConfig, num_to_build, offset = _core()
    account = "--account-for-loss-in-pipeline-split" in flags
    core = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=8, pipeline_dtype=torch.bfloat16,
                             pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v,
                             account_for_embedding_in_pipeline_split=account, account_for_loss_in_pipeline_split=account)
    text = " ".join(["--num-layers", str(layers), "--pipeline-model-parallel-size", str(p),
                     "--micro-batch-size", "1", *flags])
    config = parse_megatron("a.args", text)
    assert config.virtual_stages == v
    layout = megatron_layout_of(config)
    assert not layout.problems and len(layout.stages) == p * v
    for stage in layout.stages:
        decoders = [int(u.split(".")[1]) for u in stage.units if u.startswith("decoder.")]
        start, count = offset(core, stage.vstage, stage.rank), num_to_build(core, stage.vstage, stage.rank)
        assert decoders == list(range(start, start + count))
