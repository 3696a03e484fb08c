"""Issue 24's findings (hardening, round two), one test per class member: exit 2 (or 3) and one
line, or the right answer; never an internal error, a hang, a clobbered file or a left process."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cli_checks import invoke, one_line_error, write
from conftest import make_profile_dict
from doctor_profiles import llama3_8b, write_profile
from pipeplan.errors import BadInputError

DOCTOR = Path(__file__).parent / "data" / "doctor"


# ---------------------------------------------------------------- outputs
def test_a_fifo_output_is_refused_and_left_a_fifo(tmp_path, profile_file):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    one_line_error(invoke("plan", profile_file, "--stages", 2, "-o", fifo, "-q"), 2, "FIFO")
    assert fifo.is_fifo()


def test_a_link_to_a_device_is_refused(tmp_path, profile_file, plan_file):
    # Through a link so that the old code replaced the link, never /dev/null itself.
    link = tmp_path / "null.json"
    link.symlink_to("/dev/null")
    one_line_error(invoke("plan", profile_file, "--stages", 2, "-o", link, "-q"), 2, "character device")
    one_line_error(invoke("export", plan_file, "--format", "torch", "-o", link), 2, "character device")
    one_line_error(invoke("schema", "plan", "-o", link), 2, "character device")
    assert link.is_symlink() and os.readlink(link) == "/dev/null"


@pytest.mark.parametrize("name", ["", "x" * 300])
def test_empty_and_too_long_output_names_are_one_line(profile_file, name):
    one_line_error(invoke("plan", profile_file, "--stages", 2, "-o", name, "-q"), 2, "-o")


def test_doctor_junit_equal_to_the_profile_is_refused(tmp_path):
    profile = write_profile(llama3_8b(), tmp_path / "p.json")
    before = profile.read_bytes()
    result = invoke("doctor", "torchtitan", DOCTOR / "torchtitan_llama3_8b_pp4.toml", "--profile", profile,
                    "--memory-cap", "80GiB", "--junit", profile)
    one_line_error(result, 2, "--junit", "input")
    assert profile.read_bytes() == before


def test_doctor_fix_sidecar_equal_to_an_input_is_refused(tmp_path):
    # --fix -o ds.json writes ds.parts.json beside it: here that is the profile.
    profile = write_profile(llama3_8b(), tmp_path / "ds.parts.json")
    before = profile.read_bytes()
    result = invoke("doctor", "deepspeed", DOCTOR / "deepspeed_pipeline_ds_config.json", "--profile", profile,
                    "--world-size", "4", "--num-stages", "4", "--fix", "-o", tmp_path / "ds.json")
    one_line_error(result, 2, "ds.parts.json", "input")
    assert profile.read_bytes() == before and not (tmp_path / "ds.json").exists()


@pytest.fixture
def titan_plan(tmp_path):
    """A plan of a Llama-like profile, which exports to torchtitan without its profile."""
    from pipeplan.formats.io import dump_model, file_sha256, load_profile
    from pipeplan.formats.plan import PlanSettings
    from pipeplan.plan import make_plan
    from test_export_fixtures import llama_like_profile, profile_bytes

    path = tmp_path / "tiny.json"
    path.write_bytes(profile_bytes(llama_like_profile(8, head_forward_ms=8.0)))
    settings = PlanSettings(stages=4, global_batch=16, memory_cap_bytes=8 * 2**30, schedule="1f1b")
    plan = make_plan(load_profile(path), settings, profile_sha256=file_sha256(path))
    return write(tmp_path, dump_model(plan), "tiny.plan.json")


def test_export_sidecar_equal_to_an_input_is_refused(tmp_path, titan_plan):
    sidecar = tmp_path / "t.schedule.csv"  # the plan itself, by an odd name
    shutil.copy(titan_plan, sidecar)
    before = sidecar.read_bytes()
    result = invoke("export", sidecar, "--format", "torchtitan", "--schedule-csv", "-o", tmp_path / "t.toml")
    one_line_error(result, 2, "t.schedule.csv", "input")
    assert sidecar.read_bytes() == before and not (tmp_path / "t.toml").exists()


def test_multi_file_export_is_all_or_nothing(tmp_path, titan_plan):
    (tmp_path / "t.schedule.csv").mkdir()  # the CSV cannot be written
    one_line_error(invoke("export", titan_plan, "--format", "torchtitan", "--schedule-csv", "-o", tmp_path / "t.toml"),
                   2, "t.schedule.csv", "directory")
    assert not (tmp_path / "t.toml").exists()


def test_a_failing_rename_puts_every_file_back(tmp_path, monkeypatch):
    from pipeplan.formats import io

    old = write(tmp_path, "old", "a.txt")
    real = os.replace
    calls = []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(io.os, "replace", flaky)
    with pytest.raises(BadInputError, match="b.txt: cannot write: No space left"):
        io.write_files_atomic({old: "new", tmp_path / "b.txt": "b", tmp_path / "c.txt": "c"})
    monkeypatch.setattr(io.os, "replace", real)
    assert old.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_run_report_target_is_checked_before_the_run(tmp_path, plan_file, profile_file):
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    one_line_error(invoke("run", plan_file, "--profile", profile_file, "--report", fifo), 2, "--report", "FIFO")


# ---------------------------------------------------------------- input limits, before parsing
def test_an_integer_past_pythons_digit_limit_is_one_line(tmp_path):
    path = write(tmp_path, '{"schema_version": 1' + "0" * 5000 + "}")
    one_line_error(invoke("validate", path), 2, "p.json", "line 1", "5001 digits", "at most 100")
    text = json.dumps(make_profile_dict()).replace('"param_bytes": 1000', '"param_bytes": ' + "9" * 5000, 1)
    one_line_error(invoke("plan", write(tmp_path, text, "q.json"), "--stages", 2), 2, "q.json", "digits")


def test_a_file_without_end_is_refused_at_the_size_limit():
    one_line_error(invoke("validate", "/dev/zero"), 2, "/dev/zero", "64 MiB")


def test_a_huge_array_is_refused_before_the_model_sees_it(tmp_path):
    data = make_profile_dict()
    data["edges"] = [["layer0", "layer1"]] * 200_001
    one_line_error(invoke("validate", write(tmp_path, data)), 2, "edges", "200001 items", "200,000")


def test_every_toml_loader_has_the_limits(tmp_path, profile_file):
    cluster = write(tmp_path, "name = 'c'\ngpus_per_node = " + "9" * 5000 + "\n", "c.toml")
    one_line_error(invoke("cluster", cluster), 2, "c.toml", "line 2", "digits")
    gpu = write(tmp_path, "[gpu]\nname = 'g'\nmemory = " + "9" * 5000 + "\n", "g.toml")
    one_line_error(invoke("profile", "gpt2-tiny", "--analytic", "--gpu-spec", gpu, "-o", tmp_path / "o.json"), 2,
                   "g.toml", "digits")
    titan = write(tmp_path, "[training]\nglobal_batch_size = " + "9" * 5000 + "\n", "t.toml")
    one_line_error(invoke("doctor", "torchtitan", titan, "--profile", profile_file), 2, "t.toml", "digits")


def test_doctor_inputs_have_the_limits(tmp_path, profile_file):
    script = write(tmp_path, "torchrun pretrain_gpt.py --global-batch-size " + "9" * 5000 + "\n", "m.sh")
    one_line_error(invoke("doctor", "megatron", script, "--profile", profile_file), 2, "m.sh", "digits")
    ds = write(tmp_path, '{"train_batch_size": ' + "9" * 5000 + "}", "ds.json")
    one_line_error(invoke("doctor", "deepspeed", ds, "--profile", profile_file), 2, "ds.json", "digits")


@pytest.mark.parametrize("value, needle", [
    ("abc", "found the string 'abc'"), ({}, "valid number"), (1e30, "less than or equal to 1000000000"),
    (float("nan"), "finite"), (-1, "greater than or equal to 0"), ("1.5", "the string '1.5'"),
    (True, "boolean"), (1e10, "less than or equal"),
])
def test_measurement_fields_the_planner_reads_are_strict(tmp_path, value, needle):
    data = make_profile_dict()
    data["source"] = "measured"
    data["measurement"] = {"action_overhead_ms": value, "torch": "free-form, not checked"}
    path = write(tmp_path, json.dumps(data))
    for command in (("validate", path), ("plan", path, "--stages", 2, "-q")):
        one_line_error(invoke(*command), 2, "p.json", "measurement: action_overhead_ms", needle)


def test_schema_version_true_is_not_version_1(tmp_path):
    data = make_profile_dict()
    data["schema_version"] = True
    one_line_error(invoke("validate", write(tmp_path, data)), 2, "schema_version: true")


def test_a_plan_with_a_negative_bubble_is_refused(tmp_path, plan_file):
    data = json.loads(plan_file.read_text())
    data["predicted"]["bubble_fraction"] = -1
    one_line_error(invoke("validate", write(tmp_path, data, "bad.json")), 2, "predicted.bubble_fraction")
    data["predicted"]["bubble_fraction"] = 1.5
    one_line_error(invoke("show", write(tmp_path, data, "bad.json")), 2, "predicted.bubble_fraction")


def test_a_plan_without_an_action_overhead_shows(tmp_path, plan_file):
    data = json.loads(plan_file.read_text())
    data["settings"]["action_overhead_ms"] = None
    result = invoke("show", write(tmp_path, data, "null.json"))
    assert result.exit_code == 0, result.stderr


CLUSTER = ('name = "c"\ngpu = "h100-sxm"\ngpus_per_node = 8\n[intra_node]\nbandwidth = "450GB/s"\nlatency_us = 3\n'
           '[inter_node]\nbandwidth = "50GB/s"\nlatency_us = 14.0\n')


@pytest.mark.parametrize("old, new, needle", [
    ("gpus_per_node = 8", 'gpus_per_node = "8"', "gpus_per_node: expected a number, found the string '8'"),
    ("gpus_per_node = 8", "gpus_per_node = 8.0", "gpus_per_node: expected a whole number"),
    ("gpus_per_node = 8", "gpus_per_node = 1180591620717411303424", "gpus_per_node: Input should be less"),
    ("latency_us = 3", "latency_us = 1e308", "intra_node.latency_us"),
    ('bandwidth = "450GB/s"', "bandwidth_bytes_per_s = 1e-300", "intra_node.bandwidth_bytes_per_s"),
    ('name = "c"', 'base = []\nname = "c"', "base: expected a preset's name"),
    ('name = "c"', 'name = "c\\u001b[31m\\u202e"', "name: contains the control character U+001B"),
    ('gpu = "h100-sxm"', 'gpu = "foo"', "'foo' is not in the GPU table"),
    ("latency_us = 3", "latency_us = true", "intra_node.latency_us: expected a number, found a boolean"),
])
def test_cluster_values_are_strict_and_bounded(tmp_path, profile_file, old, new, needle):
    path = write(tmp_path, CLUSTER.replace(old, new, 1), "c.toml")
    one_line_error(invoke("cluster", path), 2, needle)
    one_line_error(invoke("plan", profile_file, "--gpus", 16, "--cluster", path, "-q"), 2, needle)


def test_a_cluster_file_at_its_limits_still_plans(tmp_path, profile_file):
    text = CLUSTER.replace("latency_us = 3", "latency_us = 1e6").replace('bandwidth = "450GB/s"',
                                                                          "bandwidth_bytes_per_s = 1e6")
    path = write(tmp_path, "memory_cap_bytes = 80e9\n" + text, "c.toml")  # a whole float: bytes take it
    result = invoke("plan", profile_file, "--gpus", 16, "--cluster", path, "-q")
    assert result.exit_code in (0, 3), result.stderr


# ---------------------------------------------------------------- doctor: hangs and internal errors
@pytest.fixture
def llama(tmp_path):
    return write_profile(llama3_8b(), tmp_path / "llama.json")


MEGATRON = (DOCTOR / "megatron_llama3_8b_pp4.sh").read_text()
DS_CONFIG = json.loads((DOCTOR / "deepspeed_pipeline_ds_config.json").read_text())


@pytest.mark.parametrize("old, new, needle", [
    ("--num-layers $NUM_LAYERS", "--num-layers $NUM_LAYERS --num-virtual-stages-per-pipeline-rank 0",
     "virtual stages per rank v = 0"),
    ("TP_SIZE=2", "TP_SIZE=1000000000", "--tensor-model-parallel-size 1000000000"),
    ("GLOBAL_BATCH_SIZE=128", "GLOBAL_BATCH_SIZE=1000000000000", "micro-batches per pipeline"),
    ("--num-layers $NUM_LAYERS", "--num-layers $NUM_LAYERS --pipeline-model-parallel-layout '(t*9999|)*99999'",
     "expands to 999,990,000 entries"),
    ("GPUS_PER_NODE=8", "GPUS_PER_NODE=8\nA=(x)\n" + "A=(${A[@]} ${A[@]})\n" * 40, "array A grows to"),
    ("GPUS_PER_NODE=8", "GPUS_PER_NODE=8\nS=x\n" + 'S="$S$S"\n' * 40, "S grows to"),
])
def test_megatron_scripts_that_hung_or_crashed(tmp_path, llama, old, new, needle):
    script = write(tmp_path, MEGATRON.replace(old, new, 1), "m.sh")
    one_line_error(invoke("doctor", "megatron", script, "--profile", llama), 2, "m.sh", needle)


@pytest.mark.parametrize("change, args, needle", [
    ({"train_batch_size": 10**12}, ["--num-stages", 4], "micro-batches per pipeline"),
    ({}, ["--num-stages", 10**9], "pipeline stages p = 1000000000"),
    ({}, ["--num-stages", 4, "--partition-method", "type:(["], "not a regular expression"),
    ({}, ["--num-stages", 4, "--memory-cap", "0.1"], "--memory-cap 0.1"),
])
def test_deepspeed_configs_that_hung_or_crashed(tmp_path, llama, change, args, needle):
    config = write(tmp_path, dict(DS_CONFIG, **change), "ds.json")
    one_line_error(invoke("doctor", "deepspeed", config, "--profile", llama, "--world-size", 4, *args), 2, needle)


def test_a_null_batch_key_is_read_as_unset(tmp_path, llama):
    config = write(tmp_path, dict(DS_CONFIG, train_batch_size=None), "ds.json")
    result = invoke("doctor", "deepspeed", config, "--profile", llama, "--world-size", 4, "--num-stages", 4)
    assert result.exit_code in (0, 1, 2) and "internal error" not in result.stderr, result.stderr


# ---------------------------------------------------------------- shell reading: valid bash, read as bash reads it
def _read(text):
    from pipeplan.launchers.megatron.shell import read_script

    return read_script("t.sh", text)


@pytest.mark.parametrize("text, name, value", [
    ("A=$(( -9/2 ))", "A", "-4"),
    ("A=$(( -1 % 5 ))", "A", "-1"),
    ("A=$(( 010 + 0x10 + 2#101 ))", "A", "29"),
    ("A=$(( 2**63 ))", "A", str(-(2**63))),  # 64-bit wrap-around
    ("A=${X:-${Y:-4}}", "A", "4"),
    ("A=$'a\\tb'", "A", "a\tb"),
    ("A=$'it\\'s'", "A", "it's"),
    ("A=\"it's\"", "A", "it's"),
    ("A='say \"hi\"'", "A", 'say "hi"'),
    ('A="a \\"b\\""', "A", 'a "b"'),
    ('if [ -z "$1" ]; then A=5; fi', "A", "5"),
    ("A=(a b c)\nA[1]=z\nB=${A[1]}", "B", "z"),
    ("A=1\n[ -z $Y ] || exit 1\nif true; then\n  exit 2\nfi\nusage() {\n  exit 1\n}\nA=2\nexit 0\nA=3", "A", "2"),
    ("A=1\ncat <<EOF > f.txt\nA=9\nEOF\nB=2", "A", "1"),
])
def test_the_shell_reader_reads_valid_bash_as_bash(text, name, value):
    assert _read(text).scalars[name] == value


def test_unset_and_indexed_assignment():
    script = _read("A=1\nB=(x y)\nunset A\nB[2]=z")
    assert "A" not in script.scalars and script.arrays["B"] == ["x", "y", "z"]


def test_a_heredoc_body_does_not_win_over_the_commands_flag(tmp_path, llama):
    text = MEGATRON.replace("PP_SIZE=4", "PP_SIZE=4\ncat <<'EOF' > notes.txt\ntorchrun x.py --num-layers 8 "
                                         "--pipeline-model-parallel-size 8\nEOF", 1)
    script = write(tmp_path, text, "m.sh")
    result = invoke("doctor", "megatron", script, "--profile", llama, "--format", "json")
    assert json.loads(result.stdout)["config"]["pipeline_degree"] == 4, result.stdout


def test_the_shell_reader_never_runs_anything(tmp_path):
    marker = tmp_path / "ran"
    _read(f"A=$(touch {marker})\nB=`touch {marker}`\ntouch {marker}\neval 'touch {marker}'\nexit 0")
    assert not marker.exists()


# ---------------------------------------------------------------- hangs
def test_plannable_bytes_bisects_instead_of_stepping_one_byte():
    from pipeplan.cluster.memory import plannable_bytes, reserve_bytes

    # A cap of 1e30 bytes took ~1e14 steps; the answer is the largest x that fits.
    for cap, fixed, frag in ((10**30, 2 * 2**30, 0.05), (80 * 10**9, 2 * 2**30, 0.05), (1000, 10, 0.3), (5, 10, 0.1)):
        x = plannable_bytes(cap, fixed, frag)
        assert x == 0 or x + reserve_bytes(x, fixed, frag) <= cap
        assert x + 1 + reserve_bytes(x + 1, fixed, frag) > cap or x == cap - fixed


def test_a_huge_cluster_memory_cap_is_refused_at_load(tmp_path, profile_file):
    path = write(tmp_path, 'base = "dgx-h100"\nmemory_cap_bytes = ' + str(10**30) + "\n", "c.toml")
    one_line_error(invoke("plan", profile_file, "--gpus", 16, "--cluster", path, "-q"), 2, "memory_cap_bytes")


@pytest.mark.parametrize("args, needle", [
    (["profile", "gpt2-tiny", "--layers", 1_000_000], "--layers: 1000000 is more than 10,000"),
    (["profile", "llama3-8b", "--analytic", "--gpu", "h100-sxm", "--seq-len", 10**12], "--seq-len"),
    (["profile", "gpt2-tiny", "--hidden", 0], "--hidden: 0 must be at least 1"),
])
def test_model_options_are_bounded_before_building(tmp_path, args, needle):
    one_line_error(invoke(*args, "-o", tmp_path / "o.json"), 2, needle)
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("width", [1_000_000, 9])
def test_the_timeline_width_is_bounded(plan_file, width):
    result = invoke("show", plan_file, "--timeline", "--width", width)
    one_line_error(result, 2, "--width")
    assert result.stdout == ""  # refused before anything is drawn


# ---------------------------------------------------------------- import pipedream
def _graph(n, line=None):
    nodes = [f"node{i} -- Linear -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=100.0, "
             f"parameter_size=10.0" for i in range(n)]
    if line is not None:
        nodes[0] = line
    return "\n".join(nodes + [f"\tnode{i} -- node{i + 1}" for i in range(n - 1)]) + "\n"


@pytest.mark.parametrize("line, needle", [
    ("node0 -- Linear -- forward_compute_time=1.0, backward_compute_time=1.0, activation_size=1e30, "
     "parameter_size=1.0", "node node0: activation_bytes"),
    ("node0 -- Lin\x1bear -- forward_compute_time=1.0, backward_compute_time=1.0, activation_size=1.0, "
     "parameter_size=1.0", "node node0: description: contains the control character U+001B"),
    ("node" + "9" * 5000 + " -- Linear -- forward_compute_time=1.0, backward_compute_time=1.0, activation_size=1.0, "
     "parameter_size=1.0", "edge node0 -- node1 names unknown node node0"),
])
def test_pipedream_values_out_of_range_name_the_node(tmp_path, line, needle):
    path = write(tmp_path, _graph(3, line), "g.txt")
    one_line_error(invoke("import", "pipedream", path, "--batch-size", 1, "-o", tmp_path / "o.json"), 2, needle)


def test_a_large_pipedream_graph_imports_in_order(tmp_path):
    # 10,000 nodes: the edge sort was quadratic (order.index; 47 s at 50,000 nodes, 5 s now).
    path = write(tmp_path, _graph(10_000), "g.txt")
    out = tmp_path / "o.json"
    result = invoke("import", "pipedream", path, "--batch-size", 1, "-o", out)
    assert result.exit_code == 0, result.stderr
    data = json.loads(out.read_text())
    assert [layer["name"] for layer in data["layers"][:3]] == ["node0", "node1", "node2"]
    assert data["edges"][:2] == [["node0", "node1"], ["node1", "node2"]] and len(data["edges"]) == 9_999


# ---------------------------------------------------------------- run: every option checked before anything starts
@pytest.mark.parametrize("args, needle", [
    (["--timeout", "nan"], "--timeout: nan"),
    (["--timeout", "inf"], "--timeout: inf"),
    (["--job-timeout", "nan"], "--job-timeout: nan"),
    (["--nproc-per-node", "0"], "--nproc-per-node: 0"),
    (["--verify", "--verify-tolerance", "nan"], "--verify-tolerance: nan"),
    (["--seq-len", "0"], "--seq-len: 0 must be at least 1"),
    (["--layers", "1000000"], "--layers: 1000000"),
    (["--lr", "nan"], "--lr: nan"),
])
def test_run_refuses_bad_options_before_starting_torchrun(tmp_path, plan_file, profile_file, monkeypatch, args, needle):
    import subprocess

    def no_start(*a, **k):  # nothing may be started for a refused option
        raise AssertionError(f"started {a[0] if a else k}")

    monkeypatch.setattr(subprocess, "Popen", no_start)
    one_line_error(invoke("run", plan_file, "--profile", profile_file, *args), 2, needle)


def test_run_device_cuda_without_cuda_is_refused_first(plan_file, profile_file, monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    import subprocess

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    one_line_error(invoke("run", plan_file, "--profile", profile_file, "--device", "cuda"), 2, "--device cuda")


# ---------------------------------------------------------------- messages: control and bidi characters escaped everywhere
RAW = ("\x1b", "\u202e", "\x07")


def _clean(text):
    return not any(ch in text for ch in RAW)


def test_usage_errors_escape_control_characters(profile_file):
    result = invoke("plan", profile_file, "--stages", 2, "--evil\x1b[2J\u202e")
    # (click escapes these itself; pipeplan's echo is the second guard)
    assert result.exit_code == 2 and _clean(result.stderr) and "--evil" in result.stderr, repr(result.stderr)


def test_what_a_command_prints_escapes_the_names_it_was_given(tmp_path, profile_file):
    out = tmp_path / "plan\x1b[2J\u202e.json"
    result = invoke("plan", profile_file, "--stages", 2, "-o", out)
    assert result.exit_code == 0, result.stderr
    assert _clean(result.stdout) and "plan\\u001b[2J\\u202e.json" in result.stdout
    missing = invoke("validate", tmp_path / "a\u202eb\x07.json")
    one_line_error(missing, 2, "a\\u202eb\\u0007.json")


def test_a_cluster_name_with_escapes_never_reaches_the_terminal(tmp_path, profile_file):
    path = write(tmp_path, CLUSTER.replace('name = "c"', 'name = "evil\\u001b[31m\\u202e"'), "c.toml")
    for args in (("cluster", path), ("plan", profile_file, "--gpus", 16, "--cluster", path, "-q")):
        result = invoke(*args)
        assert result.exit_code == 2 and _clean(result.stdout + result.stderr), repr(result.stderr)


def test_doctor_output_escapes_what_the_script_holds(tmp_path, llama):
    text = MEGATRON.replace("--num-layers $NUM_LAYERS", "--num-layers $NUM_LAYERS --tensorboard-dir $'\\e[31mx\\u202e'")
    result = invoke("doctor", "megatron", write(tmp_path, text, "m.sh"), "--profile", llama, "--format", "markdown")
    assert result.exit_code in (0, 1), result.stderr
    assert _clean(result.stdout + result.stderr)


# ---------------------------------------------------------------- the cluster search: one wrong refusal, one crash
@pytest.fixture
def sixteen_layers(tmp_path):
    return write(tmp_path, make_profile_dict(n_layers=16, sizes=(1, 2)), "p16.json")


def test_the_microbatch_limit_is_per_replica(tmp_path, sixteen_layers):
    out = tmp_path / "plan.json"
    result = invoke("plan", sixteen_layers, "--gpus", 4096, "--cluster", "dgx-h100", "--data-parallel", 512,
                    "--global-batch", 8192, "-o", out, "-q")
    assert result.exit_code == 0, result.stderr  # refused before as "8192 micro-batches"
    plan = json.loads(out.read_text())
    assert plan["parallelism"]["data"] == 512 and plan["num_microbatches"] * plan["microbatch_size"] == 16


def test_past_the_limit_per_replica_is_still_refused(sixteen_layers):
    one_line_error(invoke("plan", sixteen_layers, "--gpus", 16, "--cluster", "dgx-h100", "--data-parallel", 2,
                          "--global-batch", 2 * 4097, "--microbatch-size", 1, "-q"), 2, "per replica", "4096")


def test_layouts_whose_data_groups_straddle_nodes_are_not_admitted(tmp_path, sixteen_layers):
    # 2,520 GPUs: t = 1, d = 180 put a pipeline rank's GPUs mid-node (an internal error before).
    out = tmp_path / "plan.json"
    result = invoke("plan", sixteen_layers, "--gpus", 2520, "--cluster", "dgx-h100", "--global-batch", 2520,
                    "-o", out, "-q")
    assert result.exit_code == 0, result.stderr
    par = json.loads(out.read_text())["parallelism"]
    group = par["tensor"] * par["data"]
    assert group % par["gpus_per_node"] == 0 or par["gpus_per_node"] % group == 0
