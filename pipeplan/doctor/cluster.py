"""doctor on a cluster (``--cluster``): the launcher's real layout, d x t x p with ZeRO, costed as a plan.

The config's own layout goes through the cluster planner's entry point for a fixed configuration,
:func:`pipeplan.cluster.search.plan_cluster` with every dimension given (what ``pipeplan plan
--gpus N --cluster C --data-parallel d --tensor-parallel t --zero z --layers-per-stage ...
--schedule s --virtual-stages v --microbatch-size b --recompute r`` does): the profile at degree
``t`` on the cluster's intra-node link, pipeline transfers on the link the ranks' placement gives,
the ZeRO-sharded state, the data-parallel sync and the optimizer step. So doctor's predicted
iteration is the plan's, to the digit.

The cap is lifted for that call so that a config over the cap is still costed; its memory per
rank (weights, gradients, optimizer state, activations, the reserve) is then held against the
real cap here, with the planner's own rule (planned bytes plus the reserve within the cap,
:func:`pipeplan.cluster.memory.job_memory`: the CUDA context, the workspaces, the layout's NCCL
buffers and the allocator's fragmentation share, each a part of the reserve).

The best plans come from the same search: at the config's own degrees (what ``--fix`` writes)
and, with ``search_layouts``, over every d x t x p of the same GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.errors import BadInputError, InfeasibleError
from pipeplan.formats.limits import MAX_BYTES
from pipeplan.formats.plan import Plan, PlanSettings, effective_cap_bytes
from pipeplan.cluster.memory import job_memory
from pipeplan.plan.assemble import stage_state_memory
from pipeplan.plan.offload import check_cpu_offload, with_offload_note
from pipeplan.cluster.search import plan_cluster
from pipeplan.launchers.registry import LAUNCHERS

__all__ = ["RankMemory", "ClusterCost", "LAUNCHER_ZERO_STAGES", "cost_on_cluster", "best_on_cluster",
           "rank_memory"]

#: The ZeRO stages a config of each launcher can be at (each record's ``config_zero_stages``, with
#: its source: Megatron-LM's distributed optimizer (1) or none; DeepSpeed's PipelineEngine asserts
#: stage < 2; torchtitan replicates (DDP, 0) or shards fully (FSDP, 3)).
LAUNCHER_ZERO_STAGES = {name: record.config_zero_stages for name, record in LAUNCHERS.items()}


@dataclass(frozen=True)
class RankMemory:
    """One GPU of a pipeline rank: its memory by part, in bytes."""

    rank: int
    weight_bytes: int
    """Weights held (ZeRO 3: the shard and the units gathered whole)."""
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """Activations at the rank's peak (the micro-batches in flight)."""
    reserve_bytes: int
    """CUDA context, cuBLAS workspaces, NCCL buffers and allocator fragmentation (``job`` by part)."""
    expert_bytes: int = 0
    """Mixture of experts: the routed experts' weights, gradients and optimizer state it holds
    (1 / E of them); the other parts are then the dense layers'."""
    quantized_weight_bytes: int = 0
    """A quantized precision's weight copies (pipeplan.facts.training_state)."""
    job: object = None
    """The reserve by part (:class:`pipeplan.cluster.memory.JobMemory`)."""
    working_bytes: int = 0
    """Of ``activation_bytes``, the loss's working memory its stages add (pipeplan.facts.loss)."""

    @property
    def planned_bytes(self) -> int:
        return (self.weight_bytes + self.gradient_bytes + self.optimizer_bytes + self.expert_bytes
                + self.quantized_weight_bytes + self.activation_bytes)

    @property
    def total_bytes(self) -> int:
        return self.planned_bytes + self.reserve_bytes


@dataclass(frozen=True)
class ClusterCost:
    """A launcher layout costed on a cluster."""

    plan: Plan
    """The cluster plan of the layout (its settings carry the real cap)."""
    memory: tuple[RankMemory, ...]
    cap_bytes: int

    @property
    def over_cap(self) -> list[RankMemory]:
        return [r for r in self.memory if r.total_bytes > self.cap_bytes]


def rank_memory(plan: Plan, profile, cluster) -> tuple[RankMemory, ...]:
    """Memory per GPU of each pipeline rank of a cluster plan, by part.

    The activations are the rank's simulated peak less its static state; under ZeRO 3 the units
    gathered whole count once per rank (they are prefetched one after the other).
    """
    out = []
    for r in sorted(plan.ranks, key=lambda r: r.rank):
        stages = [s for s in plan.stages if s.rank == r.rank]
        weights = gradients = optimizer = static = gathered = experts = quantized = 0
        for s in stages:
            if s.expert_state_bytes is not None:
                # A mixture-of-experts plan's stage: its dense parts and its experts, as the search split them.
                weights, gradients = weights + s.weight_bytes, gradients + s.gradient_bytes
                optimizer, experts = optimizer + s.optimizer_bytes, experts + s.expert_state_bytes
                quantized += s.quantized_weight_bytes or 0
                continue
            own = stage_state_memory(plan, s, profile.dtype_bytes)
            quantized += own.quantized_weight_bytes
            gathered = max(gathered, (s.weight_bytes or own.weight_bytes) - own.weight_bytes)
            weights += own.weight_bytes
            gradients += s.gradient_bytes if s.gradient_bytes is not None else own.gradient_bytes
            optimizer += s.optimizer_bytes if s.optimizer_bytes is not None else own.optimizer_bytes
        static = weights + gradients + optimizer + experts + quantized
        activations = max(0, r.peak_memory_bytes - static)
        planned = static + gathered + activations
        job = job_memory(planned, cluster, plan.settings.launcher, _layout(plan))
        out.append(RankMemory(rank=r.rank, weight_bytes=weights + gathered, gradient_bytes=gradients,
                              optimizer_bytes=optimizer, activation_bytes=activations, expert_bytes=experts,
                              quantized_weight_bytes=quantized, reserve_bytes=job.total_bytes, job=job,
                              working_bytes=sum(s.working_bytes or 0 for s in stages)))
    return tuple(out)


def _layout(plan) -> tuple[int, int, int, int, int, int]:
    """(d, t, p, C, E, EDP) of a cluster plan, for its NCCL communicators."""
    par = plan.parallelism
    return (par.data, par.tensor, par.pipeline, par.context or 1, par.expert or 1, par.expert_data)


def _plan_with_offload(profile, given: PlanSettings, profile_sha256: str) -> Plan:
    """The cluster plan, with the config's CPU activation offload costed (pipeplan.plan.offload)."""
    if given.cpu_offload_layers is None:
        return plan_cluster(profile, given, profile_sha256=profile_sha256)
    try:
        given = check_cpu_offload(given, profile)
    except BadInputError as exc:  # the planner's rules are megatron-core's: the script would not run
        raise BadInputError(f"--cpu-offloading: megatron-core refuses this configuration "
                            f"({str(exc).split(': ', 1)[-1]})") from None
    return with_offload_note(plan_cluster(profile, given, profile_sha256=profile_sha256), profile, given)


def cost_on_cluster(profile, settings: PlanSettings, layers_per_stage: list[int], *, cluster, data: int,
                    tensor: int, zero_stage: int, schedule: str, virtual_stages: int, microbatch_size: int,
                    num_microbatches: int, recompute: str, profile_sha256: str, expert: int = 1,
                    context: int = 1) -> ClusterCost:
    """A given layout on ``cluster``: the plan ``pipeplan plan --layers-per-stage`` makes of it.

    Parameters
    ----------
    profile : Profile
        With cost entries at degree ``tensor``.
    settings : PlanSettings
        Optimizer, memory cap (default the cluster's), launcher, data-parallel overlap.
    layers_per_stage : list of int
        Profile units per stage, pipeline order.
    cluster : ClusterSpec
    data, tensor, zero_stage : int
        ``d``, ``t`` and the ZeRO stage the launcher runs.
    schedule, virtual_stages, microbatch_size, num_microbatches, recompute
        As the launcher runs them (``num_microbatches`` per data-parallel replica).
    expert : int
        The launcher's expert-parallel size (a mixture-of-experts profile; ignored otherwise).
    context : int
        The launcher's context-parallel size ``C`` (the world is ``d x t x p x C``).

    Returns
    -------
    ClusterCost
        Costed even when a rank is over the cap (:attr:`ClusterCost.over_cap` says which).

    Raises
    ------
    BadInputError
        The profile has no entries at ``tensor``, ``tensor`` is above the GPUs per node, or the
        schedule refuses the numbers.
    """
    cap = effective_cap_bytes(settings.memory_cap_bytes, cluster)
    pipeline = len(layers_per_stage) // virtual_stages
    given = settings.model_copy(update={
        "num_gpus": data * tensor * pipeline * context, "cluster": cluster, "data_parallel": data,
        "context_parallel": context if context > 1 else None,
        "tensor_parallel": tensor, "stages": pipeline, "zero_stage": zero_stage,
        "layers_per_stage": list(layers_per_stage), "schedule": schedule, "virtual_stages": virtual_stages,
        "microbatch_size": microbatch_size, "global_batch": data * microbatch_size * num_microbatches,
        "recompute": recompute, "bandwidth_bytes_per_s": None, "search_stages": None,
        "expert_parallel": expert if getattr(profile, "experts", None) is not None else None,
        # Lifted so that a layout over the cap is costed too; held against `cap` below.
        "memory_cap_bytes": MAX_BYTES,
    })
    try:
        plan = _plan_with_offload(profile, given, profile_sha256)
    except InfeasibleError as exc:  # only the fixed reserve over a lifted cap: not a real case
        raise BadInputError(f"--cluster: the layout cannot be costed: {exc}") from None
    plan = plan.model_copy(update={"settings": plan.settings.model_copy(update={"memory_cap_bytes": cap})})
    return ClusterCost(plan=plan, memory=rank_memory(plan, profile, cluster), cap_bytes=cap)


def best_on_cluster(profile, settings: PlanSettings, *, launcher: str, cluster, num_gpus: int, global_batch: int,
                    degrees: tuple[int, int, int] | None, zero_stages: tuple[int, ...],
                    recompute_options: tuple[str, ...], profile_sha256: str,
                    expert: int | None = None, context: int = 1) -> tuple[Plan | None, list[str]]:
    """The fastest cluster plan ``launcher`` can run on ``num_gpus`` GPUs of ``cluster``.

    Parameters
    ----------
    degrees : (d, t, p) or None
        Keep the config's degrees (what ``--fix`` can write), or search every layout.
    zero_stages : tuple of int
        The ZeRO stages to try (the launcher's).
    recompute_options : tuple of str
        Each is one search with that recomputation on every stage: the launchers apply
        recomputation to all stages alike, so per-stage choices are not offered.

    Returns
    -------
    plan : Plan or None
        None when nothing fits.
    notes : list of str
        Why searches found nothing (the first line of the planner's message).

    Notes
    -----
    One cluster search per (ZeRO stage, recomputation); each is exact for its settings, so the
    best of them is the best plan the launcher can express.
    """
    cap = effective_cap_bytes(settings.memory_cap_bytes, cluster)
    d, t, p = degrees if degrees is not None else (None, None, None)
    best, notes = None, []
    for zero in zero_stages:
        for recompute in recompute_options:
            trial = settings.model_copy(update={
                "num_gpus": num_gpus, "cluster": cluster, "global_batch": global_batch, "launcher": launcher,
                "zero_stage": zero, "recompute": recompute, "data_parallel": d, "tensor_parallel": t, "stages": p,
                "memory_cap_bytes": cap, "layers_per_stage": None, "schedule": "auto", "virtual_stages": None,
                "microbatch_size": None, "bandwidth_bytes_per_s": None, "search_stages": None,
                "cpu_offload_layers": None,  # the search's plans are costed without it
                "expert_parallel": expert if degrees is not None and getattr(profile, "experts", None) else None,
                "context_parallel": context if context > 1 else None})
            try:
                plan = plan_cluster(profile, trial, profile_sha256=profile_sha256)
            except (InfeasibleError, BadInputError) as exc:
                notes.append(f"ZeRO {zero}, recompute {recompute}: {str(exc).splitlines()[0]}")
                continue
            if best is None or plan.predicted.iteration_ms < best.predicted.iteration_ms * (1 - 1e-9):
                best = plan
    return best, notes
