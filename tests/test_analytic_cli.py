"""`pipeplan profile --analytic`, `pipeplan gpus`, and the version-2 profile format."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, make_profile_dict
from cli_checks import invoke
from pipeplan.errors import BadInputError
from pipeplan.formats.io import load_profile
from pipeplan.formats.profile import Profile



def write_config(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


LLAMA_SMALL = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
               "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 1000}


def test_analytic_8b_profile_plans_at_degree_1_and_is_byte_identical(tmp_path):
    out1, out2 = tmp_path / "a.json", tmp_path / "b.json"
    for out in (out1, out2):
        result = invoke("profile", "llama3-8b", "--analytic", "--gpu", "h100-sxm", "--seq-len", 8192,
                        "--microbatch-sizes", "1,2", "--tensor-parallel", "1,2,4,8", "-o", out)
        assert result.exit_code == 0, result.output
    assert out1.read_bytes() == out2.read_bytes()
    profile = load_profile(out1)
    assert profile.schema_version == 2 and profile.source == "analytic"
    assert profile.tensor_parallel_degrees == [1, 2, 4, 8] and profile.microbatch_sizes == [1, 2]
    names = [layer.name for layer in profile.layers]
    assert names[0] == "model.embed_tokens" and names[1] == "model.layers.0"
    assert names[-2:] == ["model.norm", "lm_head"] and len(names) == 35
    assert profile.measurement["gpu"]["name"] == "h100-sxm" and "efficiency" in profile.measurement
    block = profile.layers[1]
    assert block.cost_at(1).tensor_parallel is None             # the planner's entry is degree 1
    assert block.cost_at(1, 8).tensor_parallel == 8
    assert block.param_bytes_at(8) < block.param_bytes / 7.9
    plan = tmp_path / "plan.json"
    result = invoke("plan", out1, "--stages", 4, "--global-batch", 16, "--memory-cap", "80GiB", "-o", plan, "-q")
    assert result.exit_code == 0, result.output
    data = json.loads(plan.read_text())
    assert sum(len(s["layers"]) for s in data["stages"]) == 35
    # Megatron's layout comes from the units' roles: embedding first, loss last.
    megatron = tmp_path / "megatron-plan.json"
    result = invoke("plan", out1, "--stages", 4, "--global-batch", 16, "--schedule", "1f1b", "-o", megatron, "-q")
    assert result.exit_code == 0, result.output
    result = invoke("export", megatron, "--format", "megatron", "--profile", out1)
    assert result.exit_code == 0 and "--pipeline-model-parallel-layout 'E" in result.output and "L'" in result.output
    # The plan saw degree-1 costs: its stages' forward times add up to the degree-1 entries'.
    b = data["microbatch_size"]
    assert sum(s["forward_ms"] for s in data["stages"]) == pytest.approx(
        sum(layer.cost_at(b).forward_ms for layer in profile.layers), rel=1e-6)


def test_config_path_and_gpu_spec_file(tmp_path):
    config = write_config(tmp_path, LLAMA_SMALL)
    spec = tmp_path / "gpu.toml"
    spec.write_text('name = "toy"\nmemory = "16GiB"\nhbm_bandwidth = "1TB/s"\nlink_bandwidth = "50GB/s"\n'
                    '[peak_flops]\nbf16 = 100e12\n')
    out = tmp_path / "p.json"
    result = invoke("profile", config, "--analytic", "--gpu-spec", spec, "--seq-len", 256, "-o", out)
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.device.memory_bytes == 16 * 2**30 and profile.sequence_length == 256


@pytest.mark.parametrize("change,field", [
    ({"model_type": "bert"}, "model_type"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_attention_heads": 7}, "num_attention_heads"),
    ({"num_hidden_layers": -1}, "num_hidden_layers"),
])
def test_bad_configs_exit_2_naming_the_field(tmp_path, change, field):
    data = {k: v for k, v in {**LLAMA_SMALL, **change}.items() if v is not None}
    config = write_config(tmp_path, data)
    result = invoke("profile", config, "--analytic", "--gpu", "a100-80gb", "-o", tmp_path / "p.json")
    assert result.exit_code == 2, result.output
    assert field in result.output and str(config) in result.output
    assert "Traceback" not in result.output and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("args,needle", [
    (["--tensor-parallel", "1,3"], "--tensor-parallel"),
    (["--tensor-parallel", "16"], "num_attention_heads"),
    (["--gpu", "tpu-v5"], "--gpu"),
    (["--dtype", "int8"], "--dtype"),
])
def test_bad_options_exit_2(tmp_path, args, needle):
    config = write_config(tmp_path, LLAMA_SMALL)
    base = ["profile", config, "--analytic", "-o", tmp_path / "p.json"]
    if "--gpu" not in args:
        base += ["--gpu", "a100-80gb"]
    result = invoke(*base, *args)
    assert result.exit_code == 2, result.output
    assert needle in result.output


def test_bad_gpu_spec_names_the_field(tmp_path):
    spec = tmp_path / "gpu.toml"
    spec.write_text('name = "toy"\nmemory = "16GiB"\nhbm_bandwidth = "1TB/s"\n[peak_flops]\nbf16 = 1e12\n')
    result = invoke("profile", "gpt2", "--analytic", "--gpu-spec", spec, "-o", tmp_path / "p.json")
    assert result.exit_code == 2 and "link_bytes_per_s" in result.output and str(spec) in result.output


def test_unknown_shipped_name_lists_the_shipped_ones(tmp_path):
    result = invoke("profile", "llama9-1t", "--analytic", "--gpu", "h100-sxm", "-o", tmp_path / "p.json")
    assert result.exit_code == 2 and "llama3-70b" in result.output


def test_analytic_options_need_analytic(tmp_path):
    result = invoke("profile", "gpt2-tiny", "--gpu", "h100-sxm", "-o", tmp_path / "p.json")
    assert result.exit_code == 2 and "--analytic" in result.output


def test_gpus_lists_the_shipped_specs():
    result = invoke("gpus")
    assert result.exit_code == 0
    for name in ("h100-sxm", "h200", "gh200", "b200", "a100-40gb", "a100-80gb", "l4", "mi300x"):
        assert name in result.output


def test_every_shipped_config_builds_at_its_degrees():
    from pipeplan.analytic import analytic_profile, get_gpu, shipped_configs

    for name in shipped_configs():
        profile = analytic_profile(name, get_gpu("h100-sxm"), seq_len=1024, microbatch_sizes=[1, 2],
                                   tensor_parallel=[1, 2, 4])
        assert profile.tensor_parallel_degrees == [1, 2, 4], name


def test_analytic_needs_no_torch():
    code = ("import sys; from pipeplan.analytic import analytic_profile, get_gpu; "
            "analytic_profile('llama3-70b', get_gpu('h100-sxm'), tensor_parallel=[1, 8]); "
            "import pipeplan.cli; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported torch'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr


# --- the version-2 format ---------------------------------------------------------------

def _v2(**cost):
    data = make_profile_dict(n_layers=2, sizes=(1,))
    data["schema_version"] = 2
    for layer in data["layers"]:
        layer["costs"].append({**layer["costs"][0], "tensor_parallel": 2, "param_bytes": 500,
                               "tensor_parallel_collective": "all_reduce", "tensor_parallel_forward_bytes": 20,
                               "tensor_parallel_backward_bytes": 20, **cost})
    return data


def test_version_1_files_load_and_version_2_fields_need_version_2(tmp_path):
    for path in sorted((REPO / "profiles").glob("*.json")):
        assert load_profile(path).tensor_parallel_degrees == [1]
    data = _v2()
    data["schema_version"] = 1
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BadInputError, match=r"costs\[1\]\.tensor_parallel: needs schema_version 2"):
        load_profile(path)


def test_one_entry_per_size_and_degree():
    data = _v2()
    Profile.model_validate(data)
    data["layers"][0]["costs"].append(dict(data["layers"][0]["costs"][1]))
    with pytest.raises(ValueError, match="pairs repeat"):
        Profile.model_validate(data)


def test_every_degree_has_the_same_sizes_and_degree_1_is_present():
    data = _v2()
    for layer in data["layers"]:
        layer["costs"] = layer["costs"][1:]
    with pytest.raises(ValueError, match="degree 1"):
        Profile.model_validate(data)


def test_entries_above_degree_1_give_their_share_and_traffic():
    data = _v2()
    del data["layers"][1]["costs"][1]["tensor_parallel_forward_bytes"]
    with pytest.raises(ValueError, match=r"costs\[1\]\.tensor_parallel_forward_bytes: needed at tensor_parallel 2"):
        Profile.model_validate(data)


def test_param_bytes_at_degree_1_must_be_the_layers():
    data = _v2()
    data["layers"][0]["costs"][0]["param_bytes"] = 7
    with pytest.raises(ValueError, match="param_bytes"):
        Profile.model_validate(data)


# --- calibrate: the efficiency model fitted to a measured profile -------------------------

CPU_SPEC = ('name = "dev-cpu"\nmemory = "16GiB"\nhbm_bandwidth = "10GB/s"\nlink_bandwidth = "5GB/s"\n'
            '[peak_flops]\nfp32 = 80e9\n')


def test_calibrate_fits_the_efficiency_to_a_measured_profile(tmp_path):
    measured = REPO / "profiles" / "gpt2-cpu.json"        # the built-in gpt2: GPT-2 small's shapes
    spec = tmp_path / "cpu.toml"
    spec.write_text(CPU_SPEC)
    analytic, calibrated = tmp_path / "a.json", tmp_path / "c.json"
    result = invoke("profile", "gpt2", "--analytic", "--gpu-spec", spec, "--seq-len", 128, "--dtype", "fp32",
                    "--microbatch-sizes", "1,2,4", "--tensor-parallel", "1,2", "-o", analytic)
    assert result.exit_code == 0, result.output
    result = invoke("calibrate", analytic, "--measured", measured, "-o", calibrated)
    assert result.exit_code == 0, result.output
    assert "rms log error" in result.output
    before, after = load_profile(analytic), load_profile(calibrated)
    assert after.measurement["efficiency"]["source"].startswith("fitted by pipeplan calibrate")
    assert after.tensor_parallel_degrees == [1, 2] and after.microbatch_sizes == [1, 2, 4]
    truth = load_profile(measured)

    def error(profile):
        return sum(abs(la.cost_at(b).forward_ms + la.cost_at(b).backward_ms
                       - lm.cost_at(b).forward_ms - lm.cost_at(b).backward_ms)
                   for la, lm in zip(profile.layers, truth.layers) for b in truth.microbatch_sizes)
    assert error(after) < error(before)


def test_calibrate_fit_recovers_a_known_efficiency():
    from pipeplan.analytic import EfficiencyModel, analytic_profile, get_gpu, load_model_config
    from pipeplan.analytic.calibrate import fit_efficiency

    truth = EfficiencyModel(gemm=0.55, attention=0.35, memory=0.7, kernel_latency_us=6.0)
    cfg, gpu = load_model_config("llama3-8b"), get_gpu("h100-sxm")
    fake = analytic_profile(cfg, gpu, seq_len=4096, microbatch_sizes=[1, 2, 4], efficiency=truth)
    fitted, report = fit_efficiency(cfg, gpu, fake)
    assert report["rms_log_error_after"] < 0.01 < report["rms_log_error_before"]
    # One sequence length fixes the GEMM share well and the attention core's only roughly: the two
    # always come in the same proportion in a block (the forward/backward ratio tells them apart).
    assert fitted.gemm == pytest.approx(0.55, rel=0.03) and fitted.attention == pytest.approx(0.35, rel=0.2)
    assert fitted.memory == pytest.approx(0.7, rel=0.03) and fitted.kernel_latency_us == pytest.approx(6.0, rel=0.05)


def test_calibrate_without_report_or_measured_exits_2(tmp_path):
    result = invoke("calibrate", tmp_path / "plan.json", "-o", tmp_path / "out.json")
    assert result.exit_code == 2 and "REPORT" in result.output


def test_validate_names_the_degrees(tmp_path):
    out = tmp_path / "p.json"
    assert invoke("profile", "gpt2", "--analytic", "--gpu", "l4", "--tensor-parallel", "1,4", "-o", out).exit_code == 0
    result = invoke("validate", out)
    assert result.exit_code == 0 and "tensor-parallel degrees [1, 4]" in result.output
