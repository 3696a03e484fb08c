"""The cluster model's cost terms: collectives, placement, ZeRO memory, data-parallel sync, space."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.cluster.collectives import collective_ms, flat_collective_ms, ring_ms, tree_all_reduce_ms
from pipeplan.cluster.dataparallel import data_parallel_sync
from pipeplan.cluster.memory import plannable_bytes, reserve_bytes, zero3_gathered_bytes
from pipeplan.facts.training_state import state_memory
from pipeplan.facts.training_state import OPTIMIZERS, optimizer_step_ms, training_state
from pipeplan.cluster.placement import GroupSpan, Layout
from pipeplan.cluster.presets import PRESETS
from pipeplan.cluster.space import Degrees, candidates, divisors, parallel_degrees
from pipeplan.errors import BadInputError
from pipeplan.formats.cluster import Link

# ---------------------------------------------------------------- collectives


def _simulate_ring(kind: str, n: int, size: int):
    """Run the ring algorithm on real data; return (steps, bytes sent per rank, result ok).

    Each rank's buffer is cut into n chunks; a reduce-scatter passes partial sums around the
    ring for n - 1 steps, an all-gather passes the finished chunks for n - 1 more.
    """
    rng = np.random.default_rng(n * 1000 + size)
    chunks = np.array_split(np.arange(size), n)
    data = [rng.integers(0, 100, size).astype(np.int64) for _ in range(n)]
    expected = sum(data)
    buf = [d.copy() for d in data]
    sent = [0] * n
    steps = 0
    if kind in ("all-reduce", "reduce-scatter"):
        for step in range(n - 1):
            msgs = []
            for r in range(n):
                c = (r - step) % n
                msgs.append(((r + 1) % n, c, buf[r][chunks[c]].copy()))
                sent[r] += len(chunks[c])
            for dst, c, payload in msgs:
                buf[dst][chunks[c]] += payload
            steps += 1
        owned = {r: (r + 1) % n for r in range(n)}  # rank r holds the full sum of chunk r+1
        ok = all(np.array_equal(buf[r][chunks[c]], expected[chunks[c]]) for r, c in owned.items())
    else:
        owned = {r: r for r in range(n)}
        for r in range(n):
            buf[r][:] = 0
            buf[r][chunks[r]] = expected[chunks[r]]
        ok = True
    if kind in ("all-reduce", "all-gather"):
        for step in range(n - 1):
            msgs = []
            for r in range(n):
                c = (owned[r] - step) % n
                msgs.append(((r + 1) % n, c, buf[r][chunks[c]].copy()))
                sent[r] += len(chunks[c])
            for dst, c, payload in msgs:
                buf[dst][chunks[c]] = payload
            steps += 1
        ok = ok and all(np.array_equal(b, expected) for b in buf)
    return steps, sent, ok


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["all-reduce", "reduce-scatter", "all-gather"]),
       n=st.integers(2, 9), chunk=st.integers(1, 40),
       bandwidth=st.floats(1e9, 1e12), latency_us=st.floats(0, 50))
def test_ring_formula_equals_the_ring_algorithm_run_on_data(kind, n, chunk, bandwidth, latency_us):
    size = n * chunk  # elements of one byte each, so that every chunk is the same
    steps, sent, ok = _simulate_ring(kind, n, size)
    assert ok, "the simulated ring did not compute the collective"
    assert len(set(sent)) == 1
    link = Link(bandwidth_bytes_per_s=bandwidth, latency_us=latency_us, efficiency=1.0, call_latency_us=8.4)
    expected_ms = (8.4 + steps * latency_us) / 1e3 + sent[0] / bandwidth * 1e3
    assert ring_ms(kind, size, n, link) == pytest.approx(expected_ms, rel=1e-9)


def test_ring_edge_cases_and_errors():
    link = PRESETS["dgx-h100"].intra_node
    assert ring_ms("all-reduce", 0, 8, link) == 0.0
    assert ring_ms("all-gather", 1e9, 1, link) == 0.0
    with pytest.raises(ValueError, match="broadcast"):
        ring_ms("broadcast", 1, 2, link)
    with pytest.raises(ValueError, match="ranks"):
        ring_ms("all-reduce", 1, 0, link)


def test_efficiency_scales_the_bandwidth_term_only():
    full = Link(bandwidth_bytes_per_s=100e9, latency_us=0, efficiency=1.0)
    half = Link(bandwidth_bytes_per_s=100e9, latency_us=0, efficiency=0.5)
    assert ring_ms("all-reduce", 1e9, 8, half) == pytest.approx(2 * ring_ms("all-reduce", 1e9, 8, full))


def test_tree_wins_small_buffers_on_many_ranks_and_ring_large_ones():
    net = PRESETS["dgx-h100"].inter_node
    assert flat_collective_ms("all-reduce", 4096, 128, net) == tree_all_reduce_ms(4096, 128, net)
    assert flat_collective_ms("all-reduce", 4096, 128, net) < ring_ms("all-reduce", 4096, 128, net)
    assert flat_collective_ms("all-reduce", 1e10, 128, net) == ring_ms("all-reduce", 1e10, 128, net)


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(["all-reduce", "reduce-scatter", "all-gather"]),
       per_node=st.sampled_from([1, 2, 4, 8]), nodes=st.integers(1, 64), size=st.floats(1e3, 1e10),
       preset=st.sampled_from(sorted(PRESETS)))
def test_hierarchical_collective_properties(kind, per_node, nodes, size, preset):
    spec = PRESETS[preset]
    intra, inter = spec.intra_node, spec.inter_node
    t = collective_ms(kind, size, per_node, nodes, intra, inter)
    assert t >= 0
    if nodes == 1:
        assert t == flat_collective_ms(kind, size, per_node, intra)
    elif per_node == 1:
        assert t == flat_collective_ms(kind, size, nodes, inter)
    else:
        # Never faster than moving each GPU's share of the network part at line rate alone,
        # and never slower than a flat ring over every GPU at the network's bandwidth
        # (the hierarchical scheme exists because the intra-node link is faster).
        share = size / per_node
        net_lower = ring_ms(kind, share, nodes, inter) if kind != "all-reduce" else min(
            ring_ms(kind, share, nodes, inter), tree_all_reduce_ms(share, nodes, inter))
        assert t >= net_lower
        assert t <= ring_ms(kind, size, per_node * nodes, inter) * 1.0001 + 1e-9
    # Doubling the buffer never makes it faster.
    assert collective_ms(kind, 2 * size, per_node, nodes, intra, inter) >= t


def test_hierarchical_all_reduce_is_reduce_scatter_plus_all_gather_over_the_network():
    spec = PRESETS["dgx-h100"]
    size = 8e9
    rs = collective_ms("reduce-scatter", size, 8, 4, spec.intra_node, spec.inter_node)
    ag = collective_ms("all-gather", size, 8, 4, spec.intra_node, spec.inter_node)
    ar = collective_ms("all-reduce", size, 8, 4, spec.intra_node, spec.inter_node)
    # a large buffer: the ring is chosen on the network, so AR = RS + AG, one network call fewer
    assert ar == pytest.approx(rs + ag - spec.inter_node.call_latency_us / 1e3, rel=1e-12)


# ---------------------------------------------------------------- placement


@pytest.mark.parametrize("d,t,p", [(2, 4, 2), (1, 8, 8), (4, 2, 4), (8, 1, 2), (3, 2, 4), (1, 1, 16)])
def test_placement_matches_megatron_rank_generator(d, t, p):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    gen = parallel_state.RankGenerator(tp=t, ep=1, dp=d, pp=p, cp=1, order="tp-cp-ep-dp-pp")
    layout = Layout(data=d, tensor=t, pipeline=p, gpus_per_node=8)
    ours_tp = sorted(layout.tensor_group(pp, dd) for pp in range(p) for dd in range(d))
    ours_dp = sorted(layout.data_group(pp, tt) for pp in range(p) for tt in range(t))
    ours_pp = sorted(layout.pipeline_group(dd, tt) for dd in range(d) for tt in range(t))
    assert ours_tp == sorted(tuple(g) for g in gen.get_ranks("tp"))
    assert ours_dp == sorted(tuple(g) for g in gen.get_ranks("dp"))
    assert ours_pp == sorted(tuple(g) for g in gen.get_ranks("pp"))
    for rank in range(d * t * p):
        assert layout.rank(*layout.coordinates(rank)) == rank


def test_placement_links_and_spans():
    # 64 GPUs, t = 8, p = 8 (Korthikanti's GPT-3 run): each stage is one node.
    layout = Layout(data=1, tensor=8, pipeline=8, gpus_per_node=8)
    assert layout.tensor_span() == GroupSpan(8, 1)
    assert all(layout.pipeline_link(s, s + 1) == "inter" for s in range(7))
    assert layout.pipeline_link(7, 0) == "inter"  # the interleaved wrap-around
    assert layout.describe_stage(2) == "GPUs 16-23 (node 2)"
    # t = 2, d = 2: two stages per node; the transfer inside a node stays on NVLink.
    layout = Layout(data=2, tensor=2, pipeline=4, gpus_per_node=8)
    assert [layout.pipeline_link(s, s + 1) for s in range(3)] == ["intra", "inter", "intra"]
    assert layout.data_span() == GroupSpan(2, 1)
    # d spans nodes: 8 replicas of t = 4 on 4 nodes, two per node.
    layout = Layout(data=8, tensor=4, pipeline=1, gpus_per_node=8)
    assert layout.data_span() == GroupSpan(ranks_per_node=2, nodes=4)
    assert layout.data_span().link == "inter"
    assert Layout(1, 1, 1, 8).data_span().link == "local"


def test_placement_refuses_tensor_across_nodes_and_partial_nodes():
    with pytest.raises(BadInputError, match="does not divide the 8 GPUs"):
        Layout(data=1, tensor=16, pipeline=1, gpus_per_node=8)
    with pytest.raises(BadInputError, match="whole nodes"):
        Layout(data=3, tensor=4, pipeline=1, gpus_per_node=8)
    Layout(data=1, tensor=4, pipeline=1, gpus_per_node=8)  # half a node is fine


# ---------------------------------------------------------------- optimizer conventions and ZeRO


def test_megatron_distributed_optimizer_table():
    """Megatron Core's documented bytes per parameter: 18 -> 6 + 12/d (bf16), 16 -> 8 + 8/d (fp32)."""
    bf16 = training_state("adam-fp32-grads", 2)
    fp32 = training_state("adam", 4)
    for d in (1, 2, 8, 64):
        assert state_memory(1e6, bf16, 0, d).total_bytes == 18e6
        assert state_memory(1e6, bf16, 1, d).total_bytes == pytest.approx((6 + 12 / d) * 1e6, abs=2)
        assert state_memory(1e6, fp32, 0, d).total_bytes == 16e6
        assert state_memory(1e6, fp32, 1, d).total_bytes == pytest.approx((8 + 8 / d) * 1e6, abs=2)


def test_zero_paper_figure_1():
    """Rajbhandari et al. 2020, figure 1: 7.5B parameters, d = 64, K = 12."""
    adam = training_state("adam", 2)
    gb = [state_memory(7.5e9, adam, stage, 64).total_bytes / 1e9 for stage in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)


def test_adam_matches_the_planner_s_long_standing_convention():
    """Plans of schema 1 assumed 16 bytes per parameter for adam, 12 for sgd, 2 x dtype for none."""
    from pipeplan.facts.training_state import state_bytes_per_param_byte

    for dtype_bytes in (2, 4):
        for optimizer, total in (("adam", 16), ("sgd", 12), ("none", 2 * dtype_bytes)):
            assert training_state(optimizer, dtype_bytes).total_bytes == total
            assert state_bytes_per_param_byte(optimizer, dtype_bytes) == total / dtype_bytes


@settings(max_examples=60, deadline=None)
@given(optimizer=st.sampled_from(OPTIMIZERS), dtype_bytes=st.sampled_from([2, 4]),
       params=st.integers(0, 10**11), d=st.integers(1, 512))
def test_each_zero_stage_shards_one_more_part(optimizer, dtype_bytes, params, d):
    state = training_state(optimizer, dtype_bytes)
    mems = [state_memory(params, state, s, d) for s in range(4)]
    totals = [m.total_bytes for m in mems]
    assert totals == sorted(totals, reverse=True)
    assert mems[0].total_bytes == pytest.approx(params * state.total_bytes, abs=3)
    assert mems[3].total_bytes == pytest.approx(params * state.total_bytes / d, abs=3)
    assert mems[1].weight_bytes == mems[0].weight_bytes and mems[1].gradient_bytes == mems[0].gradient_bytes
    assert mems[2].weight_bytes == mems[0].weight_bytes


def test_zero3_gather_and_reserve():
    adam = training_state("adam", 2)
    assert zero3_gathered_bytes(1e9, adam, 1) == 0
    assert zero3_gathered_bytes(1e9, adam, 8) == pytest.approx(2 * 2e9 * 7 / 8, abs=1)
    assert reserve_bytes(0, 2**30, 0.05) == 2**30
    cap = 80 * 10**9
    x = plannable_bytes(cap, 2 * 2**30, 0.1)
    assert x + reserve_bytes(x, 2 * 2**30, 0.1) <= cap < x + 1 + reserve_bytes(x + 1, 2 * 2**30, 0.1)
    assert plannable_bytes(2**30, 2 * 2**30, 0.05) == 0


def test_optimizer_step_is_memory_bound():
    adam = training_state("adam-fp32-grads", 2)
    assert adam.step_bytes == 3 * 4 + 2 * 12 + 4 + (4 + 2)   # clip, update, weight copy
    assert training_state("adam", 4).step_bytes == 3 * 4 + 2 * 8 + 4 + 2 * 4  # fp32: in place
    one = optimizer_step_ms(1e9, adam, 3.35e12)
    assert optimizer_step_ms(1e9, adam, 3.35e12, loss_scaling=True) == pytest.approx(one * 54 / 46)
    assert optimizer_step_ms(2e9, adam, 3.35e12) == pytest.approx(2 * one)
    assert optimizer_step_ms(1e9, training_state("none", 2), 3.35e12) == 0.0
    with pytest.raises(ValueError):
        training_state("lion", 2)


# ---------------------------------------------------------------- data-parallel sync


def test_data_parallel_sync_by_zero_stage():
    spec = PRESETS["dgx-h100"]
    adam = training_state("adam", 2)  # gradients and weights both 2 bytes: RS + AG == AR
    span = GroupSpan(ranks_per_node=1, nodes=8)
    m = 16
    s0, s1, s2, s3 = (data_parallel_sync(1e9, adam, z, span, spec, m) for z in range(4))
    assert s0.weight_gather_ms == 0 and s0.gradient_ms > 0
    # ring RS + AG moves what AR moves, in one more call
    assert s1.total_ms == pytest.approx(s0.total_ms + spec.inter_node.call_latency_us / 1e3, rel=1e-9)
    assert s2.gradient_ms == pytest.approx(m * s1.gradient_ms)
    assert s3.weight_gather_ms == pytest.approx(2 * m * s1.weight_gather_ms)
    assert s0.exposed_ms == s0.total_ms
    half = data_parallel_sync(1e9, adam, 0, span, spec, m, overlap=0.5)
    assert half.exposed_ms == pytest.approx(s0.total_ms / 2)
    megatron = training_state("adam-fp32-grads", 2)
    assert data_parallel_sync(1e9, megatron, 0, span, spec, m).gradient_ms > s0.gradient_ms  # fp32 grads
    assert data_parallel_sync(1e9, adam, 3, GroupSpan(1, 1), spec, m).total_ms == 0.0


# ---------------------------------------------------------------- the search space


def _brute_degrees(n, g, units, heads, tdeg):
    out = []
    for d in range(1, n + 1):
        for t in range(1, n + 1):
            for p in range(1, n + 1):
                if d * t * p != n or g % t or p > units or any(h % t for h in heads):
                    continue
                if (t * d) % g and g % (t * d):  # a pipeline rank's t x d GPUs would start mid-node
                    continue
                if tdeg is not None and t not in tdeg:
                    continue
                out.append(Degrees(d, t, p))
    return sorted(out)


@settings(max_examples=80, deadline=None)
@given(nodes=st.integers(1, 6), g=st.sampled_from([1, 2, 4, 8]), units=st.integers(1, 40),
       heads=st.lists(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 64]), max_size=2),
       tdeg=st.one_of(st.none(), st.sets(st.sampled_from([1, 2, 4, 8]), min_size=1)))
def test_parallel_degrees_equal_brute_force(nodes, g, units, heads, tdeg):
    n = nodes * g
    expected = _brute_degrees(n, g, units, heads, tdeg)
    if not expected:
        with pytest.raises(BadInputError):
            parallel_degrees(n, g, units, heads, tdeg)
        return
    assert parallel_degrees(n, g, units, heads, tdeg) == expected


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 256), datas=st.sets(st.integers(1, 16), min_size=1),
       sizes=st.sets(st.integers(1, 16), min_size=1))
def test_candidates_equal_brute_force(batch, datas, sizes):
    degrees = [Degrees(d, 1, 1) for d in datas]
    expected = sorted((d, b, batch // (d * b)) for d in datas for b in sizes if batch % (d * b) == 0)
    if not expected:
        with pytest.raises(BadInputError, match="global-batch"):
            candidates(degrees, batch, sizes)
        return
    got = [(c.data, c.microbatch_size, c.num_microbatches) for c in candidates(degrees, batch, sizes)]
    assert got == expected


def test_space_errors_name_the_problem():
    with pytest.raises(BadInputError, match="not a whole number of 8-GPU nodes; use 8 or 16"):
        parallel_degrees(12, 8, 96)
    with pytest.raises(BadInputError, match="above the 8 GPUs of a node"):
        parallel_degrees(64, 8, 96, tensor=16)
    with pytest.raises(BadInputError, match="does not divide the model's 6 heads"):
        parallel_degrees(64, 8, 96, head_counts=[6], tensor=4)
    with pytest.raises(BadInputError, match="no costs at degree 8"):
        parallel_degrees(64, 8, 96, tensor_degrees=[1, 2, 4], tensor=8)
    with pytest.raises(BadInputError, match="more than the profile's 4 units"):
        parallel_degrees(64, 8, 4, pipeline=8)
    with pytest.raises(BadInputError, match="--data-parallel: 3 does not divide --gpus 64"):
        parallel_degrees(64, 8, 96, data=3)
    with pytest.raises(BadInputError, match="no data x tensor x pipeline layout"):
        parallel_degrees(64, 8, 96, data=64, tensor=8)
    assert divisors(1) == [1] and divisors(97) == [1, 97]


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.floats(1e3, 1e9), min_size=1, max_size=6), t=st.sampled_from([1, 2, 4, 8]),
       sequence_parallel=st.booleans())
def test_tensor_parallel_term_is_the_sum_of_its_calls(sizes, t, sequence_parallel):
    from pipeplan.cluster.collectives import tensor_parallel_ms

    link = PRESETS["dgx-a100"].intra_node
    if sequence_parallel:
        kinds = ["reduce-scatter" if i % 2 else "all-gather" for i in range(len(sizes))]
        name = "reduce_scatter_all_gather"
    else:
        kinds = ["all-reduce"] * len(sizes)
        name = "all_reduce"
    expected = sum(ring_ms(k, s, t, link) for k, s in zip(kinds, sizes))
    assert tensor_parallel_ms(name, sum(sizes), len(sizes), t, link) == pytest.approx(expected, rel=1e-9)


def test_send_uses_the_link_it_is_given():
    from pipeplan.cluster.collectives import send_ms

    spec = PRESETS["dgx-h100"]
    assert send_ms(0, spec.inter_node) == 0.0
    assert send_ms(1e8, spec.inter_node) > send_ms(1e8, spec.intra_node)


# ---------------------------------------------------------------- the iteration


@settings(max_examples=80, deadline=None)
@given(data=st.data(), ranks=st.integers(1, 8))
def test_iteration_parts_add_up(data, ranks):
    from pipeplan.cluster.iteration import iteration_parts

    floats = st.floats(0, 100)
    end = [data.draw(floats) for _ in range(ranks)]
    makespan = max(end)
    busy = data.draw(st.floats(0, 1)) * makespan
    transfer = data.draw(st.floats(0, 1)) * (makespan - busy)
    bubble = makespan - busy - transfer
    tp = data.draw(st.floats(0, 1)) * busy
    sync = [data.draw(floats) for _ in range(ranks)]
    opt = [data.draw(floats) for _ in range(ranks)]
    parts = iteration_parts(busy, tp, transfer, bubble, end, sync, opt)
    expected = max(e + s for e, s in zip(end, sync)) + max(opt)
    assert parts.iteration_ms == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert parts.pipeline_ms == pytest.approx(makespan, rel=1e-9, abs=1e-9)
    assert min(parts.compute_ms, parts.tensor_parallel_ms, parts.data_parallel_ms) >= 0
    # the sync is never counted below what the last-ending rank's own sync adds
    last = max(range(ranks), key=lambda r: end[r])
    assert parts.data_parallel_ms >= sync[last] - 1e-9


def test_iteration_errors_and_throughput():
    from pipeplan.cluster.iteration import iteration_parts, model_flops_utilization, pipeline_lower_bound_ms

    with pytest.raises(ValueError, match="one value per pipeline rank"):
        iteration_parts(1.0, 0.0, 0.0, 0.0, [1.0], [0.0, 0.0], [0.0])
    with pytest.raises(ValueError, match="make-span"):
        iteration_parts(2.0, 0.0, 0.0, 0.0, [1.0], [0.0], [0.0])
    assert model_flops_utilization(312e12, 1000.0, 1, 312e12) == pytest.approx(1.0)
    assert pipeline_lower_bound_ms(100.0, 4, 4) == 100.0


# --------------------------------------------------------------------------- overlap (pipeplan.cluster.overlap)


def test_megatron_buckets_fill_in_reverse_and_close_at_bucket_size():
    """Megatron-core's _does_param_require_new_bucket loop: parameters in reverse, a bucket closes
    once it holds bucket_size; each ready when the last micro-batch's backward has passed its
    last (earliest) parameter. Units of 30M, 50M, 50M parameters, buckets of 40M, backward 1, 2, 2 ms
    in a window [10, 15] ms."""
    from pipeplan.cluster.overlap import StageUnits, buckets

    stage = StageUnits((30e6, 50e6, 50e6), (0.5, 1.0, 1.0), (1.0, 2.0, 2.0), (10.0, 15.0), bucket_params=40e6)
    # reverse: unit 2 (50M) ends at 12 ms, unit 1 at 14 ms, unit 0 at 15 ms
    expected = [
        (40e6, 12.0, 1.0 * 40 / 50),                       # 40M of unit 2
        (40e6, 14.0, 1.0 * 10 / 50 + 1.0 * 30 / 50),       # 10M of unit 2, 30M of unit 1
        (40e6, 15.0, 1.0 * 20 / 50 + 0.5 * 20 / 30),       # 20M of unit 1, 20M of unit 0
        (10e6, 15.0, 0.5 * 10 / 30),                       # the rest of unit 0: the last bucket
    ]
    got = buckets(stage)
    assert len(got) == len(expected)
    assert [x for b in got for x in b] == pytest.approx([x for b in expected for x in b])
    one = StageUnits((30e6, 50e6), (0.5, 1.0), (1.0, 2.0), (10.0, 13.0))
    assert buckets(one) == [(80e6, 13.0, 1.5)]
    per_unit = StageUnits((30e6, 50e6), (0.5, 1.0), (1.0, 2.0), (10.0, 13.0), bucket_params=0)
    assert buckets(per_unit) == [(50e6, 12.0, 1.0), (30e6, 13.0, 0.5)]


def test_gradient_stream_exposes_at_least_the_last_bucket():
    from pipeplan.cluster.overlap import StageUnits, exposed_sync_ms, stream_exposed_ms

    stage = StageUnits((30e6, 50e6, 50e6), (0.5, 1.0, 1.0), (1.0, 2.0, 2.0), (10.0, 15.0), bucket_params=40e6)
    # 13 ms of reduce-scatter over 130M parameters: 4, 4, 4 and 1 ms by bucket
    ready = [(12.0, 4.0), (14.0, 4.0), (15.0, 4.0), (15.0, 1.0)]
    # stream: 12-16, 16-20, 20-24, 24-25: 10 ms after the rank's end at 15 ms
    assert stream_exposed_ms(ready, 15.0) == pytest.approx(10.0)
    assert exposed_sync_ms(13.0, 0.0, 1, {"grad-reduce"}, [stage], 15.0, 8) == pytest.approx((10.0, 0.0))
    # without the overlap everything is exposed; a rank that ends later hides more
    assert exposed_sync_ms(13.0, 0.0, 1, set(), [stage], 15.0, 8) == (13.0, 0.0)
    assert exposed_sync_ms(13.0, 0.0, 1, {"grad-reduce"}, [stage], 20.0, 8) == pytest.approx((5.0, 0.0))
    # the last bucket, ready as the rank's backward ends, is never hidden; later work (another
    # chunk's) hides it
    assert exposed_sync_ms(13.0, 0.0, 1, {"grad-reduce"}, [stage], 15.0, 8)[0] >= 1.0
    assert exposed_sync_ms(13.0, 0.0, 1, {"grad-reduce"}, [stage], 30.0, 8)[0] == 0.0
    # ZeRO 2: every micro-batch's reduce-scatter (13 / 8 ms each), as the last one's, times 8
    per = stream_exposed_ms([(r, c / 8) for r, c in ready], 15.0)
    assert exposed_sync_ms(13.0, 0.0, 2, {"grad-reduce"}, [stage], 15.0, 8)[0] == pytest.approx(8 * per)


def test_param_gather_hides_each_bucket_behind_the_forward_of_the_one_before():
    from pipeplan.cluster.overlap import StageUnits, exposed_sync_ms

    stage = StageUnits((30e6, 50e6, 50e6), (0.5, 1.0, 1.0), (1.0, 2.0, 2.0), (10.0, 15.0), bucket_params=40e6)
    # forward order: buckets of 10M, 40M, 40M, 40M; forwards 0.1667, 0.7333, 0.8, 0.8 ms; 13 ms of all-gather
    comm = [1.0, 4.0, 4.0, 4.0]
    forward = [0.5 * 10 / 30, 0.5 * 20 / 30 + 1.0 * 20 / 50, 1.0 * 30 / 50 + 1.0 * 10 / 50, 1.0 * 40 / 50]
    hand = comm[0] + sum(max(0.0, comm[i + 1] - forward[i]) for i in range(3))
    assert exposed_sync_ms(0.0, 13.0, 1, {"param-gather"}, [stage], 15.0, 8) == pytest.approx((0.0, hand))
    assert exposed_sync_ms(0.0, 13.0, 1, {"grad-reduce"}, [stage], 15.0, 8) == (0.0, 13.0)


def test_zero3_prefetch_per_unit_against_hand_computation():
    """Three units of 10, 20, 30 parameters; 6 ms of all-gathers (both passes) and 6 ms of
    reduce-scatters per iteration of 2 micro-batches: per micro-batch a unit's all-gather is
    1.5 ms x its share, its reduce-scatter 3 ms x its share."""
    from pipeplan.cluster.overlap import StageUnits, exposed_sync_ms, fsdp_microbatch_exposed_ms

    stage = StageUnits((10.0, 20.0, 30.0), (0.2, 0.2, 0.2), (0.4, 0.4, 0.4), (0.0, 1.2))
    g = [1.5 / 6, 1.5 * 2 / 6, 1.5 * 3 / 6]        # 0.25, 0.5, 0.75
    r = [3.0 / 6, 3.0 * 2 / 6, 3.0 * 3 / 6]        # 0.5, 1, 1.5
    forward = g[0] + max(0, g[1] - 0.2) + max(0, g[2] - 0.2)
    backward = g[2] + max(0, g[1] - 0.4) + max(0, g[0] + r[2] - 0.4) + max(0, r[1] - 0.4) + r[0]
    assert fsdp_microbatch_exposed_ms(g, r, stage.forward_ms, stage.backward_ms, True, True) == pytest.approx(
        forward + backward)
    gradient, gather = exposed_sync_ms(6.0, 6.0, 3, {"grad-reduce", "param-gather"}, [stage], 1.2, 2)
    assert gradient + gather == pytest.approx(2 * (forward + backward)) and gradient == pytest.approx(gather)
    # nothing overlapped: 2 gathers + a reduce-scatter of every unit, every micro-batch: the whole sync
    assert sum(exposed_sync_ms(6.0, 6.0, 3, set(), [stage], 1.2, 2)) == pytest.approx(12.0)


def test_tensor_parallel_shares_and_their_floor():
    from pipeplan.cluster.overlap import tensor_parallel_exposed_shares as shares

    assert shares({"tp-comm"}, "megatron", "reduce_scatter_all_gather", 8) == (0.125, 0.0)
    assert shares({"tp-comm"}, None, "reduce_scatter_all_gather", 2) == (0.125, 0.0)
    assert shares({"tp-comm"}, "torchtitan", "reduce_scatter_all_gather", 2) == (0.5, 0.5)
    assert shares({"tp-comm"}, "megatron", "all_reduce", 8) == (1.0, 1.0)   # needs sequence parallelism
    assert shares(set(), "megatron", "reduce_scatter_all_gather", 8) == (1.0, 1.0)


def test_tp_comm_view_keeps_the_exposed_share_and_the_plan_reports_the_rest(tmp_path):
    """The view at t = 2 with tp-comm: each unit's forward keeps max(1/8 x TP, TP - compute), the
    backward max(0, TP - compute); exposed + hidden is the whole collective."""
    from pipeplan.api import make_profile
    from pipeplan.cluster.profile_view import degree_view

    path = tmp_path / "l8.json"
    make_profile("llama3-8b", path, analytic=True, gpu="h100-sxm", seq_len=2048, microbatch_sizes="1",
                 tensor_parallel="2")
    from pipeplan.formats.io import load_profile

    profile, cluster = load_profile(path), PRESETS["dgx-h100"]
    whole = degree_view(profile, 2, cluster)
    hidden = degree_view(profile, 2, cluster, tp_comm="megatron")
    checked = 0
    for layer in profile.layers:
        cost = next(c for c in layer.costs if c.tensor_parallel == 2)
        key = (layer.name, 1)
        forward, backward = whole.tensor_parallel_ms[key]
        if not forward:
            continue
        exposed = hidden.tensor_parallel_ms[key]
        assert exposed[0] == pytest.approx(max(forward / 8, forward - cost.forward_ms))
        assert exposed[1] == pytest.approx(max(0.0, backward - cost.backward_ms))
        assert sum(exposed) + sum(hidden.tensor_parallel_hidden_ms[key]) == pytest.approx(forward + backward)
        checked += 1
    assert checked >= 32


def test_overlapped_cluster_plan_parts_add_up_and_match_the_stream_by_hand(tmp_path):
    """p = 1, d = 8 (one GPU per replica on one node), Megatron's buckets of 40M parameters: the
    plan's exposed gradient reduce is the stream of hand-made buckets over its one backward."""
    from pipeplan.api import plan_profile
    from pipeplan.cluster.placement import cluster_layout
    from pipeplan.formats.io import load_profile
    from pipeplan.plan import plan_simulation
    from pipeplan.requests import ClusterRequest

    profile_path = "profiles/transformer32-analytic.json"
    profile, cluster = load_profile(profile_path), PRESETS["dgx-a100"]

    def plan(overlap):
        return plan_profile(profile_path, ClusterRequest(
            num_gpus=8, cluster=cluster, global_batch=16, data_parallel=8, tensor_parallel=1, stages=1,
            zero_stage=1, launcher="megatron", overlap=overlap, microbatch_size=1))

    off, on = plan(None), plan(["grad-reduce"])
    assert off.predicted.gradient_reduce_ms is None and on.settings.overlap == ["grad-reduce"]
    p = on.predicted
    parts = (p.compute_ms + (p.tensor_parallel_ms or 0) + p.transfer_ms + p.bubble_ms + (p.overhead_ms or 0)
             + p.data_parallel_ms + p.optimizer_ms)
    assert parts == pytest.approx(p.iteration_ms, abs=1e-5)
    assert p.gradient_reduce_ms + p.param_gather_ms == pytest.approx(p.data_parallel_ms, abs=1e-5)
    # by hand: the reduce-scatter of every parameter's fp32... here adam: 2-byte gradients
    state = training_state("adam-fp32-grads", profile.dtype_bytes)
    params = [layer.param_bytes / profile.dtype_bytes for layer in profile.layers]
    span = cluster_layout(cluster, 8, 1, 1).data_span()
    sync = data_parallel_sync(sum(params), state, 1, span, cluster, on.num_microbatches)
    sim = plan_simulation(on)
    start, end = max(((e.start_ms, e.end_ms) for e in sim.events if e.kind in ("FULL_B", "W")), key=lambda x: x[1])
    backward = [next(c.backward_ms for c in layer.costs if c.microbatch_size == 1) for layer in profile.layers]
    size, held, ready = 40e6, 0.0, []
    done = 0.0
    for n, b in zip(reversed(params), reversed(backward)):
        done += b
        at = start + (end - start) * done / sum(backward)
        held += n
        while held >= size:
            ready.append((at, size))
            held -= size
    if held > 0:
        ready.append((end, held))
    finish = 0.0
    for at, n in ready:
        finish = max(at, finish) + sync.gradient_ms * n / sum(params)
    exposed = max(0.0, finish - sim.iteration_ms)
    assert p.gradient_reduce_ms == pytest.approx(exposed, rel=1e-6, abs=1e-6)
    assert p.param_gather_ms == pytest.approx(sync.weight_gather_ms, rel=1e-6)   # not overlapped
    assert p.data_parallel_hidden_ms == pytest.approx(sync.gradient_ms - exposed, rel=1e-6, abs=1e-6)
    assert on.predicted.iteration_ms < off.predicted.iteration_ms
    assert off.predicted.data_parallel_ms == pytest.approx(sync.total_ms, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(units=st.lists(st.tuples(st.floats(1e5, 1e9), st.floats(0.01, 10.0), st.floats(0.01, 20.0)),
                      min_size=1, max_size=8),
       bucket=st.sampled_from([None, 0, 5e7, 4e8]), zero=st.sampled_from([0, 1, 2, 3]),
       gradient_ms=st.floats(0.0, 500.0), gather_ms=st.floats(0.0, 500.0), m=st.integers(1, 16),
       overlaps=st.sets(st.sampled_from(["grad-reduce", "param-gather"])), slack_ms=st.floats(0.0, 50.0))
def test_overlap_never_adds_time_and_off_is_the_whole_sync(units, bucket, zero, gradient_ms, gather_ms, m, overlaps,
                                                           slack_ms):
    from pipeplan.cluster.overlap import StageUnits, exposed_sync_ms

    params, forward, backward = (tuple(x) for x in zip(*units))
    end = 100.0 + sum(backward)
    stage = StageUnits(params, forward, backward, (100.0, end), bucket_params=bucket)
    gradient, gather = exposed_sync_ms(gradient_ms, gather_ms, zero, overlaps, [stage], end + slack_ms, m)
    assert -1e-9 <= gradient <= gradient_ms * (1 + 1e-9) + 1e-9
    assert -1e-9 <= gather <= gather_ms * (1 + 1e-9) + 1e-9
    assert exposed_sync_ms(gradient_ms, gather_ms, zero, set(), [stage], end, m) == pytest.approx(
        (gradient_ms, gather_ms))
    more = exposed_sync_ms(gradient_ms, gather_ms, zero, overlaps | {"grad-reduce", "param-gather"}, [stage],
                           end + slack_ms, m)
    assert sum(more) <= gradient + gather + 1e-6 * (1 + gradient_ms + gather_ms)
