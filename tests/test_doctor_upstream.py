"""doctor on real upstream launch files (tests/data/doctor/upstream/, origin and licence in its
ORIGIN.md): each misreading issue 23 found has a test here on the file itself."""

from __future__ import annotations

import tomllib

import pytest
from typer.testing import CliRunner

from conftest import REPO
from pipeplan.analytic.api import analytic_profile
from pipeplan.cli import app
from pipeplan.launchers.torchtitan.reader import parse_torchtitan
from pipeplan.facts.gpus import get_gpu
from pipeplan.formats.io import dump_model, load_plan

UPSTREAM = REPO / "tests" / "data" / "doctor" / "upstream"

pytestmark = pytest.mark.slow


def _file(name: str):
    path = UPSTREAM / name
    return path, path.read_text()


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """Analytic Llama 3 profiles on A100 80GB at torchtitan's sequence (8192)."""
    root = tmp_path_factory.mktemp("upstream")
    out = {}
    for model, sizes in (("llama3-8b", (1, 2)), ("llama3-70b", (1, 8)), ("llama3-405b", (1, 2))):
        path = root / f"{model}.json"
        path.write_text(dump_model(analytic_profile(model, get_gpu("a100-80gb"), seq_len=8192,
                                                    microbatch_sizes=sizes, tensor_parallel=(1, 8))))
        out[model] = path
    return out


def _doctor(config, profile, gpus, *extra):
    return CliRunner().invoke(app, ["doctor", "torchtitan", str(config), "--profile", str(profile), "--cluster",
                                    "dgx-a100", "--world-size", str(gpus), "--same-layout", *extra])


@pytest.mark.parametrize("name, local", [("torchtitan_v0.2.2_llama3_70b.toml", 8),
                                         ("torchtitan_v0.2.2_llama3_405b.toml", 2)])
def test_no_pipeline_runs_one_local_batch_whole(name, local):
    """At PP 1 torchtitan runs local_batch_size as one batch (gradient accumulation 1), not
    local_batch_size micro-batches of pipeline_parallel_microbatch_size (its default 1)."""
    path, text = _file(name)
    config = parse_torchtitan(str(path), text, world_size=64)
    assert (config.pipeline_degree, config.microbatch_size, config.num_microbatches) == (1, local, 1)


def test_70b_gap_is_a_change_not_what_the_file_already_runs_and_said_without_a_schedule(profiles):
    path, _ = _file("torchtitan_v0.2.2_llama3_70b.toml")
    result = _doctor(path, profiles["llama3-70b"], 64)
    assert result.exit_code in (0, 1), result.output
    assert "no pipeline (p = 1)" in result.output and "1 batches (gradient accumulation) of 8" in result.output
    # The misreading was a "faster" plan that is the file itself (one batch of 8). What doctor may
    # claim is a real change: here micro-batch 1 with gradient accumulation 8 and no recomputation.
    assert "micro-batch size 8 (1 micro-batches)" not in result.output, result.output
    gap = next(line for line in result.output.splitlines() if "[gap-to-best]" in line)
    assert "as fast as pipeplan's best plan" in gap or "micro-batch size 1 (8 micro-batches)" in gap, gap
    assert "[imbalance]" not in result.output  # one stage has nothing to be imbalanced against


def test_405b_fix_writes_no_pipeline_keys_under_pp_1(profiles, tmp_path):
    path, text = _file("torchtitan_v0.2.2_llama3_405b.toml")
    fixed = tmp_path / "fixed.toml"
    result = _doctor(path, profiles["llama3-405b"], 128, "--fix", "-o", str(fixed))
    assert result.exit_code in (0, 1), result.output
    parallelism = tomllib.loads(fixed.read_text())["parallelism"]
    assert parallelism["pipeline_parallel_degree"] == 1
    assert not {"pipeline_parallel_schedule", "module_fqns_per_model_part",
                "pipeline_parallel_microbatch_size"} & set(parallelism), parallelism


def test_8b_fix_makes_exactly_the_change_its_finding_states(profiles, tmp_path):
    """The finding says "drop recomputation"; the fixed file differs in activation_checkpoint.mode
    alone, torchtitan's own ConfigManager accepts it, and doctor then finds no gap."""
    path, text = _file("torchtitan_v0.2.2_llama3_8b.toml")
    fixed = tmp_path / "fixed.toml"
    result = _doctor(path, profiles["llama3-8b"], 8, "--fix", "-o", str(fixed))
    assert result.exit_code == 0, result.output
    assert "drop recomputation" in result.output
    before, after = tomllib.loads(text), tomllib.loads(fixed.read_text())
    changed = {(table, key) for table in set(before) | set(after)
               for key in set(before.get(table, {})) | set(after.get(table, {}))
               if before.get(table, {}).get(key) != after.get(table, {}).get(key)}
    assert changed == {("activation_checkpoint", "mode")} and after["activation_checkpoint"]["mode"] == "none"
    parse_torchtitan(str(fixed), fixed.read_text())  # runs torchtitan's ConfigManager where it imports
    again = _doctor(fixed, profiles["llama3-8b"], 8)
    assert "as fast as pipeplan's best plan" in again.output, again.output


@pytest.fixture(scope="module")
def gpt3_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt3") / "gpt3-175b.json"
    path.write_text(dump_model(analytic_profile("gpt3-175b", get_gpu("a100-80gb"), seq_len=2048, microbatch_sizes=(1,),
                                                tensor_parallel=(8,))))
    return path


def test_megatron_175b_as_written_is_refused_at_start_up_and_read_as_written(gpt3_profile):
    """8 processes for t x p = 128: Megatron refuses to start, so doctor says error (exit 1); the
    script's --fp16 is noticed; without --sequence-parallel the header does not claim it."""
    path, _ = _file("megatron_core_v0.16.1_train_gpt3_175b_distributed.sh")
    result = CliRunner().invoke(app, ["doctor", "megatron", str(path), "--profile", str(gpt3_profile), "--cluster",
                                      "dgx-a100", "--same-layout"])
    assert result.exit_code == 1, result.output
    assert "error: [world-size]" in result.output and "world_size (8) is not divisible by 128" in result.output
    assert "[precision] fp16" in result.output
    header = result.output.splitlines()[1]
    assert header.startswith("on dgx-a100:") and "sequence parallel" not in header, header


def test_doctor_reads_pipeplans_own_megatron_export_and_a_script_that_sources_it(profiles, tmp_path):
    """README's way to launch a plan: `source plan.sh && torchrun ... "${PIPEPLAN_MEGATRON_ARGS[@]}"`.
    doctor reads the export alone (its flags array) and a script sourcing it (read beside the
    script, never run), and the export says the profile's precision (--bf16)."""
    from pipeplan.launchers.megatron.reader import parse_megatron

    runner = CliRunner()
    plan, export = tmp_path / "plan.json", tmp_path / "plan.sh"
    assert runner.invoke(app, ["plan", str(profiles["llama3-8b"]), "--gpus", "16", "--cluster", "dgx-a100",
                               "--global-batch", "64", "--launcher", "megatron", "-q", "-o", str(plan)]).exit_code == 0
    assert runner.invoke(app, ["export", str(plan), "--format", "megatron", "--profile", str(profiles["llama3-8b"]),
                               "-o", str(export)]).exit_code == 0
    assert "--bf16" in export.read_text()
    script = tmp_path / "run.sh"
    script.write_text('#!/bin/bash\nsource plan.sh && torchrun --nproc-per-node 8 --nnodes 2 pretrain_gpt.py '
                      '"${PIPEPLAN_MEGATRON_ARGS[@]}" --hidden-size 4096\n')
    alone = parse_megatron(str(export), export.read_text(), world_size=16)
    sourced = parse_megatron(str(script), script.read_text())
    for config in (alone, sourced):
        assert (config.num_layers, config.microbatch_size) == (32, 1) and "--bf16" in config.settings
    assert sourced.settings["world size"] == "16"
    result = runner.invoke(app, ["doctor", "megatron", str(script), "--profile", str(profiles["llama3-8b"]),
                                 "--cluster", "dgx-a100", "--same-layout"])
    assert "no command with" not in result.output and "[precision]" not in result.output, result.output
    # plan --launcher megatron, export, doctor: no error and no gap (the plan keeps Megatron's
    # fp32 main gradients: --optimizer auto is adam-fp32-grads under --launcher megatron).
    assert "0 error(s), 0 warning(s)" in result.output and "as fast as pipeplan's best plan" in result.output
    assert load_plan(plan).settings.optimizer == "adam-fp32-grads"
    # A script that sources itself is refused by name, not read forever.
    loop = tmp_path / "loop.sh"
    loop.write_text("source loop.sh\n")
    with pytest.raises(Exception, match="sources itself"):
        parse_megatron(str(loop), loop.read_text())


@pytest.mark.parametrize("launcher, suffix", [("megatron", ".sh"), ("torchtitan", ".toml"), ("deepspeed", ".json")])
def test_plan_for_a_launcher_then_export_then_doctor_finds_no_error_and_no_gap(profiles, tmp_path, launcher, suffix):
    """A plan for a launcher is a plan the launcher runs (pipeplan.launchers.registry: its ZeRO stages,
    optimizer state and schedules), so doctor on its export costs it the same and finds no gap."""
    runner = CliRunner()
    plan, export = tmp_path / "plan.json", tmp_path / f"export{suffix}"
    profile = profiles["llama3-8b"]
    assert runner.invoke(app, ["plan", str(profile), "--gpus", "16", "--cluster", "dgx-a100", "--global-batch", "64",
                               "--launcher", launcher, "-q", "-o", str(plan)]).exit_code == 0
    assert runner.invoke(app, ["export", str(plan), "--format", launcher, "--profile", str(profile),
                               "-o", str(export)]).exit_code == 0
    result = runner.invoke(app, ["doctor", launcher, str(export), "--profile", str(profile), "--cluster", "dgx-a100",
                                 "--world-size", "16", "--same-layout"])
    assert result.exit_code == 0, result.output
    assert "0 error(s), 0 warning(s)" in result.output and "as fast as pipeplan's best plan" in result.output
    predicted = float(result.output.split("predicted: ")[1].split(" ms")[0])
    assert predicted == pytest.approx(load_plan(plan).predicted.iteration_ms, rel=1e-6)


REGISTRY = '''
from dataclasses import dataclass, field


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    tensor_parallel_degree: int = 8
    pipeline_parallel_degree: int = 2
    pipeline_parallel_microbatch_size: int = 2


@dataclass
class Training:
    local_batch_size: int = 8
    seq_len: int = 8192


@dataclass
class Job:
    model: dict = field(default_factory=lambda: {"name": "llama3", "flavor": "70B"})
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: dict = field(default_factory=lambda: {"mode": "full"})


def llama3_70b():
    return Job()
'''


def test_doctor_reads_a_python_config_registry_and_command_line_overrides(profiles, tmp_path, monkeypatch):
    """torchtitan's main branch: jobs are Python functions (`doctor torchtitan module:function`,
    imported from the current directory as torchtitan does); any job takes overrides
    (`--var parallelism.pipeline_parallel_degree=2`, torchtitan's `--parallelism....=2`), which
    torchtitan's own ConfigManager checks on a TOML job."""
    (tmp_path / "my_jobs_for_doctor.py").write_text(REGISTRY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = _doctor("my_jobs_for_doctor:llama3_70b", profiles["llama3-70b"], 64)
    assert "my_jobs_for_doctor:llama3_70b: torchtitan, 2 pipeline ranks" in result.output, result.output
    assert "4 micro-batches of 2" in result.output
    path, _ = _file("torchtitan_v0.2.2_llama3_70b.toml")
    result = _doctor(path, profiles["llama3-70b"], 64, "--var", "parallelism.pipeline_parallel_degree=2",
                     "--var", "--parallelism.pipeline_parallel_microbatch_size=4")
    assert "torchtitan, 2 pipeline ranks" in result.output and "2 micro-batches of 4" in result.output, result.output
    bad = _doctor(path, profiles["llama3-70b"], 64, "--var", "parallelism.no_such_key=1")
    assert bad.exit_code == 2 and "no_such_key" in bad.output, bad.output
    missing = _doctor("no_such_module_here:job", profiles["llama3-70b"], 64)
    assert missing.exit_code == 2 and "cannot import no_such_module_here" in missing.output
