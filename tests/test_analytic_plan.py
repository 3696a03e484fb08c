"""Selective recomputation in the planner, on analytic profiles that carry its fields."""

from __future__ import annotations

import json

import pytest

from conftest import REPO
from pipeplan.analytic import analytic_profile, get_gpu
from cli_checks import invoke
from pipeplan.formats.io import load_plan, write_json_atomic
from pipeplan.plan import plan_simulation


#: A GPT-3-style model trained without flash attention, where the attention core's s^2 tensors
#: are most of the activations (Korthikanti et al. 2022): selective recomputation pays.
GPT = {"model_type": "gpt2", "n_layer": 8, "n_embd": 1024, "n_head": 16, "n_positions": 2048,
       "vocab_size": 32000}


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt")
    config = folder / "config.json"
    config.write_text(json.dumps(GPT))
    profile = analytic_profile(config, get_gpu("a100-80gb"), seq_len=2048, dtype="fp16", microbatch_sizes=[1, 2],
                               flash_attention=False)
    path = folder / "gpt.json"
    write_json_atomic(path, profile)
    return path


def _plan(tmp_path, profile_path, name, *args):
    out = tmp_path / f"{name}.json"
    result = invoke("plan", profile_path, "--stages", 2, "--global-batch", 8, "--schedule", "1f1b",
                    "--microbatch-size", 2, "-o", out, "-q", *args)
    return result, out


def test_auto_picks_selective_where_it_fits_and_full_would_cost_more(tmp_path, profile_path):
    result, free = _plan(tmp_path, profile_path, "none", "--recompute", "none")
    assert result.exit_code == 0, result.output
    result, selective = _plan(tmp_path, profile_path, "selective", "--recompute", "selective")
    assert result.exit_code == 0, result.output
    peak_none = max(r.peak_memory_bytes for r in load_plan(free).ranks)
    peak_selective = max(r.peak_memory_bytes for r in load_plan(selective).ranks)
    assert peak_selective < 0.6 * peak_none
    cap = (peak_none + peak_selective) // 2
    result, _ = _plan(tmp_path, profile_path, "none-capped", "--recompute", "none", "--memory-cap", cap)
    assert result.exit_code == 3, result.output
    result, auto = _plan(tmp_path, profile_path, "auto", "--memory-cap", cap)
    assert result.exit_code == 0, result.output
    result, full = _plan(tmp_path, profile_path, "full", "--recompute", "all", "--memory-cap", cap)
    assert result.exit_code == 0, result.output
    chosen = load_plan(auto)
    modes = {s.recompute_granularity for s in chosen.stages if s.recompute}
    assert modes == {"selective"}, [(s.recompute, s.recompute_granularity) for s in chosen.stages]
    assert all(r.peak_memory_bytes <= cap for r in chosen.ranks)
    assert chosen.predicted.iteration_ms < load_plan(full).predicted.iteration_ms
    assert any("attention core" in note for note in chosen.notes)
    # The plan file simulates again to its own prediction (selective kept bytes and all).
    again = plan_simulation(chosen)
    assert again.iteration_ms == pytest.approx(chosen.predicted.iteration_ms, rel=1e-6)
    assert max(again.rank_peak_memory_bytes) == max(r.peak_memory_bytes for r in chosen.ranks)
    # Launchers are told which recomputation it is.
    result = invoke("export", auto, "--format", "megatron", "--profile", profile_path)
    assert result.exit_code == 0 and "--recompute-granularity selective" in result.output
    result = invoke("show", auto)
    assert result.exit_code == 0 and "(sel)" in result.output


def test_selective_costs_the_attention_core_again(tmp_path, profile_path):
    from pipeplan.formats.io import load_profile

    profile = load_profile(profile_path)
    _, none = _plan(tmp_path, profile_path, "none", "--recompute", "none")
    _, selective = _plan(tmp_path, profile_path, "selective", "--recompute", "selective")
    extra = sum(layer.cost_at(2).selective_recompute_ms for layer in profile.layers)
    added = sum(s.backward_ms for s in load_plan(selective).stages) - sum(s.backward_ms for s in load_plan(none).stages)
    assert extra > 0 and added == pytest.approx(extra, abs=1e-5)


def test_selective_needs_a_profile_that_gives_it(tmp_path):
    result = invoke("plan", REPO / "profiles" / "gpt2-tiny-cpu.json", "--stages", 2, "--recompute", "selective",
                    "-o", tmp_path / "p.json")
    assert result.exit_code == 2 and "selective" in result.output and "--analytic" in result.output
