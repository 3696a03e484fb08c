"""doctor --cluster: launcher configs at t > 1 and d > 1, costed exactly as the cluster plan of the same
configuration, with memory per rank by part, MFU, and ZeRO findings.

The profiles are the shipped analytic ones (``pipeplan profile llama3-70b --analytic ...``); the
configs are written the way each launcher's docs write them. Every doctor number that matters is
checked against ``pipeplan plan --gpus --cluster --data-parallel --tensor-parallel --zero
--layers-per-stage ...`` for the same configuration, through the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.doctor import DoctorOptions, doctor_file, read_config
from pipeplan.formats.io import load_plan, load_profile
from pipeplan.formats.plan import PlanSettings

DATA = Path(__file__).parent / "data" / "doctor"
REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
runner = CliRunner()

#: Llama 3 70B on 8 DGX H100 nodes, written like Megatron-LM's examples: t = 8, p = 4, d = 2 with the
#: distributed optimizer, and t = 8, p = 2, d = 4 without it (docs/doctor-megatron.md's examples).
EXAMPLES = REPO / "docs" / "examples" / "doctor"


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    root = tmp_path_factory.mktemp("profiles")
    out = {}
    for name, model, gpu, extra in [
        # docs/doctor-megatron.md's profile.
        ("70b", "llama3-70b", "h100-sxm", ["--seq-len", "8192", "--microbatch-sizes", "1,2", "--tensor-parallel", "2,4,8"]),
        ("8b", "llama3-8b", "h100-sxm", ["--seq-len", "8192", "--microbatch-sizes", "1", "--tensor-parallel", "2"]),
    ]:
        path = root / f"{name}.json"
        result = _invoke("profile", model, "--analytic", "--gpu", gpu, *extra, "-o", path)
        assert result.exit_code == 0, result.output
        out[name] = path
    return out


def _script(tmp_path, pp=4, distributed_optimizer=True, name="train.sh"):
    source = EXAMPLES / ("train_llama3_70b.sh" if pp == 4 else "train_llama3_70b_pp2.sh")
    text = source.read_text()
    has = "--use-distributed-optimizer" in text
    if distributed_optimizer and not has:
        text = text.replace("    --sequence-parallel\n", "    --sequence-parallel\n    --use-distributed-optimizer\n")
    elif has and not distributed_optimizer:
        text = text.replace("    --use-distributed-optimizer\n", "")
    path = tmp_path / name
    path.write_text(text)
    return path


def _doctor(launcher, config, profile, **options):
    options.setdefault("search_layouts", False)
    settings = PlanSettings(stages=1, global_batch=1, optimizer=options.pop("optimizer", "adam-fp32-grads"))
    return doctor_file(launcher, config, profile, settings, options=DoctorOptions(cluster="dgx-h100", **options))


def _plan(tmp_path, profile, result, *extra):
    """``pipeplan plan`` of the configuration doctor read, split included."""
    c = result.config
    counts = ",".join(str(len(s.layers)) for s in sorted(result.plan.stages, key=lambda s: s.index))
    out = tmp_path / "plan.json"
    d = c.data_degree
    args = ["plan", profile, "--gpus", d * c.tensor_degree * c.pipeline_degree, "--cluster", "dgx-h100",
            "--data-parallel", d, "--tensor-parallel", c.tensor_degree, "--zero", c.zero_stage,
            "--layers-per-stage", counts, "--schedule", c.schedule, "--virtual-stages", c.virtual_stages,
            "--microbatch-size", c.microbatch_size, "--global-batch", d * c.samples_per_replica,
            "--launcher", c.launcher, *extra, "-o", out]
    done = _invoke(*args)
    return done, (load_plan(out) if done.exit_code == 0 else None)


def _flagged(result):
    return [f for f in result.findings if f.severity in ("error", "warning")]


def test_megatron_70b_t8_p4_d2_is_the_cluster_plan_of_the_same_configuration(tmp_path, profiles):
    script = _script(tmp_path)
    result, text, _ = _doctor("megatron", script, profiles["70b"])
    c = result.config
    assert (c.tensor_degree, c.pipeline_degree, c.data_degree, c.zero_stage, c.sequence_parallel) == (8, 4, 2, 1, True)
    assert result.exit_code == 0 and not _flagged(result), text
    done, plan = _plan(tmp_path, profiles["70b"], result, "--recompute", "none", "--optimizer", "adam-fp32-grads")
    assert done.exit_code == 0, done.output
    mine = result.plan
    # The same iteration, to the digit, and the same parts.
    assert mine.predicted.iteration_ms == plan.predicted.iteration_ms
    for part in ("compute_ms", "bubble_ms", "transfer_ms", "tensor_parallel_ms", "data_parallel_ms", "optimizer_ms",
                 "model_flops_utilization", "tokens_per_second_per_gpu"):
        assert getattr(mine.predicted, part) == getattr(plan.predicted, part), part
    pr = mine.predicted
    parts = (pr.compute_ms + pr.bubble_ms + pr.transfer_ms + pr.tensor_parallel_ms + pr.data_parallel_ms
             + pr.optimizer_ms + (pr.overhead_ms or 0))
    assert parts == pytest.approx(pr.iteration_ms, rel=1e-6)
    assert pr.tensor_parallel_ms > 0 and pr.data_parallel_ms > 0 and 0.2 < pr.model_flops_utilization < 0.7
    assert f"MFU {100 * pr.model_flops_utilization:.3g}%" in text
    # Memory per rank by part: the plan's state, its simulated peak, the cluster's reserve.
    memory = result.cluster_cost.memory
    assert [m.planned_bytes for m in memory] == [r.peak_memory_bytes for r in plan.ranks]
    for m, stage in zip(memory, sorted(plan.stages, key=lambda s: s.rank)):
        assert (m.weight_bytes, m.gradient_bytes, m.optimizer_bytes) == (
            stage.weight_bytes, stage.gradient_bytes, stage.optimizer_bytes)
        assert m.optimizer_bytes == pytest.approx(6 * stage.param_bytes / 2, rel=1e-6)  # 12 B/param over d = 2
    top = max(memory, key=lambda m: m.planned_bytes)
    assert top.reserve_bytes == plan.reserve_bytes
    assert all(m.total_bytes <= 80 * GIB for m in memory)
    assert "memory per GPU:" in text and "weights" in text


def test_zero0_over_the_cap_is_flagged_by_how_much_and_the_distributed_optimizer_fixes_it(tmp_path, profiles):
    script = _script(tmp_path, pp=2, distributed_optimizer=False)
    result, text, _ = _doctor("megatron", script, profiles["70b"])
    assert result.config.data_degree == 4 and result.config.zero_stage == 0
    over = [f for f in result.findings if f.code == "over-memory"]
    assert result.exit_code == 1 and over, text
    worst = max(result.cluster_cost.memory, key=lambda m: m.total_bytes)
    assert worst.total_bytes > 80 * GIB
    from pipeplan.quantities import format_bytes

    assert f"{format_bytes(worst.total_bytes - 80 * GIB)} over the 80.00 GiB cap" in over[0].message
    assert "optimizer" in over[0].message and "--use-distributed-optimizer" in over[0].fix
    # The planner agrees: this configuration does not fit at ZeRO 0 and fits at ZeRO 1.
    done, _ = _plan(tmp_path, profiles["70b"], result, "--recompute", "none", "--optimizer", "adam-fp32-grads")
    assert done.exit_code == 3, done.output
    fixed_script = _script(tmp_path, pp=2, distributed_optimizer=True, name="zero1.sh")
    fixed, text, _ = _doctor("megatron", fixed_script, profiles["70b"])
    assert not [f for f in fixed.findings if f.code == "over-memory"] and fixed.exit_code == 0, text
    done, plan = _plan(tmp_path, profiles["70b"], fixed, "--recompute", "none", "--optimizer", "adam-fp32-grads")
    assert done.exit_code == 0 and plan.predicted.iteration_ms == fixed.plan.predicted.iteration_ms


def test_fix_turns_on_the_distributed_optimizer_and_round_trips(tmp_path, profiles):
    script = _script(tmp_path, pp=2, distributed_optimizer=False)
    out = tmp_path / "fixed.sh"
    result = _invoke("doctor", "megatron", script, "--profile", profiles["70b"], "--cluster", "dgx-h100",
                     "--same-layout", "--fix", "-o", out)
    assert result.exit_code == 1, result.output  # the input config is over the cap
    assert "--use-distributed-optimizer" in out.read_text()
    again = _invoke("doctor", "megatron", out, "--profile", profiles["70b"], "--cluster", "dgx-h100", "--same-layout")
    assert again.exit_code == 0, again.output
    config, layout = read_config("megatron", out, load_profile(profiles["70b"]))
    assert config.zero_stage == 1
    best = _doctor("megatron", script, profiles["70b"])[0].best
    assert [len(s.units) for s in layout.stages][1:-1] == [len(s.layers) for s in sorted(
        best.stages, key=lambda s: s.index)][1:-1]


def test_torchtitan_fsdp_tp_pp_is_costed_at_zero3(tmp_path, profiles):
    # FSDP 2 x TP 8 x PP 4, interleaved, full activation checkpointing (tests/data, torchtitan's style).
    # Under a pipeline torchtitan's default reshard policy keeps the weights whole after forward
    # (parallelize.py: reshard_after_forward = not pp_enabled): ZeRO 1's memory; "always" is ZeRO 3.
    default = DATA / "torchtitan_llama3_70b_interleaved.toml"
    assert _doctor("torchtitan", default, profiles["70b"], optimizer="adam")[0].config.zero_stage == 1
    toml = tmp_path / "always.toml"
    toml.write_text(default.read_text().replace("[parallelism]\n", '[parallelism]\nfsdp_reshard_after_forward = "always"\n'))
    result, text, _ = _doctor("torchtitan", toml, profiles["70b"], optimizer="adam")
    c = result.config
    assert (c.data_degree, c.tensor_degree, c.pipeline_degree, c.zero_stage, c.recompute) == (2, 8, 4, 3, "full")
    # Full recomputation with each GPU at a third of its memory: the one thing flagged is the gap.
    assert result.exit_code == 0 and [f.code for f in _flagged(result)] == ["gap-to-best"], text
    assert "drop recomputation" in _flagged(result)[0].message
    done, plan = _plan(tmp_path, profiles["70b"], result, "--recompute", "all", "--optimizer", "adam")
    assert done.exit_code == 0, done.output
    assert plan.predicted.iteration_ms == result.plan.predicted.iteration_ms
    assert plan.parallelism.zero_stage == 3
    # ZeRO 3: the weights are a shard plus the units gathered whole, more than a plain shard.
    from pipeplan.facts.training_state import state_memory
    from pipeplan.facts.training_state import training_state

    state = training_state("adam", 2)
    for m, rank in zip(result.cluster_cost.memory, sorted(plan.ranks, key=lambda r: r.rank)):
        own = [s for s in plan.stages if s.rank == rank.rank]
        shard = sum(state_memory(s.param_bytes / 2, state, 3, 2).weight_bytes for s in own)
        gathered = m.weight_bytes - shard
        assert gathered > 0 and m.planned_bytes == rank.peak_memory_bytes + gathered
    # data_parallel_shard_degree = -1 takes what the world size leaves: the same job.
    shard = tmp_path / "shard.toml"
    shard.write_text(toml.read_text().replace("data_parallel_shard_degree = 2", "data_parallel_shard_degree = -1"))
    again, _, _ = _doctor("torchtitan", shard, profiles["70b"], optimizer="adam", world_size=64)
    assert again.config.data_degree == 2 and again.plan.predicted.iteration_ms == result.plan.predicted.iteration_ms


def _ds_config(tmp_path, stage: int) -> Path:
    data = json.loads((DATA / "deepspeed_pipeline_ds_config.json").read_text())
    data["zero_optimization"]["stage"] = stage
    path = tmp_path / f"ds_zero{stage}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def test_deepspeed_zero1_data_parallel_is_the_cluster_plan(tmp_path, profiles):
    # train_batch_size 64 = micro-batch 1 x 16 accumulation x d 4 on 16 GPUs in 4 stages.
    path = _ds_config(tmp_path, 1)
    profile = load_profile(profiles["8b"])
    parts = [0, 9, 18, 26, len(profile.layers)]
    result, text, _ = _doctor("deepspeed", path, profiles["8b"], optimizer="adam", world_size=16,
                              parts=tuple(parts))
    c = result.config
    assert (c.data_degree, c.pipeline_degree, c.zero_stage, c.num_microbatches) == (4, 4, 1, 16)
    assert result.exit_code == 0 and not _flagged(result), text
    done, plan = _plan(tmp_path, profiles["8b"], result, "--recompute", "none", "--optimizer", "adam")
    assert done.exit_code == 0, done.output
    assert plan.predicted.iteration_ms == result.plan.predicted.iteration_ms
    assert [len(s.layers) for s in plan.stages] == [b - a for a, b in zip(parts, parts[1:])]
    # DeepSpeed's PipelineEngine refuses ZeRO 2 and 3.
    refused, text, _ = _doctor("deepspeed", _ds_config(tmp_path, 2), profiles["8b"], world_size=16, parts=tuple(parts))
    assert any(f.code == "refused" and "zero_optimization.stage" in f.setting for f in refused.findings), text


@pytest.mark.parametrize("launcher,name,extra", [
    ("megatron", "megatron_llama3_8b_pp4.sh", []),
    ("torchtitan", "torchtitan_llama3_8b_pp4.toml", []),
])
def test_launchers_example_configs_raise_no_alarm_on_a_cluster(launcher, name, extra, profiles):
    result = _invoke("doctor", launcher, DATA / name, "--profile", profiles["8b"], "--cluster", "dgx-h100",
                     "--same-layout", *extra)
    assert result.exit_code == 0, result.output
    # Nothing wrong with the config is claimed: no error, and no warning but the predicted gap to
    # pipeplan's plan (Megatron's even split leaves the 128k-vocabulary head and loss on the last
    # rank, which interleaving evens out: predicted 1.11x).
    flagged = [line for line in result.output.splitlines() if line.startswith(("error:", "warning:"))]
    assert all(line.startswith("warning: [gap-to-best]") for line in flagged), result.output
    assert "MFU" in result.output and "memory per GPU:" in result.output


def test_search_over_layouts_finds_a_plan_at_least_as_fast(profiles):
    result, text, _ = _doctor("megatron", DATA / "megatron_llama3_8b_pp4.sh", profiles["8b"], search_layouts=True)
    assert result.best_any is not None and result.best is not None, text
    par = result.best_any.parallelism
    assert par.num_gpus == 8 and par.zero_stage == 1
    assert result.best_any.predicted.iteration_ms <= result.best.predicted.iteration_ms * (1 + 1e-9)
    assert result.best.predicted.iteration_ms <= result.plan.predicted.iteration_ms * (1 + 1e-9)
    assert "best plan for the same 8 GPUs" in text


@pytest.mark.parametrize("args,words", [
    (["--cluster", "no-such-cluster"], ["--cluster", "no-such-cluster"]),
    (["--cluster", "missing.toml"], ["missing.toml"]),
])
def test_bad_cluster_exits_2_naming_it(tmp_path, profiles, args, words):
    result = _invoke("doctor", "megatron", _script(tmp_path), "--profile", profiles["70b"], *args)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and all(w in result.output for w in words), result.output


def test_cluster_file_with_a_negative_field_exits_2_naming_the_file_and_field(tmp_path, profiles):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\ngpu = "h100-sxm"\ngpus_per_node = 8\n[intra_node]\nbandwidth = "450GB/s"\n'
                   'latency_us = -1\n[inter_node]\nbandwidth = "50GB/s"\nlatency_us = 14\n')
    result = _invoke("doctor", "megatron", _script(tmp_path), "--profile", profiles["70b"], "--cluster", bad)
    assert result.exit_code == 2 and "bad.toml" in result.output and "latency_us" in result.output, result.output


def test_profile_without_the_configs_tensor_degree_exits_2(tmp_path, profiles):
    # The 8B profile has degrees 1 and 2; the script runs t = 8.
    script = DATA / "megatron_llama3_8b_pp4.sh"
    text = script.read_text().replace("TP_SIZE=2", "TP_SIZE=8").replace("NUM_NODES=1", "NUM_NODES=4")
    path = tmp_path / "t8.sh"
    path.write_text(text)
    result = _invoke("doctor", "megatron", path, "--profile", profiles["8b"], "--cluster", "dgx-h100", "--same-layout")
    assert result.exit_code == 2 and "--tensor-model-parallel-size 8" in result.output and "t8.sh" in result.output, result.output


def test_deepspeed_zero_stage_out_of_range_exits_2(tmp_path, profiles):
    path = _ds_config(tmp_path, 7)
    result = _invoke("doctor", "deepspeed", path, "--profile", profiles["8b"], "--num-stages", "4")
    assert result.exit_code == 2 and "zero_optimization.stage" in result.output and path.name in result.output


def test_deepspeed_zero0_over_the_cap_is_fixed_at_zero1_and_fix_writes_the_stage(tmp_path, profiles):
    path = _ds_config(tmp_path, 0)
    out = tmp_path / "fixed.json"
    common = ["--profile", profiles["8b"], "--cluster", "dgx-h100", "--same-layout", "--world-size", "16",
              "--memory-cap", "64GiB"]
    result = _invoke("doctor", "deepspeed", path, "--num-stages", "4", *common, "--fix", "-o", out)
    assert result.exit_code == 1 and "[over-memory] rank 0" in result.output, result.output
    assert "use zero_optimization.stage = 1 (ZeRO 1)" in result.output
    fixed = json.loads(out.read_text())
    assert fixed["zero_optimization"]["stage"] == 1 and fixed["optimizer"]["type"] == "Adam"  # the rest kept
    parts = json.loads((tmp_path / "fixed.parts.json").read_text())["parts"]
    again = _invoke("doctor", "deepspeed", out, "--parts", ",".join(map(str, parts)), *common)
    assert again.exit_code == 0 and "over-memory" not in again.output, again.output


@pytest.mark.parametrize("script", ["train_llama3_70b.sh", "train_llama3_70b_pp2.sh"])
def test_cluster_worked_examples_in_the_docs_are_what_doctor_prints(monkeypatch, profiles, script):
    monkeypatch.chdir(REPO)
    result = _invoke("doctor", "megatron", f"docs/examples/doctor/{script}", "--profile", profiles["70b"],
                     "--cluster", "dgx-h100", "--same-layout")
    assert result.exit_code in (0, 1), result.output
    text = (REPO / "docs" / "doctor-megatron.md").read_text()
    assert result.output.rstrip() in text, "docs/doctor-megatron.md is out of date: rerun its cluster example"


def test_deepspeed_with_tensor_parallelism_is_costed_at_its_degree(tmp_path, profiles):
    # Megatron-DeepSpeed style: t = 2 from the command line, 4 stages, 16 GPUs, so d = 2.
    data = json.loads((DATA / "deepspeed_pipeline_ds_config.json").read_text())
    data.update(train_batch_size=32, gradient_accumulation_steps=16, zero_optimization={"stage": 1})
    path = tmp_path / "ds_t2.json"
    path.write_text(json.dumps(data, indent=2))
    profile = load_profile(profiles["8b"])
    parts = (0, 9, 18, 26, len(profile.layers))
    result, text, _ = _doctor("deepspeed", path, profiles["8b"], optimizer="adam", world_size=16, parts=parts,
                              tensor_degree=2)
    c = result.config
    assert (c.data_degree, c.tensor_degree, c.pipeline_degree) == (2, 2, 4)
    assert result.exit_code == 0 and result.plan.parallelism.tensor == 2, text
    done, plan = _plan(tmp_path, profiles["8b"], result, "--recompute", "none", "--optimizer", "adam")
    assert done.exit_code == 0 and plan.predicted.iteration_ms == result.plan.predicted.iteration_ms, done.output
    assert result.plan.predicted.tensor_parallel_ms > 0
    cli = _invoke("doctor", "deepspeed", path, "--profile", profiles["8b"], "--cluster", "dgx-h100", "--same-layout",
                  "--world-size", "16", "--tensor-parallel", "2", "--parts", ",".join(map(str, parts)))
    assert cli.exit_code == 0 and f"{result.plan.predicted.iteration_ms:.6g} ms per iteration" in cli.output, cli.output


def test_megatron_overlap_flags_are_costed_as_the_plan_with_the_same_overlap(tmp_path, profiles):
    """--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size in the script: doctor's cluster
    costing hides what `pipeplan plan --overlap grad-reduce,param-gather` hides, to the digit."""
    script = _script(tmp_path)
    plain, _, _ = _doctor("megatron", script, profiles["70b"])
    text = script.read_text().replace("    --use-distributed-optimizer\n", "    --use-distributed-optimizer\n"
                                      "    --overlap-grad-reduce\n    --overlap-param-gather\n"
                                      "    --ddp-bucket-size 50000000\n")
    script.write_text(text)
    result, report, _ = _doctor("megatron", script, profiles["70b"])
    assert result.config.overlap == ("grad-reduce", "param-gather") and result.config.ddp_bucket_size == 50_000_000
    mine, before = result.plan.predicted, plain.plan.predicted
    assert mine.iteration_ms < before.iteration_ms and before.gradient_reduce_ms is None
    assert mine.gradient_reduce_ms + mine.param_gather_ms == pytest.approx(mine.data_parallel_ms, abs=1e-5)
    assert "exposed: gradient reduce" in report
    done, plan = _plan(tmp_path, profiles["70b"], result, "--recompute", "none", "--optimizer", "adam-fp32-grads",
                       "--overlap", "grad-reduce,param-gather", "--ddp-bucket-size", "50000000")
    assert done.exit_code == 0, done.output
    assert plan.predicted.iteration_ms == mine.iteration_ms
    assert plan.predicted.data_parallel_hidden_ms == mine.data_parallel_hidden_ms
