"""Memory a real job sees (the reserve by part) and Megatron's CPU activation offload.

Each term is checked against a hand computation of the formula docs/cluster-model.md ("Memory a
real job sees") and docs/cost-model.md ("CPU activation offload") write; the offload's option
through the CLI, its bad inputs (exit 2), and the export -> doctor round trip.
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.cluster.memory import job_memory, nccl_buffer_bytes, nccl_communicators, plannable_for
from pipeplan.cluster.presets import PRESETS
from pipeplan.cluster.profile_view import degree_view
from pipeplan.errors import BadInputError
from pipeplan.facts.gpus import HOST_LINK_BYTES_PER_S
from pipeplan.facts.job_memory import cublas_workspace_bytes
from pipeplan.formats.cluster import cluster_from_dict
from pipeplan.formats.io import load_plan, load_profile
from pipeplan.plan.offload import offload_exposed_ms, offloaded_layers, with_cpu_offload

runner = CliRunner()
MIB = 2**20


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def profile_8b(tmp_path_factory):
    path = tmp_path_factory.mktemp("jobmem") / "8b.json"
    done = _invoke("profile", "llama3-8b", "--analytic", "--gpu", "h100-sxm", "--seq-len", "8192",
                   "--microbatch-sizes", "1", "--tensor-parallel", "1,2", "-o", path)
    assert done.exit_code == 0, done.output
    return path


def test_each_fixed_term_is_its_documented_figure():
    # PyTorch's workspaces: Hopper ":4096:8" (32 MiB) + cuBLASLt 32 MiB; Ampere 80 GB ":4096:2:16:8" + 4 MiB.
    assert cublas_workspace_bytes("h100-sxm", 80 * 2**30) == 32 * MIB + 32 * MIB
    assert cublas_workspace_bytes("a100-80gb", 80 * 2**30) == 2 * 4 * MIB + 8 * 16 * 1024 + 4 * MIB
    assert cublas_workspace_bytes("a100-40gb", 16 * 2**30) == 2 * 4 * MIB + 8 * 16 * 1024 + MIB
    # d 8 x t 8 x p 4: world, tensor, data (collectives), pipeline sends, the tied embedding's pair.
    comms = nccl_communicators(8, 8, 4)
    assert [name for name, _, _ in comms] == ["world", "tensor", "data", "pipeline", "embedding"]
    # collectives: 8 channels x 2 neighbours x 4 MiB (the pair: 1 neighbour); p2p: 2 peers x 2 channels x 4 MiB
    assert nccl_buffer_bytes(comms) == 3 * 8 * 2 * 4 * MIB + 2 * 2 * 4 * MIB + 8 * 1 * 4 * MIB
    # the expert all-to-all reaches every other rank of its group: (E - 1) x 2 channels x 4 MiB
    assert nccl_buffer_bytes([("expert", "all-to-all", 8)]) == 7 * 2 * 4 * MIB
    assert nccl_communicators(1, 1, 1) == []
    # E 8 over t 4 x d 16: the experts' own data-parallel group of EDP = 64 / 8 = 8 reduces their gradients
    assert ("expert data", "collective", 8) in nccl_communicators(16, 4, 1, 1, 8, 8)
    assert all(name != "expert data" for name, _, _ in nccl_communicators(16, 4, 1, 1, 1, 64))


def test_the_plan_reserve_is_its_parts_by_hand(profile_8b, tmp_path):
    out = tmp_path / "plan.json"
    done = _invoke("plan", profile_8b, "--gpus", "8", "--cluster", "dgx-h100", "--global-batch", "32",
                   "--data-parallel", "4", "--tensor-parallel", "2", "--stages", "1", "--zero", "1", "-q", "-o", out)
    assert done.exit_code == 0, done.output
    plan = load_plan(out)
    parts = plan.reserve_parts
    peak = max(r.peak_memory_bytes for r in plan.ranks)
    assert parts.cuda_context_bytes == 666_632_192
    assert parts.cublas_workspace_bytes == 64 * MIB
    # world (8), tensor (2: one neighbour), data (4): collectives only at p = 1
    assert parts.nccl_buffer_bytes == (8 * 2 + 8 * 1 + 8 * 2) * 4 * MIB
    assert parts.fragmentation_bytes == math.ceil(0.05 * peak)
    assert plan.reserve_bytes == 666_632_192 + 64 * MIB + 40 * 4 * MIB + math.ceil(0.05 * peak)
    assert peak + plan.reserve_bytes <= 80 * 2**30
    shown = _invoke("show", out)
    assert "reserve per GPU by part" in shown.output and "NCCL buffers" in shown.output, shown.output


def test_the_old_single_reserve_still_loads_and_overrides(profile_8b, tmp_path):
    spec = tmp_path / "old.toml"
    spec.write_text('base = "dgx-h100"\nname = "old"\nreserve = "2GiB"\nfragmentation = 0.1\n')
    out = tmp_path / "plan.json"
    done = _invoke("plan", profile_8b, "--gpus", "8", "--cluster", spec, "--global-batch", "32",
                   "--data-parallel", "4", "--tensor-parallel", "2", "--stages", "1", "-q", "-o", out)
    assert done.exit_code == 0, done.output
    plan = load_plan(out)
    peak = max(r.peak_memory_bytes for r in plan.ranks)
    assert plan.reserve_parts.spec_reserve_bytes == 2 * 2**30 and plan.reserve_parts.nccl_buffer_bytes == 0
    assert plan.reserve_bytes == 2 * 2**30 + math.ceil(0.1 * peak)
    cluster = cluster_from_dict({**PRESETS["dgx-h100"].model_dump(exclude_none=True), "cuda_context": "1GiB"})
    assert job_memory(0, cluster, None, (1, 1, 1)).cuda_context_bytes == 2**30
    # plannable: the largest x with x + ceil(f x) within the cap less the fixed parts
    x = plannable_for(80 * 2**30, cluster, None, (8, 1, 1))
    fixed = job_memory(0, cluster, None, (8, 1, 1)).fixed_bytes
    assert x + fixed + math.ceil(0.05 * x) <= 80 * 2**30 < x + 1 + fixed + math.ceil(0.05 * (x + 1))


@pytest.mark.parametrize("line, field", [('reserve = "lots"', "reserve"), ("nccl_channels = 0", "nccl_channels"),
                                         ("fragmentation = 1.5", "fragmentation")])
def test_a_bad_reserve_field_is_exit_2_naming_it(profile_8b, tmp_path, line, field):
    spec = tmp_path / "bad.toml"
    spec.write_text(f'base = "dgx-h100"\nname = "bad"\n{line}\n')
    done = _invoke("plan", profile_8b, "--gpus", "8", "--cluster", spec, "--global-batch", "32", "-q")
    assert done.exit_code == 2 and field in done.output and "Traceback" not in done.output, done.output


def test_offload_memory_and_time_by_hand(profile_8b):
    profile = load_profile(profile_8b)
    names = offloaded_layers(profile, 16)
    assert names == [f"model.layers.{i}" for i in range(16)]
    after = with_cpu_offload(profile, 16)
    acts = {layer.name: layer.cost_at(1, 2).activation_bytes for layer in profile.layers}
    kept = {layer.name: layer.cost_at(1, 2).activation_bytes for layer in after.layers}
    # the offloaded layers free their bytes, less one layer's (the double buffer)
    freed = sum(acts.values()) - sum(kept.values())
    assert freed == sum(acts[n] for n in names) - max(acts[n] for n in names)
    # per micro-batch: copy = A / bw each way, covered by the next L // N = 2 layers' forward / backward
    bw = HOST_LINK_BYTES_PER_S["h100-sxm"]
    per = offload_exposed_ms(profile, 16, 1, 2, bw)
    hand = 0.0
    for n in names:
        c = profile.layers[[layer.name for layer in profile.layers].index(n)].cost_at(1, 2)
        copy = c.activation_bytes / bw * 1e3
        hand += max(0.0, copy - 2 * c.forward_ms) + max(0.0, copy - 2 * c.backward_ms)
    assert per["exposed_ms"] == pytest.approx(hand) and per["d2h_ms"] == pytest.approx(
        sum(acts[n] for n in names) / bw * 1e3)


def test_offload_through_the_cli_and_export_doctor_round_trip(profile_8b, tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", profile_8b, "--gpus", "8", "--cluster", "dgx-h100", "--global-batch", "64", "--launcher",
            "megatron", "--zero", "1", "--data-parallel", "4", "--tensor-parallel", "2"]
    done = _invoke(*args, "--cpu-offload-layers", "16", "-q", "-o", out)
    assert done.exit_code == 0, done.output
    plan = load_plan(out)
    base = tmp_path / "base.json"
    assert _invoke(*args, "--stages", "1", "--recompute", "none", "-q", "-o", base).exit_code == 0
    without = load_plan(base)
    # by hand on the layout's view (the entries at t = 2, tensor-parallel collectives in the compute
    # that covers the copies): copy = A / bw, window L // N = 2 layers
    view = degree_view(load_profile(profile_8b), 2, PRESETS["dgx-h100"])
    bw, hand = HOST_LINK_BYTES_PER_S["h100-sxm"], 0.0
    for layer in [layer for layer in view.profile.layers if layer.kind == "block"][:16]:
        c = layer.cost_at(plan.microbatch_size)
        copy = c.activation_bytes / bw * 1e3
        hand += max(0.0, copy - 2 * c.forward_ms) + max(0.0, copy - 2 * c.backward_ms)
    assert plan.settings.stages == 1 and plan.settings.cpu_offload_layers == 16
    assert plan.predicted.cpu_offload_ms == pytest.approx(plan.num_microbatches * hand, abs=1e-5) and hand > 0
    assert plan.predicted.iteration_ms == pytest.approx(without.predicted.iteration_ms + plan.predicted.cpu_offload_ms,
                                                        abs=1e-5)
    assert plan.ranks[0].peak_memory_bytes < without.ranks[0].peak_memory_bytes
    script = tmp_path / "train.sh"
    done = _invoke("export", "-f", "megatron", out, "--profile", profile_8b, "-o", script)
    assert done.exit_code == 0, done.output
    text = script.read_text()
    assert "--cpu-offloading\n" in text and "--cpu-offloading-num-layers 16" in text
    doctor = _invoke("doctor", "megatron", script, "--profile", profile_8b, "--cluster", "dgx-h100", "--same-layout",
                     "--world-size", "8", "--format", "json")
    assert doctor.exit_code in (0, 1), doctor.output
    report = json.loads(doctor.output)
    assert report["plan"]["predicted"]["iteration_ms"] == pytest.approx(plan.predicted.iteration_ms, rel=1e-9)
    assert report["plan"]["predicted"]["cpu_offload_ms"] == pytest.approx(plan.predicted.cpu_offload_ms, rel=1e-9)
    assert "cuda_context_bytes" in report["memory_per_rank"][0]["reserve_parts"]


@pytest.mark.parametrize("extra, words", [
    (["--cpu-offload-layers", "16", "--launcher", "torchtitan"], "--launcher megatron"),
    (["--cpu-offload-layers", "16", "--launcher", "megatron", "--stages", "2"], "pipeline parallelism"),
    (["--cpu-offload-layers", "16", "--launcher", "megatron", "--recompute", "all"], "recomputation"),
    (["--cpu-offload-layers", "32", "--launcher", "megatron"], "below the profile's 32"),
    (["--cpu-offload-layers", "0", "--launcher", "megatron"], "--cpu-offload-layers"),
])
def test_offload_bad_input_is_exit_2(profile_8b, extra, words):
    done = _invoke("plan", profile_8b, "--gpus", "8", "--cluster", "dgx-h100", "--global-batch", "64", "-q", *extra)
    assert done.exit_code == 2 and words in done.output and "Traceback" not in done.output, done.output


def test_offload_without_a_cluster_is_refused():
    from pipeplan.plan.offload import check_cpu_offload
    from pipeplan.formats.plan import PlanSettings
    with pytest.raises(BadInputError, match="--gpus"):
        check_cpu_offload(PlanSettings(stages=1, launcher="megatron", cpu_offload_layers=2),
                          type("P", (), {"layers": [type("L", (), {"kind": "block", "name": str(i)})()
                                                    for i in range(4)]})())


@pytest.mark.parametrize("fields, accepted", [
    (dict(cpu_offloading_num_layers=16), True),                       # what the export writes
    (dict(cpu_offloading_num_layers=32), False),                      # N at the layer count
    (dict(cpu_offloading_num_layers=16, pipeline_model_parallel_size=2), False),
    (dict(cpu_offloading_num_layers=16, recompute_granularity="full", recompute_method="uniform",
          recompute_num_layers=1), False),
])
def test_the_planners_offload_rules_are_megatron_cores(fields, accepted):
    # The planner refuses (exit 2, test above) exactly what megatron-core's TransformerConfig refuses.
    torch = pytest.importorskip("torch")
    try:
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        pytest.skip("megatron-core not installed")
    make = lambda: TransformerConfig(num_layers=32, hidden_size=64, num_attention_heads=8, cpu_offloading=True,
                                     pipeline_dtype=torch.bfloat16, **fields)
    if accepted:
        config = make()
        assert (config.cpu_offloading, config.cpu_offloading_num_layers, config.cpu_offloading_activations,
                config.cpu_offloading_weights) == (True, 16, True, False)
    else:
        with pytest.raises(ValueError):
            make()


def test_doctor_refuses_offload_with_a_pipeline_as_megatron_core_does(profile_8b, tmp_path):
    out, script = tmp_path / "plan.json", tmp_path / "train.sh"
    assert _invoke("plan", profile_8b, "--gpus", "8", "--cluster", "dgx-h100", "--global-batch", "64", "--launcher",
                   "megatron", "--zero", "1", "--cpu-offload-layers", "8", "-q", "-o", out).exit_code == 0
    assert _invoke("export", "-f", "megatron", out, "--profile", profile_8b, "-o", script).exit_code == 0
    script.write_text(script.read_text().replace("--cpu-offloading-num-layers 8",
                                                 "--cpu-offloading-num-layers 8 --pipeline-model-parallel-size 2"))
    done = _invoke("doctor", "megatron", script, "--profile", profile_8b, "--cluster", "dgx-h100", "--same-layout",
                   "--world-size", "8")
    assert done.exit_code == 2 and "--cpu-offloading" in done.output and "pipeline" in done.output, done.output
