"""doctor on torchtitan TOML job configs, checked by torchtitan's own ConfigManager and stage rules."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from pipeplan.doctor import doctor_file, read_config
from pipeplan.launchers.torchtitan.reader import llm_fqns_per_stage
from pipeplan.errors import BadInputError
from pipeplan.formats.plan import PlanSettings

from doctor_profiles import llama3_8b, llama3_70b, write_profile
from test_export_fixtures import torchtitan_config_manager

tomllib = pytest.importorskip("tomllib")

DATA = Path(__file__).parent / "data" / "doctor"
GIB = 2**30
SETTINGS = PlanSettings(stages=1, global_batch=1, memory_cap_bytes=80 * GIB, bandwidth_bytes_per_s=25e9)


def _doctor(name, profile, tmp_path, settings=SETTINGS, path=None, **kw):
    prof = write_profile(profile, tmp_path / "profile.json")
    return doctor_file("torchtitan", path or DATA / name, prof, settings, **kw)


def _torchtitan_generator():
    """torchtitan's own generate_llm_fqn_per_model_part (its module imports torch and the model code)."""
    pytest.importorskip("torch")
    torchtitan_config_manager()
    kernels = "torchtitan.models.moe.kernels"
    if kernels not in sys.modules:
        # It imports triton at import time (no GPU, no triton here); nothing doctor calls uses it.
        stub = types.ModuleType(kernels)
        stub.generate_permute_indices = None
        sys.modules[kernels] = stub
    try:
        from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
    except Exception as exc:  # noqa: BLE001 - whatever stops the import, the oracle is absent
        pytest.skip(f"torchtitan.distributed.pipeline_parallel does not import here: {exc}")
    return generate_llm_fqn_per_model_part


@pytest.mark.parametrize("stages,layers,first,last", [(4, 32, 1, 1), (8, 32, 1, 1), (12, 80, 1, 1), (16, 126, 2, 2),
                                                      (4, 6, 1, 1), (3, 7, 2, 1), (1, 8, 1, 1), (9, 5, 1, 1)])
def test_generated_stages_are_torchtitans(stages, layers, first, last):
    generate = _torchtitan_generator()
    try:
        expected = generate(stages, layers, first, last)
    except ValueError:
        with pytest.raises(ValueError):
            llm_fqns_per_stage(stages, layers, first, last)
        return
    assert llm_fqns_per_stage(stages, layers, first, last) == expected


@pytest.mark.parametrize("name", ["torchtitan_llama3_8b_pp4.toml", "torchtitan_llama3_70b_interleaved.toml",
                                  "torchtitan_issue775_microbatches_lt_pp.toml", "torchtitan_profile_names.toml"])
def test_test_configs_are_valid_torchtitan_configs(name):
    config = torchtitan_config_manager()().parse_args(["--job.config_file", str(DATA / name)])
    assert config.parallelism.pipeline_parallel_degree == 4


def test_example_configs_raise_no_alarm(tmp_path):
    for name, profile in [("torchtitan_llama3_8b_pp4.toml", llama3_8b()),
                          ("torchtitan_llama3_70b_interleaved.toml", llama3_70b())]:
        result, text, _ = _doctor(name, profile, tmp_path)
        assert result.exit_code == 0, text
        assert not [f for f in result.findings if f.severity in ("error", "warning")], text
        assert result.plan is not None and result.best is not None


def test_layers_per_stage_layout(tmp_path):
    config, layout = read_config("torchtitan", DATA / "torchtitan_llama3_70b_interleaved.toml", llama3_70b())
    # ceil((80 + 1 + 1) / 7) = 12 stages: 3 per rank, Interleaved1F1B's loop placement
    assert config.virtual_stages == 3 and len(layout.stages) == 12
    assert [s.rank for s in layout.stages] == [i % 4 for i in range(12)]
    assert layout.stages[0].units[0] == "tok_embeddings" and layout.stages[-1].units[-2:] == ("norm", "output")


def test_issue_775_fewer_micro_batches_than_ranks(tmp_path):
    result, _, _ = _doctor("torchtitan_issue775_microbatches_lt_pp.toml", llama3_8b(), tmp_path)
    finding = next(f for f in result.findings if f.code == "schedule-refuses")
    assert finding.severity == "error" and "2 micro-batches" in finding.message
    assert "local_batch_size" in finding.setting and "use 4 micro-batches" in finding.fix
    assert result.exit_code == 1


def test_profile_names_build_empty_stages(tmp_path):
    """The old export's bug: embed/blocks.N/head are not torchtitan's module names."""
    result, _, _ = _doctor("torchtitan_profile_names.toml", llama3_8b(), tmp_path)
    codes = {f.code: f for f in result.findings}
    assert "blocks.0" in codes["unknown-unit"].message and codes["unknown-unit"].severity == "error"
    assert "32 of 32 transformer layers" in codes["layers-lost"].message
    assert "3 stage(s) hold no layers" in codes["empty-stage"].message  # the last keeps norm


def test_first_and_last_stage_over_memory(tmp_path):
    """torchtitan 2093: the embedding and the head (with its fp32 logits) sit on the end stages."""
    profile = llama3_8b()
    text = (DATA / "torchtitan_llama3_8b_pp4.toml").read_text()
    path = tmp_path / "oom.toml"
    # no FSDP (so the cost model's unsharded memory is the real one), 2 samples per micro-batch
    path.write_text(text.replace("data_parallel_shard_degree = 2", "data_parallel_shard_degree = 1")
                    .replace("pipeline_parallel_microbatch_size = 1", "pipeline_parallel_microbatch_size = 2"))
    free, _, _ = _doctor(None, profile, tmp_path, settings=SETTINGS.model_copy(update={"memory_cap_bytes": None}),
                         path=path)
    peaks = [r.peak_memory_bytes for r in free.plan.ranks]
    assert peaks[0] == max(peaks)  # the embedding and 1F1B's deepest in-flight count
    cap = (peaks[0] + sorted(peaks)[-2]) // 2
    result, _, _ = _doctor(None, profile, tmp_path, settings=SETTINGS.model_copy(update={"memory_cap_bytes": cap}),
                           path=path)
    over = [f for f in result.findings if f.code == "over-memory"]
    assert len(over) == 1 and over[0].message.startswith("rank 0 ") and "tok_embeddings" in over[0].message
    assert result.best is not None and max(r.peak_memory_bytes for r in result.best.ranks) <= cap


@pytest.mark.parametrize("edit,setting", [
    (("pipeline_parallel_degree = 4", 'pipeline_parallel_degree = "4"'), "parallelism.pipeline_parallel_degree"),
    (("local_batch_size = 32", "local_batch_size = 32.5"), "training.local_batch_size"),
    (('pipeline_parallel_schedule = "1F1B"', 'pipeline_parallel_schedule = "2F2B"'), "pipeline_parallel_schedule"),
    (('mode = "selective"', 'mode = "sometimes"'), "activation_checkpoint.mode"),
    (("[parallelism]", "[parallelism\n"), "not valid TOML"),
    (("context_parallel_degree = 1", "context_parallel_degree = 1\npipeline_parallel_degre = 4"), "ConfigManager"),
])
def test_bad_toml_names_the_file_and_setting(tmp_path, edit, setting):
    if setting == "ConfigManager":
        torchtitan_config_manager()
    path = tmp_path / "bad.toml"
    path.write_text((DATA / "torchtitan_llama3_8b_pp4.toml").read_text().replace(*edit))
    with pytest.raises(BadInputError) as info:
        read_config("torchtitan", path, llama3_8b())
    assert str(path) in str(info.value) and setting in str(info.value)


@pytest.mark.parametrize("name,profile", [("torchtitan_llama3_8b_pp4.toml", llama3_8b),
                                          ("torchtitan_profile_names.toml", llama3_8b),
                                          ("torchtitan_issue775_microbatches_lt_pp.toml", llama3_8b)])
def test_fix_round_trips_keeps_other_settings_and_torchtitan_accepts_it(tmp_path, name, profile):
    out = tmp_path / "fixed.toml"
    result, _, written = _doctor(name, profile(), tmp_path, fix_output=out)
    assert written == [out]
    before, after = tomllib.loads((DATA / name).read_text()), tomllib.loads(out.read_text())
    changed = {"pipeline_parallel_schedule", "pipeline_parallel_microbatch_size", "module_fqns_per_model_part",
               "pipeline_parallel_layers_per_stage"}
    for table, values in before.items():
        for key, value in values.items():
            if key not in changed and not (table == "activation_checkpoint" and key == "mode"):
                assert after[table][key] == value, (table, key)
    best = result.best
    config, layout = read_config("torchtitan", out, profile())
    assert [list(s.units) for s in layout.stages] == [s.layers for s in sorted(best.stages, key=lambda s: s.index)]
    assert [s.rank for s in layout.stages] == [s.rank for s in sorted(best.stages, key=lambda s: s.index)]
    assert (config.schedule, config.microbatch_size) == (best.schedule, best.microbatch_size)
    assert (DATA / name).read_text().split("[parallelism]")[0] == out.read_text().split("[parallelism]")[0]
    torchtitan_config_manager()().parse_args(["--job.config_file", str(out)])
    again, _, _ = doctor_file("torchtitan", out, tmp_path / "profile.json", SETTINGS)
    assert again.exit_code == 0 and again.speedup == pytest.approx(1.0, abs=1e-6)
