"""The search space of a cluster plan: every (d, t, p) and micro-batch size that can run.

For ``N`` GPUs in nodes of ``G``, a global batch of ``B`` samples and micro-batch sizes ``b``:

- ``d x t x p = N``;
- ``t`` divides ``G`` (tensor parallelism stays inside a node; on a cluster whose NVLink domain
  spans nodes, ``G`` here is the job's domain segment, ``ClusterSpec.domain_gpus_for``: a GB200
  NVL72 job's t = 8 spans two 4-GPU trays on NVLink), divides every head count given
  (attention heads, KV heads: Megatron splits heads whole), and is a degree the profile has;
- ``p`` is at most the number of units (each stage needs one);
- a pipeline rank's ``t x d`` consecutive GPUs fill whole nodes or divide one (``t x d`` a multiple
  or a divisor of ``G``; of the domain segment where it spans nodes), so every data group lies
  evenly over its nodes (t = 1, d = 180 on 8-GPU nodes would start mid-node);
- ``B`` is divisible by ``d x b``; each replica runs ``m = B / (d x b)`` micro-batches, at most
  4096 (the limit is per replica: 4,096 GPUs at d = 512 with ``B`` = 8,192 run 16 each).

A fixed degree (``--data-parallel``, ``--tensor-parallel``, ``--stages``, ``--microbatch-size``)
keeps only its value. Schedules, virtual stages, recomputation and ZeRO are searched per
candidate by the planner; their own rules (e.g. ``m`` against ``p``) are the schedules'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

from pipeplan.errors import BadInputError
from pipeplan.launchers.registry import launcher_zero_stages
from pipeplan.formats.limits import MAX_MICROBATCHES

__all__ = ["Degrees", "Candidate", "parallel_degrees", "candidates", "divisors", "zero_stages", "recompute_families"]


@dataclass(frozen=True, order=True)
class Degrees:
    """One way to lay ``N`` GPUs out: data x tensor x pipeline."""

    data: int
    tensor: int
    pipeline: int


@dataclass(frozen=True, order=True)
class Candidate:
    """A layout with a micro-batch size: what the planner costs and splits."""

    data: int
    tensor: int
    pipeline: int
    microbatch_size: int
    num_microbatches: int
    """Per replica: ``global_batch / (data x microbatch_size)``."""


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending.

    Examples
    --------
    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    if n < 1:
        raise ValueError(f"{n} has no positive divisors")
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def _check_gpus(num_gpus: int, gpus_per_node: int) -> None:
    if num_gpus < 1:
        raise BadInputError(f"--gpus: {num_gpus} must be at least 1")
    if num_gpus > gpus_per_node and num_gpus % gpus_per_node:
        lower = num_gpus // gpus_per_node * gpus_per_node
        raise BadInputError(
            f"--gpus: {num_gpus} is not a whole number of {gpus_per_node}-GPU nodes; "
            f"use {lower} or {lower + gpus_per_node}")


def parallel_degrees(num_gpus: int, gpus_per_node: int, num_units: int,
                     head_counts: Iterable[int] = (), tensor_degrees: Optional[Iterable[int]] = None,
                     data: Optional[int] = None, tensor: Optional[int] = None,
                     pipeline: Optional[int] = None, gpus_per_domain: Optional[int] = None,
                     context: int = 1) -> list[Degrees]:
    """Every (d, t, p) with ``d t p = num_gpus`` that the rules (module docstring) allow (with a
    context-parallel degree ``C``: ``d t p C = num_gpus``, a pipeline rank's GPUs ``t C d``).

    Parameters
    ----------
    num_gpus, gpus_per_node : int
    num_units : int
        Units of the profile (the most stages a pipeline can have).
    head_counts : iterable of int
        Counts ``t`` must divide (attention heads, KV heads); empty: no such rule.
    tensor_degrees : iterable of int, optional
        Degrees the profile has costs for; None: every degree (a profile that scales itself).
    data, tensor, pipeline : int, optional
        Fixed degrees.
    gpus_per_domain : int, optional
        The job's NVLink domain segment (``ClusterSpec.domain_gpus_for``) where it spans nodes;
        None: the node. Tensor groups and pipeline ranks are fitted to it.

    Returns
    -------
    list of Degrees
        Sorted by (d, t, p).

    Raises
    ------
    BadInputError
        If ``num_gpus`` is not whole nodes, a fixed degree breaks a rule, or nothing is left;
        the message names the rule.

    Examples
    --------
    >>> [(x.data, x.tensor, x.pipeline) for x in parallel_degrees(8, 8, 4, head_counts=[4], tensor_degrees=[1, 2, 4, 8])]
    [(1, 2, 4), (1, 4, 2), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1), (8, 1, 1)]

    Notes
    -----
    O(number of divisor pairs of N), at most a few hundred for any real cluster.
    """
    _check_gpus(num_gpus, gpus_per_node)
    if context < 1 or num_gpus % context:
        raise BadInputError(f"--context-parallel: {context} does not divide --gpus {num_gpus}")
    num_gpus //= context
    node_only = gpus_per_domain is None or gpus_per_domain == gpus_per_node
    where, a_where = ("node", "a node") if node_only else ("NVLink domain", "an NVLink domain")
    G = gpus_per_node if gpus_per_domain is None else gpus_per_domain
    heads = [int(h) for h in head_counts]
    allowed_t = None if tensor_degrees is None else {int(t) for t in tensor_degrees}
    if tensor is not None:
        if tensor > G:
            raise BadInputError(
                f"--tensor-parallel: {tensor} is above the {G} GPUs of {a_where}; "
                f"tensor parallelism runs inside {a_where}")
        if G % tensor:
            raise BadInputError(f"--tensor-parallel: {tensor} does not divide the {G} GPUs of {a_where}")
        for h in heads:
            if h % tensor:
                raise BadInputError(f"--tensor-parallel: {tensor} does not divide the model's {h} heads")
        if allowed_t is not None and tensor not in allowed_t:
            raise BadInputError(
                f"--tensor-parallel: the profile has no costs at degree {tensor}; it has "
                f"{', '.join(map(str, sorted(allowed_t)))} (build it with --tensor-parallel)")
    if pipeline is not None and pipeline > num_units:
        raise BadInputError(f"--stages: {pipeline} is more than the profile's {num_units} units")
    for name, value in (("--data-parallel", data), ("--tensor-parallel", tensor), ("--stages", pipeline)):
        if value is not None and (value < 1 or num_gpus % value):
            raise BadInputError(f"{name}: {value} does not divide --gpus {num_gpus}")
    out = []
    for t in divisors(num_gpus):
        if tensor is not None and t != tensor:
            continue
        if G % t or any(h % t for h in heads) or (allowed_t is not None and t not in allowed_t):
            continue
        for p in divisors(num_gpus // t):
            if (pipeline is not None and p != pipeline) or p > num_units:
                continue
            d = num_gpus // (t * p)
            if data is not None and d != data:
                continue
            if (t * context * d) % G and G % (t * context * d):
                # A pipeline rank's t x d GPUs would start mid-node (t = 1, d = 180 on 8-GPU
                # nodes): its data groups straddle nodes unevenly, which no collective here costs.
                continue
            out.append(Degrees(d, t, p))
    if not out:
        fixed = ", ".join(f"{n} {v}" for n, v in (("--data-parallel", data), ("--tensor-parallel", tensor),
                                                   ("--stages", pipeline)) if v is not None)
        raise BadInputError(
            f"--gpus: no data x tensor x pipeline layout of {num_gpus} GPUs fits"
            + (f" {fixed}" if fixed else "")
            + f" (tensor within a {G}-GPU {where}" + (f", dividing heads {heads}" if heads else "")
            + f", at most {num_units} stages)")
    return sorted(out)


def candidates(degrees: Iterable[Degrees], global_batch: int, microbatch_sizes: Iterable[int]) -> list[Candidate]:
    """Each layout with each micro-batch size ``b`` such that ``d x b`` divides the batch.

    Raises
    ------
    BadInputError
        If no pair divides the global batch; the message gives the sizes tried.

    Examples
    --------
    >>> [(c.data, c.microbatch_size, c.num_microbatches) for c in
    ...  candidates([Degrees(2, 1, 4), Degrees(8, 1, 1)], 32, [1, 2, 4, 8])]
    [(2, 1, 16), (2, 2, 8), (2, 4, 4), (2, 8, 2), (8, 1, 4), (8, 2, 2), (8, 4, 1)]
    """
    if global_batch < 1:
        raise BadInputError(f"--global-batch: {global_batch} must be at least 1")
    sizes = sorted({int(b) for b in microbatch_sizes})
    degrees = list(degrees)
    out = []
    over_limit = 0
    for deg in degrees:
        for b in sizes:
            if b >= 1 and global_batch % (deg.data * b) == 0:
                count = global_batch // (deg.data * b)
                if count > MAX_MICROBATCHES:  # per replica: the simulator steps through each one
                    over_limit += 1
                    continue
                out.append(Candidate(deg.data, deg.tensor, deg.pipeline, b, count))
    if not out and over_limit:
        raise BadInputError(
            f"--global-batch: {global_batch} makes more than {MAX_MICROBATCHES} micro-batches per replica in every "
            f"layout and micro-batch size that divides it; give a smaller --global-batch, a larger "
            f"--microbatch-size or more data-parallel replicas")
    if not out:
        datas = sorted({deg.data for deg in degrees})
        raise BadInputError(
            f"--global-batch: {global_batch} is not divisible by d x b for any data-parallel degree "
            f"d in {datas} and micro-batch size b in {sizes}")
    return sorted(out)


def batch_divisor_note(degrees: Iterable[Degrees], global_batch: int, microbatch_sizes: Iterable[int]) -> Optional[str]:
    """Which data-parallel degrees the global batch leaves out, and the nearest batches that keep
    them all; None when it keeps every one.

    The search only tries a layout whose ``d x b`` divides the batch for some micro-batch size
    ``b``: a batch with few divisors (1001 on 512 GPUs) silently left only d = 1.

    Examples
    --------
    >>> print(batch_divisor_note([Degrees(1, 1, 8), Degrees(2, 1, 4), Degrees(8, 1, 1)], 1001, [1, 2]))
    global batch 1001 leaves out d = 2, 8 (d x the micro-batch size must divide it, sizes [1, 2]): only d = 1 was searched; a global batch of 1000 or 1008 keeps every d
    >>> batch_divisor_note([Degrees(2, 1, 4)], 32, [1, 2]) is None
    True
    """
    sizes = sorted({int(b) for b in microbatch_sizes if int(b) >= 1})
    datas = sorted({deg.data for deg in degrees})
    kept = [d for d in datas if any(global_batch % (d * b) == 0 for b in sizes)]
    left_out = [d for d in datas if d not in kept]
    if not left_out or not sizes:
        return None
    step = math.lcm(*(d * sizes[0] for d in datas))
    lower, upper = (global_batch // step) * step, (global_batch // step + 1) * step
    nearest = f"{lower} or {upper}" if lower > 0 else f"{upper}"
    return (f"global batch {global_batch} leaves out d = {', '.join(map(str, left_out))} (d x the micro-batch size "
            f"must divide it, sizes {sizes}): only d = {', '.join(map(str, kept)) or 'none'} was searched; "
            f"a global batch of {nearest} keeps every d")


def zero_stages(settings, d: int, p: int) -> list[int]:
    """The ZeRO stages to try at ``d`` replicas of ``p`` ranks: the fixed one, else what the
    launcher runs as planned (:mod:`pipeplan.launchers.registry`)."""
    if settings.zero_stage is not None:
        return [settings.zero_stage]
    # At d = 1 nothing is sharded. ZeRO 1 moves no more bytes than ZeRO 0 (a ring all-reduce is a
    # reduce-scatter plus an all-gather) and holds less; it pays one more call's fixed latency per
    # iteration (8.4 us on the presets), which the search gives up for a third fewer candidates:
    # --zero 0 plans ZeRO 0 (pipeplan.launchers.registry.launcher_zero_stages).
    # A plan for a launcher holds only what that launcher shards (pipeplan.launchers.registry):
    # Megatron-LM's distributed optimizer keeps the whole gradient buffer (ZeRO 1 memory) and has no
    # ZeRO 3; DeepSpeed's PipelineEngine asserts ZeRO < 2 under pipeline parallelism; torchtitan's
    # FSDP has no optimizer-only sharding (the exports refuse or re-express the rest).
    return list(launcher_zero_stages(settings.launcher, d, p))


def recompute_families(settings, view_has_selective: bool) -> list[tuple[str, str]]:
    """(view family, the pipeline planner's recompute setting).

    Under ``--overlap moe-a2a`` no layer is recomputed in full: megatron-core's
    ``TransformerConfig.__post_init__`` asserts ``recompute_granularity != 'full'`` with
    ``overlap_moe_expert_parallel_comm`` (``--recompute all`` is exit 2; auto plans none)."""
    mode = settings.recompute
    no_full = "moe-a2a" in (getattr(settings, "overlap", None) or ())
    if mode == "all" and no_full:
        raise BadInputError("--recompute: all is refused with --overlap moe-a2a (megatron-core asserts "
                            "recompute_granularity != 'full' with overlap_moe_expert_parallel_comm); use "
                            "selective or none")
    if mode == "selective":
        return [("selective", "none")]
    if mode in ("none", "all"):
        return [("plain", mode)]
    return [("plain", "none" if no_full else "auto")] + ([("selective", "none")] if view_has_selective else [])
