"""The cluster model against published runs: Korthikanti et al. 2022, table 5, within 10% each."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeplan.analytic.api import analytic_profile
from pipeplan.facts.gpus import get_gpu
from pipeplan.cluster.presets import PRESETS
from pipeplan.cluster.search import plan_cluster
from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.formats.plan import PlanSettings

REPO = Path(__file__).resolve().parents[1]


def test_table_5_is_predicted_within_10_percent():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "validate_korthikanti.py")],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    errors = [float(e) for e in re.findall(r"\| ([+-]\d+\.\d)% \|", proc.stdout)]
    assert len(errors) == 4, proc.stdout
    assert all(abs(e) < 10 for e in errors), proc.stdout


@pytest.fixture(scope="module")
def llama8b():
    return analytic_profile("llama3-8b", get_gpu("h100-sxm"), seq_len=4096, dtype="bf16", microbatch_sizes=[1, 2],
                            tensor_parallel=[1, 2, 4, 8])


def _plan(profile, **kw):
    settings = PlanSettings(cluster=PRESETS["dgx-h100"], schedule="1f1b", recompute="auto", **kw)
    return plan_cluster(profile, settings, profile_sha256="test")


def test_tensor_parallel_plan_has_its_collectives_and_mfu(llama8b):
    plan = _plan(llama8b, num_gpus=16, global_batch=32, tensor_parallel=4, stages=2, data_parallel=2, zero_stage=1)
    p = plan.predicted
    assert plan.parallelism.sequence_parallel and plan.parallelism.tensor == 4
    assert p.tensor_parallel_ms > 0 and p.data_parallel_ms > 0 and p.optimizer_ms > 0
    total = p.compute_ms + p.tensor_parallel_ms + p.bubble_ms + p.transfer_ms + p.data_parallel_ms + p.optimizer_ms
    assert total == pytest.approx(p.iteration_ms, abs=1e-5)
    assert 0 < p.model_flops_utilization < 1
    assert p.tokens_per_second_per_gpu == pytest.approx(32 * 4096 / (p.iteration_ms / 1e3) / 16, rel=1e-5)
    # every GPU of a stage is on one node, the two pipeline ranks on two
    assert [s.rank for s in plan.stages] == [0, 1]


def test_tensor_parallelism_divides_the_state(llama8b):
    t1 = _plan(llama8b, num_gpus=8, global_batch=16, tensor_parallel=1, stages=8, data_parallel=1, zero_stage=0)
    t8 = _plan(llama8b, num_gpus=8, global_batch=16, tensor_parallel=8, stages=1, data_parallel=1, zero_stage=0)
    state_t1 = sum(s.weight_bytes for s in t1.stages)
    state_t8 = sum(s.weight_bytes for s in t8.stages)
    # t = 8 holds an eighth of the sharded weights per GPU (norms are replicated): between 1/8 and 1/7
    assert state_t1 / 8 <= state_t8 <= state_t1 / 7


def test_free_search_is_at_least_as_fast_as_any_fixed_layout(llama8b):
    free = _plan(llama8b, num_gpus=8, global_batch=16)
    for t, p, d in ((8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 8, 1)):
        try:
            fixed = _plan(llama8b, num_gpus=8, global_batch=16, tensor_parallel=t, stages=p, data_parallel=d)
        except (InfeasibleError, BadInputError):  # a layout that cannot run is fine
            continue
        assert free.predicted.iteration_ms <= fixed.predicted.iteration_ms * (1 + 1e-9)
