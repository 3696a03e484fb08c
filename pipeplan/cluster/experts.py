"""Expert parallelism in the cluster search: the degrees a request allows, a trial's expert group,
its parameters split into dense and routed-expert ones, and their sync, step and memory.

Megatron-core's rules (``megatron.core.parallel_state.initialize_model_parallel``): the expert
layers' ranks are ``ETP x E x EDP x PP = world``, with ``E`` ranks of each pipeline rank's
``t x d`` forming an expert-parallel group (expert-tensor innermost, then expert, then
expert-data); each holds ``num_experts / E`` whole experts, so ``E`` divides the number of
experts; the groups are carved out of the data-parallel ranks, so ``E`` divides ``d``; and
``ETP`` divides ``t``. The expert-data-parallel degree is ``EDP = t x d / (E x ETP)``.

A dense profile (no ``experts``) has ``E = ETP = 1`` and none of this changes its plans.
docs/cluster-model.md, expert parallelism.
"""

from __future__ import annotations

import math

from pipeplan.cluster.dataparallel import moe_data_parallel_sync
from pipeplan.cluster.placement import cluster_layout
from pipeplan.cluster.profile_view import ExpertGroup
from pipeplan.cluster.space import divisors
from pipeplan.errors import BadInputError
from pipeplan.facts.training_state import optimizer_step_ms, state_bytes_per_param_byte, state_memory

__all__ = ["check_expert_request", "expert_choices", "expert_data_degree", "expert_group", "view_expert_bytes",
           "moe_rank_tails", "moe_tails_lower_bound", "moe_static_bytes", "moe_stage_memory", "expert_note",
           "no_expert_layout_message"]


def check_expert_request(profile, settings) -> None:
    """Refuse expert options a profile cannot take (exit 2, naming the option and the rule)."""
    experts = getattr(profile, "experts", None)
    e, etp, f = settings.expert_parallel, settings.expert_tensor_parallel, settings.expert_imbalance
    if experts is None:
        given = [name for name, value, neutral in (("--expert-parallel", e, 1), ("--expert-tensor-parallel", etp, 1),
                                                   ("--expert-imbalance", f, 1.0))
                 if value is not None and value != neutral]
        if given:
            raise BadInputError(f"{given[0]}: the profile has no experts (a dense model); expert parallelism needs "
                                f"a mixture-of-experts profile (its experts field)")
        return
    if e is not None and experts.num_experts % e:
        raise BadInputError(f"--expert-parallel: {e} does not divide the model's {experts.num_experts} experts "
                            f"(each expert-parallel rank holds num_experts / E whole experts)")


def expert_choices(profile, settings, data: int, tensor: int) -> list[int]:
    """The expert-parallel degrees a (d, t) layout allows: the fixed one where it divides ``d``,
    else every divisor of both ``d`` and the number of experts; ``[1]`` for a dense profile, and
    ``[]`` where the fixed ``ETP`` does not divide ``t``."""
    experts = getattr(profile, "experts", None)
    if experts is None:
        return [1]
    etp = settings.expert_tensor_parallel or 1
    if tensor % etp:
        return []
    if settings.expert_parallel is not None:
        return [settings.expert_parallel] if data % settings.expert_parallel == 0 else []
    return divisors(math.gcd(data, experts.num_experts))


def expert_data_degree(data: int, tensor: int, expert: int, expert_tensor: int) -> int:
    """``EDP = t x d / (E x ETP)``.

    Examples
    --------
    >>> expert_data_degree(data=8, tensor=4, expert=8, expert_tensor=1)
    4
    """
    return max(1, tensor * data // (expert * expert_tensor))


def expert_group(settings, cluster, data: int, tensor: int, pipeline: int, expert: int) -> ExpertGroup:
    """The expert group of a layout: its degrees, the imbalance, its ranks on one node."""
    etp = settings.expert_tensor_parallel or 1
    layout = cluster_layout(cluster, data, tensor, pipeline)
    group = layout.expert_group(expert, etp)
    # Ranks of the group that share the first one's NVLink domain (its node, unless the domain spans nodes).
    on_first_node = sum(1 for gpu in group if layout.domain(gpu) == layout.domain(group[0]))
    return ExpertGroup(expert=expert, expert_tensor=etp, imbalance=float(settings.expert_imbalance or 1.0),
                       ranks_per_node=on_first_node)


def view_expert_bytes(view, layer_names) -> float:
    """The routed experts' parameter bytes one GPU holds of these units (the view's)."""
    return view.stage_expert_bytes(layer_names)


def moe_static_bytes(optimizer: str, dtype_bytes: int, zero_stage: int, data: int, expert_data: int,
                     param_bytes: float, expert_bytes: float) -> float:
    """Training state of ``param_bytes`` of which ``expert_bytes`` are routed experts: the dense
    part sharded over ``d``, the experts' over ``EDP`` (the cost model's state term)."""
    dense = state_bytes_per_param_byte(optimizer, dtype_bytes, zero_stage, data)
    expert = state_bytes_per_param_byte(optimizer, dtype_bytes, zero_stage, expert_data)
    return dense * (param_bytes - expert_bytes) + expert * expert_bytes


def moe_rank_tails(trial, rank_params, rank_expert_params, m: int, cluster, state, hbm, overlap: float,
                   fp16: bool, step_efficiency: float):
    """Each pipeline rank's exposed sync (dense over d, experts over EDP) and optimizer step
    (dense shard over d, experts' over EDP under ZeRO >= 1), from its parameters."""
    layout = cluster_layout(cluster, trial.data, trial.tensor, trial.pipeline)
    etp, edp = trial.expert_tensor, trial.expert_data
    span = layout.data_span()
    expert_span = layout.loose_span(layout.expert_data_group(trial.expert, etp))
    sync, step = [], []
    for total, expert in zip(rank_params, rank_expert_params):
        dense = total - expert
        sync.append(moe_data_parallel_sync(dense, expert, state, trial.zero_stage, span, expert_span, cluster, m,
                                           overlap).exposed_ms)
        shard = dense / trial.data + expert / edp if trial.zero_stage >= 1 else total
        step.append(optimizer_step_ms(shard, state, hbm, step_efficiency, fp16) if hbm else 0.0)
    return sync, step


def moe_stage_memory(param_bytes: float, expert_bytes: float, dtype_bytes: int, state, zero_stage: int,
                     data: int, expert_data: int):
    """A stage's dense state by part, and its routed experts' whole state (bytes)."""
    dense = state_memory((param_bytes - expert_bytes) / dtype_bytes, state, zero_stage, data)
    expert = state_memory(expert_bytes / dtype_bytes, state, zero_stage, expert_data)
    return dense, expert.total_bytes


def moe_tails_lower_bound(trial, rank_params, m: int, cluster, state, hbm, overlap: float, fp16: bool,
                          step_efficiency: float):
    """A lower bound on each rank's sync and step from its total parameters alone (the pipeline
    search's incumbent knows no more): all of them as dense or all as experts, whichever is
    cheaper. Each group's time is a latency plus bytes at a rate, so the split's time, both
    latencies and each share at its own rate, is at least the cheaper of the two."""
    as_dense = moe_rank_tails(trial, rank_params, [0.0] * len(rank_params), m, cluster, state, hbm, overlap, fp16,
                              step_efficiency)
    as_experts = moe_rank_tails(trial, rank_params, rank_params, m, cluster, state, hbm, overlap, fp16,
                                step_efficiency)
    return ([min(a, b) for a, b in zip(as_dense[0], as_experts[0])],
            [min(a, b) for a, b in zip(as_dense[1], as_experts[1])])


def expert_note(profile, group: ExpertGroup, expert_data: int, fast_link: str = "the intra-node link") -> str:
    """The plan's note on its expert parallelism (``fast_link``: what the plan calls the link inside
    an NVLink domain)."""
    n = profile.experts.num_experts
    link = fast_link if group.ranks_per_node >= group.expert else "the network"
    routing = f"imbalance {group.imbalance:g} (--expert-imbalance)" if group.imbalance != 1 else "balanced"
    return (f"expert parallelism E={group.expert} (expert-tensor {group.expert_tensor}, expert-data {expert_data}): "
            f"each GPU holds {n // group.expert} of the {n} experts of each MoE layer; dispatch and combine "
            f"all-to-alls over {link}; routing {routing}")


def no_expert_layout_message(profile, settings) -> str:
    etp = settings.expert_tensor_parallel or 1
    return (f"--expert-parallel: no layout has an expert-parallel degree that divides its data-parallel degree "
            f"and the model's {profile.experts.num_experts} experts"
            + (f" with --expert-tensor-parallel {etp} dividing t" if etp > 1 else "")
            + (f" (E = {settings.expert_parallel} must divide d)" if settings.expert_parallel else ""))
