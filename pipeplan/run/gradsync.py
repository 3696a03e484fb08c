"""Gradients that must agree across processes: data-parallel replicas and tied weights.

A plan with data-parallel degree ``d`` runs ``d`` replicas of its ``p``-rank pipeline on
``d x p`` processes, numbered as Megatron numbers them (tensor innermost, then data, then
pipeline; :class:`pipeplan.cluster.placement.Layout` with ``t = 1``): global rank
``r = data_rank + d x pipeline_rank``. So with ``d = 2, p = 2`` ranks 0 and 1 hold stage 0 of
replicas 0 and 1, ranks 2 and 3 stage 1.

- :class:`ReplicaGroups` makes the process groups: each replica's pipeline (its ``p`` ranks,
  which the replica's ``PipelineStage`` objects talk in) and each pipeline rank's data group
  (its ``d`` replicas).
- :func:`replica_share` cuts a rank's replica's share out of the global batch.
- :class:`DataParallelGrads` averages a rank's gradients over its data group after the
  backward, before the optimizer, so that every replica steps with the gradient of the whole
  global batch.
- :class:`TiedGrads` sums the gradients of tied weights over the stages of one pipeline that
  hold a copy.

Notes
-----
Why the result equals one process on the global batch: the global batch of ``d x m x b``
samples is cut into ``d`` consecutive shares of ``m x b``; replica ``k``'s micro-batch ``i`` is
micro-batch ``k x m + i`` of the whole batch cut into ``d x m``. Torch's schedules scale each
replica's gradient by ``1 / m``, and the average over replicas by ``1 / d`` more, which is the
mean over the ``d x m`` micro-batches that one process computes (:mod:`pipeplan.run.verify`).
Summation order differs, so fp32 results agree to rounding (about 1e-7 relative), not bit for bit.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence
from pipeplan.cluster.placement import Layout

__all__ = ["ReplicaGroups", "replica_share", "DataParallelGrads", "TiedGrads", "plan_data_parallel"]


class ReplicaGroups:
    """This process's place among ``data`` replicas of a ``pipeline``-rank pipeline, and its groups.

    Every rank must build it at the same point (``torch.distributed.new_group`` is collective
    over the whole world, and every rank makes every group in the same order). With one
    replica no group is made: the pipeline talks in the default group, as it always has.

    Parameters
    ----------
    data : int
        Replicas ``d``.
    pipeline : int
        Pipeline ranks ``p`` per replica.
    rank : int
        This process's global rank, ``0 <= rank < d x p``.
    timeout : datetime.timedelta, optional
        How long a rank waits for a peer in these groups: give the run's (new groups do not
        inherit ``init_process_group``'s; gloo's default is 30 minutes).

    Raises
    ------
    ValueError
        A rank outside the world.

    Examples
    --------
    >>> groups = ReplicaGroups(2, 2, 3, make_groups=False)
    >>> groups.pipeline_rank, groups.data_rank, groups.pipeline_ranks(), groups.data_ranks()
    (1, 1, [1, 3], [2, 3])
    >>> groups.stage_ranks({0: 0, 1: 1})
    [{0: 0, 1: 2}, {0: 1, 1: 3}]
    """

    def __init__(self, data: int, pipeline: int, rank: int, *, timeout: Optional[Any] = None,
                 make_groups: bool = True) -> None:
        self.data = int(data)
        self.pipeline = int(pipeline)
        self.world_size = self.data * self.pipeline
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.data} x {self.pipeline} = {self.world_size} ranks")
        self.rank = rank
        self.layout = Layout(data=self.data, tensor=1, pipeline=self.pipeline, gpus_per_node=self.world_size)
        self.pipeline_rank, self.data_rank, _ = self.layout.coordinates(rank)
        self.pipeline_group: Optional[Any] = None
        self.data_group: Optional[Any] = None
        if make_groups and self.data > 1:
            import torch.distributed as dist

            for data_rank in range(self.data):
                group = dist.new_group(self.pipeline_ranks(data_rank), timeout=timeout)
                if data_rank == self.data_rank:
                    self.pipeline_group = group
            for pipeline_rank in range(self.pipeline):
                group = dist.new_group(self.data_ranks(pipeline_rank), timeout=timeout)
                if pipeline_rank == self.pipeline_rank:
                    self.data_group = group

    def global_rank(self, pipeline_rank: int, data_rank: Optional[int] = None) -> int:
        """The global rank of a pipeline rank in replica ``data_rank`` (default: this one)."""
        return self.layout.rank(pipeline_rank, self.data_rank if data_rank is None else data_rank, 0)

    def pipeline_ranks(self, data_rank: Optional[int] = None) -> list[int]:
        """The global ranks of one replica's pipeline, by pipeline rank (default: this replica)."""
        return [self.global_rank(k, data_rank) for k in range(self.pipeline)]

    def data_ranks(self, pipeline_rank: Optional[int] = None) -> list[int]:
        """The global ranks of one pipeline rank's replicas (default: this process's pipeline rank)."""
        k = self.pipeline_rank if pipeline_rank is None else pipeline_rank
        return list(self.layout.data_group(k, 0))

    def stage_ranks(self, stage_pipeline_rank: dict[int, int]) -> list[dict[int, int]]:
        """Per replica, stage index -> the global rank that runs it (from the plan's pipeline ranks)."""
        return [{stage: self.global_rank(k, data_rank) for stage, k in stage_pipeline_rank.items()}
                for data_rank in range(self.data)]


def replica_share(inputs: Any, target: Any, data_rank: int, data: int) -> tuple[Any, Any]:
    """Replica ``data_rank``'s share of a global batch: the ``data_rank``-th of ``data`` equal
    consecutive slices along dim 0 of every tensor (other values are kept whole).

    Examples
    --------
    >>> import torch
    >>> (x,), y = replica_share((torch.arange(8),), torch.arange(8) * 10, 1, 2)
    >>> x.tolist(), y.tolist()
    ([4, 5, 6, 7], [40, 50, 60, 70])
    """
    import torch

    if data == 1:
        return inputs, target

    def part(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.tensor_split(value, data)[data_rank]
        return value

    if isinstance(inputs, dict):
        shared = {k: part(v) for k, v in inputs.items()}
    else:
        shared = tuple(part(v) for v in inputs)
    return shared, part(target)


class DataParallelGrads:
    """Averages gradients over a data-parallel group: one all-reduce of one flat fp32 buffer.

    A parameter's gradient counts where any replica has one: the buffer carries a 0/1 flag per
    parameter, so a parameter that one replica's batch left unused (``grad`` None there) gets
    the average of the others' (with zeros for the replica without), as one process on the
    whole batch would compute it; a parameter no replica used keeps ``grad`` None.

    Parameters
    ----------
    params : sequence of torch.nn.Parameter
        This rank's parameters (duplicates dropped), in the same order on every replica.
    group : ProcessGroup or None
        The data group; None means one replica (:meth:`sync` does nothing).
    data : int
        Replicas in the group (the divisor).
    """

    def __init__(self, params: Sequence[Any], group: Optional[Any], data: int) -> None:
        seen: set[int] = set()
        self.params = [p for p in params if not (id(p) in seen or seen.add(id(p)))]
        self.group = group
        self.data = int(data)

    def sync(self) -> None:
        """After the backward (and the tied-weight sync), before the optimizer."""
        if self.group is None or self.data == 1 or not self.params:
            return
        import torch
        import torch.distributed as dist

        device = self.params[0].device
        sizes = [p.numel() for p in self.params]
        flat = torch.zeros(sum(sizes) + len(self.params), dtype=torch.float32, device=device)
        offset = 0
        flags = flat[sum(sizes):]
        for i, (p, size) in enumerate(zip(self.params, sizes)):
            if p.grad is not None:
                flat[offset:offset + size].copy_(p.grad.detach().reshape(-1))
                flags[i] = 1.0
            offset += size
        # gloo has no ReduceOp.AVG: sum, then divide.
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for i, (p, size) in enumerate(zip(self.params, sizes)):
            if float(flags[i]) > 0:
                mean = flat[offset:offset + size].div_(self.data).view(p.shape).to(p.dtype)
                if p.grad is None:
                    p.grad = mean.clone()
                else:
                    p.grad.copy_(mean)
            offset += size


class TiedGrads:
    """Sums the gradients of tied weights over the stages (and ranks) that hold a copy.

    Every rank makes the same process groups in the same order (``new_group`` is collective),
    one per tied weight and replica, of the ranks whose stages use it.

    Parameters
    ----------
    tied : dict
        Canonical parameter name -> the stage indexes that hold a copy.
    stage_rank : dict or list of dict
        Stage index -> global rank; with data parallelism one such map per replica
        (:meth:`ReplicaGroups.stage_ranks`).
    modules, param_names : sequences
        This rank's stage modules and, per module, its parameter names -> canonical names.
    rank : int
        This process's global rank.
    timeout : datetime.timedelta, optional
        How long a rank waits in these groups (as :class:`ReplicaGroups`).
    """

    def __init__(self, tied: dict[str, list[int]], stage_rank: dict[int, int] | Sequence[dict[int, int]],
                 modules: Sequence[Any], param_names: Sequence[dict[str, str]], rank: int, *,
                 timeout: Optional[Any] = None) -> None:
        import torch.distributed as dist

        replicas = [stage_rank] if isinstance(stage_rank, dict) else list(stage_rank)
        self.groups: list[tuple[str, Any, list[Any]]] = []
        for canonical, stages in sorted(tied.items()):
            for mapping in replicas:
                ranks = sorted({mapping[s] for s in stages})
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank not in ranks:
                    continue
                params, seen = [], set()
                for module, names in zip(modules, param_names):
                    for name, param in module.named_parameters(remove_duplicate=False):
                        if names.get(name) == canonical and id(param) not in seen:
                            seen.add(id(param))
                            params.append(param)
                self.groups.append((canonical, group, params))

    def sync(self) -> None:
        """After backward, before the optimizer: every copy gets the sum of all copies' gradients."""
        import torch
        import torch.distributed as dist

        for _, group, params in self.groups:
            if not params:
                continue
            total = torch.zeros_like(params[0])
            for p in params:
                if p.grad is not None:
                    total += p.grad
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in params:
                p.grad = total.clone()


def plan_data_parallel(plan: Any) -> int:
    """The plan's data-parallel degree ``d`` (1 for a plan without ``parallelism``)."""
    parallelism = getattr(plan, "parallelism", None)
    return int(parallelism.data) if parallelism is not None else 1
