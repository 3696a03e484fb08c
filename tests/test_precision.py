"""``--precision``: each term against a hand computation of its documented formula
(docs/analytic.md and docs/cost-model.md, "Precision"), plans in bf16 unchanged, and the exports
read back by megatron-core's and torchtitan's own config code; doctor on an FP8 Megatron-LM script."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cli_checks import invoke, one_line_error
from pipeplan.analytic.api import analytic_profile
from pipeplan.analytic.efficiency import DEFAULT_EFFICIENCY, gemm_shape_factor, part_ms
from pipeplan.analytic.families import load_model_config
from pipeplan.analytic.flops import Shape, unit_work
from pipeplan.analytic.memory import block_activation_terms
from pipeplan.api import plan_profile
from pipeplan.cluster.presets import resolve_cluster
from pipeplan.doctor import DoctorOptions, doctor_file
from pipeplan.errors import BadInputError
from pipeplan.export import export_plan
from pipeplan.facts.gpus import get_gpu
from pipeplan.facts.training_state import state_memory, training_state
from pipeplan.formats.io import dump_model, load_plan, write_json_atomic
from pipeplan.formats.plan import PlanSettings
from pipeplan.requests import ClusterRequest

DATA = Path(__file__).parent / "data" / "doctor"
#: NVIDIA's examples/llama/train_llama3_8b_h100_fp8.sh as published (tests/data/doctor/upstream/ORIGIN.md).
FP8_SCRIPT = DATA / "upstream" / "megatron_core_v0.16.1_train_llama3_8b_h100_fp8.sh"
H100 = get_gpu("h100-sxm")
B200 = get_gpu("b200")
T, H, F = 8192, 4096, 14336  # Llama 3 8B at one sample of 8192 tokens


def _fp8_shape(q=1.0):
    return Shape(T, 1, quantized_bytes=q)


def test_fp8_gemm_is_its_flops_over_the_fp8_peak_times_the_gemm_efficiency():
    cfg = load_model_config("llama3-8b")
    work = unit_work(cfg, "block", 0, _fp8_shape())
    o_proj = next(p for p in work.forward if p.name == "o_proj")
    assert o_proj.quantized and o_proj.flops == 2.0 * T * H * H
    # Operands in fp8 (1 byte: input and weight), output in bf16 (2 bytes).
    assert o_proj.bytes == 1 * (T * H + H * H) + 2 * T * H
    e = DEFAULT_EFFICIENCY
    # Without an SM count only the k loop's fill applies (4096 x 4096 outputs fill 128 x 128 tiles).
    fill = 1 + e.gemm_k_overhead / H
    by_hand = 1e3 * max(o_proj.flops * fill / (H100.peak_flops["fp8"] * e.gemm),
                        o_proj.bytes / (H100.hbm_bytes_per_s * e.memory))
    assert part_ms(o_proj, H100.peak_flops["bf16"], H100.hbm_bytes_per_s, e, H100.peak_flops["fp8"]) == \
        pytest.approx(by_hand + e.kernel_latency_us / 1e3, rel=1e-12)
    # The attention core and the norms stay at their own peaks: not quantized.
    assert not any(p.quantized for p in work.forward if p.kind != "gemm")
    # The head (Megatron's output layer is no TE module) stays bf16.
    assert not any(p.quantized for p in unit_work(cfg, "head", 0, _fp8_shape()).forward)


def test_the_profile_is_the_sum_of_its_parts_at_their_peaks():
    cfg = load_model_config("llama3-8b")
    profile = analytic_profile(cfg, H100, seq_len=T, precision="fp8", microbatch_sizes=(1,))
    assert profile.precision == "fp8" and profile.measurement["precision"]["name"] == "fp8"
    e = DEFAULT_EFFICIENCY
    work = unit_work(cfg, "block", 0, _fp8_shape())

    def by_hand(parts):
        total = 0.0
        for p in parts:
            peak = H100.peak_flops["fp8" if p.quantized else "bf16"]
            fraction = e.attention if p.kind == "attention" else e.gemm
            compute = p.flops / (peak * fraction) if p.flops else 0.0
            if p.kind == "gemm":
                compute *= gemm_shape_factor(p, H100.sm_count, e.gemm_k_overhead)
            total += 1e3 * max(compute, p.bytes / (H100.hbm_bytes_per_s * e.memory)) + e.kernel_latency_us / 1e3
        return total

    cost = profile.layers[1].costs[0]
    assert cost.forward_ms == pytest.approx(by_hand(work.forward), abs=1e-6)
    assert cost.backward_ms == pytest.approx(by_hand(work.backward_input + work.backward_weight), abs=2e-6)
    casts = [p for p in work.forward if p.name.endswith("_quantize")]
    assert cost.quantize_forward_ms == pytest.approx(by_hand(casts), abs=1e-6)
    grad_casts = [p for p in work.backward_input if p.name.endswith("_quantize")]
    assert cost.quantize_backward_ms == pytest.approx(by_hand(grad_casts), abs=1e-6)


def test_casts_read_the_dtype_and_write_row_and_column_copies():
    cfg = load_model_config("llama3-8b")
    work = unit_work(cfg, "block", 0, _fp8_shape())
    forward = {p.name: p for p in work.forward}
    backward = {p.name: p for p in work.backward_input}
    assert forward["o_proj_quantize"].bytes == (2 + 2 * 1) * T * H
    assert forward["q_proj_quantize"].bytes == (2 + 2 * 1) * T * H
    # Key and value read the input query's projection already cast (TE's LayerNormLinear); up the gate's.
    assert "k_proj_quantize" not in forward and "up_proj_quantize" not in forward
    assert backward["down_proj_grad_quantize"].bytes == (2 + 2 * 1) * T * H
    assert backward["gate_proj_grad_quantize"].bytes == (2 + 2 * 1) * T * F


@pytest.mark.parametrize("precision,q", [("fp8", 1.0), ("mxfp8", 1 + 1 / 32), ("nvfp4", 0.5 + 1 / 16)])
def test_saved_gemm_inputs_are_kept_quantized(precision, q):
    cfg = load_model_config("llama3-8b")
    bf16 = sum(block_activation_terms(cfg, Shape(T, 1)).values())
    low = sum(block_activation_terms(cfg, _fp8_shape(q)).values())
    # The norm's output into q/k/v, the attention output into o_proj, the MLP norm's output, down_proj's input.
    assert bf16 - low == pytest.approx((2 - q) * T * (3 * H + F))


def test_training_state_adds_te_weight_copies_sharded_as_the_weights():
    fp8 = training_state("adam-fp32-grads", 2, "fp8")
    assert (fp8.weight_bytes, fp8.quantized_weight_bytes, fp8.total_bytes) == (2, 2.0, 20.0)
    gather = training_state("adam", 2, "fp8", quantized_params=True)  # --fp8-param-gather, --grad-reduce-in-bf16
    assert (gather.weight_bytes, gather.quantized_weight_bytes, gather.gradient_bytes) == (1.0, 1.0, 2)
    nvfp4 = training_state("adam", 2, "nvfp4")
    assert nvfp4.quantized_weight_bytes == 2 * (0.5 + 1 / 16)
    for zero, d in ((1, 8), (3, 8)):
        memory = state_memory(1e9, fp8, zero, d)
        assert memory.quantized_weight_bytes == math.ceil(2e9 / (d if zero == 3 else 1))
        assert memory.total_bytes == memory.weight_bytes + memory.gradient_bytes + memory.optimizer_bytes + \
            memory.quantized_weight_bytes
    assert training_state("adam", 2, None) == training_state("adam", 2, "bf16") == training_state("adam", 2)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    out = {}
    for name, precision, gpu in (("bf16", "bf16", H100), ("fp8", "fp8", H100), ("nvfp4", "nvfp4", B200)):
        path = root / f"{name}.json"
        write_json_atomic(path, analytic_profile("llama3-8b", gpu, seq_len=T, precision=precision,
                                                 microbatch_sizes=(1,)))
        out[name] = path
    return out


def _cluster_plan(tmp_path, profile_path, cluster="dgx-h100", **fields):
    request = ClusterRequest.make(num_gpus=8, cluster=resolve_cluster(cluster), data_parallel=8, global_batch=128,
                                  microbatch_size=1, optimizer="adam", schedule="1f1b", **fields)
    out = tmp_path / f"plan-{len(list(tmp_path.iterdir()))}.json"
    plan_profile(profile_path, request, out)
    return load_plan(out), out


def test_plan_memory_and_time_parts_add_up(tmp_path, profiles):
    plan, _ = _cluster_plan(tmp_path, profiles["fp8"], zero_stage=1)
    assert plan.settings.precision == "fp8" and plan.settings.fp8_param_gather is None
    (stage,) = plan.stages
    params = stage.param_bytes / 2
    assert stage.quantized_weight_bytes == math.ceil(params * 2)  # fp8 copy + transpose, not sharded at ZeRO 1
    assert stage.weight_bytes == math.ceil(params * 2)
    p = plan.predicted
    assert p.quantize_ms > 0
    parts = (p.compute_ms + p.tensor_parallel_ms + p.quantize_ms + p.bubble_ms + (p.overhead_ms or 0) + p.transfer_ms
             + p.data_parallel_ms + p.optimizer_ms)
    assert parts == pytest.approx(p.iteration_ms, abs=1e-5)
    gathered, _ = _cluster_plan(tmp_path, profiles["fp8"], zero_stage=1, fp8_param_gather=True)
    (stage,) = gathered.stages
    assert stage.weight_bytes == stage.quantized_weight_bytes == math.ceil(params * 1)
    assert gathered.settings.fp8_param_gather is True


def test_plans_without_precision_are_unchanged(tmp_path, profiles):
    default = analytic_profile("llama3-8b", H100, seq_len=T, microbatch_sizes=(1,))
    assert dump_model(default) == profiles["bf16"].read_text()
    assert "precision" not in profiles["bf16"].read_text() and "quantize" not in profiles["bf16"].read_text()
    plan, path = _cluster_plan(tmp_path, profiles["bf16"], zero_stage=1)
    text = path.read_text()
    assert "precision" not in text and "quantize" not in text and "fp8" not in text
    with pytest.raises(BadInputError, match="--fp8-param-gather"):
        _cluster_plan(tmp_path, profiles["bf16"], zero_stage=1, fp8_param_gather=True)


def test_dtype_fp8_points_to_precision(tmp_path):
    result = invoke("profile", "llama3-8b", "--analytic", "--gpu", "h100-sxm", "--dtype", "fp8", "-o", tmp_path / "p.json")
    one_line_error(result, 2, "--dtype", "--precision fp8")
    result = invoke("profile", "llama3-8b", "--analytic", "--gpu", "h100-sxm", "--precision", "nvfp4",
                    "-o", tmp_path / "p.json")
    one_line_error(result, 2, "--precision", "h100-sxm", "nvfp4")
    result = invoke("profile", "llama3-8b", "--analytic", "--gpu", "h100-sxm", "--precision", "fp6",
                    "-o", tmp_path / "p.json")
    one_line_error(result, 2, "--precision", "fp6")
    assert not (tmp_path / "p.json").exists()


def _megatron_flags(text: str) -> dict:
    import shlex

    words = shlex.split(text.split("PIPEPLAN_MEGATRON_ARGS=(")[1].split(")\n")[0])
    flags, i = {}, 0
    while i < len(words):
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            flags[words[i]], i = words[i + 1], i + 2
        else:
            flags[words[i]], i = None, i + 1
    return flags


@pytest.mark.parametrize("name,cluster,gather", [("fp8", "dgx-h100", False), ("fp8", "dgx-h100", True),
                                                  ("nvfp4", "dgx-b200", True)])
def test_megatron_export_is_megatron_cores_config(tmp_path, profiles, name, cluster, gather):
    pytest.importorskip("torch")
    try:
        from megatron.core.enums import Fp4Recipe, Fp8Recipe
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        pytest.skip("megatron-core not installed")
    plan, _ = _cluster_plan(tmp_path, profiles[name], cluster=cluster, zero_stage=1,
                            **({"fp8_param_gather": True} if gather else {}))
    from pipeplan.formats.io import load_profile

    flags = _megatron_flags(export_plan(plan, load_profile(profiles[name]), "megatron")[".sh"])
    fp8, fp4 = flags.get("--fp8-format"), flags.get("--fp4-format")
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8, fp8=fp8,
                               fp8_recipe=flags.get("--fp8-recipe", "delayed"), fp8_param="--fp8-param-gather" in flags,
                               fp4=fp4, fp4_recipe=flags.get("--fp4-recipe", "nvfp4"),
                               fp4_param="--fp4-param-gather" in flags)
    if name == "fp8":
        assert (config.fp8, Fp8Recipe(config.fp8_recipe), config.fp8_param) == ("hybrid", Fp8Recipe.tensorwise, gather)
    else:
        assert (config.fp4, Fp4Recipe(config.fp4_recipe), config.fp4_param, config.fp8) == ("e2m1", Fp4Recipe.nvfp4,
                                                                                           True, None)


def test_torchtitan_export_is_torchtitans_config(tmp_path, profiles):
    from test_export_fixtures import torchtitan_config_manager

    ConfigManager = torchtitan_config_manager()
    plan, _ = _cluster_plan(tmp_path, profiles["fp8"], zero_stage=3, fp8_param_gather=True)
    text = export_plan(plan, None, "torchtitan")[".toml"]
    path = tmp_path / "job.toml"
    path.write_text(text)
    config = ConfigManager().parse_args(["--job.config_file", str(path)])
    float8 = config.quantize.linear.float8
    assert config.model.converters == ["quantize.linear.float8"]
    assert (float8.recipe_name, float8.enable_fsdp_float8_all_gather, float8.filter_fqns) == ("tensorwise", True,
                                                                                            ["output"])
    # The converter's name as torchtitan registers it (its module imports triton, so read, not imported).
    import sys

    source = Path(sys.modules["torchtitan"].__path__[0]) / "components" / "quantization" / "float8.py"
    assert 'register_model_converter(Float8LinearConverter, "quantize.linear.float8")' in source.read_text()
    nvfp4, _ = _cluster_plan(tmp_path, profiles["nvfp4"], cluster="dgx-b200", zero_stage=3)
    with pytest.raises(BadInputError, match="NVFP4"):
        export_plan(nvfp4, None, "torchtitan")


def _doctor(script, profile):
    settings = PlanSettings(stages=1, global_batch=1, optimizer="adam-fp32-grads")
    return doctor_file("megatron", script, profile, settings,
                       options=DoctorOptions(cluster="dgx-h100", search_layouts=False, optimizer_auto=True))


def test_doctor_reads_nvidias_fp8_llama3_8b_script_without_a_false_over_memory(profiles):
    result, text, _ = _doctor(FP8_SCRIPT, profiles["fp8"])
    c = result.config
    assert (c.precision, c.quantized_params, c.gradient_reduce_dtype, c.data_degree) == ("fp8", True, "bf16", 8)
    assert result.plan.settings.optimizer == "adam" and result.plan.settings.fp8_param_gather
    assert result.exit_code == 0 and "over-memory" not in text and "[precision]" not in text, text
    assert "quantized copies" in text and "fp8 casts" in text
    # The same script against a bf16 profile: said, not silently costed as bf16.
    result, text, _ = _doctor(FP8_SCRIPT, profiles["bf16"])
    assert any(f.code == "precision" and f.severity == "warning" for f in result.findings), text


@pytest.mark.parametrize("extra,precision", [("--fp8-recipe tensorwise", "fp8"), ("--fp8-recipe mxfp8", "mxfp8"),
                                             ("--fp8-recipe blockwise", "fp8")])
def test_doctor_reads_the_fp8_recipe(tmp_path, profiles, extra, precision):
    script = (FP8_SCRIPT).read_text().replace(
        '"--fp8-format hybrid"', f'"--fp8-format hybrid" "{extra}"')
    path = tmp_path / "s.sh"
    path.write_text(script)
    result, _, _ = _doctor(path, profiles["fp8"])
    assert result.config.precision == precision


def test_doctor_refuses_a_recipe_megatron_refuses(tmp_path, profiles):
    script = (FP8_SCRIPT).read_text().replace('"--fp8-format hybrid"',
                                                                         '"--fp8-format e5m2"')
    path = tmp_path / "bad.sh"
    path.write_text(script)
    with pytest.raises(BadInputError, match="--fp8-format"):
        _doctor(path, profiles["fp8"])


def test_doctor_reads_torchtitans_float8_converter(tmp_path):
    from pipeplan.launchers.torchtitan.reader import torchtitan_precision

    assert torchtitan_precision({"model": {"converters": ["quantize.linear.float8"]},
                                 "quantize": {"linear": {"float8": {"enable_fsdp_float8_all_gather": True}}}}) \
        == ("fp8", True)
    assert torchtitan_precision({"model": {"converters": "quantize.linear.mx"}}) == ("mxfp8", False)
    assert torchtitan_precision({"model": {"converters": 3}, "quantize": []}) == (None, False)
    assert json.dumps(torchtitan_precision({})) == "[null, false]"


def test_pipeline_plans_count_the_copies_and_show_names_every_part(tmp_path, profiles):
    from pipeplan.plan.costmodel import CostModel

    settings = PlanSettings(stages=2, optimizer="adam", precision="fp8")
    assert CostModel.from_settings(settings, 2).static_bytes_per_param_byte == (16 + 2) / 2  # + the fp8 copy and its transpose
    gathered = settings.model_copy(update={"fp8_param_gather": True})
    assert CostModel.from_settings(gathered, 2).static_bytes_per_param_byte == 16 / 2
    _, path = _cluster_plan(tmp_path, profiles["fp8"], zero_stage=1)
    shown = invoke("show", path)
    assert shown.exit_code == 0, shown.output
    assert "fp8 copies" in shown.output and "fp8 casts" in shown.output and "fp8 GEMMs" in shown.output


def test_doctor_torchtitan_reads_the_exported_float8_settings(tmp_path, profiles):
    from pipeplan.launchers.torchtitan.reader import parse_torchtitan

    plan, _ = _cluster_plan(tmp_path, profiles["fp8"], zero_stage=3, fp8_param_gather=True)
    text = export_plan(plan, None, "torchtitan")[".toml"]
    path = tmp_path / "job.toml"
    path.write_text(text)
    config = parse_torchtitan(str(path), text, num_layers=32, world_size=8)
    assert (config.precision, config.quantized_params, config.zero_stage) == ("fp8", True, 3)


def test_calibrate_keeps_the_precision_and_recovers_the_efficiency(tmp_path, profiles):
    from pipeplan.analytic.calibrate import calibrate_analytic_files

    out = tmp_path / "calibrated.json"
    rebuilt, report = calibrate_analytic_files(profiles["fp8"], profiles["fp8"], out)
    assert rebuilt.precision == "fp8"
    assert report["efficiency"]["gemm"] == pytest.approx(DEFAULT_EFFICIENCY.gemm, rel=0.03)
    assert report["rms_log_error_after"] < 0.01


def test_doctor_reads_the_megatron_export_back_as_planned(tmp_path, profiles):
    from pipeplan.formats.io import load_profile

    plan, _ = _cluster_plan(tmp_path, profiles["fp8"], zero_stage=1, fp8_param_gather=True)
    script = tmp_path / "plan.sh"
    script.write_text(export_plan(plan, load_profile(profiles["fp8"]), "megatron")[".sh"])
    settings = PlanSettings(stages=1, global_batch=1, optimizer="adam")
    result, _, _ = doctor_file("megatron", script, profiles["fp8"], settings,
                               options=DoctorOptions(cluster="dgx-h100", search_layouts=False, world_size=8))
    assert (result.config.precision, result.config.quantized_params) == ("fp8", True)
    assert result.plan.predicted.iteration_ms == pytest.approx(plan.predicted.iteration_ms, rel=1e-9)
