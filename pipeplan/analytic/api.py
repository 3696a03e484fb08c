"""``pipeplan profile --analytic``: a profile estimated from a model config and a GPU spec."""

from __future__ import annotations


from pathlib import Path
from typing import Optional, Sequence, Union

from pipeplan.analytic.collectives import unit_collectives
from pipeplan.analytic.configs import ModelConfig
from pipeplan.analytic.families import load_model_config
from pipeplan.analytic.efficiency import (DEFAULT_EFFICIENCY, EfficiencyModel, grouped_launch_host_ms, host_ms,
                                         parts_ms, pass_ms)
from pipeplan.analytic.flops import Shape, model_flops_per_token, unit_work
from pipeplan.facts.gpus import GpuSpec
from pipeplan.facts.loss import DEFAULT_LOSS, loss_working_bytes_by_form
from pipeplan.facts.precision import PRECISIONS, get_precision
from pipeplan.formats.gpu import resolve_gpu
from pipeplan.analytic.memory import (unit_activation_bytes, unit_loss_elements, unit_output_bytes,
                                      unit_routed_activation_bytes)
from pipeplan.analytic.op_sac import unit_op_sac
from pipeplan.analytic.recompute import unit_selective_modules
from pipeplan.analytic.shapes import (check_tensor_parallel, tied_table_count, unit_active_param_count,
                                      unit_expert_param_count, unit_param_count)
from pipeplan.errors import BadInputError
from pipeplan.formats.profile import Device, Experts, Layer, LayerCost, ParameterCounts, Profile, TiedWeight
from pipeplan.formats.io import write_json_atomic
from pipeplan.profile.api import parse_microbatch_sizes

__all__ = ["analytic_profile", "analytic_profile_to_file", "parse_degrees", "default_seq_len", "DTYPE_BYTES",
           "model_units", "model_ties", "model_parameter_counts", "unit_own_param_count"]

#: Bytes per element of each training dtype the analytic model takes.
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


def parse_degrees(text: Union[str, Sequence[int]], option: str = "--tensor-parallel") -> list[int]:
    """``'1,2,4,8'`` to ``[1, 2, 4, 8]``; degree 1 is always included (the planner reads it).

    Examples
    --------
    >>> parse_degrees("8,2")
    [1, 2, 8]
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    degrees = set()
    for item in items:
        try:
            value = int(str(item).strip())
        except ValueError:
            raise BadInputError(f"{option}: {item!r} is not an integer; write e.g. 1,2,4,8") from None
        if value <= 0:
            raise BadInputError(f"{option}: {value} must be positive")
        degrees.add(value)
    return sorted(degrees | {1})


def default_seq_len(cfg: ModelConfig) -> int:
    """The context the model was pre-trained at: ``rope_scaling.original_max_position_embeddings``
    where the config extends its context (Llama 3.1), else ``max_position_embeddings``."""
    scaling = cfg.raw.get("rope_scaling") or {}
    original = scaling.get("original_max_position_embeddings") if isinstance(scaling, dict) else None
    return int(original) if isinstance(original, int) and original > 0 else cfg.max_positions


def model_units(cfg: ModelConfig) -> list[tuple[str, str, int]]:
    """``(name, kind, index)`` of each unit in order: the embedding, the blocks, the final norm,
    the multi-token prediction depths (named as DeepSeek-V3's checkpoint names them, the blocks
    after the last: ``model.layers.61``), the head."""
    units = [(cfg.names.embedding, "embedding", 0)]
    units += [(cfg.block_name(i), "block", i) for i in range(cfg.num_layers)]
    if cfg.names.norm is not None:
        units.append((cfg.names.norm, "norm", 0))
    depths = range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers)
    units += [(cfg.block_name(i), "mtp", i) for i in depths]
    units.append((cfg.names.head, "head", 0))
    return units


def unit_own_param_count(cfg: ModelConfig, kind: str, index: int, t: int = 1) -> int:
    """A unit's parameters on one rank, a tied weight counted in its first user only: a tied head
    leaves out the token table it shares with the embedding (a stage holding the head without
    the embedding keeps a copy: the profile's ``tied_weights``)."""
    count = unit_param_count(cfg, kind, t, index)
    if kind == "head" and cfg.tied_embeddings:
        count -= tied_table_count(cfg, t)
    return count


def model_ties(cfg: ModelConfig, dtype_bytes: int) -> list[TiedWeight]:
    """The weights several units use, as a measured profile lists them: the token table (a tied
    head, the multi-token prediction depths' embedding) and an untied head's matrix (the depths'
    shared output head)."""
    units = model_units(cfg)
    depths = [name for name, kind, _ in units if kind == "mtp"]
    table = [cfg.names.embedding] + ([cfg.names.head] if cfg.tied_embeddings else []) + depths
    ties = []
    if len(table) > 1:
        ties.append(TiedWeight(name=f"{cfg.names.embedding}.weight", layers=table,
                               param_bytes=tied_table_count(cfg) * dtype_bytes))
    if depths and not cfg.tied_embeddings:
        ties.append(TiedWeight(name=f"{cfg.names.head}.weight", layers=[cfg.names.head] + depths,
                               param_bytes=unit_param_count(cfg, "head") * dtype_bytes))
    return ties


def _unit_key(cfg: ModelConfig, kind: str, index: int) -> tuple:
    """Units with one key have equal costs (blocks differ by window and by dense or routed MLP)."""
    if kind == "mtp":  # the last depth sends less on (memory.unit_output_bytes)
        last = index == cfg.num_layers + cfg.mtp_layers - 1
        return (kind, index in cfg.sliding_layers, cfg.is_moe_layer(index), last)
    if kind == "block":
        return (kind, index in cfg.sliding_layers, cfg.is_moe_layer(index))
    return (kind,)


def _round(value: float) -> float:
    return round(float(value), 6)


def _entry(cfg: ModelConfig, kind: str, index: int, shape: Shape, gpu: GpuSpec, dtype: str,
           efficiency: EfficiencyModel, precision: str = "bf16") -> LayerCost:
    peak, bw = gpu.flops_for(dtype), gpu.hbm_bytes_per_s
    # --precision's peak for the quantized GEMMs (docs/analytic.md, "Precision").
    quantized = gpu.peak_flops[get_precision(precision).peak] if shape.quantized_bytes else None
    work = unit_work(cfg, kind, index, shape)
    sms = gpu.sm_count
    # Each pass is the GPU's time or the host's launches, whichever is longer (docs/analytic.md,
    # "Host overhead"); the sub-parts below (experts, casts, recomputation) are GPU time.
    forward, forward_wait = pass_ms(work.forward, peak, bw, efficiency, quantized, sms)
    b_input, input_wait = pass_ms(work.backward_input, peak, bw, efficiency, quantized, sms)
    b_weight, weight_wait = pass_ms(work.backward_weight, peak, bw, efficiency, quantized, sms)

    def gpu_ms(parts, quantized_peak=None):
        return parts_ms(parts, peak, bw, efficiency, quantized_peak, sms)

    t = shape.tensor_parallel
    fields = dict(
        microbatch_size=shape.microbatch_size,
        forward_ms=_round(forward),
        backward_ms=_round(b_input + b_weight),
        backward_input_ms=_round(b_input),
        backward_weight_ms=_round(b_weight),
        activation_bytes=unit_activation_bytes(cfg, kind, index, shape),
        output_bytes=unit_output_bytes(cfg, kind, shape, index),
        selective_activation_bytes=unit_activation_bytes(cfg, kind, index, shape, selective=True),
        selective_recompute_ms=_round(gpu_ms(work.attention_core)),
    )
    if forward_wait > 0 or input_wait + weight_wait > 0:
        fields.update(host_wait_forward_ms=_round(forward_wait), host_wait_backward_ms=_round(input_wait + weight_wait))
    expert_fields = _expert_fields(cfg, kind, index, shape, work, gpu_ms, quantized)
    if expert_fields:
        # The host's side of each pass and what each local expert beyond the first adds to it (TE's
        # grouped GEMM launches one GEMM per local expert; the cluster view knows E: docs/analytic.md).
        backward = work.backward_input + work.backward_weight
        expert_fields.update(host_forward_ms=_round(host_ms(work.forward, efficiency)),
                             host_backward_ms=_round(host_ms(backward, efficiency)),
                             expert_host_forward_ms=_round(grouped_launch_host_ms(work.forward)),
                             expert_host_backward_ms=_round(grouped_launch_host_ms(backward)))
    fields.update(expert_fields)
    if shape.quantized_bytes is not None:
        fields.update(_cast_fields(cfg, kind, index, work, gpu_ms))
    modules = unit_selective_modules(cfg, kind, index, shape, work.forward, gpu_ms)
    if modules is not None:
        fields["selective_modules"] = modules
    logits = unit_loss_elements(cfg, kind, shape)
    if logits:
        # The loss's working memory per implementation (pipeplan.facts.loss); the planner takes the
        # launcher's (pipeplan.plan.loss), the default form's without one.
        fields["loss_working_bytes"] = loss_working_bytes_by_form(logits, shape.dtype_bytes)
        fields["working_bytes"] = fields["loss_working_bytes"][DEFAULT_LOSS]
    op_sac = unit_op_sac(cfg, kind, index, shape, work.forward, lambda parts: parts_ms(parts, peak, bw, efficiency))
    if op_sac is not None:
        fields["selective_op_sac"] = op_sac
    if t > 1:
        traffic = unit_collectives(cfg, kind, shape)
        experts = unit_expert_param_count(cfg, kind, t, index)
        if experts:
            fields["expert_param_bytes"] = experts * shape.dtype_bytes
        fields.update(
            tensor_parallel=t,
            param_bytes=unit_own_param_count(cfg, kind, index, t) * shape.dtype_bytes,
            sequence_parallel=shape.sequence_parallel,
            tensor_parallel_collective=traffic.kind,
            tensor_parallel_forward_bytes=traffic.forward_bytes,
            tensor_parallel_backward_bytes=traffic.backward_bytes,
            tensor_parallel_forward_count=traffic.forward_count,
            tensor_parallel_backward_count=traffic.backward_count,
        )
    return LayerCost(**fields)


#: The routed experts' parts of an MoE block (pipeplan.analytic.flops._mlp) and the shared experts'.
_ROUTED_PARTS = frozenset({"gate_proj", "up_proj", "down_proj", "fc1", "fc2", "activation", "token_permute",
                           "token_unpermute"})
_SHARED_PARTS = frozenset({"shared_gate_proj", "shared_up_proj", "shared_down_proj", "shared_activation"})


def _part_owner(name: str) -> str:
    """The GEMM a ``--precision`` cast belongs to (``gate_proj_quantize`` -> ``gate_proj``)."""
    return name.removesuffix("_grad_quantize").removesuffix("_quantize")


def _cast_fields(cfg: ModelConfig, kind: str, index: int, work, gpu_ms) -> dict:
    """A quantized precision's casts of the unit (``*_quantize`` parts), less the routed and shared
    experts' (in their own parts): the named part ``quantize_ms`` of the iteration."""
    experts = _ROUTED_PARTS | _SHARED_PARTS if kind in ("block", "mtp") and cfg.is_moe_layer(index) else frozenset()

    def casts(parts):
        return gpu_ms([p for p in parts if p.name.endswith("_quantize") and _part_owner(p.name) not in experts])

    return dict(quantize_forward_ms=_round(casts(work.forward)),
                quantize_backward_ms=_round(casts(work.backward_input + work.backward_weight)))


def _expert_fields(cfg: ModelConfig, kind: str, index: int, shape: Shape, work, gpu_ms,
                   quantized: Optional[float] = None) -> dict:
    """An MoE unit's routed and shared experts' share of its passes, and one dispatch's bytes per
    rank (docs/cluster-model.md, expert parallelism); empty for a dense unit."""
    if kind not in ("block", "mtp") or not cfg.is_moe_layer(index):
        return {}

    def part_of(parts, names):
        return gpu_ms([p for p in parts if _part_owner(p.name) in names], quantized)

    backward = work.backward_input + work.backward_weight
    fields = dict(
        expert_forward_ms=_round(part_of(work.forward, _ROUTED_PARTS)),
        expert_backward_ms=_round(part_of(backward, _ROUTED_PARTS)),
        # Each rank sends each of its tokens (1/t of them under sequence parallelism) to its
        # top-k experts: k copies of the hidden state.
        expert_dispatch_bytes=int(shape.tokens // shape.sp_share * cfg.experts_per_token * cfg.hidden_size
                                  * shape.dtype_bytes),
        expert_activation_bytes=unit_routed_activation_bytes(cfg, kind, index, shape),
    )
    if cfg.shared_expert_intermediate_size:
        fields.update(shared_expert_forward_ms=_round(part_of(work.forward, _SHARED_PARTS)),
                      shared_expert_backward_ms=_round(part_of(backward, _SHARED_PARTS)))
    return fields


def analytic_profile(
    config: Union[str, Path, ModelConfig],
    gpu: GpuSpec,
    *,
    seq_len: Optional[int] = None,
    dtype: str = "bf16",
    precision: str = "bf16",
    microbatch_sizes: Sequence[int] = (1, 2, 4),
    tensor_parallel: Sequence[int] = (1,),
    sequence_parallel: bool = True,
    flash_attention: bool = True,
    efficiency: EfficiencyModel = DEFAULT_EFFICIENCY,
) -> Profile:
    """Estimate a profile of ``config`` on ``gpu`` at each micro-batch size and tensor-parallel degree.

    Parameters
    ----------
    config : str, Path or ModelConfig
        A HuggingFace ``config.json`` path, a shipped config's name, or a loaded config.
    gpu : GpuSpec
        From :func:`pipeplan.facts.gpus.get_gpu` or a ``--gpu-spec`` file.
    seq_len : int, optional
        Tokens per sample; default: the model's pre-training context (:func:`default_seq_len`).
    dtype : {'bf16', 'fp16', 'fp32'}
        Training dtype (parameters, activations): bytes per element and which peak FLOP/s applies.
    precision : {'bf16', 'fp8', 'mxfp8', 'nvfp4'}
        How the transformer blocks' GEMMs run (:mod:`pipeplan.facts.precision`): at the GPU's
        peak for it, with quantized operands and saved inputs; ``bf16``: in the dtype.
    microbatch_sizes, tensor_parallel : sequence of int
        Each pair gets one cost entry per unit; degree 1 is always included.
    sequence_parallel : bool
        Megatron's sequence parallelism at degrees above 1 (norms, dropouts, residuals and the
        activations they keep divided by t; collectives as reduce-scatter + all-gather).
    flash_attention : bool
        No ``s^2`` score tensors kept; attention backward recomputes the scores (2.5x forward).
    efficiency : EfficiencyModel
        Achieved fractions of the peaks (pipeplan.analytic.efficiency).

    Returns
    -------
    Profile
        ``source: analytic``, schema_version 2, units named as the HF model names its modules.

    Raises
    ------
    BadInputError
        A bad config field, an unknown dtype, a degree that does not divide the heads.

    Notes
    -----
    Identical blocks are computed once per (size, degree): the cost is
    O(sizes x degrees x distinct block kinds + layers x sizes x degrees) small steps.
    """
    cfg = config if isinstance(config, ModelConfig) else load_model_config(config)
    if dtype not in DTYPE_BYTES:
        hint = (f"; {dtype} is a --precision (the GEMMs' recipe: {', '.join(PRECISIONS)}), with --dtype bf16 "
                f"for the parameters and activations" if dtype in PRECISIONS else "")
        raise BadInputError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPE_BYTES)}{hint}")
    if precision not in PRECISIONS:
        raise BadInputError(f"--precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    recipe = get_precision(precision)
    if recipe.quantized and dtype not in ("bf16", "fp16"):
        raise BadInputError(f"--precision {precision}: quantized GEMMs keep 16-bit parameters and activations; "
                            f"give --dtype bf16 (not {dtype})")
    gpu.flops_for(dtype)
    if recipe.quantized and recipe.peak not in gpu.peak_flops:
        raise BadInputError(f"--precision: {gpu.name} has no peak for {recipe.peak}; it lists "
                            f"{', '.join(sorted(gpu.peak_flops))}")
    seq = default_seq_len(cfg) if seq_len is None else seq_len
    if seq <= 0:
        raise BadInputError(f"--seq-len: {seq} must be positive")
    if cfg.learned_positions and seq > cfg.max_positions:
        raise BadInputError(
            f"--seq-len: {seq} exceeds the {cfg.max_positions} positions of {cfg.name}'s learned position table"
        )
    degrees = sorted(set(tensor_parallel) | {1})
    for t in degrees:
        check_tensor_parallel(cfg, t)
    sizes = sorted(set(microbatch_sizes))
    if not sizes or sizes[0] <= 0:
        raise BadInputError("--microbatch-sizes: give positive sizes, e.g. 1,2,4")
    e = DTYPE_BYTES[dtype]
    shapes = [Shape(seq, b, t, sequence_parallel and t > 1, flash_attention, e, recipe.operand_bytes)
              for b in sizes for t in degrees]
    cache: dict = {}
    layers = []
    for name, kind, index in model_units(cfg):
        key = _unit_key(cfg, kind, index)
        if key not in cache:
            cache[key] = [_entry(cfg, kind, index, shape, gpu, dtype, efficiency, precision) for shape in shapes]
        layers.append(_layer(cfg, name, kind, index, cache[key], e))
    measurement = {
        "method": "analytic (pipeplan.analytic; docs/analytic.md)",
        "config": cfg.raw,
        "config_source": cfg.origin or None,
        "config_shape": cfg.summary(),
        "gpu": gpu.model_dump(),
        "efficiency": efficiency.model_dump(),
        "dtype": dtype,
        "precision": ({"name": precision, "source": recipe.source, "method": "pipeplan.facts.precision; "
                       "docs/analytic.md, 'Precision'"} if recipe.quantized else None),
        "flash_attention": flash_attention,
        "sequence_parallel": sequence_parallel,
        "tensor_parallel_degrees": degrees,
        "parameters": sum(unit_own_param_count(cfg, kind, index) for _, kind, index in model_units(cfg)),
        "model_flops_per_token": float(f"{model_flops_per_token(cfg, seq, flash_attention):.6e}"),
        "activation_model": "Korthikanti et al. 2022, generalised per tensor (pipeplan.analytic.memory)",
        "tied_embeddings": ("the head shares the token table with the embedding: counted once, in the "
                            "embedding (tied_weights; a stage holding the head alone keeps a copy)"
                            if cfg.tied_embeddings else None),
        "multi_token_prediction": ({"depths": cfg.mtp_layers, "method": (
            "DeepSeek-V3 report section 2.2: each depth is a unit (2 norms, a 2h -> h projection, "
            "one routed block, an output norm) that shares the token table and the head (tied_weights); "
            "its FLOPs are not in model_flops_per_token (transformers' model has no such layer)")}
            if cfg.mtp_layers else None),
    }
    return Profile(
        schema_version=2, model=cfg.name, source="analytic",
        device=Device(name=f"{gpu.description or gpu.name} (analytic)", memory_bytes=gpu.memory_bytes),
        dtype=dtype, precision=precision if recipe.quantized else None, sequence_length=seq, layers=layers,
        measurement={k: v for k, v in measurement.items() if v is not None},
        tied_weights=model_ties(cfg, e) or None,
        parameters=model_parameter_counts(cfg),
        experts=_experts(cfg),
    )


def _layer(cfg: ModelConfig, name: str, kind: str, index: int, costs: list, dtype_bytes: int) -> Layer:
    modules = {"embedding": cfg.names.embedding_modules, "norm": cfg.names.norm_modules}.get(kind, ())
    description = f"covers {' + '.join(modules)}" if len(modules) > 1 else None
    if kind == "mtp":
        description = (f"multi-token prediction depth {index - cfg.num_layers + 1} (DeepSeek-V3 MTP module; "
                       f"shares the token table and the head)")
    experts = unit_expert_param_count(cfg, kind, 1, index)
    return Layer(
        name=name, param_bytes=unit_own_param_count(cfg, kind, index) * dtype_bytes, costs=costs,
        kind="other" if kind == "mtp" else kind, description=description,
        expert_param_bytes=experts * dtype_bytes if experts else None,
    )


def model_parameter_counts(cfg: ModelConfig) -> ParameterCounts:
    """Total and active parameters of the model's units, each tied weight once.

    Examples
    --------
    >>> counts = model_parameter_counts(load_model_config("mixtral-8x7b"))
    >>> round(counts.total / 1e9, 2), round(counts.active / 1e9, 2)
    (46.7, 12.88)
    """
    units = model_units(cfg)
    total = sum(unit_own_param_count(cfg, kind, index) for _, kind, index in units)
    tied = cfg.tied_embeddings and tied_table_count(cfg)
    active = sum(unit_active_param_count(cfg, kind, index) for _, kind, index in units) - tied
    return ParameterCounts(total=total, active=active)


def _experts(cfg: ModelConfig) -> Optional[Experts]:
    if not cfg.num_experts:
        return None
    return Experts(num_experts=cfg.num_experts, experts_per_token=cfg.experts_per_token,
                   expert_intermediate_size=cfg.expert_width,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size or None)


def analytic_profile_to_file(config: Union[str, Path], output: Union[str, Path], *, gpu: Optional[str] = None,
                             gpu_spec: Optional[Union[str, Path]] = None, microbatch_sizes="1,2,4",
                             tensor_parallel="1", **kwargs) -> Profile:
    """``pipeplan profile CONFIG --analytic``: build and write atomically (options as the CLI's)."""
    spec = resolve_gpu(gpu, gpu_spec)
    profile = analytic_profile(config, spec, microbatch_sizes=parse_microbatch_sizes(microbatch_sizes),
                               tensor_parallel=parse_degrees(tensor_parallel), **kwargs)
    write_json_atomic(output, profile)
    return profile


def summary_rows(profile: Profile) -> list[dict]:
    """Per degree and size: the whole model's time and memory (for the CLI's table)."""
    rows = []
    for t in profile.tensor_parallel_degrees:
        for b in profile.microbatch_sizes:
            costs = [layer.cost_at(b, t) for layer in profile.layers]
            rows.append({
                "tensor_parallel": t, "microbatch_size": b,
                "forward_ms": sum(c.forward_ms for c in costs),
                "backward_ms": sum(c.backward_ms for c in costs),
                "param_bytes": sum(layer.param_bytes_at(t) for layer in profile.layers),
                "activation_bytes": sum(c.activation_bytes for c in costs),
                "selective_activation_bytes": sum(c.selective_activation_bytes or 0 for c in costs),
                "tp_bytes": sum((c.tensor_parallel_forward_bytes or 0) + (c.tensor_parallel_backward_bytes or 0)
                                for c in costs),
            })
    return rows


__all__.append("summary_rows")

