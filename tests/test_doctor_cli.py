"""`pipeplan doctor` on the command line: exit codes, formats, JUnit, --fix, one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeplan.cli import app

from doctor_profiles import decoder_profile, llama3_8b, write_profile

runner = CliRunner()
DATA = Path(__file__).parent / "data" / "doctor"


@pytest.fixture
def profile(tmp_path):
    return write_profile(llama3_8b(), tmp_path / "llama3-8b.json")


def test_clean_config_exits_0_and_prints_the_layout(profile):
    result = runner.invoke(app, ["doctor", "torchtitan", str(DATA / "torchtitan_llama3_8b_pp4.toml"),
                                 "--profile", str(profile), "--memory-cap", "80GiB"])
    assert result.exit_code == 0, result.output
    assert "0 error(s), 0 warning(s)" in result.output and "tok_embeddings .. layers.7" in result.output


def test_error_finding_exits_1_with_markdown_and_junit(profile, tmp_path):
    junit = tmp_path / "doctor.xml"
    result = runner.invoke(app, ["doctor", "megatron", str(DATA / "megatron_bridge_interleaved_m6.sh"),
                                 "--profile", str(profile), "--format", "markdown", "--junit", str(junit)])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("### pipeplan doctor:") and "| error | schedule-refuses |" in result.output
    root = ET.parse(junit).getroot()
    assert root.get("failures") == "1"
    assert any(case.find("failure") is not None and "schedule-refuses" in case.get("classname")
               for case in root.iter("testcase"))


def test_json_format_and_deepspeed_parts(profile):
    result = runner.invoke(app, ["doctor", "deepspeed", str(DATA / "deepspeed_pipeline_ds_config.json"),
                                 "--profile", str(profile), "--world-size", "4", "--layers-per-part",
                                 "0,9,18,27,35", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [len(s["units"]) for s in data["layout"]] == [9, 9, 9, 8]
    assert data["plan"]["predicted"]["iteration_ms"] > data["best"]["predicted"]["iteration_ms"] > 0


def test_fix_writes_the_launchers_file(profile, tmp_path):
    out = tmp_path / "fixed.sh"
    result = runner.invoke(app, ["doctor", "megatron", str(DATA / "megatron_bridge_interleaved_m6.sh"),
                                 "--profile", str(profile), "--fix", "-o", str(out)])
    assert result.exit_code == 1 and f"wrote {out}" in result.output
    again = runner.invoke(app, ["doctor", "megatron", str(out), "--profile", str(profile)])
    assert again.exit_code == 0, again.output
    assert "--pipeline-model-parallel-layout" in out.read_text()


@pytest.mark.parametrize("args,message", [
    (["megatron", "torchtitan_bad_type.toml"], "no command with --num-layers"),
    (["torchtitan", "torchtitan_bad_type.toml"], "parallelism.pipeline_parallel_degree: '4' is a str"),
    (["deepspeed", "deepspeed_bad_type.json", "--num-stages", "4"], "train_batch_size: '64' must be a positive"),
    (["fairscale", "deepspeed_bad_type.json"], "launcher 'fairscale'"),
    (["deepspeed", "deepspeed_pipeline_ds_config.json", "--parts", "0,a"], "--parts"),
    (["megatron", "megatron_gpt3_175b.sh", "--fix"], "--fix: give -o FILE"),
    (["megatron", "nowhere.sh"], "no such file"),
])
def test_bad_input_exits_2_with_one_line(profile, args, message):
    launcher, name, *rest = args
    result = runner.invoke(app, ["doctor", launcher, str(DATA / name), "--profile", str(profile), *rest])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    if launcher != "fairscale" and "--fix" not in rest and "--parts" not in rest:
        assert name in lines[0]


def test_unparseable_script_as_a_subprocess(tmp_path):
    profile = write_profile(decoder_profile(4, 256, 4, 128, 1000), tmp_path / "p.json")
    script = tmp_path / "train.sh"
    script.write_text('torchrun pretrain_gpt.py --num-layers 4 --micro-batch-size "1\n')
    proc = subprocess.run([sys.executable, "-m", "pipeplan", "doctor", "megatron", str(script), "--profile", str(profile)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert str(script) in proc.stderr and "unterminated" in proc.stderr


REPO = Path(__file__).resolve().parents[1]
ANALYTIC = REPO / "profiles" / "transformer32-analytic.json"


@pytest.mark.parametrize("page,args", [
    ("doctor-megatron.md", ["megatron", "docs/examples/doctor/train_llama_pp4.sh"]),
    ("doctor-torchtitan.md", ["torchtitan", "docs/examples/doctor/llama_pp4.toml"]),
    ("doctor-deepspeed.md", ["deepspeed", "docs/examples/doctor/ds_config.json", "--world-size", "4",
                             "--num-stages", "4", "--partition-method", "uniform"]),
])
def test_worked_examples_in_the_docs_are_what_doctor_prints(monkeypatch, page, args):
    if not ANALYTIC.exists():
        pytest.skip("the shipped analytic profile is absent")
    monkeypatch.chdir(REPO)
    result = runner.invoke(app, ["doctor", *args, "--profile", str(ANALYTIC.relative_to(REPO))])
    assert result.exit_code in (0, 1), result.output
    text = (REPO / "docs" / page).read_text()
    assert result.output.rstrip() in text, f"docs/{page} is out of date: rerun its worked example"


def test_analytic_profiles_from_model_configs_feed_doctor(tmp_path):
    """`pipeplan profile --analytic` (HF names: model.embed_tokens, model.layers.N, lm_head) maps by
    kind onto Megatron's and torchtitan's units; the example configs raise no alarm with it."""
    profile = tmp_path / "llama3-8b.json"
    made = runner.invoke(app, ["profile", "llama3-8b", "--analytic", "--gpu", "h100-sxm", "--seq-len", "8192",
                               "--microbatch-sizes", "1,2", "-o", str(profile)])
    if made.exit_code != 0:
        pytest.skip(f"analytic profiles are not available: {made.output.strip()[-200:]}")
    for launcher, name in [("megatron", "megatron_llama3_8b_pp4.sh"), ("torchtitan", "torchtitan_llama3_8b_pp4.toml")]:
        result = runner.invoke(app, ["doctor", launcher, str(DATA / name), "--profile", str(profile), "--format", "json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.output)
        assert not [f for f in data["findings"] if f["severity"] != "info"], data["findings"]
        assert data["plan"] is not None and data["best"] is not None
    out = tmp_path / "fixed.toml"
    result = runner.invoke(app, ["doctor", "torchtitan", str(DATA / "torchtitan_issue775_microbatches_lt_pp.toml"),
                                 "--profile", str(profile), "--fix", "-o", str(out)])
    assert result.exit_code == 1 and "model.layers" not in out.read_text() and '"layers.0"' in out.read_text()


def test_plan_for_a_launcher_on_the_command_line(tmp_path):
    """`pipeplan plan --launcher megatron` never picks an interleaved count Megatron refuses."""
    profile = write_profile(decoder_profile(16, 1024, 8, 1024, 32000, sizes=(1,)), tmp_path / "p.json")
    out = tmp_path / "plan.json"
    args = ["plan", str(profile), "--stages", "4", "--global-batch", "6", "--schedule", "interleaved", "-q"]
    assert runner.invoke(app, [*args, "-o", str(out)]).exit_code == 0  # torch's class runs 6
    refused = runner.invoke(app, [*args, "--launcher", "megatron"])
    assert refused.exit_code == 2 and "its interleaved schedule refuses 6" in refused.output
    ok = runner.invoke(app, ["plan", str(profile), "--stages", "4", "--global-batch", "8", "--launcher", "megatron",
                             "-o", str(out), "-q"])
    assert ok.exit_code == 0, ok.output
    plan = json.loads(out.read_text())
    assert plan["settings"]["launcher"] == "megatron" and plan["schedule"] in ("1f1b", "interleaved")
    bad = runner.invoke(app, [*args, "--launcher", "fairscale"])
    assert bad.exit_code == 2 and bad.output.startswith("error: --launcher")


def test_the_header_and_the_best_plan_say_micro_batches_the_same_way(profile, tmp_path):
    # The header said "micro-batch 2 x 32" (size x count), the best-plan line "32 x 2" (count x size).
    config = json.loads((DATA / "deepspeed_pipeline_ds_config.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 2
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, ["doctor", "deepspeed", str(path), "--profile", str(profile), "--world-size", "4",
                                 "--layers-per-part", "0,9,18,27,35"])
    assert result.exit_code in (0, 1), result.output
    assert "32 micro-batches of 2 per replica" in result.output
    best = next(line for line in result.output.splitlines() if line.startswith("best plan"))
    assert re.search(r"v = \d+, \d+ micro-batches of \d+, layers per stage", best), best
    assert not re.search(r"micro-batch \d+ x \d+|, \d+ x \d+,", result.output)
