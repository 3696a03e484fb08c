"""Every consumer of a plan costs it as the planner did (issue: one cost model per plan).

Three bugs sat at the joins between packages; each test below failed on the code before the
fix:

- the run report's prediction (``pipeplan.run.plans.simulate_plan``) built a cost model by hand
  and left out recomputation and ZeRO;
- the API planned what the CLI refuses (ZeRO and data-parallel degrees with no ``--gpus``);
- a cluster plan whose search chose selective recomputation recorded no recomputation, so the
  Megatron export left out ``--recompute-granularity selective``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeplan.analytic import analytic_profile, get_gpu
from pipeplan.api import ClusterRequest, PipelineRequest, plan_any, plan_profile
from pipeplan.cluster.presets import PRESETS
from pipeplan.errors import BadInputError
from pipeplan.export import export_plan
from pipeplan.launchers.degrees import recompute_of
from pipeplan.formats.io import load_profile
from pipeplan.formats.plan import PlanSettings
from pipeplan.plan import plan_simulation
from pipeplan.run.plans import simulate_plan

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
GPT2_TINY = PROFILES / "gpt2-tiny-cpu.json"


def _same_as_the_plan(plan, profile):
    """The replay from the profile agrees with the plan's own numbers (time and every rank's peak)."""
    replay = simulate_plan(plan, profile)
    again = plan_simulation(plan)  # from the plan file's own numbers, no profile
    assert replay.iteration_ms == pytest.approx(again.iteration_ms, rel=1e-6)
    assert list(replay.rank_peak_memory_bytes) == pytest.approx([r.peak_memory_bytes for r in plan.ranks], abs=2)


@pytest.mark.parametrize("recompute", ["all", "none"])
def test_run_report_prediction_counts_recomputation(recompute):
    plan = plan_profile(GPT2_TINY, PipelineRequest(stages=2, recompute=recompute))
    assert all(s.recompute == (recompute == "all") for s in plan.stages)
    replay = simulate_plan(plan, load_profile(GPT2_TINY))
    assert replay.iteration_ms == pytest.approx(plan.predicted.iteration_ms, rel=1e-6)
    assert list(replay.rank_peak_memory_bytes) == [r.peak_memory_bytes for r in plan.ranks]
    _same_as_the_plan(plan, load_profile(GPT2_TINY))


@pytest.mark.parametrize("zero", [1, 3])
def test_run_report_prediction_counts_zero_sharding(zero):
    """A data-parallel plan's replay shards the training state as the plan did (ZeRO over d = 2)."""
    profile = load_profile(GPT2_TINY)
    request = ClusterRequest(num_gpus=4, cluster=PRESETS["pcie-l4"], stages=2, data_parallel=2, zero_stage=zero,
                             recompute="none", global_batch=16)
    plan = plan_any(profile, request, profile_sha256="0" * 64)
    assert plan.parallelism.zero_stage == zero and plan.parallelism.data == 2
    _same_as_the_plan(plan, profile)


@pytest.mark.parametrize("fields", [dict(tensor_parallel=4, zero_stage=3, data_parallel=8), dict(zero_stage=1),
                                    dict(data_parallel_overlap=0.5)])
def test_api_refuses_cluster_options_without_gpus(fields):
    """The CLI refuses --zero / --data-parallel / --tensor-parallel without --gpus; so does the API."""
    settings = PlanSettings(stages=2, **fields)
    with pytest.raises(BadInputError, match="need num_gpus"):
        plan_profile(GPT2_TINY, settings)
    with pytest.raises(BadInputError, match="Extra inputs are not permitted"):
        PipelineRequest.make("api", stages=2, **fields)


def test_api_refuses_gpus_without_a_cluster():
    with pytest.raises(BadInputError, match="needs the cluster"):
        plan_profile(GPT2_TINY, PlanSettings(num_gpus=8))


@pytest.fixture(scope="module")
def no_flash_70b():
    """Llama 3 70B at sequence 4096 without flash attention: the attention core is worth
    recomputing, so the free search picks selective recomputation."""
    return analytic_profile("llama3-70b", get_gpu("h100-sxm"), seq_len=4096, microbatch_sizes=(1, 2),
                            tensor_parallel=(4, 8), flash_attention=False)


def test_selective_winner_is_recorded_and_exported(no_flash_70b):
    # At p = 4 (at p = 8 the search now finds interleaved v = 5 with full recomputation on a few stages faster).
    request = ClusterRequest(num_gpus=64, cluster=PRESETS["dgx-h100"], global_batch=128, launcher="megatron", stages=4)
    plan = plan_any(no_flash_70b, request, profile_sha256="0" * 64)
    assert plan.settings.recompute == "auto"
    assert all(s.recompute and s.recompute_granularity == "selective" for s in plan.stages)
    assert all(s.selective_activation_bytes == s.activation_bytes for s in plan.stages)
    assert recompute_of(plan).mode == "selective"
    assert any("recompute selective on every stage" in note for note in plan.notes)
    assert not any(", recompute none" in note for note in plan.notes)
    exported = "".join(export_plan(plan, no_flash_70b, "megatron").values())
    assert "--recompute-granularity selective" in exported
    # Re-simulated from the file, the plan is the same plan (selective keeps the same bytes).
    assert plan_simulation(plan).rank_peak_memory_bytes == pytest.approx(
        [r.peak_memory_bytes for r in plan.ranks], abs=2)


def test_the_cap_rule_is_the_same_for_requests_and_records():
    """No cap: infinite for a pipeline, the GPU's memory for a cluster (one rule, every entry)."""
    import math

    h100 = PRESETS["dgx-h100"]
    assert math.isinf(PipelineRequest(stages=2).cap_bytes()) and math.isinf(PlanSettings(stages=2).cap_bytes())
    assert ClusterRequest(num_gpus=8, cluster=h100).cap_bytes() == h100.cap_bytes() == 80 * 2**30
    assert PlanSettings(num_gpus=8, cluster=h100).cap_bytes() == 80 * 2**30
    assert ClusterRequest(num_gpus=8, cluster=h100, memory_cap_bytes=2**30).cap_bytes() == 2**30
