"""The efficiency model's shape terms (tile and wave quantisation, stream-K, the k loop's fill)
and the host-overhead term, each against a hand computation from docs/analytic.md's formulas."""

from __future__ import annotations

import math

import pytest

from pipeplan.analytic import analytic_profile, get_gpu, load_model_config
from pipeplan.analytic.calibrate import fit_efficiency
from pipeplan.analytic.efficiency import (DEFAULT_EFFICIENCY, EfficiencyModel, gemm_shape_factor, host_ms, part_ms,
                                          pass_ms)
from pipeplan.analytic.flops import Part, Shape, unit_work
from pipeplan.facts.gpus import GPUS

E = DEFAULT_EFFICIENCY


def _gemm(m, n, k, groups=1):
    return Part("g", "gemm", 2.0 * m * n * k * groups, 0.0, m=m, n=n, k=k, groups=groups)


def test_every_shipped_gpu_has_a_sourced_sm_count():
    for gpu in GPUS.values():
        assert gpu.sm_count and gpu.sources.get("sm_count"), gpu.name
    assert GPUS["h100-sxm"].sm_count == 132 and GPUS["a100-80gb"].sm_count == 108


def test_tile_quantisation_pads_m_and_n_to_the_tile():
    # m = 100 pads to 128 (one 128 x 128 tile; 128 x 256 and 256 x 128 pad more), no SM count.
    assert gemm_shape_factor(_gemm(100, 128, 4096), None, 0.0) == pytest.approx(128 / 100)
    # 200 x 300: 128 x 128 tiles pad to 256 x 384 (6 tiles), 128 x 256 to 256 x 512, 256 x 128 to 256 x 384.
    assert gemm_shape_factor(_gemm(200, 300, 4096), None, 0.0) == pytest.approx(256 * 384 / (200 * 300))
    # The k loop's fill: (1 + k0 / k).
    assert gemm_shape_factor(_gemm(128, 128, 1024), None, 64.0) == pytest.approx(1 + 64 / 1024)


def test_wave_quantisation_and_stream_k_by_hand():
    sms, k0 = 108, 64.0
    # 8192 x 768 x 6144 on 108 SMs (the 22B run's q_proj at t = 8): 128 x 128 tiles: 64 x 6 = 384
    # tiles, 3.56 waves; data-parallel pays 4 full waves, stream-K one fill per tile touched.
    tiles = 64 * 6
    data_parallel = math.ceil(tiles / sms) * sms / tiles * (1 + k0 / 6144)
    stream_k = 1 + k0 / 6144 + sms * k0 / (tiles * 6144)
    assert stream_k < data_parallel
    # 128 x 256 and 256 x 128 tiles (192 tiles) give 1 + k0/k + 108 k0 / (192 k), more than 384 tiles.
    assert gemm_shape_factor(_gemm(8192, 768, 6144), sms, k0) == pytest.approx(stream_k)
    # Whole waves and k0 = 0: no loss at all.
    assert gemm_shape_factor(_gemm(128 * 12, 128 * 9, 4096), sms, 0.0) == pytest.approx(1.0)
    # A grouped GEMM counts every group's tiles in one launch: 128 experts of 256 x 768 x 2048 on
    # 148 SMs: 128 x 2 x 6 = 1536 tiles of 128 x 128, 10.4 waves; stream-K's fill over them.
    tiles = 128 * 2 * 6
    want = min(math.ceil(tiles / 148) * 148 / tiles * (1 + k0 / 2048), 1 + k0 / 2048 + 148 * k0 / (tiles * 2048))
    assert gemm_shape_factor(_gemm(256, 768, 2048, 128), 148, k0) == pytest.approx(want)


def test_a_gemm_part_is_its_large_gemm_time_times_the_shape_factor():
    h100 = GPUS["h100-sxm"]
    part = _gemm(1000, 4096, 512)
    factor = gemm_shape_factor(part, h100.sm_count, E.gemm_k_overhead)
    by_hand = 1e3 * part.flops * factor / (h100.peak_flops["bf16"] * E.gemm) + E.kernel_latency_us / 1e3
    assert part_ms(part, h100.peak_flops["bf16"], h100.hbm_bytes_per_s, E, None, h100.sm_count) == pytest.approx(by_hand)
    assert factor > 1.0
    # A part without GEMM dimensions (attention, an older caller's GEMM) keeps the flat efficiency.
    flat = Part("g", "gemm", part.flops, 0.0)
    assert part_ms(flat, h100.peak_flops["bf16"], h100.hbm_bytes_per_s, E) == pytest.approx(
        1e3 * part.flops / (h100.peak_flops["bf16"] * E.gemm) + E.kernel_latency_us / 1e3)


def test_gemm_parts_carry_each_pass_shape_per_rank_and_per_expert():
    cfg = load_model_config("qwen3-30b-a3b")
    work = unit_work(cfg, "block", 1, Shape(4096, 1, 2, True))
    forward = {p.name: p for p in work.forward}
    # Column-parallel q_proj at t = 2: m tokens, n = heads x d / 2, k = hidden.
    q = forward["q_proj"]
    assert (q.m, q.n, q.k, q.groups) == (4096, cfg.num_heads * cfg.head_dim // 2, cfg.hidden_size, 1)
    # A routed expert GEMM: 128 groups of 4096 x 8 / 128 = 256 tokens; n = the expert width / t.
    gate = forward["gate_proj"]
    assert (gate.m, gate.n, gate.k, gate.groups) == (256, cfg.expert_width // 2, cfg.hidden_size, 128)
    b = next(p for p in work.backward_input if p.name == "gate_proj")
    w = next(p for p in work.backward_weight if p.name == "gate_proj")
    assert (b.m, b.n, b.k) == (256, cfg.hidden_size, cfg.expert_width // 2)
    assert (w.m, w.n, w.k) == (cfg.hidden_size, cfg.expert_width // 2, 256)
    assert gate.flops == pytest.approx(2.0 * gate.m * gate.n * gate.k * gate.groups)


def test_a_pass_is_the_gpu_or_the_host_whichever_is_longer():
    parts = [Part("tiny", "memory", 0.0, 1e3) for _ in range(10)]
    gpu_ms = 10 * (1e3 / (8e12 * E.memory) * 1e3 + E.kernel_latency_us / 1e3)
    assert host_ms(parts, E) == pytest.approx(10 * E.host_us_per_kernel / 1e3)
    total, wait = pass_ms(parts, 1e15, 8e12, E)
    assert total == pytest.approx(10 * E.host_us_per_kernel / 1e3) and wait == pytest.approx(total - gpu_ms)
    # A GPU-bound pass: the host term vanishes.
    big = [_gemm(8192, 8192, 8192)]
    total, wait = pass_ms(big, 1e15, 8e12, E, None, 132)
    assert wait == 0.0 and total == pytest.approx(part_ms(big[0], 1e15, 8e12, E, None, 132))
    # launches count: a part that launches 3 kernels costs 3 host launches.
    assert host_ms([Part("x", "memory", 0.0, 0.0, launches=3)], E) == pytest.approx(3 * E.host_us_per_kernel / 1e3)


def test_the_profile_records_the_host_wait_and_dense_large_runs_have_none():
    slow_host = EfficiencyModel(host_us_per_kernel=500.0)
    profile = analytic_profile("qwen3-30b-a3b", get_gpu("b200"), seq_len=512, microbatch_sizes=(1,), efficiency=slow_host)
    block = profile.layers[1].cost_at(1)
    cfg = load_model_config("qwen3-30b-a3b")
    work = unit_work(cfg, "block", 1, Shape(512, 1))
    gpu = get_gpu("b200")
    args = (gpu.flops_for("bf16"), gpu.hbm_bytes_per_s, slow_host, None, gpu.sm_count)
    forward, forward_wait = pass_ms(work.forward, *args)
    b_input, input_wait = pass_ms(work.backward_input, *args)
    b_weight, weight_wait = pass_ms(work.backward_weight, *args)
    # Host-bound: 500 us per launch; the routing and permute parts carry megatron-core's counts.
    launches = sum(p.launches for p in work.forward)
    assert launches == len(work.forward) - 2 + 25 + 18
    assert forward == pytest.approx(launches * 0.5)
    assert block.forward_ms == pytest.approx(forward, abs=1e-6)
    assert block.host_wait_forward_ms == pytest.approx(forward_wait, abs=1e-6) and forward_wait > 0
    assert block.host_wait_backward_ms == pytest.approx(input_wait + weight_wait, abs=2e-6)
    assert block.backward_ms == pytest.approx(b_input + b_weight, abs=2e-6)
    # Llama 3 70B at 8192 tokens: every unit GPU-bound at the default host cost.
    dense = analytic_profile("llama3-70b", get_gpu("h100-sxm"), seq_len=8192, microbatch_sizes=(1,))
    assert all(c.host_wait_forward_ms is None for layer in dense.layers[1:-1] for c in layer.costs)


def test_calibrate_still_recovers_a_known_efficiency_with_the_new_terms():
    cfg = load_model_config("llama3-8b")
    gpu = get_gpu("h100-sxm")
    truth = EfficiencyModel(gemm=0.6, attention=0.4, memory=0.7, kernel_latency_us=5.0)
    measured = analytic_profile(cfg, gpu, seq_len=2048, microbatch_sizes=(1, 2, 4), efficiency=truth)
    fitted, report = fit_efficiency(cfg, gpu, measured)
    assert fitted.gemm == pytest.approx(0.6, rel=0.03) and fitted.memory == pytest.approx(0.7, rel=0.03)
    assert fitted.gemm_k_overhead == E.gemm_k_overhead and fitted.host_us_per_kernel == E.host_us_per_kernel
    assert report["rms_log_error_after"] < 0.01


def test_a_gpu_spec_file_may_give_its_sm_count(tmp_path):
    from pipeplan.formats.gpu import load_gpu_spec

    text = ('name = "mine"\nmemory = "80GiB"\nhbm_bandwidth = "3.35TB/s"\nlink_bandwidth = "450GB/s"\n'
            '[peak_flops]\nbf16 = 989.4e12\n')
    without = tmp_path / "a.toml"
    without.write_text(text)
    with_sms = tmp_path / "b.toml"
    with_sms.write_text(text.replace('link_bandwidth = "450GB/s"\n', 'link_bandwidth = "450GB/s"\nsm_count = 132\n'))
    assert load_gpu_spec(without).sm_count is None and load_gpu_spec(with_sms).sm_count == 132
    # Without an SM count only tile padding and the k fill apply (no waves).
    part = _gemm(8192, 768, 6144)
    assert gemm_shape_factor(part, None, E.gemm_k_overhead) == pytest.approx(1 + E.gemm_k_overhead / 6144)
