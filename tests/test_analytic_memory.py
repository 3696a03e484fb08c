"""Activation memory against Korthikanti et al. 2022's formulas and their figure 1.

Figure 1 of "Reducing Activation Recomputation in Large Transformer Models" (A100 80 GB, fp16,
sequence 2048, tensor-parallel 8): the 22B model (48 layers, hidden 6144, 64 heads, batch 4 as
one micro-batch) holds 45.56 GiB of parameters and optimizer state, 59.25 GiB of activations
without recomputation, and 9.56 GiB with sequence parallelism and selective recomputation.
"""

from __future__ import annotations

import json

import pytest

from pipeplan.analytic import analytic_profile, get_gpu, load_model_config
from pipeplan.analytic.flops import Shape
from pipeplan.analytic.memory import MEGATRON_ADAM_BYTES_PER_PARAM, block_activation_terms

GIB = 2**30

#: Korthikanti et al.'s 22B model as a GPT-2-family config (Megatron's vocabulary of 51200).
GPT_22B = {"model_type": "gpt2", "n_layer": 48, "n_embd": 6144, "n_head": 64, "n_positions": 2048,
           "vocab_size": 51200, "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1}


@pytest.fixture
def gpt22b(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT_22B))
    return path


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("s,b", [(2048, 1), (2048, 4), (1024, 2)])
def test_gpt3_block_matches_korthikanti_formulas(t, s, b):
    cfg = load_model_config("gpt3-175b")
    h, a = cfg.hidden_size, cfg.num_heads
    sbh = s * b * h
    total = lambda **kw: sum(block_activation_terms(cfg, Shape(s, b, t, flash_attention=False, **kw)).values())
    if t == 1:
        assert total() == 34 * sbh + 5 * a * s * s * b
    # Section 4.2.1, tensor parallelism alone: sbh (10 + 24/t + 5as/(ht)).
    assert total() == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    # Section 4.2.2, with sequence parallelism: sbh/t (34 + 5as/h).
    assert total(sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h), rel=1e-12)


def test_selective_recompute_keeps_34sbh_over_t_in_the_profile():
    cfg = load_model_config("gpt3-175b")
    s, b, t, h = 2048, 1, 8, cfg.hidden_size
    profile = analytic_profile(cfg, get_gpu("a100-80gb"), seq_len=s, dtype="fp16", microbatch_sizes=[b],
                               tensor_parallel=[t], flash_attention=False)
    entry = profile.layers[1].cost_at(b, t)
    assert entry.selective_activation_bytes == 34 * s * b * h // t
    assert entry.activation_bytes == (34 * s * b * h + 5 * cfg.num_heads * s * s * b) // t


def test_flash_attention_drops_the_s_squared_terms():
    cfg = load_model_config("gpt3-175b")
    terms = block_activation_terms(cfg, Shape(2048, 1, flash_attention=True))
    assert not {"softmax_output", "softmax_dropout_mask", "softmax_dropout_output"} & set(terms)
    assert terms["softmax_stats"] == 4 * cfg.num_heads * 2048


def _figure1(gpt22b):
    def blocks(**kw):
        profile = analytic_profile(gpt22b, get_gpu("a100-80gb"), seq_len=2048, dtype="fp16",
                                   microbatch_sizes=[4], tensor_parallel=[8], flash_attention=False, **kw)
        return profile, [layer for layer in profile.layers if layer.kind == "block"]
    profile, plain = blocks(sequence_parallel=False)
    _, sp = blocks(sequence_parallel=True)
    state_blocks = sum(layer.param_bytes_at(8) for layer in plain) // 2 * MEGATRON_ADAM_BYTES_PER_PARAM
    # Pipeline 1: the tied head and the token table are one tensor, so the head's copy is left out.
    unique = [layer for layer in profile.layers if layer.kind != "head"]
    state_all = sum(layer.param_bytes_at(8) for layer in unique) // 2 * MEGATRON_ADAM_BYTES_PER_PARAM
    return {
        "state_blocks": state_blocks / GIB,
        "state_all": state_all / GIB,
        "activations": sum(layer.cost_at(4, 8).activation_bytes for layer in plain) / GIB,
        "sp_selective": sum(layer.cost_at(4, 8).selective_activation_bytes for layer in sp) / GIB,
        "activations_all": sum(layer.cost_at(4, 8).activation_bytes for layer in profile.layers) / GIB,
    }


def test_korthikanti_figure_1_22b(gpt22b):
    got = _figure1(gpt22b)
    # Activations of the 48 blocks: the figure's numbers to its two decimals.
    assert got["activations"] == pytest.approx(59.25, abs=0.005)
    assert got["sp_selective"] == pytest.approx(9.56, abs=0.005)
    # Parameters + optimizer state (Megatron's 18 bytes per parameter): the figure counts the
    # blocks' 12 L h^2 weights; pipeplan also counts their biases and norms (+0.08%) and, for the
    # whole model, the embedding and position tables (+2.0%).
    assert got["state_blocks"] == pytest.approx(45.56, rel=0.001)
    assert got["state_all"] == pytest.approx(45.56, rel=0.025)
    assert got["state_all"] > 45.56
