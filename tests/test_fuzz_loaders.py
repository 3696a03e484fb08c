"""Fuzzing the loaders test_fuzz.py does not reach (issue 24): cluster and GPU TOML, the three
launcher configs doctor reads (a Megatron script through the shell reader, torchtitan TOML,
DeepSpeed JSON), PipeDream's graph.txt, and ``run``'s option checks.

Each draws a valid file mutated at one place (a value replaced by an edge number, a wrong type,
an odd string, a long integer) or a line of hostile text, runs the command through typer's
runner and asserts exit 0, 2 or 3 (1 only as doctor's verdict, with a report on stdout), one
line on stderr, never a traceback. Derandomized and bounded (a few dozen examples each, no
deadline), so CI sees the same examples every run in a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from conftest import make_profile_dict
from doctor_profiles import llama3_8b, write_profile
from pipeplan.cli import app

runner = CliRunner()
DOCTOR = Path(__file__).parent / "data" / "doctor"

FUZZ = settings(derandomize=True, deadline=None, database=None, print_blob=False, max_examples=30,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])

#: TOML values (as TOML text) at the edges: wrong types, extremes, long integers, odd strings.
TOML_VALUES = ["0", "-1", "1", "8", "8.0", '"8"', "true", "[]", "{}", "1e308", "1e-300", "-1e308", "nan", "inf",
               str(2**70), "9" * 200, '""', '"\\u001b[31m"', '"\\u202e"', '"h100-sxm"', '"foo"', '"450GB/s"',
               '"1e400GB/s"', '"-5GB/s"', '"abc"', "0.5", "1.5", "[1, 2]"]
JSON_VALUES = [0, -1, 1, 8, 8.0, "8", True, None, [], {}, 1e308, -1e308, 2**70, "auto", "", "\x1b[31m", 10**30,
               0.5, "1.5"]
SHELL_VALUES = ["0", "-1", "1", "8", "1000000000", "1" + "0" * 30, "$((1/0))", "$(( -9/2 ))", "$((2**64))",
                "${X:-${Y:-4}}", "$'\\x1b[2J'", "'it''s'", "\"a \\\"b\\\"\"", "$(rm -rf /)", "`touch x`", "$((010))",
                "$((08))", "${A[@]}", "${A[99]}", "\"\"", "abc", "1e12", "4 4", "16#ff", "$((1<<70))"]


def _check(result, command: str, verdict_ok: bool = False) -> int:
    code = result.exit_code
    where = f"{command}: exit {code}\nstdout: {result.stdout[-1200:]}\nstderr: {result.stderr[-1200:]}"
    assert code in ({0, 2, 3} | ({1} if verdict_ok else set())), where
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, where
    assert result.exception is None or isinstance(result.exception, SystemExit), (where, repr(result.exception))
    if code in (2, 3):
        assert len(result.stderr.strip().splitlines()) == 1, where
    assert "\x1b" not in result.stdout + result.stderr, where
    return code


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-loaders")
    profile = root / "profile.json"
    profile.write_text(json.dumps(make_profile_dict(n_layers=8, sizes=(1, 2))))
    llama = write_profile(llama3_8b(), root / "llama.json")
    return {"root": root, "profile": profile, "llama": llama}


CLUSTER_LINES = ['name = "c"', 'gpu = "h100-sxm"', "gpus_per_node = 8", "[intra_node]", 'bandwidth = "450GB/s"',
                 "latency_us = 3.4", "[inter_node]", 'bandwidth = "50GB/s"', "latency_us = 14.0"]
CLUSTER_KEYS = {0: "name", 1: "gpu", 2: "gpus_per_node", 4: "bandwidth", 5: "latency_us", 7: "bandwidth",
                8: "latency_us"}


@settings(FUZZ, max_examples=15)
@given(line=st.sampled_from(sorted(CLUSTER_KEYS)), value=st.sampled_from(TOML_VALUES),
       extra=st.sampled_from(["", 'base = "dgx-h100"', "base = []", "memory_cap_bytes = 80e9", "reserve = -1",
                              "fragmentation = 1.0", 'memory_cap = "0.1"', "efficiency = 2"]))
def test_fuzz_cluster_toml(files, line, value, extra):
    lines = list(CLUSTER_LINES)
    lines[line] = f"{CLUSTER_KEYS[line]} = {value}"
    path = files["root"] / "cluster.toml"
    path.write_text("\n".join(([extra] if extra else []) + lines) + "\n")
    _check(_invoke("cluster", path), "cluster")
    _check(_invoke("plan", files["profile"], "--gpus", 16, "--cluster", path, "--global-batch", 16, "-q"),
           "plan --cluster")


@FUZZ
@given(key=st.sampled_from(["memory", "hbm_bandwidth", "name", "peak_flops", "link_bandwidth"]),
       value=st.sampled_from(TOML_VALUES))
def test_fuzz_gpu_spec_toml(files, key, value):
    base = {"name": '"g"', "memory": '"80GB"', "hbm_bandwidth": '"3TB/s"', "link_bandwidth": '"450GB/s"'}
    base[key] = value
    path = files["root"] / "gpu.toml"
    path.write_text("[gpu]\n" + "".join(f"{k} = {v}\n" for k, v in base.items()))
    _check(_invoke("profile", "llama3-8b", "--analytic", "--gpu-spec", path, "-o", files["root"] / "a.json"),
           "profile --analytic --gpu-spec")


MEGATRON = (DOCTOR / "megatron_llama3_8b_pp4.sh").read_text()
MEGATRON_VARS = ["TP_SIZE", "PP_SIZE", "MICRO_BATCH_SIZE", "GLOBAL_BATCH_SIZE", "NUM_LAYERS", "SEQ_LENGTH",
                 "GPUS_PER_NODE", "NUM_NODES"]


@settings(FUZZ, max_examples=6)  # each diagnoses a 32-layer model (~2 s on a loaded 2-core machine)
@given(name=st.sampled_from(MEGATRON_VARS), value=st.sampled_from(SHELL_VALUES),
       extra=st.sampled_from(["", "--num-virtual-stages-per-pipeline-rank 0",
                              "--pipeline-model-parallel-layout '(t*9999|)*99999'",
                              "--pipeline-model-parallel-layout 'Et*8|t*8|t*8|t*8L'", "--context-parallel-size 0",
                              "--recompute-granularity full", "--decoder-first-pipeline-num-layers 99"]))
def test_fuzz_megatron_script(files, tmp_path, name, value, extra):
    lines = MEGATRON.splitlines()
    text = "\n".join(f"{name}={value}" if line.startswith(f"{name}=") else line for line in lines)
    if extra:
        text = text.replace("--num-layers $NUM_LAYERS", f"--num-layers $NUM_LAYERS {extra}", 1)
    path = tmp_path / "train.sh"
    path.write_text(text + "\n")
    _check(_invoke("doctor", "megatron", path, "--profile", files["llama"]), "doctor megatron", verdict_ok=True)
    assert not (tmp_path / "x").exists()  # `touch x` was never run


TITAN = (DOCTOR / "torchtitan_llama3_8b_pp4.toml").read_text()


@settings(FUZZ, max_examples=12)
@given(key=st.sampled_from(["pipeline_parallel_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                            "pipeline_parallel_microbatch_size", "pipeline_parallel_schedule", "local_batch_size",
                            "global_batch_size"]),
       value=st.sampled_from(TOML_VALUES))
def test_fuzz_torchtitan_toml(files, tmp_path, key, value):
    section = "training" if key.endswith("batch_size") and not key.startswith("pipeline") else "parallelism"
    lines, done = [], False
    for line in TITAN.splitlines():
        if line.split("=")[0].strip() == key:
            line, done = f"{key} = {value}", True
        lines.append(line)
        if not done and line.strip() == f"[{section}]":  # a key the file lacks goes first in its table
            lines.append(f"{key} = {value}")
            done = True
    path = tmp_path / "t.toml"
    path.write_text("\n".join(lines) + "\n")
    _check(_invoke("doctor", "torchtitan", path, "--profile", files["llama"]), "doctor torchtitan", verdict_ok=True)


DS = json.loads((DOCTOR / "deepspeed_pipeline_ds_config.json").read_text())


@settings(FUZZ, max_examples=10)
@given(key=st.sampled_from(["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                            "zero_optimization", "pipeline"]),
       value=st.sampled_from(JSON_VALUES),
       options=st.sampled_from([["--num-stages", "4"], ["--num-stages", "1000000000"], ["--parts", "0,9,18,27,35"],
                                ["--num-stages", "4", "--partition-method", "type:(["],
                                ["--num-stages", "4", "--partition-method", "uniform"]]))
def test_fuzz_deepspeed_json(files, tmp_path, key, value, options):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(dict(DS, **{key: value})))
    _check(_invoke("doctor", "deepspeed", path, "--profile", files["llama"], "--world-size", 4, *options),
           "doctor deepspeed", verdict_ok=True)


GRAPH_NODE = ("node{i} -- Linear -- forward_compute_time={f}, backward_compute_time=2.0, activation_size={a}, "
              "parameter_size=10.0")


@FUZZ
@given(f=st.sampled_from(["1.0", "0", "nan", "inf", "-1", "1e308", "abc", "[1;2]", "9" * 200]),
       a=st.sampled_from(["100.0", "1e30", "-5", "nan", "1e400", "[]", "0"]),
       edge=st.sampled_from(["\tnode0 -- node1", "\tnode1 -- node0", "\tnode0 -- node9", "\tnode0", "", "\t -- "]),
       name=st.sampled_from(["node0", "n\x1bode0", "node" + "9" * 100, "node0 -- x"]))
def test_fuzz_pipedream_graph(files, tmp_path, f, a, edge, name):
    nodes = [GRAPH_NODE.format(i=0, f=f, a=a).replace("node0", name, 1), GRAPH_NODE.format(i=1, f="1.0", a="1.0")]
    path = tmp_path / "g.txt"
    path.write_text("\n".join(nodes + [edge]) + "\n")
    _check(_invoke("import", "pipedream", path, "--batch-size", 1, "-o", tmp_path / "o.json"), "import pipedream")


@pytest.fixture(scope="module")
def plan_file(files):
    out = files["root"] / "plan.json"
    result = _invoke("plan", files["profile"], "--stages", 2, "--global-batch", 4, "--schedule", "1f1b", "-o", out,
                     "-q")
    assert result.exit_code == 0, result.stderr
    return out


@settings(FUZZ, max_examples=15)
@given(option=st.sampled_from(["--timeout", "--job-timeout", "--verify-tolerance", "--seq-len", "--nproc-per-node",
                               "--layers", "--lr", "--steps", "--threads"]),
       value=st.sampled_from(["nan", "inf", "-inf", "0", "-1", "1e308", "1000000000", "abc", ""]))
def test_fuzz_run_options_refuse_before_starting(files, plan_file, monkeypatch, option, value):
    import subprocess

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("started")))
    result = _invoke("run", plan_file, "--profile", files["profile"], "--verify", option, value)
    if "RuntimeError: started" in result.stderr:  # it got as far as starting torchrun: a valid value
        assert (option, value) in RUN_VALID, (option, value)
        return
    assert result.exit_code == 2, (option, value, result.exit_code, result.stderr, repr(result.exception))
    _check(result, f"run {option} {value}")


#: Values of the fuzzed options that are valid (a learning rate of 0, a long run).
RUN_VALID = {("--lr", "0"), ("--lr", "1e308"), ("--steps", "1000000000"), ("--verify-tolerance", "1e308")}
