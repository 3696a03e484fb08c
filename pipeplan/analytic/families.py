"""Per-family readers: a HuggingFace config dict to a :class:`ModelConfig`.

Each reader takes the fields its transformers class reads, with the same defaults, and the module
names its transformers class gives its units (checked against transformers' models in
tests/test_analytic_params.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from pipeplan.analytic.configs import ModelConfig, UnitNames, read_config_json
from pipeplan.errors import BadInputError

__all__ = ["FAMILIES", "parse_family", "load_model_config"]

_MISSING = object()


class _Reader:
    """Reads fields of one config, naming the file and field in every error."""

    def __init__(self, data: dict[str, Any], origin: str):
        self.data, self.origin = data, origin

    def int(self, key: str, default: Any = _MISSING, *aliases: str) -> int:
        for k in (key, *aliases):
            if self.data.get(k) is not None:
                value = self.data[k]
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise BadInputError(f"{self.origin}: {k}: {value!r} must be a positive integer")
                return value
        if default is _MISSING:
            raise BadInputError(f"{self.origin}: {key}: missing field (needed to size the model)")
        return default

    def count(self, key: str, default: int = 0) -> int:
        """A non-negative integer (a number of layers or experts that may be 0)."""
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadInputError(f"{self.origin}: {key}: {value!r} must be a non-negative integer")
        return value

    def experts(self, family: str, count_key: str, topk_key: str, width_key: str | None) -> tuple[int, int, int]:
        """A mixture of experts' count, top-k and expert width, each required.

        transformers' config classes default them to one published model's shapes (DeepSeek-V3's
        256 experts, Qwen3-MoE's 128): a config that leaves one out would be sized as another
        model, so a missing one is refused, naming the rule.
        """
        keys = [k for k in (count_key, topk_key, width_key) if k]
        rule = (f"a {family} (mixture-of-experts) config must give {', '.join(keys[:-1])} and {keys[-1]}, "
                f"or the experts cannot be sized")
        for key in keys:
            if self.data.get(key) is None:
                raise BadInputError(f"{self.origin}: {key}: missing field; {rule}")
        count, topk = self.int(count_key), self.int(topk_key)
        if topk > count:
            raise BadInputError(
                f"{self.origin}: {topk_key}: {topk} must be between 1 and {count_key} {count} "
                f"(each token goes to top-k of the experts)"
            )
        return count, topk, self.int(width_key) if width_key else 0

    def float(self, key: str, default: float = 0.0) -> float:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
            raise BadInputError(f"{self.origin}: {key}: {value!r} must be a number in [0, 1)")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise BadInputError(f"{self.origin}: {key}: {value!r} must be true or false")
        return value

    def head_dim(self, hidden: int, heads: int, heads_key: str, hidden_key: str) -> int:
        explicit = self.data.get("head_dim")
        if explicit is not None:
            return self.int("head_dim")
        if hidden % heads:
            raise BadInputError(
                f"{self.origin}: {heads_key}: {heads} heads do not divide {hidden_key} {hidden}"
            )
        return hidden // heads


_HF_LAYOUT = UnitNames("model.embed_tokens", "model.layers", "model.norm", "lm_head",
                       ("model.embed_tokens",), ("model.norm",))


def _llama_like(r: _Reader, name: str, family: str, **overrides) -> ModelConfig:
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    kv = r.int("num_key_value_heads", heads)
    sliding = r.data.get("sliding_window") if r.bool("use_sliding_window", True) else None
    layers = r.int("num_hidden_layers")
    fields = dict(
        name=name, family=family, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv, head_dim=r.head_dim(hidden, heads, "num_attention_heads", "hidden_size"),
        intermediate_size=r.int("intermediate_size"), vocab_size=r.int("vocab_size"),
        max_positions=r.int("max_position_embeddings", 4096), names=_HF_LAYOUT,
        qkv_bias=r.bool("attention_bias", False), out_bias=r.bool("attention_bias", False),
        mlp_bias=r.bool("mlp_bias", False), tied_embeddings=r.bool("tie_word_embeddings", False),
        attention_dropout=r.float("attention_dropout"),
        sliding_window=r.int("sliding_window") if sliding else None,
        sliding_layers=tuple(range(layers)) if sliding else (),
        raw=r.data,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def _llama(r: _Reader, name: str) -> ModelConfig:
    return _llama_like(r, name, "llama")


def _mistral(r: _Reader, name: str) -> ModelConfig:
    return _llama_like(r, name, "mistral")


def _qwen2(r: _Reader, name: str) -> ModelConfig:
    # Qwen2Attention: q/k/v with bias, o_proj without; sliding window only if use_sliding_window,
    # and then only from max_window_layers on.
    layers = r.int("num_hidden_layers")
    use_sliding = r.bool("use_sliding_window", False) and r.data.get("sliding_window")
    first = r.int("max_window_layers", layers) if use_sliding else layers
    return _llama_like(
        r, name, "qwen2", qkv_bias=True, out_bias=False,
        sliding_window=r.int("sliding_window") if use_sliding else None,
        sliding_layers=tuple(range(first, layers)) if use_sliding else (),
    )


def _gemma2(r: _Reader, name: str) -> ModelConfig:
    layers = r.int("num_hidden_layers")
    window = r.int("sliding_window", 4096)
    # transformers' Gemma2Config: layer_types alternate, sliding on even-numbered layers.
    types = r.data.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    return _llama_like(
        r, name, "gemma2", head_dim=r.int("head_dim", 256), tied_embeddings=r.bool("tie_word_embeddings", True),
        sandwich_norms=True, logit_softcap=r.data.get("final_logit_softcapping") is not None,
        sliding_window=window, sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        max_positions=r.int("max_position_embeddings", 8192),
    )


def _mixtral(r: _Reader, name: str) -> ModelConfig:
    # MixtralSparseMoeBlock: a router without bias, num_local_experts SwiGLU experts of
    # intermediate_size each; attention as Mistral's.
    experts, topk, _ = r.experts("mixtral", "num_local_experts", "num_experts_per_tok", None)
    return _llama_like(r, name, "mixtral", num_experts=experts, experts_per_token=topk)


def _qwen3_moe(r: _Reader, name: str) -> ModelConfig:
    # Qwen3MoeDecoderLayer: a routed MLP where (i + 1) % decoder_sparse_step == 0 and i is not in
    # mlp_only_layers, else a dense MLP of intermediate_size; Qwen3MoeAttention: no biases (unless
    # attention_bias), RMSNorm over each query and key head (q_norm, k_norm).
    experts, topk, width = r.experts("qwen3_moe", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    layers = r.int("num_hidden_layers")
    step = r.int("decoder_sparse_step", 1)
    only = r.data.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise BadInputError(f"{r.origin}: mlp_only_layers: {only!r} must be a list of layer numbers")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    use_sliding = r.bool("use_sliding_window", False) and r.data.get("sliding_window")
    first = r.int("max_window_layers", layers) if use_sliding else layers
    return _llama_like(
        r, name, "qwen3_moe", num_experts=experts, experts_per_token=topk, expert_intermediate_size=width,
        dense_layers=dense, qk_norm=True,
        sliding_window=r.int("sliding_window") if use_sliding else None,
        sliding_layers=tuple(range(first, layers)) if use_sliding else (),
    )


def _deepseek_v3(r: _Reader, name: str) -> ModelConfig:
    # DeepseekV3Attention (multi-head latent attention, DeepSeek-V3 report section 2.1.1):
    # q = q_b(norm(q_a(x))) (or q_proj(x) without q_lora_rank), [c_kv, k_rope] = kv_a(x),
    # [k_nope, v] = kv_b(norm(c_kv)); DeepseekV3DecoderLayer: a dense MLP of intermediate_size
    # below first_k_dense_replace, else DeepseekV3MoE: a router (gate) without bias, routed
    # experts of moe_intermediate_size, one shared MLP of n_shared_experts x that width.
    experts, topk, width = r.experts("deepseek_v3", "n_routed_experts", "num_experts_per_tok",
                                     "moe_intermediate_size")
    layers = r.int("num_hidden_layers")
    heads = r.int("num_attention_heads")
    nope, rope = r.int("qk_nope_head_dim"), r.int("qk_rope_head_dim")
    shared = r.count("n_shared_experts", 0)
    dense = r.count("first_k_dense_replace", 0)
    return _llama_like(
        r, name, "deepseek_v3", num_kv_heads=heads, head_dim=nope + rope, v_head_dim=r.int("v_head_dim"),
        q_lora_rank=r.count("q_lora_rank", 0), kv_lora_rank=r.int("kv_lora_rank"), qk_rope_head_dim=rope,
        num_experts=experts, experts_per_token=topk, expert_intermediate_size=width,
        shared_experts=shared, shared_expert_intermediate_size=shared * width,
        dense_layers=tuple(range(min(dense, layers))), mtp_layers=r.count("num_nextn_predict_layers", 0),
        sliding_window=None, sliding_layers=(),
    )


def _gpt_oss(r: _Reader, name: str) -> ModelConfig:
    # GptOssAttention: Q/K/V/O with biases (attention_bias), one learned sink logit per head;
    # layer_types alternate sliding (window sliding_window) and full attention, sliding first;
    # GptOssMLP: a router with bias, num_local_experts experts of intermediate_size with biases.
    experts, topk, _ = r.experts("gpt_oss", "num_local_experts", "num_experts_per_tok", None)
    layers = r.int("num_hidden_layers")
    types = r.data.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    if not isinstance(types, list) or len(types) != layers:
        raise BadInputError(f"{r.origin}: layer_types: needs one entry per layer ({layers})")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    bias = r.bool("attention_bias", True)
    return _llama_like(
        r, name, "gpt_oss", num_experts=experts, experts_per_token=topk, router_bias=True, expert_bias=True,
        attention_sinks=True, qkv_bias=bias, out_bias=bias, head_dim=r.int("head_dim", 64),
        sliding_window=r.int("sliding_window", 128) if sliding else None, sliding_layers=sliding,
    )


def _gpt2(r: _Reader, name: str) -> ModelConfig:
    hidden = r.int("n_embd", _MISSING, "hidden_size")
    heads = r.int("n_head", _MISSING, "num_attention_heads")
    if hidden % heads:
        raise BadInputError(f"{r.origin}: n_head: {heads} heads do not divide n_embd {hidden}")
    positions = r.int("n_positions", 1024, "max_position_embeddings")
    names = UnitNames("transformer.wte", "transformer.h", "transformer.ln_f", "lm_head",
                      ("transformer.wte", "transformer.wpe"), ("transformer.ln_f",))
    return ModelConfig(
        name=name, family="gpt2", hidden_size=hidden, num_layers=r.int("n_layer", _MISSING, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        intermediate_size=r.int("n_inner", 4 * hidden), vocab_size=r.int("vocab_size"),
        max_positions=positions, names=names, norm="layernorm", gated_mlp=False,
        qkv_bias=True, out_bias=True, mlp_bias=True, tied_embeddings=r.bool("tie_word_embeddings", True),
        learned_positions=positions, attention_dropout=r.float("attn_pdrop", 0.1),
        hidden_dropout=r.float("resid_pdrop", 0.1), raw=r.data,
    )


def _gpt_neox(r: _Reader, name: str) -> ModelConfig:
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    if hidden % heads:
        raise BadInputError(f"{r.origin}: num_attention_heads: {heads} heads do not divide hidden_size {hidden}")
    names = UnitNames("gpt_neox.embed_in", "gpt_neox.layers", "gpt_neox.final_layer_norm", "lm_head",
                      ("gpt_neox.embed_in",), ("gpt_neox.final_layer_norm",))
    bias = r.bool("attention_bias", True)
    return ModelConfig(
        name=name, family="gpt_neox", hidden_size=hidden, num_layers=r.int("num_hidden_layers"),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        intermediate_size=r.int("intermediate_size"), vocab_size=r.int("vocab_size"),
        max_positions=r.int("max_position_embeddings", 2048), names=names, norm="layernorm",
        gated_mlp=False, qkv_bias=bias, out_bias=bias, mlp_bias=True,
        tied_embeddings=r.bool("tie_word_embeddings", False),
        parallel_residual=r.bool("use_parallel_residual", True),
        attention_dropout=r.float("attention_dropout"), hidden_dropout=r.float("hidden_dropout"), raw=r.data,
    )


def _opt(r: _Reader, name: str) -> ModelConfig:
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    if hidden % heads:
        raise BadInputError(f"{r.origin}: num_attention_heads: {heads} heads do not divide hidden_size {hidden}")
    proj = r.int("word_embed_proj_dim", hidden)
    final_norm = r.bool("do_layer_norm_before", True) and not r.bool("_remove_final_layer_norm", False)
    positions = r.int("max_position_embeddings", 2048)
    embedding_modules = ["model.decoder.embed_tokens", "model.decoder.embed_positions"]
    norm_modules = []
    if proj != hidden:
        embedding_modules.append("model.decoder.project_in")
    if final_norm:
        norm_modules.append("model.decoder.final_layer_norm")
    if proj != hidden:
        norm_modules.append("model.decoder.project_out")
    norm_name = norm_modules[0] if norm_modules else None
    names = UnitNames("model.decoder.embed_tokens", "model.decoder.layers", norm_name, "lm_head",
                      tuple(embedding_modules), tuple(norm_modules))
    bias = r.bool("enable_bias", True)
    if not r.bool("layer_norm_elementwise_affine", True):
        raise BadInputError(f"{r.origin}: layer_norm_elementwise_affine: false is not supported")
    return ModelConfig(
        name=name, family="opt", hidden_size=hidden, num_layers=r.int("num_hidden_layers"),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        intermediate_size=r.int("ffn_dim"), vocab_size=r.int("vocab_size"), max_positions=positions,
        names=names, norm="layernorm", gated_mlp=False, qkv_bias=bias, out_bias=bias, mlp_bias=bias,
        tied_embeddings=r.bool("tie_word_embeddings", True), learned_positions=positions + 2,
        embed_proj_dim=proj if proj != hidden else None, final_norm=final_norm,
        attention_dropout=r.float("attention_dropout"), hidden_dropout=r.float("dropout", 0.1), raw=r.data,
    )


#: model_type to its reader.
FAMILIES: dict[str, Callable[[_Reader, str], ModelConfig]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "gemma2": _gemma2,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "opt": _opt,
}


def parse_family(data: dict[str, Any], name: str, origin: str) -> ModelConfig:
    """Dispatch on ``model_type``; unknown families name the field and the supported ones."""
    family = data.get("model_type")
    if family is None:
        raise BadInputError(f"{origin}: model_type: missing field; supported: {', '.join(sorted(FAMILIES))}")
    if family not in FAMILIES:
        raise BadInputError(
            f"{origin}: model_type: {family!r} is not a supported family; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[family](_Reader(data, origin), name)


def load_model_config(config: str | Path) -> ModelConfig:
    """Read a HuggingFace ``config.json`` (or a shipped config by name) into a :class:`ModelConfig`.

    Parameters
    ----------
    config : str or Path
        A ``config.json`` path, a folder holding one, or a name from :func:`shipped_configs`.

    Raises
    ------
    BadInputError
        Unknown ``model_type``, a missing or malformed field, heads that do not divide the hidden
        size: the message names the file and the field.

    Examples
    --------
    >>> cfg = load_model_config("llama3-8b")
    >>> cfg.family, cfg.num_layers, cfg.num_kv_heads, cfg.names.embedding
    ('llama', 32, 8, 'model.embed_tokens')
    """
    data, name, origin = read_config_json(config)
    return replace(parse_family(data, name, origin), origin=origin)
