"""NVLink domains that span nodes (GB200/GB300 NVL72) and the Blackwell GPU table (issue 26).

A cluster spec's ``gpus_per_nvlink_domain`` (default: the node) says how many consecutive GPUs
share the fast link; placement asks "same domain" where it means bandwidth. Checked here: the
spec's rule and its message, the job's domain segments against Megatron Bridge's own rule, a
GB200 NVL72 t = 8 over two 4-GPU trays timed at NVLink speed by hand, data, expert and pipeline
groups inside one domain across trays, and that a spec without the field plans as before.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from pipeplan.analytic import analytic_profile
from pipeplan.cli import app
from pipeplan.cluster.collectives import all_to_all_ms, collective_ms
from pipeplan.cluster.experts import expert_group
from pipeplan.cluster.placement import Layout, cluster_layout
from pipeplan.cluster.presets import PRESETS, resolve_cluster
from pipeplan.cluster.profile_view import degree_view
from pipeplan.cluster.space import parallel_degrees
from pipeplan.errors import BadInputError
from pipeplan.facts.gpus import GPUS, PRECISIONS
from pipeplan.formats.cluster import ClusterSpec, cluster_from_dict

runner = CliRunner()

NVL72 = PRESETS["gb200-nvl72"]


def _spec(**over) -> dict:
    data = {"name": "c", "gpu": "gb200", "gpus_per_node": 4, "gpus_per_nvlink_domain": 72,
            "intra_node": {"bandwidth": "900GB/s", "latency_us": 3.4},
            "inter_node": {"bandwidth": "50GB/s", "latency_us": 14}}
    data.update(over)
    return data


# --- the GPU table ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,bf16,fp8,nvfp4,memory_gib", [
    # Dense per-GPU figures: HGX B200 / HGX B300 per 8 GPUs, GB200 / GB300 NVL72 per 72 GPUs, halved
    # where the sheet gives them with sparsity (B300's and GB300's FP4 are given dense too).
    ("b200", 36e15 / 8 / 2, 72e15 / 8 / 2, 72e15 / 8, 180),
    ("b300", 36e15 / 8 / 2, 72e15 / 8 / 2, 108e15 / 8, 288),
    ("gb200", 360e15 / 72 / 2, 720e15 / 72 / 2, 1440e15 / 72 / 2, 186),
    ("gb300", 360e15 / 72 / 2, 720e15 / 72 / 2, 1080e15 / 72, 279),
])
def test_blackwell_dense_peaks_from_the_system_figures(name, bf16, fp8, nvfp4, memory_gib):
    gpu = GPUS[name]
    assert gpu.flops_for("bf16") == pytest.approx(bf16)
    assert gpu.flops_for("fp8") == pytest.approx(fp8)
    assert gpu.flops_for("mxfp8") == gpu.flops_for("fp8")  # MX scaling runs at the FP8 rate
    assert gpu.flops_for("nvfp4") == pytest.approx(nvfp4)
    assert gpu.memory_bytes == memory_gib * 2**30
    assert gpu.hbm_bytes_per_s == 8e12 and gpu.link_bytes_per_s == 900e9  # NVLink 5: 1.8 TB/s both ways
    # Every figure names its source.
    assert {f"peak_flops.{k}" for k in gpu.peak_flops} | {"memory_bytes", "hbm_bytes_per_s",
                                                          "link_bytes_per_s"} <= set(gpu.sources)


def test_hopper_has_no_block_scaled_precisions_and_says_so():
    for name in ("h100-sxm", "h200"):
        assert GPUS[name].flops_for("fp8") == 1978.9e12 and GPUS[name].flops_for("bf16") == 989.4e12
        with pytest.raises(BadInputError, match=f"{name} has no peak for nvfp4; it lists bf16, fp16, fp32"):
            GPUS[name].flops_for("nvfp4")
    assert GPUS["h200"].memory_bytes == 141 * 2**30 and GPUS["h200"].hbm_bytes_per_s == 4.8e12
    assert set(PRECISIONS) >= {k for g in GPUS.values() for k in g.peak_flops}


def test_sources_stay_out_of_the_dump():
    """A profile records the GPU's figures (``measurement.gpu``); the sources are not figures."""
    assert "sources" not in GPUS["b300"].model_dump() and "nvfp4" in GPUS["b300"].model_dump()["peak_flops"]


# --- the spec field ------------------------------------------------------------------------------

def test_domain_defaults_to_the_node_and_is_not_written():
    spec = PRESETS["dgx-h100"]
    assert spec.gpus_per_nvlink_domain is None and spec.nvlink_domain_gpus == 8
    assert "gpus_per_nvlink_domain" not in spec.model_dump(exclude_none=True)
    assert (NVL72.gpus_per_node, NVL72.nvlink_domain_gpus) == (4, 72)
    assert (PRESETS["gb300-nvl72"].gpus_per_node, PRESETS["gb300-nvl72"].nvlink_domain_gpus) == (4, 72)


def test_domain_must_be_whole_nodes_exit_2(tmp_path):
    with pytest.raises(BadInputError, match="c.toml: gpus_per_nvlink_domain: 70 is not a multiple of "
                                            "gpus_per_node 4 \\(an NVLink domain is whole nodes\\)"):
        cluster_from_dict(_spec(gpus_per_nvlink_domain=70), "c.toml")
    path = tmp_path / "c.toml"
    path.write_text('base = "gb200-nvl72"\nname = "sixteen"\ngpus_per_node = 16\n')
    result = runner.invoke(app, ["cluster", str(path)])
    assert result.exit_code == 2
    assert "gpus_per_nvlink_domain: 72 is not a multiple of gpus_per_node 16" in result.output
    path.write_text('base = "gb200-nvl72"\nname = "nvl36"\ngpus_per_nvlink_domain = 36\n')
    assert resolve_cluster(str(path)).nvlink_domain_gpus == 36


def _bridge_segment_nodes(nodes: int) -> int:
    """Megatron Bridge's launcher (scripts/performance/utils/executors.py@v0.5.1): all nodes when at
    most 18, else the largest divisor of the node count up to 18."""
    if nodes <= 18:
        return nodes
    return max(k for k in range(1, 19) if nodes % k == 0)


@given(nodes=st.integers(min_value=1, max_value=600))
@settings(max_examples=80, deadline=None)
def test_domain_segments_are_megatron_bridges(nodes):
    assert NVL72.domain_gpus_for(4 * nodes) == 4 * _bridge_segment_nodes(nodes)


@pytest.mark.parametrize("gpus,segment", [(8, 8), (64, 64), (128, 64), (256, 64), (144, 72)])
def test_reference_job_segments(gpus, segment):
    """systems.json: 8 GPUs -> 8, 64 -> 64, 128 and 256 -> 64 GPUs per domain."""
    assert NVL72.domain_gpus_for(gpus) == segment


def test_node_domain_segments_are_the_node():
    for spec in PRESETS.values():
        if spec.gpus_per_nvlink_domain is None:
            assert {spec.domain_gpus_for(n * spec.gpus_per_node) for n in (1, 2, 3, 16)} == {spec.gpus_per_node}


# --- placement and collectives -------------------------------------------------------------------

def test_tensor_eight_over_two_trays_is_one_domain():
    layout = cluster_layout(NVL72, 2, 8, 4)   # 64 GPUs: one 64-GPU segment
    group = layout.tensor_group(0, 0)
    assert {layout.node(g) for g in group} == {0, 1}        # two trays ...
    assert layout.tensor_span().link == "intra"             # ... one NVLink domain
    assert layout.pipeline_link(0, 1) == "intra"            # pipeline neighbours across trays: NVLink
    assert layout.data_span().nodes == 1
    # Without the domain, four-GPU nodes keep t within a node.
    with pytest.raises(BadInputError, match="does not divide the 4 GPUs of a node"):
        Layout(2, 8, 4, 4)
    assert [d.tensor for d in parallel_degrees(64, 4, 80, [64, 8], data=8, pipeline=1,
                                               gpus_per_domain=NVL72.domain_gpus_for(64))] == [8]
    with pytest.raises(BadInputError, match="above the 4 GPUs of a node"):
        parallel_degrees(64, 4, 80, [64, 8], tensor=8)


def test_crossing_segments_uses_the_network():
    layout = cluster_layout(NVL72, 16, 8, 1)   # 128 GPUs: two 64-GPU segments
    assert layout.domain_size == 64
    span = layout.data_span()                  # 16 ranks 8 apart: 8 in each segment
    assert (span.ranks_per_node, span.nodes, span.link) == (8, 2, "inter")
    pipe = cluster_layout(NVL72, 8, 8, 2)
    assert pipe.pipeline_link(0, 1) == "inter"


def test_data_sync_over_trays_at_nvlink_speed():
    """A data group of 16 over 4 trays of one domain: a flat ring on NVLink, by hand."""
    span = cluster_layout(NVL72, 16, 4, 1).data_span()
    assert (span.ranks_per_node, span.nodes) == (16, 1)
    S = 4e9
    link = NVL72.intra_node
    ring = (link.call_latency_us + 2 * 15 * link.latency_us) / 1e3 + 2 * 15 / 16 * S / (900e9 * 0.8) * 1e3
    assert collective_ms("all-reduce", S, span.ranks_per_node, span.nodes, NVL72.intra_node,
                         NVL72.inter_node) == pytest.approx(ring)


def test_expert_group_over_trays_all_to_all_on_nvlink():
    from types import SimpleNamespace as NS

    request = NS(expert_tensor_parallel=1, expert_imbalance=None)
    group = expert_group(request, NVL72, data=64, tensor=1, pipeline=1, expert=16)   # 16 ranks, 4 trays
    assert group.ranks_per_node == 16
    S = 64e6
    by_hand = (8.4 + 3.4) / 1e3 + 15 / 16 * S / (900e9 * 0.8) * 1e3
    assert all_to_all_ms(S, 16, group.ranks_per_node, NVL72.intra_node, NVL72.inter_node) == pytest.approx(by_hand)


@pytest.fixture(scope="module")
def llama_gb200():
    return analytic_profile("llama3-8b", GPUS["gb200"], seq_len=4096, microbatch_sizes=[1],
                            tensor_parallel=[1, 8])


def test_gb200_tensor_eight_plan_times_its_collectives_at_nvlink_speed(llama_gb200, tmp_path):
    """``--gpus 8 --tensor-parallel 8`` on gb200-nvl72: two trays, one NVLink domain. Each layer's
    tensor-parallel collectives, from the profile's payloads and calls, by the ring formula at
    900 GB/s x 0.8 and NCCL's latencies; the plan's part is m x their sum (one pipeline rank)."""
    link = NVL72.intra_node
    t, m = 8, 4
    per_microbatch_ms = 0.0
    for layer in llama_gb200.layers:
        for c in layer.costs:
            if c.tensor_parallel == t and c.tensor_parallel_collective is not None:
                f = 2 if c.tensor_parallel_collective == "all_reduce" else 1
                for payload, count in ((c.tensor_parallel_forward_bytes, c.tensor_parallel_forward_count),
                                       (c.tensor_parallel_backward_bytes, c.tensor_parallel_backward_count)):
                    per_microbatch_ms += (count * (8.4 + f * (t - 1) * 3.4) / 1e3
                                          + f * (t - 1) / t * payload / (900e9 * 0.8) * 1e3)
    view = degree_view(llama_gb200, t, NVL72)
    assert sum(a + b for a, b in view.tensor_parallel_ms.values()) == pytest.approx(per_microbatch_ms)
    assert per_microbatch_ms > 0 and link.bandwidth_bytes_per_s == 900e9

    profile = tmp_path / "p.json"
    profile.write_text(llama_gb200.model_dump_json())
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(profile), "--gpus", "8", "--cluster", "gb200-nvl72",
                                 "--tensor-parallel", "8", "--global-batch", str(m), "--recompute", "none",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["parallelism"]["tensor"] == 8 and plan["parallelism"]["gpus_per_node"] == 4
    assert plan["predicted"]["tensor_parallel_ms"] == pytest.approx(m * per_microbatch_ms, rel=1e-6)
    assert any("NVLink domains of 72" in note for note in plan["notes"])


def test_explicit_node_domain_plans_as_the_preset(llama_gb200, tmp_path):
    """``gpus_per_nvlink_domain = gpus_per_node`` is the default: the same plan, and a plan of a
    preset without the field does not mention it (its bytes are as before the field)."""
    profile = tmp_path / "p.json"
    profile.write_text(llama_gb200.model_dump_json())
    explicit = tmp_path / "c.toml"
    explicit.write_text('base = "dgx-b200"\nname = "dgx-b200"\ngpu = "gb200"\ngpus_per_nvlink_domain = 8\n')
    plain = tmp_path / "plain.toml"
    plain.write_text('base = "dgx-b200"\nname = "dgx-b200"\ngpu = "gb200"\n')
    plans = []
    for cluster in (plain, explicit):
        out = tmp_path / f"{cluster.stem}.json"
        result = runner.invoke(app, ["plan", str(profile), "--gpus", "16", "--cluster", str(cluster),
                                     "--global-batch", "16", "-o", str(out)])
        assert result.exit_code == 0, result.output
        plans.append(json.loads(out.read_text()))
    assert "gpus_per_nvlink_domain" not in json.dumps(plans[0])
    assert plans[1]["settings"]["cluster"].pop("gpus_per_nvlink_domain") == 8
    assert plans[0] == plans[1]


def test_presets_list_the_domain():
    result = runner.invoke(app, ["cluster"])
    assert result.exit_code == 0
    row = next(line for line in result.output.splitlines() if "gb200-nvl72" in line)
    assert "72" in row and "gb200" in row
    assert isinstance(ClusterSpec.model_validate(NVL72.model_dump()), ClusterSpec)
