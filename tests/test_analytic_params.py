"""Parameter counts and FLOPs of the analytic model against transformers' own models (meta device).

Every supported family is built by transformers from the same config (the shipped one, with two
blocks so that it builds in well under a second: per-unit counts do not depend on depth; a
mixture of experts keeps one dense and one routed block where it has both kinds) and compared
unit by unit, exactly. The mixtures of experts' total and active counts are checked on the full
shipped configs, built whole on the meta device.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pipeplan.analytic.api import model_parameter_counts, model_units
from pipeplan.analytic.configs import shipped_config_dir, shipped_configs
from pipeplan.analytic.families import load_model_config
from pipeplan.analytic.flops import model_flops_per_token
from pipeplan.analytic.shapes import unit_expert_param_count, unit_param_count

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_LAYER_KEYS = ("num_hidden_layers", "n_layer")


def _shallow(data: dict, layers: int = 2) -> dict:
    data = {k: v for k, v in data.items() if not k.startswith("_") or k == "_remove_final_layer_norm"}
    for key in _LAYER_KEYS:
        if key in data:
            data[key] = layers
    if "layer_types" in data:
        data["layer_types"] = data["layer_types"][:layers]
    if data.get("first_k_dense_replace"):
        data["first_k_dense_replace"] = 1      # block 0 dense, block 1 routed (DeepSeek-V3)
    return data


#: Shapes the shipped configs do not cover: OPT's projection (350m), tied Qwen2 (0.5B), a
#: GPT-NeoX with sequential residual, Llama with biases, a Gemma 2 with a 3-layer sliding pattern.
EXTRA = {
    "opt-350m-like": {"model_type": "opt", "hidden_size": 1024, "ffn_dim": 4096, "num_attention_heads": 16,
                      "num_hidden_layers": 2, "vocab_size": 50272, "word_embed_proj_dim": 512,
                      "do_layer_norm_before": False, "max_position_embeddings": 2048},
    "qwen2-0.5b-like": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
                        "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 2,
                        "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 32768},
    "neox-sequential": {"model_type": "gpt_neox", "hidden_size": 512, "intermediate_size": 2048,
                        "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 1000,
                        "use_parallel_residual": False, "rotary_pct": 0.25},
    "llama-biased": {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376,
                     "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
                     "vocab_size": 1000, "attention_bias": True, "mlp_bias": True, "head_dim": 96},
    # DeepSeek-style latent attention without a query low rank (DeepSeek-V2-Lite), two shared
    # experts, attention biases, a tied head; a Qwen3-MoE with a dense layer by decoder_sparse_step.
    "deepseek-no-q-lora": {"model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 512,
                           "moe_intermediate_size": 64, "n_routed_experts": 8, "n_shared_experts": 2,
                           "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_attention_heads": 4,
                           "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
                           "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24,
                           "num_hidden_layers": 3, "vocab_size": 1000, "attention_bias": True,
                           "tie_word_embeddings": True, "n_group": 2, "topk_group": 1},
    "qwen3-moe-sparse-step": {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
                              "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
                              "decoder_sparse_step": 2, "mlp_only_layers": [3], "num_attention_heads": 4,
                              "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 4,
                              "vocab_size": 1000, "tie_word_embeddings": True},
}


def _cases():
    for name in shipped_configs():
        data = json.loads(shipped_config_dir().joinpath(f"{name}.json").read_text())
        yield pytest.param(name, _shallow(data), id=name)
    for name, data in EXTRA.items():
        yield pytest.param(name, data, id=name)


def _hf_model(data: dict):
    config = transformers.CONFIG_MAPPING[data["model_type"]](**{k: v for k, v in data.items() if k != "model_type"})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _both(tmp_path, data):
    """pipeplan's reading of a config file and transformers' model of the same dict."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return load_model_config(path), _hf_model(data)


def _module_params(model, names) -> int:
    return sum(p.numel() for name in names for p in model.get_submodule(name).parameters())


def _main_units(cfg):
    """pipeplan's units that transformers builds (not the multi-token prediction depths)."""
    return [(name, kind, index) for name, kind, index in model_units(cfg) if kind != "mtp"]


def _unit_modules(cfg, name, kind):
    return {"embedding": cfg.names.embedding_modules, "norm": cfg.names.norm_modules}.get(kind, [name])


def _expert_params(model, names) -> int:
    """Parameters of the routed experts (transformers' fused ``mlp.experts`` tensors)."""
    return sum(p.numel() for n, p in model.named_parameters() if ".experts." in n
               and any(n.startswith(m + ".") for m in names))


@pytest.mark.parametrize("name,data", list(_cases()))
def test_param_counts_per_unit_equal_transformers(tmp_path, name, data):
    cfg, model = _both(tmp_path, data)
    for unit, kind, index in _main_units(cfg):
        modules = _unit_modules(cfg, unit, kind)
        assert unit_param_count(cfg, kind, 1, index) == _module_params(model, modules), unit
        assert unit_expert_param_count(cfg, kind, 1, index) == _expert_params(model, modules), unit
    # Nothing is left out: the units cover every parameter of the model.
    covered = set(cfg.names.embedding_modules) | set(cfg.names.norm_modules) | {cfg.names.head}
    covered |= {cfg.block_name(i) for i in range(cfg.num_layers)}
    for pname, _ in model.named_parameters(remove_duplicate=False):
        assert any(pname.startswith(m + ".") for m in covered), pname
    unique = sum(p.numel() for p in model.parameters())
    counts = model_parameter_counts(cfg)
    mtp = sum(unit_param_count(cfg, "mtp", 1, i) for _, kind, i in model_units(cfg) if kind == "mtp")
    assert counts.total - mtp == unique


def _hf_active(model, cfg) -> float:
    """Parameters a token passes through: every parameter, the routed experts' at k / E."""
    share = cfg.experts_per_token / cfg.num_experts if cfg.num_experts else 1.0
    return sum(p.numel() * (share if ".experts." in n else 1.0) for n, p in model.named_parameters())


#: The published mixtures of experts, with the parameters their makers give (billions; total,
#: active) and the tolerance on those round figures. GPT-OSS's model card counts 5.1 B active
#: without the token table (0.58 B), DeepSeek-V3's report 671 B / 37 B without its MTP module.
PUBLISHED = {
    "deepseek-v3": (671, 37, 0.02),
    "qwen3-30b-a3b": (30.5, 3.3, 0.02),
    "qwen3-235b-a22b": (235, 22, 0.02),
    "gpt-oss-120b": (116.8, 5.7, 0.01),
    "mixtral-8x7b": (46.7, 12.9, 0.01),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_full_moe_total_and_active_equal_transformers(tmp_path, name):
    """The full shipped config built by transformers on the meta device (no memory; DeepSeek-V3's
    61 layers in about 2 s): pipeplan's total and active counts equal its, exactly, less the
    multi-token prediction depths that transformers does not build."""
    data = json.loads(shipped_config_dir().joinpath(f"{name}.json").read_text())
    cfg, model = _both(tmp_path, {k: v for k, v in data.items() if not k.startswith("_")})
    counts = model_parameter_counts(cfg)
    depths = [i for _, kind, i in model_units(cfg) if kind == "mtp"]
    # A depth: a routed block, two input norms and an output norm, the 2h -> h projection
    # (DeepSeek-V3's checkpoint's model.layers.61 less its copies of the token table and the
    # head, which it shares with the main model).
    routed = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    block = _module_params(model, [cfg.block_name(routed)])
    depth = block + 3 * cfg.hidden_size + 2 * cfg.hidden_size ** 2
    assert all(unit_param_count(cfg, "mtp", 1, i) == depth for i in depths)
    idle = 1 - cfg.experts_per_token / cfg.num_experts
    depth_active = depth - _expert_params(model, [cfg.block_name(routed)]) * idle
    total, active = sum(p.numel() for p in model.parameters()), _hf_active(model, cfg)
    assert counts.total - len(depths) * depth == total
    assert counts.active - len(depths) * depth_active == active
    published_total, published_active, tol = PUBLISHED[name]
    assert total / 1e9 == pytest.approx(published_total, rel=tol)
    assert active / 1e9 == pytest.approx(published_active, rel=tol)


def test_active_counts_of_a_shallow_model_equal_transformers(tmp_path):
    """On a model transformers builds whole (every unit), pipeplan's active count is transformers'
    parameters with the routed experts at top-k of E."""
    for name in sorted(PUBLISHED):
        data = _shallow(json.loads(shipped_config_dir().joinpath(f"{name}.json").read_text()))
        data.pop("num_nextn_predict_layers", None)
        cfg, model = _both(tmp_path, data)
        assert model_parameter_counts(cfg).active == _hf_active(model, cfg), name


def _matmul_params(model, cfg) -> float:
    """Parameters a token multiplies by (6N's N): every Linear/Conv1D weight, the head even when
    tied, and for a mixture of experts the top-k share of the experts' weights."""
    from transformers.pytorch_utils import Conv1D

    total = 0.0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            total += module.weight.numel()
    if cfg.num_experts:
        for name, p in model.named_parameters():
            if ".experts." in name:
                total += p.numel() * cfg.experts_per_token / cfg.num_experts
    return total


@pytest.mark.parametrize("name,data", list(_cases()))
def test_flops_per_token_match_6n_plus_attention(tmp_path, name, data):
    cfg, model = _both(tmp_path, data)
    seq = min(cfg.max_positions, 4096)
    n = _matmul_params(model, cfg)
    attention = 0.0
    for i in range(cfg.num_layers):
        window = cfg.sliding_window if i in cfg.sliding_layers else None
        keys = sum(min(j + 1, window or seq) for j in range(seq)) / seq
        # Scores over the query/key head width, values over the value head width (equal but for
        # latent attention): 6 x 2 x a x (d_qk + d_v) / 2 x keys.
        attention += 6 * cfg.num_heads * (cfg.head_dim + cfg.value_head_dim) * keys
    expected = 6 * n + attention
    got = model_flops_per_token(cfg, seq)
    assert abs(got - expected) / expected < 0.02, (got, expected)


@st.composite
def _moe_configs(draw):
    """Small DeepSeek-V3, Qwen3-MoE and GPT-OSS configs of any shape the readers take."""
    family = draw(st.sampled_from(["deepseek_v3", "qwen3_moe", "gpt_oss"]))
    heads = draw(st.sampled_from([2, 4]))
    experts = draw(st.integers(1, 6))
    layers = draw(st.integers(1, 3))
    data = {"model_type": family, "hidden_size": 8 * heads * draw(st.integers(1, 3)),
            "intermediate_size": 8 * draw(st.integers(1, 8)), "num_attention_heads": heads,
            "num_hidden_layers": layers, "vocab_size": draw(st.integers(16, 64)),
            "num_experts_per_tok": draw(st.integers(1, experts)),
            "tie_word_embeddings": draw(st.booleans())}
    if family == "deepseek_v3":
        data.update(n_routed_experts=experts, moe_intermediate_size=8 * draw(st.integers(1, 4)),
                    n_shared_experts=draw(st.integers(0, 2)), first_k_dense_replace=draw(st.integers(0, layers)),
                    q_lora_rank=draw(st.sampled_from([None, 8, 16])), kv_lora_rank=8 * draw(st.integers(1, 3)),
                    qk_nope_head_dim=draw(st.sampled_from([4, 8])), qk_rope_head_dim=draw(st.sampled_from([2, 4])),
                    v_head_dim=draw(st.sampled_from([4, 8, 12])), num_key_value_heads=heads,
                    attention_bias=draw(st.booleans()), n_group=1, topk_group=1)
    elif family == "qwen3_moe":
        data.update(num_experts=experts, moe_intermediate_size=8 * draw(st.integers(1, 4)),
                    num_key_value_heads=draw(st.sampled_from([1, heads])), head_dim=draw(st.sampled_from([8, 16])),
                    decoder_sparse_step=draw(st.integers(1, 2)),
                    mlp_only_layers=draw(st.lists(st.integers(0, layers - 1), max_size=1)))
    else:
        data.update(num_local_experts=experts, num_key_value_heads=draw(st.sampled_from([1, heads])),
                    head_dim=draw(st.sampled_from([8, 16])), sliding_window=draw(st.integers(2, 8)))
    return data


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=_moe_configs())
def test_any_small_moe_config_counts_as_transformers_does(tmp_path, data):
    """Whatever the shape (latent attention with or without a query low rank, shared experts or
    none, dense layers anywhere, tied or not): total, active and each unit's expert count equal
    transformers' model on the meta device."""
    cfg, model = _both(tmp_path, data)
    counts = model_parameter_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.active == _hf_active(model, cfg)
    for unit, kind, index in _main_units(cfg):
        modules = _unit_modules(cfg, unit, kind)
        assert unit_expert_param_count(cfg, kind, 1, index) == _expert_params(model, modules), unit
