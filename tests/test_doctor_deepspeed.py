"""doctor on DeepSpeed configs (ds_config + PipelineModule partition), and the DeepSpeed export run by
DeepSpeed's own PipelineModule and engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from pipeplan.doctor import DoctorOptions, doctor_file, read_config
from pipeplan.launchers.deepspeed.reader import partition_balanced, partition_uniform
from pipeplan.errors import BadInputError
from pipeplan.export import export_plan
from pipeplan.formats.plan import PlanSettings

from doctor_profiles import decoder_profile, llama3_8b, write_profile
from test_export_fixtures import hand_plan, llama_like_profile

DATA = Path(__file__).parent / "data" / "doctor"
GIB = 2**30
SETTINGS = PlanSettings(stages=1, global_batch=1, memory_cap_bytes=80 * GIB, bandwidth_bytes_per_s=25e9)
CONFIG = DATA / "deepspeed_pipeline_ds_config.json"


def _deepspeed_utils():
    pytest.importorskip("torch")
    try:
        from deepspeed.runtime import utils
    except Exception as exc:  # noqa: BLE001 - not installed, or no accelerator it can use
        pytest.skip(f"deepspeed does not import here: {exc}")
    return utils


def _doctor(profile, tmp_path, options, path=CONFIG, settings=SETTINGS, **kw):
    prof = write_profile(profile, tmp_path / "profile.json")
    return doctor_file("deepspeed", path, prof, settings, options=options, **kw)


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.integers(0, 50), min_size=1, max_size=14), parts=st.integers(1, 6))
def test_partitions_are_deepspeeds(weights, parts):
    utils = _deepspeed_utils()
    assert partition_uniform(len(weights), parts) == list(utils.partition_uniform(len(weights), parts))
    assert partition_balanced(weights, parts) == [int(x) for x in utils.partition_balanced(weights, parts)]


def test_example_config_raises_no_alarm(tmp_path):
    for method in (None, "uniform"):
        result, text, _ = _doctor(llama3_8b(), tmp_path, DoctorOptions(num_stages=4, world_size=4,
                                                                      partition_method=method))
        assert result.exit_code == 0 and not [f for f in result.findings if f.severity != "info"], text
        assert result.plan is not None and result.config.num_microbatches == 64


def test_issue_5078_empty_ranks(tmp_path):
    """DeepSpeed 5078: ranks with no layers. Its case (42 blocks, 16 stages, 'type:transformer')
    no longer leaves ranks empty with DeepSpeed 0.19's partition_balanced; explicit parts with a
    repeated boundary, or more stages than layers, still do, and doctor flags them."""
    profile = decoder_profile(42, 1024, 8, 1024, 32000)
    result, _, _ = _doctor(profile, tmp_path, DoctorOptions(num_stages=16, world_size=16, partition_method="type:block"))
    utils = _deepspeed_utils()
    binary = [1 if layer.kind == "block" else 0 for layer in profile.layers]
    parts = [int(x) for x in utils.partition_balanced(binary, 16)]
    assert [len(s.units) for s in result.layout.stages] == [b - a for a, b in zip(parts, parts[1:])]
    assert all(s.units for s in result.layout.stages) and "empty-stage" not in {f.code for f in result.findings}
    for options in (DoctorOptions(world_size=4, parts=(0, 20, 20, 40, 45)),
                    DoctorOptions(num_stages=8, world_size=8, partition_method="uniform")):
        small = profile if options.parts else decoder_profile(3, 1024, 8, 1024, 32000)  # 6 layers, 8 stages
        result, _, _ = _doctor(small, tmp_path, options)
        finding = next(f for f in result.findings if f.code == "empty-stage")
        assert finding.severity == "error" and "hold no layers" in finding.message
        empty = [s.rank for s in result.layout.stages if not s.units]
        assert empty and all(f"rank {r}" in finding.message for r in empty)
        assert result.exit_code == 1


def test_issues_1378_4477_first_and_last_stage_memory(tmp_path):
    """The embedding on the first stage and the head with its logits on the last run out first."""
    profile = llama3_8b()
    options = DoctorOptions(num_stages=4, world_size=4, partition_method="uniform")
    free, _, _ = _doctor(profile, tmp_path, options, settings=SETTINGS.model_copy(update={"memory_cap_bytes": None}))
    peaks = [r.peak_memory_bytes for r in free.plan.ranks]
    assert peaks[0] == max(peaks)
    cap = (peaks[0] + sorted(peaks)[-2]) // 2
    result, _, _ = _doctor(profile, tmp_path, options, settings=SETTINGS.model_copy(update={"memory_cap_bytes": cap}))
    over = [f for f in result.findings if f.code == "over-memory"]
    assert len(over) == 1 and over[0].message.startswith("rank 0 ") and "tok_embeddings" in over[0].message
    assert max(r.peak_memory_bytes for r in result.best.ranks) <= cap


def test_batch_size_deepspeed_asserts(tmp_path):
    result, _, _ = _doctor(llama3_8b(), tmp_path, DoctorOptions(num_stages=4, world_size=4),
                           path=DATA / "deepspeed_batch_mismatch.json")
    finding = next(f for f in result.findings if f.code == "refused")
    assert "train_batch_size 48" in finding.setting and "set train_batch_size to 32" in finding.fix


def test_parts_past_the_layers_and_lost_layers(tmp_path):
    profile = llama3_8b()  # 35 layers
    result, _, _ = _doctor(profile, tmp_path, DoctorOptions(world_size=4, parts=(0, 9, 18, 27, 33)))
    lost = next(f for f in result.findings if f.code == "layers-lost")
    assert "2 of 35 PipelineModule layers" in lost.message
    result, _, _ = _doctor(profile, tmp_path, DoctorOptions(world_size=4, parts=(0, 9, 18, 27, 40)))
    assert any(f.code == "refused" and "past the 35 layers" in f.message for f in result.findings)


@pytest.mark.parametrize("name,options,where", [
    ("deepspeed_bad_type.json", DoctorOptions(num_stages=4), "train_batch_size"),
    ("deepspeed_pipeline_ds_config.json", DoctorOptions(), "--num-stages"),
    ("deepspeed_pipeline_ds_config.json", DoctorOptions(num_stages=4, partition_method="profile"), "--partition-method"),
    ("deepspeed_pipeline_ds_config.json", DoctorOptions(parts=(1, 9, 35)), "--parts"),
])
def test_bad_input_names_the_file_and_setting(tmp_path, name, options, where):
    with pytest.raises(BadInputError) as info:
        read_config("deepspeed", DATA / name, llama3_8b(), options)
    assert where in str(info.value)
    bad = tmp_path / "broken.json"
    bad.write_text('{"train_batch_size": 8,')
    with pytest.raises(BadInputError, match="broken.json: not valid JSON"):
        read_config("deepspeed", bad, llama3_8b(), DoctorOptions(num_stages=2))


@pytest.mark.parametrize("world_size", [4, 8])
def test_fix_round_trips_and_keeps_other_keys(tmp_path, world_size):
    profile = llama3_8b()
    out = tmp_path / "fixed.json"
    options = DoctorOptions(num_stages=4, world_size=world_size, partition_method="uniform")
    result, _, written = _doctor(profile, tmp_path, options, fix_output=out)
    sidecar = tmp_path / "fixed.parts.json"
    assert written == [out, sidecar]
    before, after = json.loads(CONFIG.read_text()), json.loads(out.read_text())
    assert {k: v for k, v in after.items() if k not in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")} \
        == {k: v for k, v in before.items() if k != "train_micro_batch_size_per_gpu"}
    exported = json.loads(sidecar.read_text())
    parts = exported["parts"]
    # The sidecar speaks for the same job as the fixed config: its topology and batch, d included.
    assert exported["topology"] == {"num_pp": 4, "num_mp": 1, "num_dp": world_size // 4}
    assert exported["ds_config"]["train_batch_size"] == after["train_batch_size"]
    config, layout = read_config("deepspeed", out, profile, DoctorOptions(world_size=world_size, parts=tuple(parts)))
    best = sorted(result.best.stages, key=lambda s: s.index)
    assert [len(s.units) for s in layout.stages] == [len(s.layers) for s in best]
    assert (config.microbatch_size, config.num_microbatches) == (result.best.microbatch_size,
                                                                 result.best.num_microbatches)
    again, _, _ = _doctor(profile, tmp_path, DoctorOptions(world_size=world_size, parts=tuple(parts)), path=out)
    assert again.exit_code == 0 and again.speedup == pytest.approx(1.0, abs=1e-6)


@pytest.mark.slow
def test_export_runs_in_deepspeeds_pipeline_engine(request, tmp_path):
    """The export's parts and ds_config, through the documented subclass, DeepSpeed's batch check and
    one training step of its pipeline engine on 2 CPU ranks."""
    # In 2 of about 6 runs on the loaded 2-core VM a rank aborted while DeepSpeed set up its
    # topology ("terminate called without an active exception", SIGABRT), before any pipeplan
    # code ran; until that is understood, the engine run is opt-in so that it cannot fail CI by chance.
    # (It used a fixed --master_port, 29561: two such runs at once on a shared machine failed with
    # EADDRINUSE; torchrun --standalone now picks a free port. Whether that was the abort is not shown.)
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("DeepSpeed's engine on torchrun aborts now and then on a loaded CPU runner: "
                    "pytest -m slow tests/test_doctor_deepspeed.py")
    _deepspeed_utils()
    profile = llama_like_profile(5)  # 8 layers
    plan = hand_plan(profile, [5, 3], "1f1b", 2, 1, 1, 4)
    export = tmp_path / "plan.deepspeed.json"
    export.write_text(export_plan(plan, profile, "deepspeed")[".json"])
    worker = Path(__file__).parent / "deepspeed_pipeline_worker.py"
    # A fresh extensions folder: the run must not depend on an op some earlier run compiled.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(worker), str(export), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["parts"] for r in ranks] == [[0, 5, 8]] * 2
    assert [r["local_layers"] for r in ranks] == [5, 3]
    assert all(r["micro_batches"] == 4 for r in ranks)
