"""Shared fixtures: small profiles built in code, and the real PipeDream profiles shipped in profiles/pipedream."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import cli_checks
from pipeplan.importers.pipedream import PROFILED_BATCH

REPO = Path(__file__).resolve().parents[1]
#: PipeDream's graphs, shipped in the repository (profiles/pipedream/README.md: origin, licence, format).
PIPEDREAM = REPO / "profiles" / "pipedream"

#: Profiling batch of each PipeDream graph (from the data's README).
PIPEDREAM_BATCH = PROFILED_BATCH


def pipedream_path(name: str) -> Path:
    # They ship in the repository: a missing one is a broken checkout, not a reason to skip.
    path = PIPEDREAM / f"{name}.graph.txt"
    assert path.is_file(), f"{path} is missing from the checkout"
    return path


def make_profile_dict(n_layers=6, sizes=(1, 2), edges=None, forward_ms=None, param_bytes=1000,
                      activation_bytes=100, output_bytes=10, model="toy"):
    """A valid profile as a dict, easy to break field by field in tests."""
    layers = []
    for i in range(n_layers):
        f = forward_ms[i] if forward_ms else 1.0 + (i % 3)
        layers.append({
            "name": f"layer{i}",
            "param_bytes": param_bytes,
            "costs": [
                {"microbatch_size": b, "forward_ms": f * b, "backward_ms": 2 * f * b,
                 "activation_bytes": activation_bytes * b, "output_bytes": output_bytes * b}
                for b in sizes
            ],
        })
    data = {"schema_version": 1, "model": model, "source": "analytic",
            "device": {"name": "test"}, "dtype": "fp32", "layers": layers}
    if edges is not None:
        data["edges"] = edges
    return data


# A small profile and its plan, written through the CLI (tests/cli_checks.py; the hardening tests).
@pytest.fixture
def profile_file(tmp_path):
    return cli_checks.write(tmp_path, make_profile_dict(n_layers=6), "profile.json")


@pytest.fixture
def plan_file(tmp_path, profile_file):
    out = tmp_path / "plan.json"
    result = cli_checks.invoke("plan", profile_file, "--stages", 2, "--global-batch", 8, "--schedule", "1f1b", "-o", out, "-q")
    assert result.exit_code == 0, result.stderr
    return out


# The quick loop (`pytest -m "not slow"`, docs/ci.md) leaves out what is marked slow. The tests
# that start torchrun jobs, profile or trace HuggingFace models, or take more than about 1.5 s of
# CPU on their own are marked here, in one table with the reason, rather than one decorator each:
# file -> {test function name, or "name[param id]" for one case: why}; so is every test whose
# name says it starts a subprocess. The full suite (README's command, .ci/run) runs every one of
# them. tests/test_suite.py fails on an entry that names no collected test.
SLOW = {
    "test_run_hf.py": dict.fromkeys([
        "test_every_model_pipelined_equals_one_process", "test_verify_fails_with_exit_1_when_tied_copies_are_not_synced",
        "test_t5_stage_that_torch_split_backward_cannot_train_is_refused_by_name",
        "test_a_stage_keeps_only_the_tied_copies_its_graph_reads",
        "test_the_traced_builder_refuses_stages_out_of_the_call_order", "test_split_backward_falls_back_and_says_which_units",
        "test_split_timing_can_be_turned_off", "test_plans_of_a_traced_model_follow_its_execution_order",
        "test_the_profile_counts_tied_weights_once_and_names_their_layers",
        "test_hf_profiles_name_each_units_role_and_the_exports_say_what_to_do_with_the_tie",
        "test_t5_profile_has_both_stacks_and_leaves_the_twice_called_dropouts_out",
        "test_llama_profile_records_the_rotary_edges_to_every_layer",
        "test_a_user_model_with_tuples_and_no_loss_is_profiled_for_the_traced_builder",
        "test_plan_refuses_a_profile_no_stage_builder_can_run"],
        "torchrun jobs of HuggingFace models, or a HuggingFace model profiled or traced by torch.export"),
    "test_run_torch.py": dict.fromkeys([
        "test_every_schedule_equals_a_single_process_step", "test_a_failing_rank_ends_the_job_naming_it",
        "test_run_then_calibrate_carries_the_schedules_own_time_into_the_next_plan"], "a torchrun job"),
    "test_run_data_parallel.py": {
        "test_two_replicas_of_a_two_rank_pipeline_equal_one_process_on_the_global_batch": "a 4-rank torchrun job"},
    "test_planner_pipedream.py": {
        **{f"test_every_profile_plans[{stages}-{name}]": "a real PipeDream graph planned at 8 or 16 stages"
           for stages in (8, 16) for name in PIPEDREAM_BATCH},
        "test_ilp_and_ideal_dp_agree_on_real_profiles[resnet50-8]": "the ILP on ResNet-50 at 8 stages"},
    "test_doctor_megatron.py": {
        "test_example_scripts_raise_no_alarm[megatron_gpt3_175b.sh-gpt3_175b]": "doctor's search over GPT-3 175B"},
    "test_plan_consumers.py": {"test_selective_winner_is_recorded_and_exported": "plans a 32-layer model with "
                               "every recomputation choice"},
    "test_expert_parallel.py": {"test_doctor_reads_the_expert_parallel_size_of_nvidias_mixtral_script":
                                "doctor's cluster search over Mixtral 8x7B"},
    "test_rank_balance.py": {"test_the_local_search_against_the_brute_force_best_rank_load": "brute force over "
                             "every rank assignment"},
    "test_fuzz.py": dict.fromkeys(["test_mutated_plans", "test_documents_from_the_published_schemas",
                                   "test_mutated_profiles", "test_mutated_reports"],
                                  "hundreds of hypothesis examples through the loaders"),
    "test_cluster_search.py": {
        **dict.fromkeys(["test_pruning_against_the_best_keeps_the_winner_with_zero_and_tensor_parallel",
                         "test_memoised_search_is_byte_identical_to_an_uncached_one"], "Llama 3 8B's cluster search, twice"),
        "test_cli_cluster_errors[args6-3-per GPU fits d=8 t=1 p=2 ZeRO]": "a cluster search that finds nothing fits",
        "test_pruning_keeps_the_winner_when_the_sync_overlaps": "the 16-GPU search twice, once with every bound off"},
    "test_export_parallel.py": {"test_cluster_plan_exports_to_every_launcher": "a cluster search, then every launcher's "
                                "own config code"},
    "test_schedules_torch.py": {"test_interleaved_classes_match_pipeline_order[zb]": "torch's zero-bubble schedule "
                                "built and run on 4 fake ranks",
                                "test_check_schedule_agrees_with_torch_constructors[zb]": "the same"},
    "test_hardening.py": {"test_the_largest_allowed_values_plan_to_finite_numbers": "plans at the formats' limits"},
    "test_progress.py": {"test_no_progress_in_a_pipe_or_with_quiet": "three planner runs as subprocesses"},
    "test_cluster_terms.py": {"test_placement_matches_megatron_rank_generator[2-4-2]": "megatron-core's rank "
                              "generator on 16 ranks",
                              "test_placement_matches_megatron_rank_generator[1-8-8]": "the same on 64 ranks"},
    "test_costmodel.py": {"test_every_path_costs_every_stage_alike": "every consumer's costing of many plans"},
    "test_doctor_cluster.py": dict.fromkeys([
        "test_search_over_layouts_finds_a_plan_at_least_as_fast", "test_fix_turns_on_the_distributed_optimizer_and_round_trips",
        "test_zero0_over_the_cap_is_flagged_by_how_much_and_the_distributed_optimizer_fixes_it",
        "test_megatron_overlap_flags_are_costed_as_the_plan_with_the_same_overlap"],
        "doctor's cluster search over a 70B layout"),
    "test_doctor_megatron.py_extra": {},
    "test_schedules_torch.py_extra": {},
}
SLOW["test_doctor_megatron.py"].update({
    "test_fix_round_trips_and_keeps_other_settings[megatron_issue468_80_layers_pp16_vp2.sh-llama3_70b]":
        "doctor and --fix on an 80-layer, 32-stage layout",
    "test_issue_468_80_layers_pp16_vp2_trains_64": "the same layout's plan"})
SLOW["test_schedules_torch.py"].update(dict.fromkeys([
    "test_interleaved_classes_match_pipeline_order_at_many_stages_per_rank[interleaved]",
    "test_interleaved_classes_match_pipeline_order_at_many_stages_per_rank[zb]"],
    "torch's interleaved classes built at v up to 8 for many micro-batch counts"))
SLOW["test_planner_pipedream.py"].update({"test_every_profile_plans[4-nasnetalarge]": "NASNet-A large's 1,000-node "
                                          "graph planned"})
del SLOW["test_doctor_megatron.py_extra"], SLOW["test_schedules_torch.py_extra"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the tests in ``SLOW`` (before ``-m`` deselects), and fail on an entry that matches none."""
    matched: set[tuple[str, str]] = set()
    files = set()
    for item in items:
        name = Path(str(item.fspath)).name
        table = SLOW.get(name)
        if not table:
            continue
        files.add(name)
        for key in (getattr(item, "originalname", item.name), item.name):
            if key in table:
                item.add_marker(pytest.mark.slow)
                matched.add((name, key))
    for item in items:
        # A test that starts `python -m pipeplan` (~1.2 s of imports) is named "..._subprocess...":
        # the quick loop covers the same through typer's runner in process.
        if "subprocess" in getattr(item, "originalname", item.name):
            item.add_marker(pytest.mark.slow)
    # Checked on whole files only (a node id such as tests/test_x.py::test_y collects one test),
    # by tests/test_suite.py.
    if not any("::" in str(arg) for arg in config.args):
        STALE_SLOW[:] = [f"{name}::{key}" for name in files for key in SLOW[name] if (name, key) not in matched]


#: Entries of ``SLOW`` that named no collected test in the last collection.
STALE_SLOW: list[str] = []


def pytest_terminal_summary(terminalreporter):
    """Beside the slowest tests: each document's time (its commands all run in one fixture)."""
    seconds = getattr(sys.modules.get("test_docs_commands"), "DOC_SECONDS", None)
    if seconds:
        terminalreporter.write_sep("=", "docs commands: the slowest documents (two run at a time)")
        for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:8]:
            terminalreporter.write_line(f"{s:.2f}s {name}")
