"""Parameter counts and FLOPs of the analytic model against transformers' own models (meta device).

Every supported family is built by transformers from the same config (the shipped one, with two
blocks so that it builds in well under a second: per-unit counts do not depend on depth) and
compared unit by unit, exactly.
"""

from __future__ import annotations

import json

import pytest

from pipeplan.analytic.configs import shipped_config_dir, shipped_configs
from pipeplan.analytic.families import load_model_config
from pipeplan.analytic.flops import model_flops_per_token
from pipeplan.analytic.shapes import unit_param_count

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


@pytest.mark.parametrize("name,data", list(_cases()))
def test_param_counts_per_unit_equal_transformers(tmp_path, name, data):
    cfg, model = _both(tmp_path, data)
    names = cfg.names
    assert unit_param_count(cfg, "embedding") == _module_params(model, names.embedding_modules)
    for i in range(cfg.num_layers):
        assert unit_param_count(cfg, "block") == _module_params(model, [cfg.block_name(i)]), cfg.block_name(i)
    assert unit_param_count(cfg, "norm") == _module_params(model, names.norm_modules)
    assert unit_param_count(cfg, "head") == _module_params(model, [names.head])
    # Nothing is left out: the units cover every parameter of the model.
    covered = set(names.embedding_modules) | set(names.norm_modules) | {names.head}
    covered |= {cfg.block_name(i) for i in range(cfg.num_layers)}
    for pname, _ in model.named_parameters(remove_duplicate=False):
        assert any(pname.startswith(m + ".") for m in covered), pname
    unique = sum(p.numel() for p in model.parameters())
    total = sum(unit_param_count(cfg, k) for k in ("embedding", "norm", "head"))
    total += cfg.num_layers * unit_param_count(cfg, "block")
    tied = unit_param_count(cfg, "head") if cfg.tied_embeddings else 0
    assert total - tied == unique


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
        attention += 12 * cfg.num_heads * cfg.head_dim * keys
    expected = 6 * n + attention
    got = model_flops_per_token(cfg, seq)
    assert abs(got - expected) / expected < 0.02, (got, expected)
